"""torchvision is the oracle, over devkits drawn at random.

Each example writes a small devkit (odd ids; colour, grayscale, CMYK and progressive JPEGs
with an EXIF orientation, a PNG behind a ``.jpg`` name; annotations in UTF-8, UTF-16 or
Latin-1, with typed objects, objects without a box or a name, float boxes, extra fields;
segmentation-only ids whose XML does not parse or who have none; class and object masks;
lists with duplicates and ids in both tasks), packs it as one file or as shards, and compares
every image set with ``VOCDetection`` / ``VOCSegmentation`` sample by sample, and with
``wrap_dataset_for_transforms_v2`` over each; the iterable must yield the same samples, and an
export must give the same files back. A second test draws histories of one devkit (ids moving
between tasks, annotations edited, made untyped, broken or removed) and appends each state to
the pack: every image set must then read as torchvision reads the folder.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_datasets import assert_same_dataset, assert_same_tensors, torchvision_dataset
from torchvision.datasets import wrap_dataset_for_transforms_v2
from vocfactory import OMIT, Sample, encode_xml, jpeg, obj, palette_mask, png, voc_xml, write_voc

import torch_serialized as ts
from torch_serialized import (
    UntypedObjectsWarning,
    VOCSerializedDataset,
    VOCSerializedIterableDataset,
    VOCSerializedSegmentation,
)

#: ids as datasets in the wild name them: VOC's, a dot, a space inside, non-ASCII, long
ID_POOL = [
    "2008_000001",
    "2008_000002",
    "a",
    "img.v2",
    "x y",
    "café",
    "z" * 40,
    "0",
]
NAMES = st.sampled_from(["dog", "cat", "person", "traffic light", "Dog", "草"])
COORD = st.one_of(st.integers(0, 30), st.floats(0, 30, allow_nan=False).map(lambda v: round(v, 2)))


@st.composite
def objects(draw: st.DrawFn) -> dict[str, Any]:
    box = [draw(COORD) for _ in range(4)]
    kind = draw(st.sampled_from(["typed", "typed", "typed", "no_box", "no_name", "odd_flag"]))
    if kind == "no_box":
        return obj(draw(NAMES), box, bndbox=OMIT)
    if kind == "no_name":
        return obj("x", box, name=OMIT)
    if kind == "odd_flag":
        return obj(draw(NAMES), box, difficult="Unspecified")
    extra = {"occluded": OMIT} if draw(st.booleans()) else {"attribute": "blue"}
    return obj(draw(NAMES), box, truncated=draw(st.sampled_from([0, 1, ""])), **extra)


@st.composite
def devkits(draw: st.DrawFn) -> dict[str, Any]:
    ids = draw(st.lists(st.sampled_from(ID_POOL), min_size=1, max_size=5, unique=True))
    in_main = draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    in_seg = [not m or draw(st.booleans()) for m in in_main]  # every id in some task
    samples = []
    for k, (image_id, main, seg) in enumerate(zip(ids, in_main, in_seg)):
        w, h = draw(st.integers(8, 40)), draw(st.integers(8, 40))
        image = draw(
            st.sampled_from(
                [
                    jpeg(w, h, seed=k),
                    jpeg(w, h, mode="L", seed=k),
                    jpeg(w, h, mode="CMYK", seed=k),
                    jpeg(w, h, seed=k, progressive=True, exif_orientation=6),
                    png(w, h, mode="RGBA", seed=k),  # a PNG behind a .jpg name: PIL sniffs
                ]
            )
        )
        if not main and draw(st.integers(0, 3)) == 0:
            xml = draw(st.sampled_from([b"<annotation><object>", b"", b"<a>&nope;</a>"]))
        elif not main and draw(st.integers(0, 3)) == 0:
            xml = None  # a segmentation-only id without an annotation
        else:
            xml = voc_xml(f"{image_id}.jpg", w, h, draw(st.lists(objects(), max_size=3)))
            encoding = draw(st.sampled_from(["utf-8", "utf-8", "UTF-16", "iso-8859-1"]))
            if encoding != "utf-8" or draw(st.booleans()):
                xml = encode_xml(xml, encoding, bom=encoding == "utf-8")
        mask = palette_mask(w, h, seed=k) if seg else None
        object_mask = palette_mask(w, h, seed=k, values=[1, 2]) if seg and k % 2 else None
        samples.append(Sample(image_id, image, xml, mask, object_mask))

    def listed(chosen: list[str]) -> list[str]:
        picked = draw(st.lists(st.sampled_from(chosen), max_size=6)) if chosen else []
        return picked or chosen[:1]  # duplicates kept, never empty when there are ids

    main_ids = [i for i, m in zip(ids, in_main) if m]
    seg_ids = [i for i, s in zip(ids, in_seg) if s]
    lists: dict[str, dict[str, list[str]]] = {}
    if main_ids:
        lists["Main"] = {"train": listed(main_ids), "val": listed(main_ids)}
        lists["Main"]["trainval"] = lists["Main"]["train"] + lists["Main"]["val"]
    if seg_ids:
        lists["Segmentation"] = {"train": listed(seg_ids), "val": listed(seg_ids)}
    shards = draw(st.sampled_from([None, 1, 2, 3]))
    return {"samples": samples, "lists": lists, "shards": shards}


def _assert_same_wrapped(tv: Any, ours: Any) -> None:
    """``wrap_dataset_for_transforms_v2`` over ours: torchvision's tensors where its wrapper
    makes them, the same exception type where it cannot."""
    tvw, oursw = wrap_dataset_for_transforms_v2(tv), wrap_dataset_for_transforms_v2(ours)
    for i in range(len(tv)):
        try:
            expected = tvw[i]
        except Exception as exc:
            with pytest.raises(type(exc)):
                oursw[i]
            continue
        assert_same_tensors(expected, oursw[i])


def _stream(path: Path, task: str, image_set: str) -> list[tuple[bytes, str]]:
    stream = VOCSerializedIterableDataset(path, image_set, task=task, shuffle=False, decode="none")
    return sorted((bytes(image.numpy()), _text(target)) for image, target in stream)


def _mapped(dataset: Any) -> list[tuple[bytes, str]]:
    return sorted((bytes(image.numpy()), _text(target)) for image, target in dataset)


def _text(target: Any) -> str:
    if isinstance(target, dict):
        return json.dumps(target, sort_keys=True)
    return bytes(target.tobytes()).hex() if hasattr(target, "tobytes") else repr(target)


_SETTINGS = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}


@settings(max_examples=40, **_SETTINGS)
@given(kit=devkits())
def test_any_devkit_reads_as_torchvision_reads_it(
    kit: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    check_against_torchvision(kit, tmp_path_factory.mktemp("oracle"))


@pytest.mark.slow
@settings(max_examples=400, **_SETTINGS)
@given(kit=devkits())
def test_many_devkits_read_as_torchvision_reads_them(
    kit: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    check_against_torchvision(kit, tmp_path_factory.mktemp("oracle"))


def check_against_torchvision(kit: dict[str, Any], tmp: Path) -> None:
    root = tmp / "src"
    write_voc(root, "2012", kit["samples"], kit["lists"])
    limits = {} if kit["shards"] is None else {"max_samples_per_shard": kit["shards"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntypedObjectsWarning)
        path = ts.pack_voc(root, tmp / "p", **limits).path
    for task, lists in kit["lists"].items():
        for image_set in lists:
            tv = torchvision_dataset(task, root, "2012", image_set)
            if task == "Main":
                ours: Any = VOCSerializedDataset(path, image_set=image_set)
            else:
                ours = VOCSerializedSegmentation(path, image_set=image_set)
            assert_same_dataset(tv, ours, task)
            if task == "Main":
                _assert_same_wrapped(tv, ours)
            # the stream yields the same samples (storage order: compared as multisets)
            if task == "Main":
                raw = VOCSerializedDataset(path, image_set=image_set, decode="none")
            else:
                raw = VOCSerializedSegmentation(path, image_set=image_set, decode="none")
            assert _stream(path, task, image_set) == _mapped(raw)
    out = ts.export_voc(path, tmp / "out")
    listed = {i for lists in kit["lists"].values() for chosen in lists.values() for i in chosen}
    for sample in (s for s in kit["samples"] if s.id in listed):
        for folder, data, ext in (
            ("JPEGImages", sample.image, ".jpg"),
            ("Annotations", sample.xml, ".xml"),
            ("SegmentationClass", sample.mask, ".png"),
            ("SegmentationObject", sample.object_mask, ".png"),
        ):
            file = out / folder / f"{sample.id}{ext}"
            assert (file.read_bytes() if file.exists() else None) == data


#: per id and step: which lists name it, and what its annotation is
_MEMBERSHIP = st.sampled_from(["main", "seg", "both", "none"])
_XML_KIND = st.sampled_from(["typed", "typed", "untyped", "broken", "missing"])


@st.composite
def histories(draw: st.DrawFn) -> list[dict[str, tuple[str, str, bool]]]:
    """Two to four states of one devkit: per id, its lists, its annotation's kind and whether
    its files are rewritten in that state (an edit); a broken or missing annotation only
    where no Main list names the id (there torchvision would fail too)."""
    ids = ID_POOL[:5]
    states = []
    for _ in range(draw(st.integers(2, 4))):
        state = {}
        for image_id in ids:
            member = draw(_MEMBERSHIP)
            kind = draw(_XML_KIND)
            if member in ("main", "both") and kind in ("broken", "missing"):
                kind = "typed"
            state[image_id] = (member, kind, draw(st.booleans()))
        if not any(m != "none" for m, _, _ in state.values()):
            state[ids[0]] = ("main", "typed", False)
        states.append(state)
    return states


def _write_state(
    root: Path, state: dict[str, tuple[str, str, bool]], step: int, written: dict[str, str]
) -> None:
    """The devkit as ``state`` says. Files are rewritten only for new or edited ids, or where
    the annotation's kind changes (the others keep their bytes and times, as an untouched
    file does); ``written``: each id's annotation kind on disk, kept up to date."""
    voc = root / "VOCdevkit" / "VOC2012"
    samples = []
    for k, (image_id, (_, kind, edited)) in enumerate(state.items()):
        seed = k + 10 * step if edited else k
        if written.get(image_id) == kind and not edited:
            continue
        written[image_id] = kind
        objects = [obj(("dog", "cat", "bird")[seed % 3], (1, 1, 9, 7))]
        if kind == "untyped":
            objects = [obj("cat", (1, 1, 9, 7), bndbox=OMIT)]
        xml: bytes | None = voc_xml(f"{image_id}.jpg", 20, 16, objects)
        if kind == "broken":
            xml = b"<annotation><object>"
        elif kind == "missing":
            xml = None
            (voc / "Annotations" / f"{image_id}.xml").unlink(missing_ok=True)
        samples.append(Sample(image_id, jpeg(20, 16, seed=seed), xml, palette_mask(20, 16, seed)))
    lists = {
        "Main": {"train": [i for i, (m, _, _) in state.items() if m in ("main", "both")]},
        "Segmentation": {"train": [i for i, (m, _, _) in state.items() if m in ("seg", "both")]},
    }
    write_voc(root, "2012", samples, lists)


