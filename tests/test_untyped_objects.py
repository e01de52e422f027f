"""Annotations torchvision reads but whose objects the pack's object rows cannot hold.

torchvision parses any XML and leaves its objects to the training code; such a sample is
packed all the same (``schema.UNTYPED_OBJECTS``): its dict target is torchvision's, sample by
sample, and only a ``tv_tensors`` target, which needs a numeric box and a name per object
(as torchvision's own wrapper does), raises, naming the sample and what its XML lacks.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _container_helpers import pinned_identity, rebuild_pack
from test_datasets import assert_same_dataset, assert_same_tensors, torchvision_dataset
from torch.utils.data import DataLoader
from torchvision.datasets import wrap_dataset_for_transforms_v2
from vocfactory import OMIT, Raw, Sample, jpeg, obj, voc_xml, write_voc

import torch_serialized as ts
from torch_serialized import (
    FormatError,
    SourceDataError,
    UntypedObjectsWarning,
    VOCSerializedDataset,
    VOCSerializedIterableDataset,
)
from torch_serialized.cli import main as cli_main
from torch_serialized.voc import schema
from torch_serialized.voc.packed import VOCPackReader


def _box(*xyxy: float) -> dict[str, float]:
    return dict(zip(("xmin", "ymin", "xmax", "ymax"), xyxy))


#: id -> (objects, what the object rows cannot hold, or "" when they can); 2012, 40x30 images
CASES: dict[str, tuple[Any, str]] = {
    "ok_a": ([obj("dog", (1, 2, 20, 25)), obj("cat", (3, 4, 30, 28))], ""),
    "no_box": (
        [obj("dog", (1, 2, 20, 25)), obj("cat", (1, 1, 2, 2), bndbox=OMIT)],
        r"object 1 has no single <bndbox>",
    ),
    "text_box": (
        [obj("dog", {"xmin": "left", "ymin": 2, "xmax": 20, "ymax": 25})],
        r"<bndbox><xmin> is 'left'",
    ),
    "no_name": (
        [obj("dog", (1, 2, 20, 25), name=OMIT)],
        r"object 0 has no single non-empty <name>",
    ),
    "odd_flag": (
        [obj("dog", (1, 2, 20, 25), difficult="Unspecified")],
        r"<difficult> is 'Unspecified'",
    ),
    "inf_box": ([obj("cat", (1, 2, "inf", 25))], r"<bndbox><xmax> is 'inf', not a finite float32"),
    "ok_b": ([obj("bird", (1.5, 2.25, 20, 25))], ""),
    "two_boxes": (
        [{"name": "dog", "bndbox": [_box(1, 2, 3, 4), _box(5, 6, 7, 8)]}],
        r"object 0 has no single <bndbox>",
    ),
    "big_box": ([obj("dog", (1, 2, "1e39", 25))], r"<xmax> is '1e39', not a finite float32"),
}
UNTYPED = [i for i, (_, why) in CASES.items() if why]
TYPED = [i for i, (_, why) in CASES.items() if not why]


def devkit(root: Path, ids: list[str] | None = None) -> Path:
    ids = list(CASES) if ids is None else ids
    samples = [
        Sample(i, jpeg(40, 30, seed=list(CASES).index(i)), voc_xml(f"{i}.jpg", 40, 30, CASES[i][0]))
        for i in ids
    ]
    write_voc(root, "2012", samples, {"Main": {"train": ids, "val": ids[::-1][:3]}})
    return root


@pytest.fixture(scope="module")
def untyped_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return devkit(tmp_path_factory.mktemp("untyped"))


@pytest.fixture(scope="module")
def untyped_packs(untyped_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("untyped-packs")
    with pytest.warns(UntypedObjectsWarning):
        single = ts.pack_voc(untyped_root, out / "single.tser")
    with pytest.warns(UntypedObjectsWarning):
        shards = ts.pack_voc(untyped_root, out / "shards", max_samples_per_shard=3)
    return {"single": single.path, "shards": shards.path}


def test_packing_says_which_samples_and_why(untyped_root: Path, tmp_path: Path) -> None:
    """Once per pack, naming the ids (in pack order) and the first reason; the result lists
    them; and packing in worker processes gives the same bytes and the same list."""
    with pytest.warns(UntypedObjectsWarning) as caught, pinned_identity():
        result = ts.pack_voc(untyped_root, tmp_path / "one.tser")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"{result.path}: {len(UNTYPED)} sample(s) ('no_box', ")
    assert "Annotations/no_box.xml: object 1 has no single <bndbox>" in message.replace("\\", "/")
    assert "replace_changed=True" in message
    assert caught[0].filename == __file__  # attributed to the caller, not to the library
    assert list(result.untyped) == UNTYPED and result.num_samples == len(CASES)
    for image_id in UNTYPED:
        assert re.search(CASES[image_id][1], result.untyped[image_id])
    with pytest.warns(UntypedObjectsWarning), pinned_identity():
        two = ts.pack_voc(untyped_root, tmp_path / "two.tser", workers=2)
    assert two.untyped == result.untyped
    assert (tmp_path / "two.tser").read_bytes() == (tmp_path / "one.tser").read_bytes()


@pytest.mark.parametrize("layout", ["single", "shards"])
@pytest.mark.parametrize("image_set", ["train", "val"])
def test_dict_targets_equal_torchvision(
    untyped_root: Path, untyped_packs: dict[str, Path], layout: str, image_set: str
) -> None:
    tv = torchvision_dataset("Main", untyped_root, "2012", image_set)
    assert_same_dataset(
        tv, VOCSerializedDataset(untyped_packs[layout], image_set=image_set), "Main"
    )


def test_the_wrapper_fails_where_torchvision_s_does(
    untyped_root: Path, untyped_packs: dict[str, Path]
) -> None:
    """``wrap_dataset_for_transforms_v2`` over our dict targets: the same boxes where
    torchvision's wrapper makes them, the same exception type where it cannot."""
    tvw = wrap_dataset_for_transforms_v2(torchvision_dataset("Main", untyped_root, "2012", "train"))
    ours = wrap_dataset_for_transforms_v2(
        VOCSerializedDataset(untyped_packs["single"], image_set="train")
    )
    failed = []
    for i, image_id in enumerate(CASES):
        try:
            expected = tvw[i]
        except Exception as exc:
            with pytest.raises(type(exc)):
                ours[i]
            failed.append(image_id)
            continue
        assert_same_tensors(expected[1], ours[i][1])
    # ok_b's float box fails the wrapper's int(); it passes no_box (one box for two labels:
    # its boxes and labels no longer pair up) and odd_flag (it has no "difficult"), where our
    # tv_tensors target refuses both rather than return unpaired boxes or a guessed flag
    assert failed == ["text_box", "no_name", "inf_box", "ok_b", "two_boxes", "big_box"]


