"""Annotations that do not parse, of ids only segmentation image sets list.

``VOCSegmentation`` reads an id's image and class mask, never its XML, so a malformed (or
unsafe, or unreadable) ``Annotations`` file of such an id must not stop the pack: the id is
packed with the file's bytes and no target (``schema.UNPARSED_ANNOTATION``), its samples equal
torchvision's, an export gives the file back, and only a ``Main`` list naming the id (where
``VOCDetection`` would parse it) makes the XML an error again.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _container_helpers import pinned_identity, rebuild_pack
from test_datasets import assert_same_dataset, torchvision_dataset
from vocfactory import Raw, Sample, jpeg, obj, palette_mask, voc_xml, write_voc

import torch_serialized as ts
from torch_serialized import (
    FormatError,
    SerializedDataset,
    SourceDataError,
    VOCSerializedDataset,
    VOCSerializedSegmentation,
)
from torch_serialized.cli import main as cli_main
from torch_serialized.voc import schema
from torch_serialized.voc.packed import VOCPackReader


def _deep() -> bytes:
    """An annotation that parses but nests deeper than a target may be stored (a dict and a
    list at each level: over ``schema.MAX_TARGET_DEPTH``, on every Python)."""
    nested = "<v>1</v>"
    for _ in range(520):
        nested = f"<n>{nested}</n><n>x</n>"
    return voc_xml("deep.jpg", 40, 30, [obj("dog", (1, 2, 20, 25), extra=Raw(nested))])


def _good(image_id: str, name: str = "dog") -> bytes:
    return voc_xml(f"{image_id}.jpg", 40, 30, [obj(name, (1, 2, 20, 25))])


#: id -> (annotation bytes, what the error says, or "" when it parses)
CASES: dict[str, tuple[bytes, str]] = {
    "main": (_good("main"), ""),  # in Main and Segmentation
    "seg_ok": (_good("seg_ok", "cat"), ""),
    "malformed": (b"<annotation><object>", r"malformed XML at line 1, column 21"),
    "empty": (b"", r"malformed XML at line 1, column 1: no element found"),
    "entity": (
        b'<?xml version="1.0"?><!DOCTYPE a [<!ENTITY e "x">]><annotation>&e;</annotation>',
        r"refusing unsafe XML that declares the entity 'e'",
    ),
    "encoding": (
        b'<?xml version="1.0" encoding="klingon"?><annotation/>',
        r"the encoding named in the XML declaration is not supported",
    ),
    "deep": (_deep(), r"elements are nested too deeply to store"),
}
SEGMENTATION = list(CASES)
UNPARSED = [i for i, (_, why) in CASES.items() if why]


def devkit(root: Path, main: list[str] | None = None, **xml: bytes) -> Path:
    """Every case with a 40x30 image and class mask, listed in Segmentation's train (and in
    val, reversed, the last three); ``main`` lists Main's train (``["main"]`` by default);
    ``xml`` replaces annotations by id."""
    samples = [
        Sample(
            i,
            jpeg(40, 30, seed=k),
            xml.get(i, CASES[i][0]),
            palette_mask(40, 30, seed=k),
        )
        for k, i in enumerate(CASES)
    ]
    lists = {
        "Main": {"train": ["main"] if main is None else main},
        "Segmentation": {"train": SEGMENTATION, "val": SEGMENTATION[::-1][:3]},
    }
    write_voc(root, "2012", samples, lists)
    return root


@pytest.fixture(scope="module")
def unparsed_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return devkit(tmp_path_factory.mktemp("unparsed"))


@pytest.fixture(scope="module")
def unparsed_packs(
    unparsed_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("unparsed-packs")
    return {
        "single": ts.pack_voc(unparsed_root, out / "single.tser").path,
        "shards": ts.pack_voc(unparsed_root, out / "shards", max_samples_per_shard=3).path,
    }


def test_packing_keeps_them_and_says_why(unparsed_root: Path, tmp_path: Path) -> None:
    """No error and no warning (torchvision's segmentation dataset is served exactly); the
    result names the ids in pack order with each file's error; worker processes write the same
    bytes and the same list."""
    with warnings.catch_warnings(), pinned_identity():
        warnings.simplefilter("error")
        result = ts.pack_voc(unparsed_root, tmp_path / "one.tser")
    assert list(result.unparsed) == UNPARSED and result.untyped == {}
    assert result.num_samples == len(CASES) and not result.skipped
    for image_id in UNPARSED:
        reason = result.unparsed[image_id].replace("\\", "/")
        assert f"Annotations/{image_id}.xml: " in reason
        assert re.search(CASES[image_id][1], reason)
    with pinned_identity():
        two = ts.pack_voc(unparsed_root, tmp_path / "two.tser", workers=2)
    assert two.unparsed == result.unparsed
    assert (tmp_path / "two.tser").read_bytes() == (tmp_path / "one.tser").read_bytes()


@pytest.mark.parametrize("layout", ["single", "shards"])
@pytest.mark.parametrize("image_set", ["train", "val"])
def test_segmentation_equals_torchvision(
    unparsed_root: Path, unparsed_packs: dict[str, Path], layout: str, image_set: str
) -> None:
    tv = torchvision_dataset("Segmentation", unparsed_root, "2012", image_set)
    ours = VOCSerializedSegmentation(unparsed_packs[layout], image_set=image_set)
    assert_same_dataset(tv, ours, "Segmentation")
    tv_main = torchvision_dataset("Main", unparsed_root, "2012", "train")
    assert_same_dataset(
        tv_main, VOCSerializedDataset(unparsed_packs[layout], image_set="train"), "Main"
    )


def test_schema_version_4_marks_them(unparsed_packs: dict[str, Path], tmp_path: Path) -> None:
    pack = VOCPackReader(unparsed_packs["single"])
    assert pack.meta["schema_version"] == schema.UNPARSED_SCHEMA_VERSION == 4
    flags = pack.columns["flags"]
    marked = np.flatnonzero(flags & schema.UNPARSED_ANNOTATION)
    assert [pack.id(int(r)) for r in marked] == UNPARSED
    for r in marked.tolist():
        assert flags[r] & schema.HAS_ANNOTATION and not flags[r] & schema.UNTYPED_OBJECTS
        assert pack.columns["num_objects"][r] == 0
        assert len(pack.field(r, schema.TARGET)) == len(pack.field(r, schema.OBJECTS)) == 0
    # a pack whose segmentation-only annotations all parse stays at the oldest version
    parsed = {i: _good(i) for i in UNPARSED}
    typed = ts.pack_voc(devkit(tmp_path / "typed", **parsed), tmp_path / "typed.tser")
    assert typed.unparsed == {}
    assert VOCPackReader(typed.path).meta["schema_version"] == schema.BASE_SCHEMA_VERSION


def test_a_reader_before_version_4_refuses_such_a_pack(
    unparsed_packs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What keeps an older torch_serialized from looking for targets that are not there: it
    reads schema versions up to 3 and refuses a newer one; replayed by lowering the version
    this reader knows."""
    monkeypatch.setattr(schema, "SCHEMA_VERSION", schema.UNTYPED_SCHEMA_VERSION)
    for layout in ("single", "shards"):
        with pytest.raises(FormatError, match="VOC schema version 4 is newer"):
            VOCSerializedSegmentation(unparsed_packs[layout], image_set="train")


def _edited(src: Path, out: Path, edit: Any) -> Path:
    def apply(contents: Any) -> None:
        marked = int(np.flatnonzero(contents.arrays["records"]["flags"] & 16)[0])
        edit(contents.user, contents.arrays, marked)

    return rebuild_pack(src, out, apply)


def _list_in_main(arrays: dict[str, np.ndarray], record: int) -> None:
    name = schema.split_array_name("Main", "train")
    arrays[name] = np.append(arrays[name], np.int64(record)).astype("<i8")


def _grow_main_count(user: dict[str, Any]) -> None:
    user["splits"]["Main"]["train"] += 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda user, _, __: user.update(schema_version=3),
            r"'schema_version'.*4 with unparsed annotations",
        ),
        (
            lambda _, arrays, r: arrays["records"]["flags"].__setitem__(r, 16),
            r"flag 16 \(unparsed\) with flag 1, no flag 8.*'flags 16, 0 objects in record",
        ),
        (
            lambda _, arrays, r: arrays["records"]["flags"].__setitem__(r, 1 | 2 | 8 | 16),
            r"flag 16 \(unparsed\) with flag 1, no flag 8.*'flags 27, 0 objects",
        ),
        (
            lambda _, arrays, r: arrays["records"]["num_objects"].__setitem__(r, 1),
            r"flag 16 \(unparsed\).*no objects.*'flags 19, 1 objects",
        ),
        (
            lambda user, arrays, r: (_list_in_main(arrays, r), _grow_main_count(user)),
            r"'split/Main/train'.*no record whose annotation did not parse",
        ),
    ],
    ids=["older-version", "without-annotation", "with-flag-8", "rows-claimed", "in-main"],
)
def test_readers_refuse_a_mark_they_cannot_trust(
    unparsed_packs: dict[str, Path], tmp_path: Path, edit: Any, message: str
) -> None:
    """A pack that marks records without saying it in its version, marks one that holds no
    annotation bytes or also claims its objects, or lists one where ``VOCDetection`` would
    need its target: refused when opened, naming the field."""
    bad = _edited(unparsed_packs["single"], tmp_path / "bad.tser", edit)
    with pytest.raises(FormatError, match=message):
        VOCSerializedSegmentation(bad, image_set="train")


