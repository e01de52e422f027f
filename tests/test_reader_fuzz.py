"""Fuzzing the reader: random files, random damage to real packs, crafted files.

A loader under week-long training runs reads files that travel between machines. It must never
crash the interpreter, silently return wrong data or allocate without bound: only our own
exceptions may escape, under a memory cap. Crafted files have their checksums fixed up, so the
damage reaches the index and metadata checks behind them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _container_helpers import (
    assert_bad_content,
    check_pack,
    record_spans,
    write_pack,
)
from _reliability_helpers import (
    snapshot,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from torch_serialized.container import manifest as mf
from torch_serialized.container import spec as fmt
from torch_serialized.container.shards import open_pack
from torch_serialized.errors import (
    ChecksumError,
    CorruptFileError,
    FormatError,
    TorchSerializedError,
)
from torch_serialized.voc.pack import pack_voc


# a small pack for fuzzing: every byte is either covered by a checksum or is padding
@pytest.fixture(scope="module")
def small_pack(tmp_path_factory) -> tuple[bytes, list[tuple[int, int, int]]]:
    path = write_pack(tmp_path_factory.mktemp("small") / "s.tser", 6)
    return path.read_bytes(), [(r, o, n) for r, _, o, n in record_spans(path)]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_any_flipped_byte_is_detected_or_harmless(tmp_path, small_pack, data):
    original, spans = small_pack
    position = data.draw(st.integers(0, len(original) - 1), label="position")
    damaged = bytearray(original)
    damaged[position] ^= data.draw(st.integers(1, 255), label="xor")
    path = tmp_path / "fuzz.tser"
    path.write_bytes(damaged)
    in_record = sorted({r for r, o, n in spans if o <= position < o + n})
    try:
        reader = open_pack(path)
    except FormatError as exc:
        assert_bad_content(exc, path)
        assert not in_record, "a damaged record byte must not fail the open"
        return
    assert reader.verify() == in_record
    if not in_record:  # padding: every read is intact
        check_pack(reader, 6)


fuzz_settings = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def json_values(depth: int, *, finite: bool = False) -> st.SearchStrategy[Any]:
    """Any JSON value, nested at most ``depth`` deep (``finite``: no NaN or infinity, which
    strict JSON, and so a manifest's checksum, cannot hold)."""
    floats = st.floats(allow_nan=not finite, allow_infinity=not finite)
    leaves = st.none() | st.booleans() | st.integers() | floats | st.text(max_size=8)
    if depth == 0:
        return leaves
    inner = json_values(depth - 1, finite=finite)
    return (
        leaves
        | st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    )


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
    """The batch read paths (``ContainerReader.read_records``, one scatter read per run of
    records, and ``views``) return what ``field`` returned, or raise ChecksumError on a
    checked reader."""
    for s, start in enumerate(reader.starts[:-1]):
        shard = reader.shard(s)
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
        # the views the datasets and the iterable read (ContainerReader.views / record)
        try:
            views = shard.views(range(len(shard)), range(len(shard.fields)))
        except ChecksumError:
            assert checked, "an unchecked reader raised ChecksumError"
            continue
        for i, row in enumerate(views):
            want = records[int(start) + i]
            assert all(w is None or w == bytes(g) for w, g in zip(want, row)), (
                f"views and field disagree on record {int(start) + i}"
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
    assert len(bases["shards"].targets) == 4  # 3 shards and the catalog
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
        parts = [
            name for name in ["records"] * 3 + sorted(spans) if spans[name][1] > spans[name][0]
        ]
        start, end = spans[draw(st.sampled_from(parts))]  # a catalog has no record bytes
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


V1_ENTRY = st.fixed_dictionaries(
    {
        "file": st.sampled_from(
            ["shard-00000.tser", "shard-00002.tser", "manifest.json", "gone"]
            + [".", "..", "", "a/b", "/etc/passwd", "sub", 0, None]
        ),
        "num_records": st.sampled_from([0, 1, 2, -1, 2**70, "2", None]),
        "bytes": st.sampled_from([0, 128, 5651, 2**70, None]),
        "meta_crc32": st.integers(-1, 2**33),
    }
)


@pytest.mark.timeout(120)
@settings(fuzz_settings, max_examples=200)
@given(
    raw=st.one_of(
        st.binary(max_size=512),
        st.builds(
            lambda shards, extra: json.dumps(
                {"format": fmt.MANIFEST_FORMAT, "version": 1, "shards": shards, "user": {}, **extra}
            ).encode(),
            st.lists(V1_ENTRY, max_size=4),
            st.dictionaries(st.sampled_from(["version", "user", "shards"]), st.none(), max_size=1),
        ),
    ),
    real_names=st.booleans(),
)
def test_random_manifests_are_refused_with_our_errors(
    tmp_path, bounded_memory, fuzz_bases, raw, real_names
):
    base = fuzz_bases["shards"]
    if real_names:  # name the real (version 2) files: a downgrade to an unprotected manifest
        shards = sorted(n for n in base.files if n.startswith("shard-"))
        for k, name in enumerate(shards):
            raw = raw.replace(f"shard-{k:05d}.tser".encode(), name.encode())
    folder = base.write(tmp_path, {fmt.MANIFEST_NAME: raw})
    (folder / "sub").mkdir(exist_ok=True)
    try:
        outcome = read_all(folder)
    except FileNotFoundError as exc:  # a listed shard is missing: test_reader's contract
        assert str(folder) in str(exc)
        return
    assert not isinstance(outcome, Outcome), "a version-1 manifest opened version-2 files"


#: Names a hostile manifest entry may take: the pack's own, missing and nonsense ones.
def entry_names(base: FuzzBase) -> list[Any]:
    real = sorted(n for n in base.files if n.endswith(fmt.FILE_SUFFIX))
    return [*real, "gone.tser", "shard-00000.tser", "manifest.json", "", "..", "a/b", "x\x00", 3]


NUMBERS = [0, 1, 2, 3, 6, 127, 128, 5000, 2**32 - 1, 2**32, 2**63 - 1, 2**63, -1, True, 1.5, None]


@st.composite
def hostile_manifest(draw: st.DrawFn, base: FuzzBase) -> tuple[dict[str, Any], list[str]]:
    """The pack's manifest after 1 to 4 hostile edits, with a valid checksum (and usually
    consistent record numbers, so the edit reaches the checks behind the parser)."""
    manifest = json.loads(base.files[fmt.MANIFEST_NAME])
    shards = manifest["shards"]
    done: list[str] = []
    for _ in range(draw(st.integers(1, 4), label="edits")):
        kind = draw(
            st.sampled_from(
                ["swap", "duplicate", "drop", "catalog<->shard", "number", "name", "pack_id"]
                + ["fields", "extra", "nest", "total"]
            ),
            label="kind",
        )
        n = len(shards)
        i, j = draw(st.integers(0, max(0, n - 1))), draw(st.integers(0, max(0, n - 1)))
        if kind == "swap" and n:
            shards[i], shards[j] = shards[j], shards[i]
        elif kind == "duplicate" and n:
            shards[j] = copy.deepcopy(shards[i])
        elif kind == "drop" and n > 1:
            del shards[i]
        elif kind == "catalog<->shard" and n:
            catalog = manifest["catalog"]
            manifest["catalog"] = {k: shards[i][k] for k in ("file", "bytes", "meta_crc32")}
            shards[i] = {**shards[i], **catalog}
        elif kind == "number":
            entry = draw(st.sampled_from([*shards, manifest["catalog"]]) if n else st.just({}))
            key = draw(st.sampled_from(["first_record", "num_records", "bytes", "meta_crc32"]))
            entry[key] = draw(st.sampled_from(NUMBERS))
        elif kind == "name":
            entry = draw(st.sampled_from([*shards, manifest["catalog"]]) if n else st.just({}))
            entry["file"] = draw(st.sampled_from(entry_names(base)))
        elif kind == "pack_id":
            manifest["pack_id"] = draw(st.sampled_from(["0" * 32, "f" * 32, "F" * 32, 7]))
        elif kind == "fields":
            manifest["fields"] = draw(st.permutations(manifest["fields"]))
        elif kind == "extra":
            manifest[draw(st.sampled_from(["user", "history", "created_by"]))] = draw(
                json_values(2, finite=True)
            )
        elif kind == "nest":
            depth = draw(st.sampled_from([10, 63, 64, 65, 500]))
            manifest["user"] = json.loads("[" * depth + "]" * depth)
        elif kind == "total":
            manifest["num_records"] = draw(st.sampled_from(NUMBERS))
        done.append(kind)
    if draw(st.booleans(), label="consistent records"):
        first = 0
        for entry in shards:
            if isinstance(entry.get("num_records"), int) and entry["num_records"] >= 0:
                entry["first_record"] = first
                first += entry["num_records"]
        manifest["num_records"] = first
    manifest["checksum"] = mf.manifest_checksum(manifest)
    return manifest, done


@pytest.mark.timeout(300)
@settings(fuzz_settings, max_examples=300)
@given(data=st.data())
def test_hostile_manifests_with_valid_checksums_are_refused_or_read_correctly(
    tmp_path, bounded_memory, fuzz_bases, data
):
    """Issue #11, item 2 and the property test: a manifest rewritten with a valid checksum
    (shards swapped, duplicated, dropped, renamed, taken for the catalog, numbers changed,
    another pack id, absurd nesting...) either reads exactly the original pack or is refused
    with our error (or FileNotFoundError) naming the pack; it never pairs ids with other
    records' bytes."""
    base = fuzz_bases["shards"]
    manifest, kinds = data.draw(hostile_manifest(base), label="manifest")
    folder = base.write(tmp_path, {fmt.MANIFEST_NAME: json.dumps(manifest).encode()})
    try:
        outcome = read_all(folder)
    except FileNotFoundError as exc:  # a listed file is missing: named, with its manifest
        event("missing file")
        assert str(folder) in str(exc)
        return
    event(f"{'+'.join(sorted(set(kinds)))}: {describe(outcome)}")
    if isinstance(outcome, TorchSerializedError):
        assert str(folder) in str(outcome)
        return
    if outcome.error is not None:  # refused when the shard was first read
        assert str(folder) in str(outcome.error)
        assert isinstance(outcome.error, CorruptFileError)
        return
    original = base.original
    assert outcome.records == original.records, f"{kinds}: records changed silently"
    assert outcome.arrays == original.arrays and outcome.user == original.user
    assert outcome.bad == []


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
    with it (size, checksum, records, a valid manifest checksum), so the damage gets past every
    checksum and reaches the checks behind them."""
    files = {target: data}
    if base.form == "shards":
        manifest = json.loads(base.files[fmt.MANIFEST_NAME])
        footer = fmt.unpack_footer(data[-fmt.FOOTER_SIZE :], "x")
        first = 0
        for entry in [manifest["catalog"], *manifest["shards"]]:
            if entry["file"] == target:
                entry["meta_crc32"] = footer["meta_crc32"]
                entry["bytes"] = len(data)
                if entry is not manifest["catalog"]:
                    entry["num_records"] = footer["num_records"]
            if "first_record" in entry:
                entry["first_record"] = first
                first += entry["num_records"]
        manifest["num_records"] = first
        manifest["checksum"] = mf.manifest_checksum(manifest)
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
    with_records = [t for t in base.targets if not t.startswith("catalog-")]
    target = data.draw(st.sampled_from(with_records), label="file")
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
    if outside:  # refused at open (a single file) or when the shard is first read
        refusal = outcome.error if isinstance(outcome, Outcome) else outcome
        assert isinstance(refusal, CorruptFileError), "an index entry outside the data was accepted"
        assert "outside" in str(refusal)
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
    with pytest.raises(CorruptFileError, match="has an invalid dtype"):
        open_pack(path)


def test_absurd_shapes_that_fit_nbytes_are_refused(tmp_path, fuzz_bases):
    """Found by the fuzzer: shapes that match nbytes but that numpy cannot build (more than 64
    axes, a dimension past int64 beside a zero) raised numpy's ValueError from the reader.
    Dimensions beyond ``MAX_JSON_INT`` are refused by strict JSON before numpy sees them."""
    base = fuzz_bases["single"]
    original = base.files[""]
    meta_offset = fmt.unpack_footer(original[-fmt.FOOTER_SIZE :], "x")["meta_offset"]
    big = fmt.MAX_JSON_INT
    for shape, nbytes, message in (
        ([1] * 70, 1, "unusable shape"),
        ([0, big, big], 0, "unusable shape"),
        ([0, big, big, big], 0, "unusable shape"),
        ([0, 2**70], 0, "integer"),
        ([0, 2**63 - 1, 2**63 - 1], 0, "integer"),
    ):
        meta = json.loads(original[meta_offset : -fmt.FOOTER_SIZE])
        desc = meta["arrays"]["file/ImageSets/Main/train.txt"]
        desc.update(
            shape=shape, nbytes=nbytes, crc32=fmt.crc32(original[desc["offset"] :][:nbytes])
        )
        path = base.write(tmp_path, {"": rebuild(original, meta)})
        with pytest.raises(CorruptFileError, match=message) as info:
            open_pack(path)
        assert str(path) in str(info.value)


@pytest.mark.parametrize("change", ["shape", "missing"])
def test_shards_that_disagree_on_a_per_record_array_are_refused(tmp_path, fuzz_bases, change):
    """Found by the fuzzer and review: a crafted shard whose per-record table has another row
    shape or dtype made arrays() raise numpy's errors; one without it silently shifted every
    later row."""
    base = fuzz_bases["shards"]
    target = base.targets[2]  # shard 1 (the catalog sorts first)
    original = base.files[target]
    meta_offset = fmt.unpack_footer(original[-fmt.FOOTER_SIZE :], "x")["meta_offset"]
    meta = json.loads(original[meta_offset : -fmt.FOOTER_SIZE])
    if change == "shape":  # same bytes, one column of raw bytes per row
        desc = meta["arrays"]["records"]
        desc.update(dtype="|u1", shape=[desc["shape"][0], desc["nbytes"] // desc["shape"][0]])
    else:
        del meta["arrays"]["records"]
    path = base.write(tmp_path, craft(base, target, rebuild(original, meta)))
    reader = open_pack(path)  # the catalog holds the columns: the shard is checked when used
    assert reader.arrays()["records"].tobytes() == base.original.arrays["records"][2]
    bytes(reader.field(0, 0))  # shard 0 is intact
    with pytest.raises(CorruptFileError, match="records") as info:
        reader.field(2, 0)
    assert str(path / target) in str(info.value)