def _expected_boxes(image_id: str) -> torch.Tensor:
    boxes = [
        [float(o["bndbox"][k]) for k in ("xmin", "ymin", "xmax", "ymax")]
        for o in CASES[image_id][0]
    ]
    return torch.tensor(boxes, dtype=torch.float32)


@pytest.mark.parametrize("layout", ["single", "shards"])
def test_tv_tensors_raise_for_them_and_only_them(
    untyped_packs: dict[str, Path], layout: str
) -> None:
    ds = VOCSerializedDataset(
        untyped_packs[layout], image_set="train", target_format="tv_tensors", decode="none"
    )
    for i, image_id in enumerate(CASES):
        if CASES[image_id][1]:
            with pytest.raises(SourceDataError, match=CASES[image_id][1]) as info:
                ds[i]
            text = str(info.value).replace("\\", "/")
            assert f"(id {image_id!r}) has no tv_tensors target" in text
            assert f"Annotations/{image_id}.xml" in text and "target_format='dict'" in text
        else:
            assert torch.equal(
                ds[i][1]["boxes"].as_subclass(torch.Tensor), _expected_boxes(image_id)
            )
    # a DataLoader's batch read: the same error when the batch holds one, else the targets
    typed = [list(CASES).index(i) for i in TYPED]
    batch = ds.__getitems__(typed)
    for (_, target), image_id in zip(batch, TYPED):
        assert torch.equal(target["boxes"].as_subclass(torch.Tensor), _expected_boxes(image_id))
    with pytest.raises(SourceDataError, match=r"\(id 'no_box'\) has no tv_tensors target"):
        ds.__getitems__([*typed, list(CASES).index("no_box")])
    dicts = VOCSerializedDataset(untyped_packs[layout], image_set="train", decode="none")
    assert [t for _, t in dicts.__getitems__(range(len(CASES)))] == [
        dicts[i][1] for i in range(len(CASES))
    ]