def test_export_gives_their_files_back(
    unparsed_packs: dict[str, Path], unparsed_root: Path, tmp_path: Path
) -> None:
    for layout, path in unparsed_packs.items():
        out = ts.export_voc(path, tmp_path / layout)
        source = unparsed_root / "VOCdevkit" / "VOC2012" / "Annotations"
        for image_id in CASES:
            name = f"{image_id}.xml"
            assert (out / "Annotations" / name).read_bytes() == (source / name).read_bytes()


def test_the_original_api_gives_them_no_target(unparsed_packs: dict[str, Path]) -> None:
    """``SerializedDataset`` walks every record: ``{}`` for these, as for an id without an
    annotation, and the parsed dict for the others."""
    dataset = SerializedDataset(unparsed_packs["shards"])
    samples = {s["id"]: s["target"] for s in (dataset[i] for i in range(len(dataset)))}
    assert set(samples) == set(CASES)
    assert all(samples[i] == {} for i in UNPARSED)
    assert samples["seg_ok"]["annotation"]["object"][0]["name"] == "cat"


def test_an_id_in_main_still_needs_its_xml_to_parse(tmp_path: Path) -> None:
    """Where ``VOCDetection`` parses the file, a file that does not parse stays an error
    naming it (``on_error="skip"`` drops the id)."""
    root = devkit(tmp_path / "src", main=["main", "malformed"])
    with pytest.raises(SourceDataError, match=r"Annotations[/\\]malformed\.xml: malformed XML"):
        ts.pack_voc(root, tmp_path / "p.tser")
    result = ts.pack_voc(root, tmp_path / "p.tser", on_error="skip")
    assert [s.id for s in result.skipped] == ["malformed"]
    assert list(result.unparsed) == [i for i in UNPARSED if i != "malformed"]


