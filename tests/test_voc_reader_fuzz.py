"""Hostile VOC packs with valid checksums: every open and read returns correct data or our error.

Issue #11's property test. Starting from a real pack of six tiny samples, Hypothesis changes what
the VOC layer reads (metadata values and their nesting, ids and their offsets, image set record
numbers, per-record columns and their dtypes, class ids, stored targets, images that claim
absurd sizes, masks) and writes the result as a new pack whose every checksum, size and binding
is valid, so each change reaches the checks behind the checksums. Then every reader opens it
and reads every sample of every image set through every path (PIL, tensor and bytes decoding,
dict and tensor targets, masks, the iterable), and ``info``, ``verify`` and ``export`` run on
it. Each either returns what the pack really holds (checked against an oracle built from the
contents written, not from our reader) or raises a ``ValueError``/``OSError`` naming the pack,
within a time cap and under an address-space cap of 512 MiB above the process's size.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _container_helpers import Contents, read_contents, write_contents
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image
from vocfactory import jpeg, jpeg_claiming, palette_mask, png_claiming

from torch_serialized import (
    VOCSerializedDataset,
    VOCSerializedIterableDataset,
    VOCSerializedSegmentation,
)
from torch_serialized.cli import main
from torch_serialized.voc import schema

#: Seconds one example may take, all reads included (a few tenths normally).
TIME_CAP = 30.0

SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_INTS = [0, 1, 2, 5, 6, 7, -1, 99, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 10**9, -(2**63)]
_JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.sampled_from(_INTS)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
_JSON = st.recursive(
    _JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = [value]
    return value


USER_KEYS = [
    "schema_version", "year", "base_dir", "voc_folder", "num_samples", "splits", "classes",
    "class_counts", "image_storage", "max_size", "options", "skipped",
]  # fmt: skip
USER_VALUES = st.one_of(
    _JSON,
    st.sampled_from(
        [
            "2007",
            "dogcat",
            ["dog", "dog"],
            ["cat", "dog", "person", "x"],
            ["dog"],
            [],
            {"Main": None},
            {"Main": {"train": 99}},
            {"Other": {}},
            "raw",
            "original",
            None,
            {"Main/train": {"unicorn": 1}},
            {"Main/train": {"dog": -5}},
        ]
    ),  # fmt: skip
    st.sampled_from([10, 63, 64, 80]).map(nested),
)
ARRAY_DTYPES = ["|u1", "|i1", "<i4", "<i8", "<u8", "<f8", "|b1"]
IMAGES = [
    b"",
    b"not an image",
    jpeg_claiming(14_000, 14_000),
    jpeg_claiming(0, 0),
    png_claiming(50_000, 50_000),
    palette_mask(12, 10),
    jpeg(9, 7, seed=3),
    jpeg(12, 10)[:200],
]
MASKS = [b"", b"\xff\xd8 junk", png_claiming(50_000, 50_000), palette_mask(3, 3), jpeg(8, 8)]


def _whole_rows(data: bytes) -> bool:
    return bool(data) and len(data) % schema.OBJECT_DTYPE.itemsize == 0


@st.composite
def hostile(draw: st.DrawFn, base: Contents) -> tuple[Contents, list[str]]:
    """``base`` after one to four hostile edits; the edits' names for the statistics."""
    c = copy.deepcopy(base)
    n = len(c.records)
    kinds: list[str] = []
    for _ in range(draw(st.integers(1, 4), label="edits")):
        kind = draw(
            st.sampled_from(
                ["user", "ids", "id_offsets", "split", "columns", "class_id", "objects"]
                + ["target", "image", "mask", "array dtype", "drop array"]
            ),
            label="kind",
        )
        kinds.append(kind)
        r = draw(st.integers(0, n - 1), label="record")
        if kind == "user":
            c.user[draw(st.sampled_from(USER_KEYS))] = draw(USER_VALUES)
        elif kind == "ids":
            blob = draw(st.binary(min_size=0, max_size=60))
            c.arrays["ids"] = np.frombuffer(blob, dtype=np.uint8).copy()
        elif kind == "id_offsets":
            values = draw(st.lists(st.sampled_from([0, 1, 5, 6, 12, 36, 2**40]), max_size=9))
            c.arrays["id_offsets"] = np.array(values, dtype="<u8")
        elif kind == "split" and any(a.startswith("split/") for a in c.arrays):
            name = draw(st.sampled_from(sorted(a for a in c.arrays if a.startswith("split/"))))
            values = draw(st.lists(st.sampled_from([0, 1, 3, 5, 6, -1, 10**9, 2**40]), max_size=8))
            dtype = draw(st.sampled_from(["<i8", "<i8", "<i4", "<u8", "<f8"]))
            c.arrays[name] = np.array(values).astype(dtype)
        elif kind == "columns" and c.arrays.get("records", np.zeros(0)).dtype == schema.COLUMNS:
            column = draw(st.sampled_from(["width", "height", "num_objects", "flags"]))
            c.arrays["records"][column][r] = draw(st.sampled_from([0, 1, 7, 60_000, 2**32 - 1]))
        elif kind == "class_id" and _whole_rows(c.records[r][schema.OBJECTS]):
            rows = np.frombuffer(c.records[r][schema.OBJECTS], schema.OBJECT_DTYPE).copy()
            rows["class_id"][0] = draw(st.sampled_from([-1, 0, 1, 2, 3, 99, 2**31 - 1]))
            c.records[r][schema.OBJECTS] = rows.tobytes()
        elif kind == "objects":
            c.records[r][schema.OBJECTS] = draw(st.binary(max_size=60))
        elif kind == "target":
            c.records[r][schema.TARGET] = draw(
                st.sampled_from([b"", b"{", b"[1]", b'{"a": NaN}', b'"x"', b"{}", b'{"a":1,"a":2}'])
                | _JSON.map(lambda v: json.dumps(v).encode())
            )
        elif kind == "image":
            c.records[r][schema.IMAGE] = draw(st.sampled_from(IMAGES))
        elif kind == "mask":
            c.records[r][schema.MASK] = draw(st.sampled_from(MASKS))
        elif kind == "array dtype" and c.arrays:
            name = draw(st.sampled_from(sorted(c.arrays)))
            dtype = draw(st.sampled_from(ARRAY_DTYPES))
            array = c.arrays[name]
            if array.dtype.names is None:
                c.arrays[name] = array.astype(dtype)
            else:  # a structured array: one of plain numbers instead
                c.arrays[name] = np.zeros(len(array), dtype=dtype)
        elif kind == "drop array" and c.arrays:
            c.arrays.pop(draw(st.sampled_from(sorted(c.arrays))))
    return c, kinds


