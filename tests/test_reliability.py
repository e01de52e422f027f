"""Reliability and security: bad input, corrupted files, interrupted writes, untrusted data.

A loader under week-long training runs reads files that travel between machines. It must never
crash the interpreter, silently return wrong data, lose the user's data or execute anything from
a file. ``test_container.py`` covers single faults of the raw container (one flipped byte, cuts
at fixed points, a killed ``PackWriter``, ``RLIMIT_FSIZE`` on the writer); ``test_packer.py``
covers bad VOC source files. This module adds:

1. fuzzing: random files, and random damage to a real pack (one file and one shard of a shard
   set), including crafted files whose checksums were fixed up so the damage reaches the
   index and metadata checks behind them; only our own exceptions may escape, under a memory cap;
2. ``pack_voc`` killed at random moments over a previous pack, and the crash state between the
   two renames that replace a shard folder;
3. a full disk (``RLIMIT_FSIZE`` and a 2 MB tmpfs) under ``pack_voc``;
4. six processes reading one pack at once, and a reader while another process re-packs its path;
5. no code execution paths in the package, Pillow's bomb limit untouched and enforced;
6. 20 epochs of a persistent-worker DataLoader without fd or memory growth.
"""

from __future__ import annotations

import ast
import copy
import ctypes
import errno
import io
import json
import multiprocessing as mp
import os
import pickle
import random
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import tokenize
import zlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _container_helpers import parse_container
from _reliability_helpers import (
    PidDataset,
    crc_reader,
    list_collate,
    pin_mmap_threshold,
    read_pickled,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image
from vocfactory import Sample, jpeg, obj, palette_mask, voc_xml, write_voc

import torch_serialized
from torch_serialized import atomic
from torch_serialized import format as fmt
from torch_serialized.errors import (
    ChecksumError,
    CorruptFileError,
    SourceDataError,
    TorchSerializedError,
    WriteError,
)
from torch_serialized.reader import open_pack
from torch_serialized.tools import make_synthetic_voc
from torch_serialized.voc.pack import pack_voc

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
FORMS = {"single": {}, "shards": {"max_samples_per_shard": 5}}
fuzz_settings = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# -- shared helpers -------------------------------------------------------------------------------
def json_values(depth: int) -> st.SearchStrategy[Any]:
    """Any JSON value, nested at most ``depth`` deep."""
    leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    if depth == 0:
        return leaves
    inner = json_values(depth - 1)
    return (
        leaves
        | st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    )


def out_name(form: str) -> str:
    return "voc" if form == "shards" else "voc.tser"


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def snapshot(path: Path) -> dict[str, bytes] | None:
    """Every byte of a pack (file or shard folder), or None if nothing is there."""
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    if path.is_file():
        return {"": path.read_bytes()}
    return None


def read_records(reader: Any) -> list[list[bytes]]:
    return [
        [bytes(reader.field(i, k)) for k in range(len(reader.fields))] for i in range(len(reader))
    ]


def run_child(command: str, *args: str) -> subprocess.Popen:
    """``_reliability_helpers.child_main(command, *args)`` in a fresh interpreter (no torch)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    code = "import sys, _reliability_helpers as h; h.child_main(*sys.argv[1:])"
    return subprocess.Popen(
        [sys.executable, "-c", code, command, *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def dead_pid() -> int:
    """The pid of a process that has exited (as a killed writer's would be)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def bounded_memory() -> Iterator[None]:
    """Cap this process's address space at its current size + 512 MiB while the test runs.

    The fuzzed files are a few KiB, so any allocation that size is a bug: it fails with
    MemoryError (a foreign exception, so the test fails) instead of swapping the machine.
    """
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs /proc/self/status")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    match = re.search(r"VmSize:\s+(\d+) kB", status.read_text())
    assert match is not None
    limit = int(match[1]) * 1024 + (512 << 20)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# -- source devkits and packs -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six tiny samples (2007): small enough that fuzzing writes a few KiB per example."""
    root = tmp_path_factory.mktemp("tiny")
    ids = [f"00000{i}" for i in range(6)]
    samples = [
        Sample(
            image_id,
            jpeg(12 + i, 10, seed=i),
            voc_xml(f"{image_id}.jpg", 12 + i, 10, [obj(("dog", "cat")[i % 2], (1, 1, 8, 6))]),
            mask=palette_mask(12 + i, 10, seed=i) if i % 3 == 0 else None,
        )
        for i, image_id in enumerate(ids)
    ]
    sets = {"Main": {"train": ids[:3], "val": ids[3:], "trainval": ids}}
    sets["Segmentation"] = {"train": [ids[0]], "val": [ids[3]]}
    write_voc(root, "2007", samples, sets)
    return root


@pytest.fixture(scope="module")
def voc40(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_voc(tmp_path_factory.mktemp("voc40"), 40, year="2007")


@pytest.fixture(scope="module")
def voc8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Different content: what a 'previous' pack or a re-pack holds."""
    return make_synthetic_voc(tmp_path_factory.mktemp("voc8"), 8, year="2007", seed=1)


@pytest.fixture(scope="module")
def voc40_packs(voc40: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("voc40-packs")
    return {f: pack_voc(voc40, folder / out_name(f), year="2007", **FORMS[f]).path for f in FORMS}


# ==============================================================================================
# 1. Fuzzing
# ==============================================================================================
@dataclass
class Outcome:
    """Everything a reader returned for a file it accepted."""

    records: list[list[bytes | None]]  # None: a checked read raised ChecksumError
    arrays: dict[str, tuple[str, tuple[int, ...], bytes]]
    user: dict[str, Any]
    bad: list[int]  # verify()
    failed: set[int] = field(default_factory=set)  # records with a ChecksumError
    error: TorchSerializedError | None = None  # raised after a successful open


def read_all(path: Path, checked: bool = False) -> Outcome | TorchSerializedError:
    """Open ``path`` and read every field of every record, all arrays, and verify().

    Returns the refusal if the open failed. Any exception but ours (and IndexError for an
    index out of range) propagates and fails the test.
    """
    try:
        reader = open_pack(path, checked=checked)
    except TorchSerializedError as exc:
        return exc
    n = len(reader)
    for outside in (n, n + 10**12, -1, -n - 1):
        with pytest.raises(IndexError):
            reader.field(outside, 0)
    outcome = Outcome([], {}, {}, [])
    try:
        for i in range(n):
            row: list[bytes | None] = []
            for k in range(len(reader.fields)):
                try:
                    row.append(bytes(reader.field(i, k)))
                except ChecksumError:
                    if not checked:
                        raise
                    outcome.failed.add(i)
                    row.append(None)
            outcome.records.append(row)
        check_batched_reads(reader, outcome.records, checked)
        outcome.arrays = {
            name: (a.dtype.str, a.shape, a.tobytes()) for name, a in reader.arrays().items()
        }
        outcome.user = reader.user
        outcome.bad = reader.verify()
    except TorchSerializedError as exc:  # contained: refused after the open
        outcome.error = exc
    return outcome


def describe(outcome: Outcome | TorchSerializedError) -> str:
    """A label for Hypothesis' statistics: how far into the file the reader got."""
    if isinstance(outcome, TorchSerializedError):
        return f"refused at open: {type(outcome).__name__}"
    if outcome.error is not None:
        return f"refused after open: {type(outcome.error).__name__}"
    return "opened, damage listed by verify()" if outcome.bad else "opened, intact"


def check_batched_reads(reader: Any, records: list[list[bytes | None]], checked: bool) -> None:
    """The streaming read path (``ContainerReader.read_records``, one scatter read per run of
    records) returns what ``field`` returned, or raises ChecksumError on a checked reader."""
    for start, shard in zip(reader.starts, reader.shards):
        read_records = getattr(shard, "read_records", None)
        if read_records is None or not len(shard):
            continue
        try:
            rows = read_records(range(len(shard)), range(len(shard.fields)))
        except ChecksumError:
            assert checked, "an unchecked reader raised ChecksumError"
            continue
        for i, row in enumerate(rows):
            want = records[int(start) + i]
            got = [bytes(array) for array in row]
            assert all(w is None or w == g for w, g in zip(want, got)), (
                f"read_records and field disagree on record {int(start) + i}"
            )


def assert_no_silent_damage(outcome: Outcome | TorchSerializedError, original: Outcome) -> None:
    """A damaged file is refused, or every record that verify() does not list is intact."""
    if isinstance(outcome, TorchSerializedError) or outcome.error is not None:
        return
    assert len(outcome.records) == len(original.records)
    bad = set(outcome.bad)
    for i, (got, want) in enumerate(zip(outcome.records, original.records)):
        if i not in bad:
            assert got == want, f"record {i} changed but verify() did not list it"
    assert outcome.arrays == original.arrays
    assert outcome.user == original.user
    if outcome.failed or any(None in row for row in outcome.records):
        assert outcome.failed == bad, "checked reads and verify() disagree"


class FuzzBase:
    """A real pack of ``tiny_root``: its files' bytes and what a reader returns for it.

    Not a dataclass: Hypothesis pretty-prints a failing example's fixtures field by field, and
    a 144 kB repr raises HypothesisWarning (an error here), hiding the real failure.
    """

    def __init__(self, form: str, files: dict[str, bytes], original: Outcome) -> None:
        self.form = form
        self.files = files  # name -> bytes ("" for a single file)
        self.original = original
        # the container files that may be damaged
        self.targets = [""] if form == "single" else sorted(n for n in files if n.endswith(".tser"))

    def __repr__(self) -> str:
        return f"<FuzzBase {self.form}: {sorted(self.files) if self.form == 'shards' else ''}>"

    def write(self, folder: Path, replace: dict[str, bytes]) -> Path:
        """Write the pack into ``folder`` with some files replaced; return the pack path."""
        if self.form == "single":
            path = folder / "fuzz.tser"
            path.write_bytes(replace.get("", self.files[""]))
            return path
        path = folder / "fuzz"
        path.mkdir(exist_ok=True)
        for name, data in self.files.items():
            (path / name).write_bytes(replace.get(name, data))
        return path


@pytest.fixture(scope="module")
def fuzz_bases(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, FuzzBase]:
    folder = tmp_path_factory.mktemp("fuzz-bases")
    bases = {}
    for form, options in (("single", {}), ("shards", {"max_samples_per_shard": 2})):
        path = pack_voc(tiny_root, folder / form, year="2007", **options).path  # type: ignore[arg-type]
        files = snapshot(path)
        assert files is not None
        original = read_all(path)
        assert isinstance(original, Outcome) and original.error is None and original.bad == []
        bases[form] = FuzzBase(form, files, original)
    assert len(bases["shards"].targets) == 3
    return bases


def regions(data: bytes) -> dict[str, tuple[int, int]]:
    """Byte ranges of a valid container's parts, by the spec."""
    meta_offset = fmt.unpack_footer(data[-fmt.FOOTER_SIZE :], "x")["meta_offset"]
    index = json.loads(data[meta_offset : -fmt.FOOTER_SIZE])["index"]
    index_end = index["offset"] + index["nbytes"]
    size = len(data)
    return {
        "header": (0, fmt.HEADER_SIZE),
        "records": (fmt.HEADER_SIZE, index["offset"]),
        "index": (index["offset"], index_end),
        "arrays": (index_end, meta_offset),
        "metadata": (meta_offset, size - fmt.FOOTER_SIZE),
        "footer": (size - fmt.FOOTER_SIZE, size),
        "anywhere": (0, size),
    }


@st.composite
def damage(draw: st.DrawFn, spans: dict[str, tuple[int, int]]) -> list[tuple[Any, ...]]:
    """One to three edits, each aimed at a part of the file."""
    ops = []
    for _ in range(draw(st.integers(1, 3))):
        # size-keeping edits and the record bytes weigh more: they are what may still open
        kind = draw(
            st.sampled_from(["overwrite"] * 3 + ["zero"] * 2 + ["insert", "delete", "truncate"])
        )
        start, end = spans[draw(st.sampled_from(["records"] * 3 + sorted(spans)))]
        at = draw(st.integers(start, end - 1))
        if kind in ("overwrite", "insert"):
            ops.append((kind, at, draw(st.binary(min_size=1, max_size=32))))
        elif kind in ("zero", "delete"):
            ops.append((kind, at, draw(st.integers(1, 4096))))
        else:
            ops.append((kind, at))
    return ops


def apply_damage(data: bytes, ops: list[tuple[Any, ...]]) -> bytes:
    out = bytearray(data)
    for kind, at, *arg in ops:
        at = min(at, len(out))
        if kind == "overwrite":
            out[at : at + len(arg[0])] = arg[0][: max(0, len(out) - at)]
        elif kind == "zero":
            length = min(arg[0], len(out) - at)
            out[at : at + length] = bytes(length)
        elif kind == "insert":
            out[at:at] = arg[0]
        elif kind == "delete":
            del out[at : at + arg[0]]
        else:
            del out[at:]
    return bytes(out)


@pytest.mark.timeout(120)
@settings(fuzz_settings, max_examples=300)
@given(
    head=st.sampled_from(["none", "magic", "header"]),
    body=st.binary(max_size=2048),
    tail=st.sampled_from(["none", "magic", "footer+bytes", "footer+json"]),
    meta=st.dictionaries(st.text(max_size=8), json_values(2), max_size=6),
    num=st.integers(0, 2**64 - 1),
)
def test_random_files_are_refused_with_our_errors(
    tmp_path, bounded_memory, head, body, tail, meta, num
):
    prefix = {"none": b"", "magic": fmt.MAGIC, "header": fmt.pack_header(64)}[head]
    data = prefix + body
    if tail == "magic":
        data += fmt.MAGIC
    elif tail.startswith("footer"):  # a valid footer, so the metadata is parsed
        blob = body[len(body) // 2 :] if tail == "footer+bytes" else json.dumps(meta).encode()
        if tail == "footer+json":
            data += blob
        start = len(data) - len(blob)
        data += fmt.pack_footer(start, len(blob), len(data) + fmt.FOOTER_SIZE, num, fmt.crc32(blob))
    path = tmp_path / "random.tser"
    path.write_bytes(data)
    refusal = read_all(path)
    assert isinstance(refusal, TorchSerializedError), "random bytes were accepted as a pack"
    assert str(path) in str(refusal)


@pytest.mark.timeout(120)
@settings(fuzz_settings, max_examples=200)
@given(
    raw=st.one_of(
        st.binary(max_size=512),
        st.builds(
            lambda shards, extra: json.dumps(
                {"format": fmt.MANIFEST_FORMAT, "version": 1, "shards": shards, "user": {}, **extra}
            ).encode(),
            st.lists(
                st.fixed_dictionaries(
                    {
                        "file": st.sampled_from(
                            ["shard-00000.tser", "shard-00002.tser", "manifest.json", "gone"]
                            + [".", "..", "", "a/b", "/etc/passwd", "sub", 0, None]
                        ),
                        "num_records": st.sampled_from([0, 1, 2, -1, 2**70, "2", None]),
                        "meta_crc32": st.integers(-1, 2**33),
                    }
                ),
                max_size=4,
            ),
            st.dictionaries(st.sampled_from(["version", "user", "shards"]), st.none(), max_size=1),
        ),
    )
)
def test_random_manifests_are_refused_with_our_errors(tmp_path, bounded_memory, fuzz_bases, raw):
    folder = fuzz_bases["shards"].write(tmp_path, {fmt.MANIFEST_NAME: raw})
    (folder / "sub").mkdir(exist_ok=True)
    try:
        outcome = read_all(folder)
    except FileNotFoundError as exc:  # a listed shard is missing: test_container's contract
        assert "gone" in str(exc)
        return
    if isinstance(outcome, Outcome):  # only a manifest that lists real shards correctly
        assert outcome.error is None and outcome.bad == []


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("form", ["single", "shards"])
@settings(fuzz_settings, max_examples=600)
@given(data=st.data())
def test_damaged_pack_is_refused_or_verify_lists_the_damage(
    tmp_path, bounded_memory, fuzz_bases, form, data
):
    base = fuzz_bases[form]
    target = data.draw(st.sampled_from(base.targets), label="file")
    ops = data.draw(damage(regions(base.files[target])), label="damage")
    checked = data.draw(st.booleans(), label="checked")
    path = base.write(tmp_path, {target: apply_damage(base.files[target], ops)})
    outcome = read_all(path, checked)
    event(describe(outcome))
    assert_no_silent_damage(outcome, base.original)


# -- crafted files: damage hidden behind valid checksums ------------------------------------------
def rebuild(data: bytes, meta: Any, num_records: Any = None) -> bytes:
    """``data`` with new metadata and a footer (and CRCs) that match it."""
    footer = fmt.unpack_footer(data[-fmt.FOOTER_SIZE :], "x")
    body = data[: footer["meta_offset"]]
    blob = json.dumps(meta, separators=(",", ":")).encode()
    n = num_records if type(num_records) is int and 0 <= num_records < 2**64 else None
    size = len(body) + len(blob) + fmt.FOOTER_SIZE
    return (
        body
        + blob
        + fmt.pack_footer(
            len(body), len(blob), size, footer["num_records"] if n is None else n, fmt.crc32(blob)
        )
    )


def craft(base: FuzzBase, target: str, data: bytes) -> dict[str, bytes]:
    """Replacement files: ``target`` -> ``data``, and for a shard set a manifest that agrees
    with it, so the damage gets past every checksum and reaches the checks behind them."""
    files = {target: data}
    if base.form == "shards":
        manifest = json.loads(base.files[fmt.MANIFEST_NAME])
        footer = fmt.unpack_footer(data[-fmt.FOOTER_SIZE :], "x")
        for entry in manifest["shards"]:
            if entry["file"] == target:
                entry["meta_crc32"] = footer["meta_crc32"]
                entry["num_records"] = footer["num_records"]
        files[fmt.MANIFEST_NAME] = json.dumps(manifest).encode()
    return files


def global_start(base: FuzzBase, target: str) -> int:
    if base.form == "single":
        return 0
    manifest = json.loads(base.files[fmt.MANIFEST_NAME])
    start = 0
    for entry in manifest["shards"]:
        if entry["file"] == target:
            return start
        start += entry["num_records"]
    raise AssertionError(target)


U64 = 2**64 - 1
ENTRY_VALUES = [0, 1, 63, 64, 65, 2**31, 2**32, 2**63 - 1, 2**63, U64]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("form", ["single", "shards"])
@settings(fuzz_settings, max_examples=400)
@given(data=st.data())
def test_index_entries_pointing_anywhere_are_refused_or_contained(
    tmp_path, bounded_memory, fuzz_bases, form, data
):
    base = fuzz_bases[form]
    target = data.draw(st.sampled_from(base.targets), label="file")
    original = base.files[target]
    footer = fmt.unpack_footer(original[-fmt.FOOTER_SIZE :], "x")
    data_end = footer["meta_offset"]
    meta = json.loads(original[data_end : -fmt.FOOTER_SIZE])
    desc = meta["index"]
    index = np.frombuffer(
        original, fmt.INDEX_DTYPE, desc["shape"][0] * desc["shape"][1], desc["offset"]
    )
    index = index.reshape(desc["shape"]).copy()
    size = len(original)
    places = st.sampled_from([data_end - 1, data_end, data_end + 1, size - 1, size, size + 1])
    numbers = st.sampled_from(ENTRY_VALUES) | places | st.integers(0, U64)
    inside = st.integers(fmt.HEADER_SIZE, data_end)
    patched = []
    absurd = data.draw(st.booleans(), label="absurd")  # else every entry stays in the data
    for _ in range(data.draw(st.integers(1, 3), label="entries")):
        i = data.draw(st.integers(0, index.shape[0] - 1), label="record")
        k = data.draw(st.integers(0, index.shape[1] - 1), label="field")
        offset = data.draw(numbers | inside if absurd else inside, label="offset")
        fitting = st.integers(0, max(0, data_end - offset))
        wrapping = st.sampled_from([(2**64 - offset) % 2**64, (2**64 - offset + 5) % 2**64])
        length = data.draw(numbers | fitting | wrapping if absurd else fitting, label="length")
        index["offset"][i, k], index["length"][i, k] = offset, length
        fits = offset >= fmt.HEADER_SIZE and offset + length <= data_end
        if fits and data.draw(st.booleans(), label="fix record crc"):
            index["crc32"][i, k] = fmt.crc32(original[offset : offset + length])
        patched.append((i, k, offset, length))
    raw = index.tobytes()
    body = original[: desc["offset"]] + raw + original[desc["offset"] + len(raw) :]
    meta["index"]["crc32"] = fmt.crc32(raw)
    crafted = rebuild(body, meta)
    path = base.write(tmp_path, craft(base, target, crafted))

    # what the file really says after all patches (a later one may overwrite an earlier)
    final = {
        (i, k): (int(index["offset"][i, k]), int(index["length"][i, k])) for i, k, *_ in patched
    }
    outside = any(o < fmt.HEADER_SIZE or o + n > data_end for o, n in final.values())
    outcome = read_all(path, checked=data.draw(st.booleans(), label="checked"))
    event(f"{'outside' if outside else 'inside'}: {describe(outcome)}")
    if outside:
        assert isinstance(outcome, CorruptFileError), "an index entry outside the data was accepted"
        assert "outside" in str(outcome)
        return
    assert isinstance(outcome, Outcome) and outcome.error is None
    start = global_start(base, target)
    for (i, k), (o, n) in final.items():  # contained: exactly the bytes the entry names
        got = outcome.records[start + i][k]
        assert got is None or got == crafted[o : o + n]


ABSURD_INTS = [-1, -(2**63), 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100, 10**30]
ABSURD_SHAPES = [[1] * 70, [0, 2**70], [2**62, 2**62], [0, 2**63 - 1, 2**63 - 1], [-1], [], [0]]
ABSURD_DTYPES = [
    "|O",
    "O",
    "<U8",
    "|S4",
    "|V8",
    "<M8[s]",
    ">i4",
    "<c16",
    "<i8\n",
    "int64",
    [["a", "|O"]],
    [["a", "<i4"], ["a", "<i4"]],
    [["", "<i4"]],
    [],
    [[1, "<i4"]],
    [["a", [["b", "<i4"]]]],
]
absurd_values = st.one_of(
    st.sampled_from(ABSURD_INTS),
    st.sampled_from(ABSURD_SHAPES).map(copy.deepcopy),  # later edits may write into them
    st.sampled_from(ABSURD_DTYPES).map(copy.deepcopy),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.lists(st.sampled_from([0, 1, 2, 3, 2**40, -1]), max_size=6),
    json_values(2),
)


def json_paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from json_paths(value, (*prefix, key))
    elif isinstance(node, list):
        for j, value in enumerate(node):
            yield from json_paths(value, (*prefix, j))


def get_path(node: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        node = node[key]
    return node


def match_nbytes(desc: dict[str, Any]) -> None:
    """Make a descriptor's nbytes agree with its (edited) shape, to reach the checks after."""
    shape = desc.get("shape")
    if isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape):
        try:
            itemsize = fmt.dtype_from_json(desc.get("dtype"), "x").itemsize
        except CorruptFileError:
            itemsize = 1
        desc["nbytes"] = int(np.prod(shape, dtype=object)) * itemsize if shape else itemsize


def set_path(node: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = node
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return node


def fix_descriptors(meta: Any, data: bytes) -> None:
    """Give every array descriptor whose extent fits the file the CRC of those bytes."""
    if not isinstance(meta, dict):
        return
    arrays = meta.get("arrays")
    descs = [meta.get("index"), *(arrays.values() if isinstance(arrays, dict) else ())]
    for desc in descs:
        if not isinstance(desc, dict):
            continue
        offset, nbytes = desc.get("offset"), desc.get("nbytes")
        if (
            type(offset) is int
            and type(nbytes) is int
            and 0 <= offset <= offset + nbytes <= len(data)
        ):
            desc["crc32"] = fmt.crc32(data[offset : offset + nbytes])


def descriptor_paths(meta: dict[str, Any]) -> list[tuple[Any, ...]]:
    keys = ["shape", "nbytes", "offset", "dtype", "crc32", "per_record"]
    out = [("index", key) for key in keys]
    out += [("arrays", name, key) for name in meta["arrays"] for key in keys]
    out += [("index",), ("arrays",), ("num_records",), ("fields",), ("format",), ("user",)]
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("form", ["single", "shards"])
@settings(fuzz_settings, max_examples=600)
@given(data=st.data())
def test_absurd_metadata_is_refused_or_contained(tmp_path, bounded_memory, fuzz_bases, form, data):
    base = fuzz_bases[form]
    target = data.draw(st.sampled_from(base.targets), label="file")
    original = base.files[target]
    meta_offset = fmt.unpack_footer(original[-fmt.FOOTER_SIZE :], "x")["meta_offset"]
    meta = json.loads(original[meta_offset : -fmt.FOOTER_SIZE])
    # every choice is drawn from lists fixed by the original file, so a replay draws the same
    where = st.sampled_from(descriptor_paths(meta)) | st.sampled_from(list(json_paths(meta)))
    edits = st.lists(st.tuples(where, absurd_values, st.booleans()), min_size=1, max_size=3)
    for path_, value, matching in data.draw(edits, label="edits"):
        try:
            meta = set_path(meta, path_, value)
            if path_ and path_[-1] == "shape" and matching:
                match_nbytes(get_path(meta, path_[:-1]))
        except (KeyError, IndexError, TypeError, AttributeError):  # an earlier edit moved it
            continue
    if data.draw(st.booleans(), label="fix array crcs"):
        fix_descriptors(meta, original)
    num = meta.get("num_records") if isinstance(meta, dict) else None
    crafted = rebuild(
        original, meta, num if data.draw(st.booleans(), label="sync footer") else None
    )
    path = base.write(tmp_path, craft(base, target, crafted))
    outcome = read_all(path, checked=data.draw(st.booleans(), label="checked"))
    event(describe(outcome))  # reaching this line: only our errors, or nothing, were raised


@pytest.mark.parametrize(
    "dtype", ["|O", [["a", "<i8"], ["b", "|O"]], "<U8", [["a", [["b", "<i4"]]]]]
)
def test_object_dtypes_in_a_crafted_file_are_refused(tmp_path, fuzz_bases, dtype):
    """No descriptor can make numpy build Python objects from file bytes."""
    base = fuzz_bases["single"]
    original = base.files[""]
    meta_offset = fmt.unpack_footer(original[-fmt.FOOTER_SIZE :], "x")["meta_offset"]
    meta = json.loads(original[meta_offset : -fmt.FOOTER_SIZE])
    meta["arrays"]["records"]["dtype"] = dtype
    path = base.write(tmp_path, {"": rebuild(original, meta)})
    with pytest.raises(CorruptFileError, match="invalid array dtype"):
        open_pack(path)


def test_absurd_shapes_that_fit_nbytes_are_refused(tmp_path, fuzz_bases):
    """Found by the fuzzer: shapes that match nbytes but that numpy cannot build (more than 64
    axes, a dimension past int64 beside a zero) raised numpy's ValueError from the reader."""
    base = fuzz_bases["single"]
    original = base.files[""]
    meta_offset = fmt.unpack_footer(original[-fmt.FOOTER_SIZE :], "x")["meta_offset"]
    for shape, nbytes in (([1] * 70, 1), ([0, 2**70], 0), ([0, 2**63 - 1, 2**63 - 1], 0)):
        meta = json.loads(original[meta_offset : -fmt.FOOTER_SIZE])
        desc = meta["arrays"]["file/ImageSets/Main/train.txt"]
        desc.update(
            shape=shape, nbytes=nbytes, crc32=fmt.crc32(original[desc["offset"] :][:nbytes])
        )
        path = base.write(tmp_path, {"": rebuild(original, meta)})
        with pytest.raises(CorruptFileError, match="unusable shape") as info:
            open_pack(path)
        assert str(path) in str(info.value)


@pytest.mark.parametrize("change", ["shape", "missing"])
def test_shards_that_disagree_on_a_per_record_array_are_refused(tmp_path, fuzz_bases, change):
    """Found by the fuzzer and review: a crafted shard whose per-record table has another row
    shape or dtype made arrays() raise numpy's errors; one without it silently shifted every
    later row."""
    base = fuzz_bases["shards"]
    target = base.targets[1]
    original = base.files[target]
    meta_offset = fmt.unpack_footer(original[-fmt.FOOTER_SIZE :], "x")["meta_offset"]
    meta = json.loads(original[meta_offset : -fmt.FOOTER_SIZE])
    if change == "shape":  # same bytes, one column of raw bytes per row
        desc = meta["arrays"]["records"]
        desc.update(dtype="|u1", shape=[desc["shape"][0], desc["nbytes"] // desc["shape"][0]])
    else:
        del meta["arrays"]["records"]
    path = base.write(tmp_path, craft(base, target, rebuild(original, meta)))
    reader = open_pack(path)
    with pytest.raises(CorruptFileError, match="records") as info:
        reader.arrays()
    assert str(path) in str(info.value)


# ==============================================================================================
# 2. Interrupted packs
# ==============================================================================================
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", FORMS)
def test_pack_killed_at_random_moments_keeps_previous_or_new_pack(tmp_path, voc40, voc8, form):
    options = FORMS[form]
    name = out_name(form)
    ref = tmp_path / "ref"
    ref.mkdir()
    previous = snapshot(pack_voc(voc8, ref / f"previous-{name}", year="2007", **options).path)
    new = snapshot(pack_voc(voc40, ref / name, year="2007", **options).path)
    assert previous and new and previous != new

    rng = random.Random(f"kill-{form}")
    delays = [0.05, *(rng.uniform(0.05, 1.5) for _ in range(3))]
    outcomes = []
    for run, delay in enumerate(delays):
        folder = tmp_path / f"run{run}"
        folder.mkdir()
        out = folder / name
        if form == "shards":
            shutil.copytree(ref / f"previous-{name}", out)
        else:
            shutil.copyfile(ref / f"previous-{name}", out)
        # 40 images, 25 ms each: the pack writes for about a second after "started"
        proc = run_child("slow_pack", str(voc40), str(out), json.dumps(options), "0.025")
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == "started\n", proc.stderr.read() if proc.stderr else ""
            time.sleep(delay)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
        state = snapshot(out)
        left = [n for n in listing(folder) if n != name]
        assert state in (previous, new), f"kill after {delay:.2f}s left a partial pack"
        assert all(
            n.startswith((f".{name}.tmp-{proc.pid}-", f".{name}.old-{proc.pid}-")) for n in left
        )
        outcomes.append((delay, "previous" if state == previous else "new", left))

        result = pack_voc(voc40, out, year="2007", **options)  # the next pack cleans up
        assert listing(folder) == [name]
        assert snapshot(result.path) == new
        assert len(open_pack(out)) == 40
    assert any(kept == "previous" and left for _, kept, left in outcomes), outcomes


def make_crash_state(tmp_path: Path, voc8: Path, voc40: Path, old_form: str) -> tuple[Path, int]:
    """The folder a writer killed between its two renames leaves: the previous pack moved to
    ``.voc.old-PID-*``, the complete new one still at ``.voc.tmp-PID-*``, nothing at ``voc``."""
    out = tmp_path / "voc"
    pack_voc(voc8, out, year="2007", **FORMS[old_form])
    pid = dead_pid()
    os.replace(out, tmp_path / f".voc.old-{pid}-0badc0de")
    staging = tmp_path / "staging"
    staging.mkdir()
    new = pack_voc(voc40, staging / "voc", year="2007", **FORMS["shards"]).path
    os.replace(new, tmp_path / f".voc.tmp-{pid}-0ddba11a")
    staging.rmdir()
    return out, pid


@pytest.mark.parametrize("old_form", FORMS)
def test_crash_between_the_two_renames_restores_the_previous_pack(tmp_path, voc8, voc40, old_form):
    ref = tmp_path / "ref"
    ref.mkdir()
    previous = snapshot(pack_voc(voc8, ref / "voc", year="2007", **FORMS[old_form]).path)
    work = tmp_path / "work"
    work.mkdir()
    out, _ = make_crash_state(work, voc8, voc40, old_form)
    assert not out.exists()

    atomic.clean_stale(out)
    assert listing(work) == ["voc"]
    assert snapshot(out) == previous
    assert len(open_pack(out)) == 8

    result = pack_voc(voc40, out, year="2007", **FORMS["shards"])
    assert listing(work) == ["voc"] and len(open_pack(result.path)) == 40


def test_crash_after_the_second_rename_keeps_the_new_pack(tmp_path, voc8, voc40):
    out, pid = make_crash_state(tmp_path, voc8, voc40, "shards")
    os.replace(tmp_path / f".voc.tmp-{pid}-0ddba11a", out)  # the second rename happened
    committed = snapshot(out)
    atomic.clean_stale(out)
    assert listing(tmp_path) == ["voc"] and snapshot(out) == committed


def test_a_live_writers_folders_are_left_alone(tmp_path, voc8, voc40):
    out, pid = make_crash_state(tmp_path, voc8, voc40, "shards")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in listing(tmp_path):
            os.replace(tmp_path / name, tmp_path / name.replace(f"-{pid}-", f"-{sleeper.pid}-"))
        before = listing(tmp_path)
        atomic.clean_stale(out)  # that writer may still be between renames
        assert listing(tmp_path) == before and not out.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_failure_between_the_two_renames_puts_the_previous_pack_back(
    tmp_path, voc8, voc40, monkeypatch
):
    out = tmp_path / "voc"
    previous = snapshot(pack_voc(voc8, out, year="2007", **FORMS["shards"]).path)
    real_replace = os.replace

    def failing_replace(src: Any, dst: Any) -> None:
        if ".voc.tmp-" in Path(src).name:
            raise OSError(errno.EIO, "Input/output error (injected)")
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", failing_replace)
    with pytest.raises(WriteError, match="injected") as info:
        pack_voc(voc40, out, year="2007", **FORMS["shards"])
    monkeypatch.undo()
    assert str(out) in str(info.value) and isinstance(info.value, OSError)
    assert listing(tmp_path) == ["voc"] and snapshot(out) == previous


# ==============================================================================================
# 3. Disk full under pack_voc
# ==============================================================================================
def check_disk_full_report(stdout: str, folder: Path, code: int, hint: str) -> None:
    results = json.loads(stdout.strip().splitlines()[-1])
    for name in ("voc.tser", "voc"):
        report = results[name]
        assert report is not None, f"{name}: the pack succeeded"
        assert report["error"] == "WriteError" and report["oserror"]
        assert report["errno"] == code
        assert str(folder / name) in report["message"]
        assert hint in report["message"] and "No partial output" in report["message"]
    assert results["left"] == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_file_size_limit_under_pack_voc_raises_write_error_and_leaves_nothing(
    tmp_path, voc40, workers
):
    folder = tmp_path / "out"
    folder.mkdir()
    proc = run_child("pack_and_report", str(voc40), str(folder), str(256 << 10), str(workers))
    stdout, stderr = proc.communicate(timeout=100)
    assert proc.returncode == 0, stderr  # not killed by SIGXFSZ, no traceback
    assert "Traceback" not in stderr
    check_disk_full_report(stdout, folder, errno.EFBIG, "file size limit")
    assert listing(folder) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_full_tmpfs_under_pack_voc_raises_write_error_and_leaves_nothing(tmp_path, voc40, workers):
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare to mount a private tmpfs")
    folder = tmp_path / "small"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    code = "import sys, _reliability_helpers as h; h.child_main(*sys.argv[1:])"
    script = 'mount -t tmpfs -o size=2m tmpfs "$1" || exit 77; shift; exec "$@"'
    proc = subprocess.run(
        [unshare, "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(folder)]
        + [sys.executable, "-c", code, "pack_and_report", str(voc40), str(folder), "0"]
        + [str(workers)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    cannot_mount = proc.returncode == 77 or (proc.returncode == 1 and "unshare" in proc.stderr)
    if cannot_mount and not proc.stdout and "Traceback" not in proc.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    check_disk_full_report(proc.stdout, folder, errno.ENOSPC, "free disk space")


# ==============================================================================================
# 4. Concurrency
# ==============================================================================================
def index_crcs(path: Path) -> dict[tuple[int, int], int]:
    """(global record, field) -> CRC32 stored in the index, read by the independent parser."""
    files = [path]
    if path.is_dir():
        manifest = json.loads((path / fmt.MANIFEST_NAME).read_text())
        files = [path / s["file"] for s in manifest["shards"]]
    out, start = {}, 0
    for file in files:
        meta, index = parse_container(file)
        for i in range(index.shape[0]):
            for k in range(index.shape[1]):
                out[(start + i, k)] = int(index[i, k]["crc32"])
        start += meta["num_records"]
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", FORMS)
def test_six_spawned_readers_at_once_read_identical_bytes(voc40_packs, form):
    path = voc40_packs[form]
    expected = index_crcs(path)
    parent = open_pack(path)
    assert {
        (i, k): zlib.crc32(b)
        for i, row in enumerate(read_records(parent))
        for k, b in enumerate(row)
    } == expected

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(6), ctx.Queue()
    procs = [
        ctx.Process(target=crc_reader, args=(str(path), rank, 3, barrier, results))
        for rank in range(6)
    ]
    for proc in procs:
        proc.start()
    try:
        reports = [results.get(timeout=180) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0] * 6
    assert sorted(rank for rank, *_ in reports) == list(range(6))
    assert len({pid for _, pid, *_ in reports}) == 6
    for rank, _, crcs, changed, torch_loaded in reports:
        assert crcs == expected, f"reader {rank} read different bytes"
        assert changed == 0
        assert not torch_loaded, "reading a pack imported torch"


def fingerprints(dataset: Any) -> list[tuple[bytes, str]]:
    """Each sample of a decode="none" dataset: its stored image bytes and its target."""
    out = []
    for i in range(len(dataset)):
        image, target = dataset[i]
        out.append((image.numpy().tobytes(), json.dumps(target, sort_keys=True)))
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", FORMS)
def test_reader_keeps_old_data_while_another_process_repacks(tmp_path, voc40, voc8, form):
    options = FORMS[form]
    out = tmp_path / out_name(form)
    pack_voc(voc40, out, year="2007", **options)
    reference = tmp_path / "ref"
    reference.mkdir()
    new_path = pack_voc(voc8, reference / out.name, year="2007", **options).path

    reader = open_pack(out)
    dataset = torch_serialized.VOCSerializedDataset(out, "trainval", decode="none")
    old_records, old_samples = read_records(reader), fingerprints(dataset)
    blob = pickle.dumps(reader)

    proc = run_child("repack", str(voc8), str(out), json.dumps(options), "4")
    assert proc.stdout is not None
    assert proc.stdout.readline() == "started\n", proc.stderr.read() if proc.stderr else ""
    rounds = 0
    while proc.poll() is None:  # the path is being replaced under our feet, four times
        assert read_records(reader) == old_records
        assert fingerprints(dataset) == old_samples
        rounds += 1
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert rounds > 0
    assert read_records(reader) == old_records, "the open reader changed after the re-pack"
    assert fingerprints(dataset) == old_samples

    assert read_records(open_pack(out)) == read_records(open_pack(new_path))
    fresh = torch_serialized.VOCSerializedDataset(out, "trainval", decode="none")
    expected = torch_serialized.VOCSerializedDataset(new_path, "trainval", decode="none")
    assert fingerprints(fresh) == fingerprints(expected) != old_samples

    # the old reader sent to a new process: refused, never a mix of old index and new bytes
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        result = pool.submit(read_pickled, blob).result(timeout=180)
    assert result[:3] == ("error", "FileChangedError", True), result
    assert str(out) in result[3]


# ==============================================================================================
# 5. Untrusted data
# ==============================================================================================
#: Modules (and numpy's switch) that load objects or run code from data: flagged wherever they
#: appear as a code token (strings and comments excluded, so docstrings may discuss pickling).
FORBIDDEN_MODULES = {
    "pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve",
    "importlib", "runpy", "subprocess", "yaml", "allow_pickle",
}  # fmt: skip
#: Builtins that run code: flagged as bare names (``re.compile`` is an attribute, not these).
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "execfile", "__import__"}
#: Calls that run commands or unpickle: ``<name>.<attr>(...)``.
FORBIDDEN_CALLS = {
    ("os", "system"), ("os", "popen"), ("torch", "load"), ("np", "load"), ("numpy", "load"),
}  # fmt: skip
#: Documented exceptions: (file, name) -> why it is safe.
ALLOWED = {
    ("__init__.py", "importlib"): (
        "PEP 562 lazy exports: the module names come from the package's fixed _LAZY table"
    ),
    ("packing.py", "subprocess"): (
        "times a cold `import <fixed module name>` in a fresh interpreter; "
        "no file content reaches the command line"
    ),
    ("memory.py", "subprocess"): (
        "runs the benchmark's fixed memory-child code in a fresh interpreter with a JSON config "
        "of paths and counts; no file content reaches the command line"
    ),
}


def package_sources() -> list[Path]:
    return sorted((ROOT / "torch_serialized").rglob("*.py"))


def test_package_source_has_no_code_execution_paths():
    found = []
    for path in package_sources():
        source = path.read_text(encoding="utf-8")
        with io.StringIO(source) as buffer:
            previous = ""
            for tok in tokenize.generate_tokens(buffer.readline):
                name = tok.string if tok.type == tokenize.NAME else ""
                bare = previous != "."
                forbidden = name in FORBIDDEN_MODULES or (bare and name in FORBIDDEN_BUILTINS)
                if forbidden and (path.name, name) not in ALLOWED:
                    found.append(f"{path.name}:{tok.start[0]}: {name}")
                if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
                    previous = tok.string
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and (node.func.value.id, node.func.attr) in FORBIDDEN_CALLS
            ):
                found.append(f"{path.name}:{node.lineno}: {node.func.value.id}.{node.func.attr}")
    assert found == [], "code that could execute file content:\n" + "\n".join(found)
    assert len(package_sources()) > 10  # the scan saw the package


def test_pillow_limits_unchanged_by_import_and_pack(tmp_path, voc8):
    fresh = subprocess.run(
        [sys.executable, "-c", "from PIL import Image, ImageFile; "
         "print(Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    from PIL import ImageFile

    def current() -> list[str]:
        return [str(Image.MAX_IMAGE_PIXELS), str(ImageFile.LOAD_TRUNCATED_IMAGES)]

    import importlib
    import pkgutil

    for module in pkgutil.walk_packages(torch_serialized.__path__, "torch_serialized."):
        if not module.name.endswith("__main__"):
            try:
                importlib.import_module(module.name)
            except ModuleNotFoundError as exc:  # an optional dependency (e.g. matplotlib)
                if exc.name and exc.name.startswith("torch_serialized"):
                    raise
    assert current() == fresh
    pack = pack_voc(voc8, tmp_path / "voc.tser", year="2007", check_images=True).path
    for decode in ("pil", "tensor"):
        torch_serialized.VOCSerializedDataset(pack, "trainval", decode=decode)[0]
    assert current() == fresh


def png_claiming(width: int, height: int) -> bytes:
    """A 100-byte PNG whose header claims ``width`` x ``height`` RGB pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(bytes(64)))
        + chunk(b"IEND", b"")
    )


def jpeg_claiming(width: int, height: int) -> bytes:
    """A tiny real JPEG whose SOF0 header is patched to claim ``width`` x ``height``."""
    data = bytearray(jpeg(16, 16))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check_images", [False, True])
@pytest.mark.parametrize(
    "bomb", [png_claiming(50_000, 50_000), jpeg_claiming(65_000, 65_000)], ids=["png", "jpeg"]
)
def test_decompression_bomb_is_refused_at_pack_time(tmp_path, bounded_memory, bomb, check_images):
    ids = ["a", "b"]
    samples = [
        Sample(i, image, voc_xml(f"{i}.jpg", 16, 16, [obj("dog", (1, 1, 8, 8))]))
        for i, image in zip(ids, [jpeg(16, 16), bomb])
    ]
    write_voc(tmp_path / "src", "2007", samples, {"Main": {"train": ids}})
    out = tmp_path / "out"
    out.mkdir()
    started = time.perf_counter()
    with pytest.raises(SourceDataError, match="decompression bomb") as info:
        pack_voc(tmp_path / "src", out / "voc.tser", year="2007", check_images=check_images)
    assert time.perf_counter() - started < 10, "the bomb was decoded"
    assert "b.jpg" in str(info.value)
    assert listing(out) == []


# ==============================================================================================
# 6. Long runs
# ==============================================================================================
def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def uss(pid: int) -> int:
    """Unique set size: private clean + private dirty bytes (``smaps_rollup``)."""
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        if key in ("Private_Clean", "Private_Dirty"):
            total += int(value.split()[0]) * 1024
    return total


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_twenty_epochs_with_persistent_workers_keep_fds_and_memory_flat(voc40_packs):
    if not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("needs /proc/<pid>/smaps_rollup (Linux >= 4.14)")
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("needs glibc's mallopt (see pin_mmap_threshold)")
    from torch.utils.data import DataLoader

    dataset = PidDataset(
        torch_serialized.VOCSerializedDataset(voc40_packs["single"], "trainval", decode="tensor")
    )
    loader = DataLoader(
        dataset,  # type: ignore[arg-type]
        batch_size=8,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        collate_fn=list_collate,
        worker_init_fn=pin_mmap_threshold,  # allocator caching is not a leak: see its doc
        # spawn, not fork: a forked worker's USS also grows as its refcount and GC writes copy
        # the pages it shares with this (test-suite-sized) parent, which says nothing of ours
        multiprocessing_context="spawn",
    )
    seen: dict[int, tuple[dict[int, tuple[int, int]], int]] = {}
    for epoch in range(1, 21):
        pids, count = set(), 0
        for batch in loader:
            for pid, (image, target) in batch:
                assert image.ndim == 3 and image.shape[0] == 3 and "annotation" in target
                pids.add(pid)
                count += 1
        assert count == len(dataset)
        if epoch in (2, 20):
            seen[epoch] = ({pid: (open_fds(pid), uss(pid)) for pid in pids}, open_fds(os.getpid()))
    workers_2, main_2 = seen[2]
    workers_20, main_20 = seen[20]
    assert len(workers_2) == 2 and set(workers_2) == set(workers_20)
    assert os.getpid() not in workers_2
    for pid, (fds, memory) in workers_2.items():
        assert workers_20[pid][0] == fds, f"worker {pid}: open fds {fds} -> {workers_20[pid][0]}"
        growth = workers_20[pid][1] - memory
        assert growth < 5 << 20, f"worker {pid}: USS grew {growth / 2**20:.1f} MiB"
    assert main_20 == main_2, f"main process: open fds {main_2} -> {main_20}"
    del loader
