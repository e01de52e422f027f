"""export_voc: byte-for-byte round trips, and refusal of unsafe or non-exportable packs."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import LAYOUTS, Packed
from torchvision.datasets import VOCDetection
from vocfactory import jpeg

from torch_serialized import ChecksumError, FormatError, SourceDataError, WriteError, pack_voc
from torch_serialized.container.shardwriter import PackWriter
from torch_serialized.tools import make_synthetic_voc
from torch_serialized.voc import export, schema
from torch_serialized.voc.export import export_voc

LIST = b"a\n"


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` by relative POSIX path."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def voc_folder(packed: Packed) -> Path:
    return packed.root / "VOCdevkit" / f"VOC{packed.year}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_synthetic_round_trip_is_byte_for_byte(
    synthetic_packs: Packed, layout: str, tmp_path: Path
) -> None:
    out = export_voc(synthetic_packs.path(layout), tmp_path / "root")
    assert out == tmp_path / "root" / "VOCdevkit" / f"VOC{synthetic_packs.year}"
    source = tree(voc_folder(synthetic_packs))
    assert any(name.startswith("SegmentationObject/") for name in source)
    assert tree(out) == source  # every file, ImageSets included; no temporaries left


@pytest.mark.parametrize("layout", LAYOUTS)
def test_corner_cases_round_trip(corner_packs: Packed, layout: str, tmp_path: Path) -> None:
    """Odd encodings, PNG behind .jpg, mask-only ids, per-class lists: all restored exactly."""
    out = export_voc(corner_packs.path(layout), tmp_path)
    exported, source = tree(out), tree(voc_folder(corner_packs))
    assert exported and all(source.get(name) == data for name, data in exported.items())
    lists = {n for n in source if n.startswith("ImageSets/") and n.endswith(".txt")}
    assert lists <= set(exported)
    ours = VOCDetection(str(tmp_path), year=corner_packs.year, image_set="train")
    theirs = VOCDetection(str(corner_packs.root), year=corner_packs.year, image_set="train")
    assert len(ours) == len(theirs)
    assert ours[0][1] == theirs[0][1]


def test_existing_files_are_kept_unless_overwrite(synthetic_packs: Packed, tmp_path: Path) -> None:
    out = export_voc(synthetic_packs.single, tmp_path)
    victim = next((out / "JPEGImages").iterdir())
    victim.write_bytes(b"edited")
    with pytest.raises(WriteError, match="already exists") as caught:
        export_voc(synthetic_packs.single, tmp_path)
    assert caught.value.errno == errno.EEXIST
    assert victim.read_bytes() == b"edited"  # refused before writing anything
    export_voc(synthetic_packs.single, tmp_path, overwrite=True)
    assert tree(out) == tree(voc_folder(synthetic_packs))


@pytest.mark.parametrize("options", [{"image_storage": "raw"}, {"max_size": 64}])
def test_refuses_packs_without_the_original_files(
    synthetic_devkit: Path, options: dict, tmp_path: Path
) -> None:
    pack = pack_voc(synthetic_devkit, tmp_path / "p.tser", year="2007", **options).path
    with pytest.raises(ValueError, match="byte for byte"):
        export_voc(pack, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def damage(packed: Packed, tmp_path: Path) -> Path:
    """A copy of ``packed.single`` whose sixth image fails its checksum."""
    source = voc_folder(packed)
    image_id = sorted(p.stem for p in (source / "JPEGImages").iterdir())[5]
    data = bytearray(packed.single.read_bytes())
    at = data.find((source / "JPEGImages" / f"{image_id}.jpg").read_bytes())
    assert at > 0
    data[at + 1000] ^= 0xFF
    damaged = tmp_path / "damaged.tser"
    damaged.write_bytes(bytes(data))
    return damaged


def test_damaged_record_leaves_nothing(synthetic_packs: Packed, tmp_path: Path) -> None:
    """The export used to leave the files written before the damaged record (~40 of them)."""
    damaged = damage(synthetic_packs, tmp_path)
    with pytest.raises(ChecksumError):
        export_voc(damaged, tmp_path / "out" / "deeper")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged.tser", "out"]
    assert list((tmp_path / "out").iterdir()) == []  # out_root's parent, as before; no temporary


@pytest.mark.parametrize("existing", ["", "VOCdevkit", "VOCdevkit/VOC2007/JPEGImages"])
def test_damaged_record_leaves_an_existing_folder_as_it_was(
    synthetic_packs: Packed, tmp_path: Path, existing: str
) -> None:
    damaged = damage(synthetic_packs, tmp_path)
    out = tmp_path / "out"
    (out / existing).mkdir(parents=True, exist_ok=True)
    (out / existing / "mine.txt").write_text("mine")
    before = tree(out)
    with pytest.raises(ChecksumError):
        export_voc(damaged, out, overwrite=True)
    assert tree(out) == before
    assert [p.name for p in out.rglob(".*")] == []


def fail_writes_after(monkeypatch: pytest.MonkeyPatch, count: int, error: BaseException) -> None:
    """Make the export's ``count + 1``-th file write raise ``error`` (a full disk, Ctrl-C)."""
    calls = iter(range(10**9))
    real = export.replace_file_at

    def failing(folder: int, name: str, data: bytes | memoryview) -> None:
        if next(calls) == count:
            raise error
        real(folder, name, data)

    monkeypatch.setattr(export, "replace_file_at", failing)