# -- the oracle: what the pack holds, read from the contents written, not by our reader ---------
def oracle_id(c: Contents, record: int) -> str:
    offsets = c.arrays["id_offsets"]
    return bytes(c.arrays["ids"][int(offsets[record]) : int(offsets[record + 1])]).decode()


def oracle_labels(c: Contents, record: int) -> list[int]:
    names = ["__background__", *sorted(c.user["classes"])]
    rows = np.frombuffer(c.records[record][schema.OBJECTS], schema.OBJECT_DTYPE)
    return [names.index(c.user["classes"][int(k)]) for k in rows["class_id"]]


def oracle_image(c: Contents, record: int) -> Image.Image:
    data = c.records[record][schema.IMAGE]
    if c.user["image_storage"] == "raw":
        row = c.arrays["records"][record]
        return Image.frombytes("RGB", (int(row["width"]), int(row["height"])), data)
    return Image.open(io.BytesIO(data)).convert("RGB")


class Checker:
    """Runs every read of a crafted pack; an exception passes only if it is ours to raise."""

    def __init__(self, path: Path, contents: Contents) -> None:
        self.path, self.c = path, contents
        self.outcomes: list[str] = []

    def attempt(self, what: str, read: Any) -> Any:
        try:
            value = read()
        except (ValueError, OSError) as exc:  # ours, or a ValueError we raise naming the pack
            assert str(self.path) in str(exc), f"{what}: {type(exc).__name__} names no file: {exc}"
            self.outcomes.append(f"{what}: {type(exc).__name__}")
            return None
        self.outcomes.append(f"{what}: read")
        return value

    def detection(self, image_set: str) -> None:
        for decode in ("none", "pil"):
            for target_format in ("dict", "tv_tensors"):
                classes = "packed" if target_format == "tv_tensors" else None
                ds = self.attempt(
                    "open",
                    lambda d=decode, t=target_format, k=classes: VOCSerializedDataset(
                        self.path, image_set=image_set, decode=d, target_format=t, classes=k
                    ),
                )
                if ds is None:
                    continue
                records = self.c.arrays[schema.split_array_name("Main", image_set)]
                assert ds.records.tolist() == records.tolist()
                assert ds.ids == [oracle_id(self.c, int(r)) for r in records]
                for i, record in enumerate(records.tolist()):
                    sample = self.attempt("read", lambda i=i, d=ds: d[i])
                    if sample is not None:
                        self.check(sample, record, decode, target_format)

    def check(self, sample: Any, record: int, decode: str, target_format: str) -> None:
        image, target = sample
        if decode == "none":
            assert image.numpy().tobytes() == self.c.records[record][schema.IMAGE]
        else:
            want = oracle_image(self.c, record)
            assert image.size == want.size and image.tobytes() == want.tobytes()
        if target_format == "dict":
            assert target == json.loads(self.c.records[record][schema.TARGET])
        else:
            assert target["labels"].tolist() == oracle_labels(self.c, record)
            rows = np.frombuffer(self.c.records[record][schema.OBJECTS], schema.OBJECT_DTYPE)
            assert torch.equal(
                target["boxes"].as_subclass(torch.Tensor), torch.from_numpy(rows["box"].copy())
            )

    def segmentation(self, image_set: str) -> None:
        ds = self.attempt("open", lambda: VOCSerializedSegmentation(self.path, image_set=image_set))
        if ds is None:
            return
        records = self.c.arrays[schema.split_array_name("Segmentation", image_set)].tolist()
        for i, record in enumerate(records):
            sample = self.attempt("read", lambda i=i: ds[i])
            if sample is not None:
                want = Image.open(io.BytesIO(self.c.records[record][schema.MASK]))
                assert sample[1].tobytes() == want.tobytes() and sample[1].size == want.size

    def stream(self, image_set: str, task: str) -> None:
        ds = self.attempt(
            "open iterable",
            lambda: VOCSerializedIterableDataset(self.path, image_set, task=task, decode="none"),
        )
        if ds is not None:
            self.attempt("iterate", lambda: list(ds))

    def commands(self, tmp: Path) -> None:
        for argv, allowed in (
            (["info", str(self.path)], (0, 2)),
            (["info", "--json", str(self.path)], (0, 2)),
            (["verify", str(self.path)], (0, 1, 2)),
            (["export", "-q", str(self.path), str(tmp / "export")], (0, 2)),
        ):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = main(argv)
            assert status in allowed, (argv, status, err.getvalue())
            if status == 2:
                assert err.getvalue().count("\n") == 1, err.getvalue()
            self.outcomes.append(f"{argv[0]}: {status}")