@pytest.mark.parametrize("layout", ["single", "shards"])
def test_append_keeps_them_until_a_main_list_needs_them(tmp_path: Path, layout: str) -> None:
    root = devkit(tmp_path / "src")
    limits = {"max_samples_per_shard": 3} if layout == "shards" else {}
    pack = ts.pack_voc(root, tmp_path / "p", **limits).path
    # nothing changed: kept as they are (not loaded again), and the version with them
    same = ts.append_voc(root, pack)
    assert (same.added, same.replaced, same.unparsed) == (0, [], {})
    assert VOCPackReader(pack).meta["schema_version"] == schema.UNPARSED_SCHEMA_VERSION
    # listed in Main now: its XML is needed, and it does not parse
    devkit(root, main=["main", "malformed"])
    with pytest.raises(SourceDataError, match=r"Annotations[/\\]malformed\.xml: malformed XML"):
        ts.append_voc(root, pack)
    # fixed: a changed file (replace_changed), parsed, and served as torchvision serves it
    devkit(root, main=["main", "malformed"], malformed=_good("malformed", "bird"))
    with pytest.raises(SourceDataError, match=r"'malformed' \(Annotations/malformed\.xml"):
        ts.append_voc(root, pack)
    fixed = ts.append_voc(root, pack, replace_changed=True)
    assert fixed.replaced == ["malformed"] and fixed.unparsed == {}
    tv = torchvision_dataset("Main", root, "2012", "train")
    assert_same_dataset(tv, VOCSerializedDataset(pack, image_set="train"), "Main")
    tv_seg = torchvision_dataset("Segmentation", root, "2012", "train")
    assert_same_dataset(tv_seg, VOCSerializedSegmentation(pack, image_set="train"), "Segmentation")