@pytest.mark.parametrize(
    "error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()]
)
def test_a_failed_write_leaves_nothing(
    synthetic_packs: Packed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    """On a full disk the export left a partial tree and said "no partial file was left"; a
    rerun then refused with "already exists"."""
    fail_writes_after(monkeypatch, 30, error)
    with pytest.raises(type(error)) as caught:
        export_voc(synthetic_packs.single, tmp_path / "out")
    if isinstance(error, OSError):
        assert isinstance(caught.value, WriteError) and caught.value.errno == errno.ENOSPC
        assert str(tmp_path / "out" / "VOCdevkit" / "VOC2007") in str(caught.value)
        assert "undone" in str(caught.value)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    out = export_voc(synthetic_packs.single, tmp_path / "out")  # the rerun needs no --overwrite
    assert tree(out) == tree(voc_folder(synthetic_packs))


def test_a_failed_overwrite_leaves_the_previous_export(
    synthetic_packs: Packed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = export_voc(synthetic_packs.single, tmp_path)
    victim = sorted((out / "JPEGImages").iterdir())[0]
    victim.write_bytes(b"edited")
    before = tree(tmp_path)
    fail_writes_after(monkeypatch, 30, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(WriteError, match="undone"):
        export_voc(synthetic_packs.single, tmp_path, overwrite=True)
    assert tree(tmp_path) == before
    assert [p.name for p in tmp_path.rglob(".*")] == []


def test_a_failed_rename_into_an_existing_folder_is_undone(
    synthetic_packs: Packed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last step, renaming staged files into an existing devkit, is undone if one fails:
    files it replaced come back, files and folders it created go."""
    out = export_voc(synthetic_packs.single, tmp_path)
    (out / "JPEGImages" / "extra.jpg").write_bytes(b"mine")
    for path in (out / "Annotations").iterdir():
        path.unlink()
    (out / "Annotations").rmdir()
    victim = sorted((out / "JPEGImages").iterdir())[0]
    victim.write_bytes(b"edited")
    before = tree(tmp_path)
    renames = iter(range(10**9))
    real = os.replace

    def failing(src: str, dst: str, **kwargs: int) -> None:
        if src == dst and next(renames) == 60:  # the merge moves a file by its own name
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst, **kwargs)

    monkeypatch.setattr(export.os, "replace", failing)
    with pytest.raises(WriteError, match="nothing was changed"):
        export_voc(synthetic_packs.single, tmp_path, overwrite=True)
    monkeypatch.undo()
    assert tree(tmp_path) == before
    assert not (out / "Annotations").exists()
    assert [p.name for p in tmp_path.rglob(".*")] == []


# -- unsafe packs -------------------------------------------------------------------------------
def forge(
    path: Path,
    ids: list[str],
    *,
    files: dict[str, bytes] | None = None,
    base_dir: str = "VOCdevkit/VOC2012",
) -> Path:
    """A pack with the given ids, list files and base_dir, as a hostile writer could make it."""
    image = jpeg(8, 8)
    with PackWriter(path, schema.FIELDS, columns=schema.COLUMNS) as writer:
        for _ in ids:
            writer.add([image, b"", b"", b"", b"", b""], (8, 8, 0, 0))
        blob, offsets = schema.encode_ids(ids)
        writer.add_array("ids", blob)
        writer.add_array("id_offsets", offsets)
        writer.add_array(schema.split_array_name("Main", "train"), np.arange(len(ids), dtype="<i8"))
        for name, data in (files or {"ImageSets/Main/train.txt": LIST}).items():
            writer.add_array(f"file/{name}", np.frombuffer(data, dtype=np.uint8))
        meta = {
            "schema": schema.SCHEMA,
            "schema_version": schema.SCHEMA_VERSION,
            "year": "2012",
            "base_dir": base_dir,
            "voc_folder": "VOC2012",
            "num_samples": len(ids),
            "classes": [],
            "splits": {"Main": {"train": len(ids)}},
            "image_storage": "original",
            "max_size": None,
        }
        return writer.close(meta)


def assert_nothing_written(tmp_path: Path) -> None:
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack.tser"]


def test_forged_pack_with_safe_ids_exports(tmp_path: Path) -> None:
    """The forging helper itself makes an exportable pack (so the refusals below are real)."""
    pack = forge(tmp_path / "pack.tser", ["a", "..b", "c.d"])
    out = export_voc(pack, tmp_path / "out")
    assert sorted(tree(out)) == [
        "ImageSets/Main/train.txt",
        "JPEGImages/..b.jpg",
        "JPEGImages/a.jpg",
        "JPEGImages/c.d.jpg",
    ]


@pytest.mark.parametrize(
    "bad_id", ["../evil", "..", ".", "", "a/b", "/tmp/evil", "a\\..\\..\\evil", "nul\x00id"]
)
def test_refuses_ids_that_escape(tmp_path: Path, bad_id: str) -> None:
    pack = forge(tmp_path / "pack.tser", ["fine", bad_id])
    with pytest.raises(FormatError, match=f"record 1 id {re.escape(repr(bad_id))}"):
        export_voc(pack, tmp_path / "out")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    "name",
    [
        "ImageSets/../../evil.txt",
        "ImageSets/Main/../../../evil.txt",
        "/tmp/evil.txt",
        "ImageSets\\..\\..\\evil.txt",
        "ImageSets/Main/a\x00.txt",
        "Annotations/evil.txt",
        "ImageSets",
        "ImageSets//Main/x.txt",
    ],
)
def test_refuses_list_files_that_escape(tmp_path: Path, name: str) -> None:
    pack = forge(tmp_path / "pack.tser", ["a"], files={name: LIST})
    with pytest.raises(FormatError, match=re.escape(repr(name))):
        export_voc(pack, tmp_path / "out")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("base_dir", ["../outside", "/tmp/abs", "VOCdevkit/../../x", "", "C:x"])
def test_refuses_base_dirs_that_escape(tmp_path: Path, base_dir: str) -> None:
    pack = forge(tmp_path / "pack.tser", ["a"], base_dir=base_dir)
    with pytest.raises(FormatError, match="base_dir"):
        export_voc(pack, tmp_path / "out")
    assert_nothing_written(tmp_path)


def test_refuses_duplicate_ids(tmp_path: Path) -> None:
    pack = forge(tmp_path / "pack.tser", ["a", "a"])
    with pytest.raises(FormatError, match="stored twice"):
        export_voc(pack, tmp_path / "out")


def test_traversal_from_a_devkit_list_is_refused_at_pack_or_export(tmp_path: Path) -> None:
    """A list naming ``../evil`` is either refused by the packer or by the exporter."""
    root = make_synthetic_voc(tmp_path / "src", 2)
    voc = root / "VOCdevkit" / "VOC2012"
    first = sorted((voc / "JPEGImages").iterdir())[0]
    (voc / "evil.jpg").write_bytes(first.read_bytes())
    (voc / "evil.xml").write_bytes((voc / "Annotations" / f"{first.stem}.xml").read_bytes())
    (voc / "ImageSets" / "Main" / "train.txt").write_text("../evil\n")
    try:
        pack = pack_voc(root, tmp_path / "pack.tser").path
    except SourceDataError as exc:  # refused at pack time
        assert "../evil" in str(exc)
        return
    with pytest.raises(FormatError, match=re.escape("'../evil'")):
        export_voc(pack, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "evil.jpg").exists()


# -- issue #11 item 6: never through a symbolic link; item 1: nothing else is touched ---------
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize(
    "link", ["VOCdevkit", "VOCdevkit/VOC2007", "VOCdevkit/VOC2007/JPEGImages", "ImageSets/Main"]
)
def test_export_refuses_to_write_through_a_symlinked_folder(
    synthetic_packs: Packed, tmp_path: Path, link: str, overwrite: bool
) -> None:
    """With out/VOCdevkit/VOC2007/JPEGImages a symlink to another folder, export wrote there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    relative = link if link.startswith("VOCdevkit") else f"VOCdevkit/VOC2007/{link}"
    linked = out / relative
    linked.parent.mkdir(parents=True)
    linked.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(WriteError, match="symbolic link") as info:
        export_voc(synthetic_packs.single, out, overwrite=overwrite)
    assert str(linked) in str(info.value)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]


def test_a_symlinked_output_root_is_the_users_choice(
    synthetic_packs: Packed, tmp_path: Path
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    export_voc(synthetic_packs.single, tmp_path / "link")
    assert tree(real / "VOCdevkit" / "VOC2007") == tree(voc_folder(synthetic_packs))


def test_export_into_an_existing_folder_touches_nothing_else(
    synthetic_packs: Packed, tmp_path: Path
) -> None:
    """Item 1's rule for export: files of the user beside (and inside) the exported folders
    survive, with and without overwrite; a file at a place export writes is replaced only
    with overwrite, and a link there is replaced as a link, its target untouched."""
    out = tmp_path / "root"
    voc = out / "VOCdevkit" / "VOC2007"
    (voc / "JPEGImages").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (voc / "JPEGImages" / "extra.jpg").write_bytes(b"my own image")
    first = sorted(p.stem for p in (voc_folder(synthetic_packs) / "JPEGImages").iterdir())[0]
    target = tmp_path / "target.jpg"
    target.write_bytes(b"do not touch")
    (voc / "JPEGImages" / f"{first}.jpg").symlink_to(target)
    with pytest.raises(WriteError, match="already exists"):
        export_voc(synthetic_packs.single, out)
    export_voc(synthetic_packs.single, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert (voc / "JPEGImages" / "extra.jpg").read_bytes() == b"my own image"
    assert target.read_bytes() == b"do not touch"
    assert not (voc / "JPEGImages" / f"{first}.jpg").is_symlink()
    exported = tree(voc)
    del exported["JPEGImages/extra.jpg"]
    assert exported == tree(voc_folder(synthetic_packs))