@pytest.fixture(scope="module")
def bases(tiny_packs: dict[str, Path]) -> dict[str, Contents]:
    return {form: read_contents(path) for form, path in tiny_packs.items()}


def run_property(tmp_path: Path, bases: dict[str, Contents], data: st.DataObject) -> None:
    form = data.draw(st.sampled_from(["single", "shards"]), label="form")
    contents, kinds = data.draw(hostile(bases[form]), label="contents")
    limits = {"max_records_per_shard": 2} if form == "shards" else {}
    folder = Path(tmp_path) / f"example-{time.monotonic_ns()}"
    folder.mkdir()
    try:
        path = write_contents(contents, folder / "pack", **limits)
    except (ValueError, TypeError) as exc:  # the writer itself refuses (e.g. a dtype)
        event(f"not writable: {type(exc).__name__}")
        return
    started = time.perf_counter()
    checker = Checker(path, contents)
    for image_set in ("train", "val", "trainval", "nope"):
        checker.detection(image_set)
        checker.stream(image_set, "Main")
    for image_set in ("train", "val"):
        checker.segmentation(image_set)
        checker.stream(image_set, "Segmentation")
    checker.commands(folder)
    elapsed = time.perf_counter() - started
    assert elapsed < TIME_CAP, f"{elapsed:.1f} s for one example"
    opened = [o for o in checker.outcomes if o.startswith("open:")]
    reads = [o for o in checker.outcomes if o.startswith("read:")]
    event(f"opened: {sum(o.endswith(': read') for o in opened)} of {len(opened)} datasets")
    good = sum(o.endswith(": read") for o in reads)
    if reads:
        event(f"samples: {'all' if good == len(reads) else 'some' if good else 'none'} read")
    event(f"edits: {'+'.join(sorted(set(kinds)))}")


@pytest.mark.timeout(600)
@settings(SETTINGS, max_examples=60)
@given(data=st.data())
def test_hostile_voc_packs_read_correctly_or_raise_our_errors(
    tmp_path, bounded_memory, bases, data
):
    run_property(tmp_path, bases, data)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@settings(SETTINGS, max_examples=300)
@given(data=st.data())
def test_hostile_voc_packs_read_correctly_or_raise_our_errors_at_length(
    tmp_path, bounded_memory, bases, data
):
    run_property(tmp_path, bases, data)