def test_the_stream_raises_too(untyped_packs: dict[str, Path]) -> None:
    stream = VOCSerializedIterableDataset(
        untyped_packs["shards"], "train", target_format="tv_tensors", decode="none", shuffle=False
    )
    with pytest.raises(SourceDataError, match="has no tv_tensors target"):
        list(stream)
    dicts = VOCSerializedIterableDataset(
        untyped_packs["shards"], "train", decode="none", shuffle=False
    )
    loader = DataLoader(dicts, batch_size=None, num_workers=2)
    assert len(list(loader)) == len(CASES)


def test_schema_version_3_marks_them(untyped_packs: dict[str, Path], tmp_path: Path) -> None:
    pack = VOCPackReader(untyped_packs["single"])
    assert pack.meta["schema_version"] == schema.UNTYPED_SCHEMA_VERSION == 3
    flags = pack.columns["flags"]
    marked = [pack.id(int(r)) for r in np.flatnonzero(flags & schema.UNTYPED_OBJECTS)]
    assert marked == UNTYPED
    assert not pack.columns["num_objects"][flags & schema.UNTYPED_OBJECTS != 0].any()
    # a typed-only pack stays at the version every earlier reader reads
    typed = ts.pack_voc(devkit(tmp_path / "typed", TYPED), tmp_path / "typed.tser")
    assert VOCPackReader(typed.path).meta["schema_version"] == schema.BASE_SCHEMA_VERSION
    assert typed.untyped == {}


