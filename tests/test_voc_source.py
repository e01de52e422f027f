"""voc.source: which ids a pack stores, in which order, and loading one id's files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from _container_helpers import (
    no_pack_output,
)
from vocfactory import (
    tiny_devkit,
)

import torch_serialized as ts
from torch_serialized.voc.packed import VOCPackReader


def test_missing_image_names_file_and_list_line(tmp_path: Path) -> None:
    root = tiny_devkit(tmp_path / "src", ["a", "b", "c"])
    (root / "VOCdevkit/VOC2007/JPEGImages/b.jpg").unlink()
    with pytest.raises(ts.SourceDataError) as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    message = str(info.value)
    assert "b.jpg" in message and "ImageSets/Main/train.txt line 2" in message
    assert isinstance(info.value, ValueError)
    no_pack_output(tmp_path)


@pytest.mark.parametrize(
    ("name", "there"),
    [("b.jpg", "b.JPG"), ("b.jpg", "b.jpeg"), ("b.jpg", "b.PNG"), ("b.xml", "b.XML")],
)
def test_a_missing_file_names_its_other_spelling_beside_it(
    tmp_path: Path, name: str, there: str
) -> None:
    """`b.JPG` (a camera's or Roboflow's spelling) where torchvision reads `b.jpg`: refused as
    torchvision refuses it, naming the file that is there and what to rename it to."""
    root = tiny_devkit(tmp_path / "src", ["a", "b", "c"])
    folder = root / "VOCdevkit/VOC2007" / ("JPEGImages" if name.endswith(".jpg") else "Annotations")
    (folder / name).rename(folder / there)
    with pytest.raises(ts.SourceNotFoundError) as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    message = str(info.value)
    assert f"'{there}' is there" in message and f"read only '{name}'" in message
    assert "rename" in message and "ImageSets/Main/train.txt line 2" in message
    no_pack_output(tmp_path)


def test_unreadable_file_is_reported(tmp_path: Path) -> None:
    root = tiny_devkit(tmp_path / "src", ["a", "b"])
    xml = root / "VOCdevkit/VOC2007/Annotations/a.xml"
    xml.unlink()
    xml.mkdir()  # reading a folder fails even as root, unlike chmod 000
    with pytest.raises(ts.SourceDataError, match=r"a\.xml: the annotation is a directory"):
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")


def test_absent_optional_files_are_not_opened(
    corner_devkit: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Masks (and annotations of Segmentation-only ids) that the folder listing lacks are never
    opened (a failed open per sample costs time, see benchmarks/README.md). The samples stay
    torchvision's (the drop-in tests check every one of them on this devkit)."""
    from torch_serialized.voc import source

    failed: list[str] = []
    real_open = open

    def logged_open(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return real_open(path, *args, **kwargs)
        except FileNotFoundError:
            failed.append(str(path))
            raise

    monkeypatch.setattr(source, "open", logged_open, raising=False)
    result = ts.pack_voc(corner_devkit, tmp_path / "p.tser", year=None)
    assert result.num_samples > 0
    assert failed == []
    pack = VOCPackReader(result.path)
    flags = pack.columns["flags"]
    from torch_serialized.voc import schema

    assert (flags & schema.HAS_MASK).any() and not (flags & schema.HAS_MASK).all()
    assert (flags & schema.HAS_OBJECT_MASK).any()


# -- issue #11 items 3 and 8: only regular files, size-capped; missing means FileNotFoundError ---
def _replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


SOURCE_FILES = {
    "image": "JPEGImages/b.jpg",
    "annotation": "Annotations/b.xml",
    "list file": "ImageSets/Main/train.txt",
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", sorted(SOURCE_FILES))
@pytest.mark.parametrize("workers", [1, 2])
def test_a_fifo_in_the_source_is_refused_not_waited_on(
    tmp_path: Path, what: str, workers: int
) -> None:
    """A named pipe blocked ``pack_voc`` forever (open() waits for a writer)."""
    root = tiny_devkit(tmp_path / "src", [f"{i:02d}" for i in range(8)] + ["b"])
    fifo = root / "VOCdevkit/VOC2007" / SOURCE_FILES[what]
    _replace_with_fifo(fifo)
    with pytest.raises(ts.SourceDataError, match="named pipe") as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007", workers=workers)
    assert str(fifo) in str(info.value)
    no_pack_output(tmp_path)


@pytest.mark.timeout(30)
def test_a_link_to_a_device_is_refused_not_read_forever(tmp_path: Path, bounded_memory) -> None:
    """A source image that is a symlink to /dev/zero was read until memory ran out."""
    root = tiny_devkit(tmp_path / "src", ["a", "b"])
    image = root / "VOCdevkit/VOC2007/JPEGImages/b.jpg"
    image.unlink()
    image.symlink_to("/dev/zero")
    with pytest.raises(ts.SourceDataError, match="character device") as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007")
    assert str(image) in str(info.value)
    skipped = ts.pack_voc(root, tmp_path / "skip.tser", year="2007", on_error="skip")
    assert [s.id for s in skipped.skipped] == ["b"]


def test_a_file_over_the_size_cap_is_refused_naming_it(tmp_path: Path) -> None:
    root = tiny_devkit(tmp_path / "src", ["a", "b"])
    image = root / "VOCdevkit/VOC2007/JPEGImages/b.jpg"
    image.write_bytes(image.read_bytes() + bytes(5000))
    cap = image.stat().st_size - 1
    with pytest.raises(ts.SourceDataError, match="max_file_bytes") as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007", max_file_bytes=cap)
    assert str(image) in str(info.value) and f"{cap:,}-byte limit" in str(info.value)
    assert ts.pack_voc(root, tmp_path / "ok.tser", year="2007", max_file_bytes=cap + 1)
    listed = root / "VOCdevkit/VOC2007/ImageSets/Main/train.txt"  # list files too
    with pytest.raises(ts.SourceDataError, match="limit") as info:
        ts.pack_voc(root, tmp_path / "out.tser", year="2007", max_file_bytes=3)
    assert str(listed) in str(info.value)
    with pytest.raises(ValueError, match="max_file_bytes"):
        ts.pack_voc(root, tmp_path / "out.tser", year="2007", max_file_bytes=0)


@pytest.mark.parametrize("missing", ["root", "year folder", "ImageSets", "image"])
def test_missing_source_data_is_a_file_not_found_error(tmp_path: Path, missing: str) -> None:
    """Issue #11 item 8: torchvision's own tests expect FileNotFoundError (or RuntimeError)
    for missing data; it is also still a SourceDataError (a ValueError), as before."""
    root = tiny_devkit(tmp_path / "src", ["a", "b"])
    voc = root / "VOCdevkit/VOC2007"
    target = {
        "root": tmp_path / "nowhere",
        "year folder": root,
        "ImageSets": root,
        "image": root,
    }[missing]
    if missing == "year folder":
        shutil.rmtree(voc)
    elif missing == "ImageSets":
        shutil.rmtree(voc / "ImageSets")
    elif missing == "image":
        (voc / "JPEGImages/b.jpg").unlink()
    with pytest.raises(FileNotFoundError) as info:
        ts.pack_voc(target, tmp_path / "out.tser", year="2007")
    assert isinstance(info.value, ts.SourceNotFoundError)
    assert isinstance(info.value, ts.SourceDataError) and isinstance(info.value, ValueError)
    no_pack_output(tmp_path)


EXTS = (".xml", ".png", ".png")


@pytest.mark.parametrize("devkit", ["corner_devkit", "synthetic_devkit", "gaps"])
def test_the_survey_gives_the_jobs_and_reads_a_full_pack_plans(
    devkit: str, request, tmp_path: Path
) -> None:
    # ``Planned.reads`` gives each job its ``reads`` and the append's quick check its files: an
    # id's image, its annotation or mask if its lists need them or its folder lists the file
    # (case-blind), on odd devkits too (ids in both tasks; "gaps": a listed id whose annotation
    # and one whose mask are missing, which load must still try to read).
    from torch_serialized.voc.images import ImageOptions
    from torch_serialized.voc.layout import find_voc_root, read_image_sets
    from torch_serialized.voc.source import survey

    if devkit == "gaps":
        root = shutil.copytree(request.getfixturevalue("synthetic_devkit"), tmp_path / "gaps")
        voc_root, _ = find_voc_root(root, None)
        next((voc_root / "Annotations").iterdir()).unlink()
        next((voc_root / "SegmentationClass").iterdir()).unlink()
    else:
        voc_root, _ = find_voc_root(request.getfixturevalue(devkit), None)
    sets = read_image_sets(voc_root)
    options = ImageOptions()
    planned = survey(voc_root, sets, options)
    jobs = planned.jobs()
    assert [planned.job(i) for i in range(len(planned))] == jobs
    files, needs = planned.reads(range(len(planned)))
    assert files.tolist() == [list(job.reads) for job in jobs]
    assert needs.tolist() == [[job.needs_annotation, job.needs_mask] for job in jobs]
    main = {i for lists in sets.get("Main", {}).values() for i in lists}
    segmentation = {i for lists in sets.get("Segmentation", {}).values() for i in lists}
    folders = ("Annotations", "SegmentationClass", "SegmentationObject")
    listing = [{n.casefold() for n in os.listdir(voc_root / f)} for f in folders]
    for job in jobs:
        assert (job.needs_annotation, job.needs_mask) == (job.id in main, job.id in segmentation)
        there = [(job.id + ext).casefold() in names for ext, names in zip(EXTS, listing)]
        assert job.reads == (
            True,
            job.needs_annotation or there[0],
            job.needs_mask or there[1],
            there[2],
        )


def test_a_prefix_read_returns_the_first_bytes_up_to_the_cap(tmp_path: Path) -> None:
    """``prefix=True`` (how a pack's header is read before it is replaced) returns at most
    ``max_bytes``; without it a longer file is refused, naming it, the cap and its size."""
    from torch_serialized.container.fileio import FileSizeError, read_regular_file

    path = tmp_path / "ten.bin"
    path.write_bytes(bytes(range(10)))
    assert read_regular_file(path, 4, "the file", prefix=True) == bytes(range(4))
    assert read_regular_file(path, 10, "the file", prefix=True) == bytes(range(10))
    with pytest.raises(FileSizeError, match=r"ten\.bin: the file is larger than the 4-byte limit"):
        read_regular_file(path, 4, "the file")


def test_a_file_that_grows_while_it_is_read_is_read_whole_or_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size ``fstat`` gave is no limit: a file longer by the time it is read (a writer
    still appending) is read to its end, or refused once past the cap, never cut short."""
    from torch_serialized.container import fileio as safeio

    path = tmp_path / "growing.bin"
    path.write_bytes(bytes(range(10)))
    real = os.fstat

    def stat_before_it_grew(fd: int) -> os.stat_result:
        st = real(fd)
        return os.stat_result((*st[:6], 4, *st[7:10]))  # st_size: 4 bytes when looked at

    monkeypatch.setattr(safeio.os, "fstat", stat_before_it_grew)
    assert safeio.read_regular_file(path, 100, "the file") == bytes(range(10))
    with pytest.raises(safeio.FileSizeError, match=r"larger than the 8-byte limit"):
        safeio.read_regular_file(path, 8, "the file")