def test_an_id_skipped_when_loaded_again_is_reported_retired(tmp_path: Path) -> None:
    """Named by a Main list now, the id is loaded again and fails (its XML does not parse);
    ``on_error="skip"`` leaves it out of every image set, as a full pack would, and the
    result and the history count it as retired (they said none were)."""
    root = devkit(tmp_path / "src")
    pack = ts.pack_voc(root, tmp_path / "p", max_samples_per_shard=3).path
    devkit(root, main=["main", "malformed"])
    result = ts.append_voc(root, pack, on_error="skip")
    assert [s.id for s in result.skipped] == ["malformed"]
    assert result.retired == ["malformed"] and result.added == 0 and result.replaced == []
    grown = VOCPackReader(pack)
    assert grown.meta["history"][-1]["retired"] == 1
    assert "malformed" not in {grown.id(int(r)) for r in grown.live}


def test_cli_pack_and_info_say_so(
    unparsed_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["pack", str(unparsed_root), str(tmp_path / "p.tser"), "-q"]) == 0
    out = capsys.readouterr().out
    assert (
        f"unparsed {len(UNPARSED)} segmentation-only samples ('malformed', 'empty', "
        "'entity', ...) whose annotation XML did not parse" in out
    )
    assert "The first: " in out and "malformed XML at line 1, column 21" in out
    assert cli_main(["info", str(tmp_path / "p.tser")]) == 0
    out = capsys.readouterr().out
    assert f"unparsed     {len(UNPARSED)} segmentation-only samples" in out
    assert "schema voc 4" in out
    assert cli_main(["info", "--json", str(tmp_path / "p.tser")]) == 0
    assert json.loads(capsys.readouterr().out)["with_unparsed_annotation"] == len(UNPARSED)


def test_serialized_dataset_gives_them_an_empty_target(unparsed_packs: dict[str, Path]) -> None:
    """The original design's ``SerializedDataset`` reads every record: one whose annotation
    did not parse has ``{}`` as its target (its bytes are stored, but no target is)."""
    dataset = ts.SerializedDataset(unparsed_packs["single"])
    samples = [dataset[i] for i in range(len(dataset))]
    assert sorted(s["id"] for s in samples if s["target"] == {}) == sorted(UNPARSED)
    assert all("annotation" in s["target"] for s in samples if s["id"] not in UNPARSED)