def test_a_reader_before_version_3_refuses_such_a_pack(
    untyped_packs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What keeps an older torch_serialized from reading these samples as boxless: it reads
    schema versions up to 2 and refuses a newer one (the previous main, checked by hand, says
    "schema version 3 is newer"); replayed here by lowering the version this reader knows."""
    monkeypatch.setattr(schema, "SCHEMA_VERSION", schema.RETIRED_SCHEMA_VERSION)
    for layout in ("single", "shards"):
        with pytest.raises(FormatError, match="VOC schema version 3 is newer"):
            VOCSerializedDataset(
                untyped_packs[layout], image_set="train", target_format="tv_tensors"
            )


def _edited(src: Path, out: Path, edit: Any) -> Path:
    def apply(contents: Any) -> None:
        edit(contents.user, contents.arrays["records"])

    return rebuild_pack(src, out, apply)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda user, _: user.update(schema_version=2),
            "'schema_version'.*3 with objects without rows",
        ),
        (
            lambda _, rows: rows["num_objects"].__setitem__(1, 1),
            r"no objects counted for flag 8.*1 objects in record 1",
        ),
        (
            lambda _, rows: rows["flags"].__setitem__(0, 1 | 64),
            r"flags within 31.*flags 65, .* in record 0",
        ),
    ],
    ids=["older-version", "rows-claimed", "unknown-flag"],
)
def test_readers_refuse_a_mark_they_cannot_trust(
    untyped_packs: dict[str, Path], tmp_path: Path, edit: Any, message: str
) -> None:
    """A pack that marks records without saying it in its version (which a reader from
    before would read as boxless), claims rows for them, or sets flags we do not know."""
    bad = _edited(untyped_packs["single"], tmp_path / "bad.tser", edit)
    with pytest.raises(FormatError, match=message):
        VOCSerializedDataset(bad, image_set="train")


def test_max_size_scales_their_dict_targets(untyped_root: Path, tmp_path: Path) -> None:
    """Their size and the coordinates that are numbers are scaled with the image, as every
    other target's are; the words are left as they were."""
    with pytest.warns(UntypedObjectsWarning):
        pack = ts.pack_voc(untyped_root, tmp_path / "small.tser", max_size=20)
    ds = VOCSerializedDataset(pack.path, image_set="train")
    by_id = dict(zip(ds.ids, range(len(ds))))
    image, target = ds[by_id["text_box"]]
    assert image.size == (20, 15)
    annotation = target["annotation"]
    assert annotation["size"]["width"] == "20" and annotation["size"]["height"] == "15"
    assert annotation["object"][0]["bndbox"] == {
        "xmin": "left",
        "ymin": "1",
        "xmax": "10",
        "ymax": "12.5",
    }
    assert ds[by_id["no_box"]][1]["annotation"]["object"][0]["bndbox"]["xmax"] == "10"


def test_append_adds_them_and_raises_the_version(tmp_path: Path) -> None:
    root = devkit(tmp_path / "src", TYPED)
    pack = ts.pack_voc(root, tmp_path / "grow", max_samples_per_shard=2).path
    assert VOCPackReader(pack).meta["schema_version"] == schema.BASE_SCHEMA_VERSION
    devkit(root, [*TYPED, "no_name"])
    with pytest.warns(UntypedObjectsWarning, match="'no_name'"):
        result = ts.append_voc(root, pack)
    assert list(result.untyped) == ["no_name"] and result.added == 1
    grown = VOCPackReader(pack)
    assert grown.meta["schema_version"] == schema.UNTYPED_SCHEMA_VERSION
    # an append that adds none keeps the version: the records are still there
    devkit(root, [*TYPED, "no_name", "ok_b"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntypedObjectsWarning)
        again = ts.append_voc(root, pack)
    assert again.untyped == {}
    assert VOCPackReader(pack).meta["schema_version"] == schema.UNTYPED_SCHEMA_VERSION
    tv = torchvision_dataset("Main", root, "2012", "train")
    assert_same_dataset(tv, VOCSerializedDataset(pack, image_set="train"), "Main")


def test_cli_pack_and_info_say_so_once(
    untyped_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntypedObjectsWarning)  # printed, not warned as well
        assert cli_main(["pack", str(untyped_root), str(tmp_path / "p.tser"), "-q"]) == 0
    out = capsys.readouterr().out
    assert f"untyped  {len(UNTYPED)} samples ('no_box', 'text_box', 'no_name', ...) whose" in out
    assert "The first: " in out and "object 1 has no single <bndbox>" in out
    assert cli_main(["info", str(tmp_path / "p.tser")]) == 0
    out = capsys.readouterr().out
    assert f"untyped      {len(UNTYPED)} samples" in out and "untyped samples counted as 0" in out


def test_export_gives_their_files_back(
    untyped_packs: dict[str, Path], untyped_root: Path, tmp_path: Path
) -> None:
    ts.export_voc(untyped_packs["shards"], tmp_path / "out")
    for image_id in UNTYPED:
        name = f"VOCdevkit/VOC2012/Annotations/{image_id}.xml"
        assert (tmp_path / "out" / name).read_bytes() == (untyped_root / name).read_bytes()


def test_a_url_pack_and_append_name_the_url(untyped_root: Path, tmp_path: Path) -> None:
    """Packed or grown at a URL, the warning names the URL (not the temporary copy it was
    written in, gone by then) and comes from the caller's line."""
    url = (tmp_path / "remote.tser").as_uri()
    with pytest.warns(UntypedObjectsWarning) as caught:
        result = ts.pack_voc(untyped_root, url)
    assert str(caught[0].message).startswith(f"{url}: {len(UNTYPED)} sample(s)")
    assert caught[0].filename == __file__ and list(result.untyped) == UNTYPED
    root = devkit(tmp_path / "src", TYPED)
    grown = (tmp_path / "grown").as_uri()
    ts.pack_voc(root, grown, max_samples_per_shard=2)
    devkit(root, [*TYPED, "two_boxes"])
    with pytest.warns(UntypedObjectsWarning) as caught:
        appended = ts.append_voc(root, grown, cache_dir=tmp_path / "cache")
    assert str(caught[0].message).startswith(f"{grown}: 1 sample(s) ('two_boxes')")
    assert caught[0].filename == __file__ and list(appended.untyped) == ["two_boxes"]


def test_an_annotation_nested_too_deeply_to_store_is_refused_by_name(tmp_path: Path) -> None:
    """Nested deeper than a target may be stored, an annotation fails in the parser or in
    storing its target: a SourceDataError naming the file either way (which ``on_error="skip"``
    skips), never a bare RecursionError, and never stored so that it reads as damaged."""
    nested = "<v>1</v>"
    for _ in range(520):  # a dict and a list at each level: over schema.MAX_TARGET_DEPTH
        nested = f"<n>{nested}</n><n>x</n>"
    deep = voc_xml("deep.jpg", 40, 30, [obj("dog", (1, 2, 20, 25), extra=Raw(nested))])
    samples = [
        Sample("deep", jpeg(40, 30), deep),
        Sample(
            "fine", jpeg(40, 30, seed=1), voc_xml("fine.jpg", 40, 30, [obj("dog", (1, 2, 3, 4))])
        ),
    ]
    write_voc(tmp_path / "src", "2012", samples, {"Main": {"train": ["deep", "fine"]}})
    with pytest.raises(
        SourceDataError, match=r"Annotations[/\\]deep\.xml: elements are nested too deeply"
    ):
        ts.pack_voc(tmp_path / "src", tmp_path / "p.tser")
    result = ts.pack_voc(tmp_path / "src", tmp_path / "p.tser", on_error="skip")
    assert [s.id for s in result.skipped] == ["deep"] and result.num_samples == 1