_TASKS = {"Main": ("main", "both"), "Segmentation": ("seg", "both")}


@settings(max_examples=60, **_SETTINGS)
@given(history=histories(), shards=st.sampled_from([None, 2]))
def test_appends_through_any_history_read_as_torchvision_reads_each_state(
    history: list[dict[str, tuple[str, str, bool]]],
    shards: int | None,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Ids moving between Main and Segmentation lists, annotations becoming untyped, broken
    (segmentation-only) or missing, files edited: after every append (``replace_changed``,
    ``retire_all``), every image set of the grown pack reads as torchvision reads the folder."""
    check_history(history, shards, tmp_path_factory.mktemp("history"))


@pytest.mark.slow
@settings(max_examples=400, **_SETTINGS)
@given(history=histories(), shards=st.sampled_from([None, 2]))
def test_appends_through_many_histories_read_as_torchvision_reads_each_state(
    history: list[dict[str, tuple[str, str, bool]]],
    shards: int | None,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    check_history(history, shards, tmp_path_factory.mktemp("history"))


def check_history(
    history: list[dict[str, tuple[str, str, bool]]], shards: int | None, tmp: Path
) -> None:
    root = tmp / "src"
    limits = {} if shards is None else {"max_samples_per_shard": shards}
    written: dict[str, str] = {}
    readers = {"Main": VOCSerializedDataset, "Segmentation": VOCSerializedSegmentation}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntypedObjectsWarning)
        _write_state(root, history[0], 0, written)
        path = ts.pack_voc(root, tmp / "p", **limits).path
        for step, state in enumerate(history[1:], start=1):
            _write_state(root, state, step, written)
            ts.append_voc(root, path, replace_changed=True, retire_all=True)
            for task, reader in readers.items():
                if any(m in _TASKS[task] for m, _, _ in state.values()):
                    tv = torchvision_dataset(task, root, "2012", "train")
                    assert_same_dataset(tv, reader(path, image_set="train"), task)
