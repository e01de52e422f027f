"""append_voc: a grown source appended to a pack reads exactly as a full re-pack of it, and as
torchvision reads the grown folder; unchanged shards stay byte-identical; changes are found by
size and time (or content with checksum); failures leave the previous pack."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _reliability_helpers import PACK_FORMS, dead_pid, out_name, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchvision.datasets import VOCDetection, VOCSegmentation

from torch_serialized import (
    SerializedDataset,
    SourceDataError,
    VOCSerializedDataset,
    VOCSerializedSegmentation,
    append_voc,
    export_voc,
    open_pack,
    pack_voc,
)
from torch_serialized.cli import main
from torch_serialized.container.reader import ContainerReader
from torch_serialized.errors import FormatError, WriteError
from torch_serialized.tools import make_synthetic_voc
from torch_serialized.voc import schema
from torch_serialized.voc.packed import VOCPackReader

YEAR = "2007"
TASKS = (
    ("Main", VOCSerializedDataset, VOCDetection),
    ("Segmentation", VOCSerializedSegmentation, VOCSegmentation),
)


# -- a source that grows -----------------------------------------------------------------------
class Source:
    """A synthetic devkit whose image set lists can be cut back (the pack's state) and restored
    (the grown state): every file stays, the lists decide what a pack holds."""

    def __init__(self, root: Path, num_images: int = 24, *, copy_of: Path | None = None) -> None:
        if copy_of is not None:  # times kept: a copy is the same source to a quick check
            self.root = Path(shutil.copytree(copy_of, root, symlinks=True))
        else:
            self.root = make_synthetic_voc(root, num_images, year=YEAR)
        self.voc = self.root / "VOCdevkit" / f"VOC{YEAR}"
        self.grown = {p: p.read_bytes() for p in sorted((self.voc / "ImageSets").rglob("*.txt"))}

    def cut(self, keep: float = 0.75) -> None:
        """Each list keeps its first lines only: the source as it was when packed."""
        for path, data in self.grown.items():
            ids = data.decode().split()
            path.write_text("".join(f"{i}\n" for i in ids[: max(1, int(len(ids) * keep))]))

    def grow(self) -> None:
        for path, data in self.grown.items():
            path.write_bytes(data)

    def listed(self) -> list[str]:
        return list(dict.fromkeys(i for d in self.grown.values() for i in d.decode().split()))

    def listed_now(self) -> list[str]:
        """The ids the lists name as they are now (after ``cut``)."""
        files = self.grown
        return list(dict.fromkeys(i for p in files for i in p.read_text().split()))

    def file(self, folder: str, image_id: str) -> Path:
        ext = ".jpg" if folder == "JPEGImages" else ".xml" if folder == "Annotations" else ".png"
        return self.voc / folder / f"{image_id}{ext}"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 24-image synthetic devkit, generated once; each test grows its own copy."""
    return make_synthetic_voc(tmp_path_factory.mktemp("append-src"), 24, year=YEAR)


@pytest.fixture
def source(tmp_path: Path, pristine: Path) -> Source:
    return Source(tmp_path / "src", copy_of=pristine)


def pack(source: Source, out: Path, form: str, **kwargs: Any) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    return pack_voc(source.root, out / out_name(form), year=YEAR, **PACK_FORMS[form], **kwargs).path


def hashes(path: Path) -> dict[str, str]:
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def as_bytes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.numpy().tobytes()
    if hasattr(value, "tobytes"):
        return (value.mode, value.size, value.tobytes())
    return value


def assert_same_as_repack(grown: Path, source: Source, tmp: Path, form: str) -> None:
    """Every image set of every task reads sample for sample as a fresh pack of the source."""
    fresh = pack(source, tmp / "fresh", form)
    ours, theirs = VOCPackReader(grown), VOCPackReader(fresh)
    for task, dataset, _ in TASKS:
        assert ours.image_sets(task) == theirs.image_sets(task)
        for image_set in theirs.image_sets(task):
            a, b = (
                dataset(grown, image_set=image_set, decode="none"),
                dataset(fresh, image_set=image_set, decode="none"),
            )
            assert list(a.ids) == list(b.ids) and len(a) == len(b)
            for i in range(len(b)):
                (xa, ya), (xb, yb) = a[i], b[i]
                assert as_bytes(xa) == as_bytes(xb), (task, image_set, i)
                assert as_bytes(ya) == as_bytes(yb), (task, image_set, i)
    assert ours.files() == theirs.files()
    assert ours.meta["splits"] == theirs.meta["splits"]
    assert ours.meta["class_counts"] == theirs.meta["class_counts"]
    assert len(SerializedDataset(grown)) == len(SerializedDataset(fresh))
    assert sorted(
        SerializedDataset(grown)[i]["id"] for i in range(len(SerializedDataset(grown)))
    ) == sorted(SerializedDataset(fresh)[i]["id"] for i in range(len(SerializedDataset(fresh))))


def assert_same_as_torchvision(
    grown: Path, source: Source, *, decode_set: str | None = "train"
) -> None:
    """torchvision on the grown folder: the same files and parsed targets, index for index;
    ``decode_set`` also compared decoded, image by image."""
    for task, dataset, tv_class in TASKS:
        for image_set in VOCPackReader(grown).image_sets(task):
            tv = tv_class(str(source.root), year=YEAR, image_set=image_set)
            ours = dataset(grown, image_set=image_set, decode="none")
            assert len(ours) == len(tv)
            for i in range(len(tv)):
                image, target = ours[i]
                assert as_bytes(image) == Path(tv.images[i]).read_bytes()
                if task == "Main":
                    parsed = tv.parse_voc_xml(ET.parse(tv.annotations[i]).getroot())
                    assert target == parsed
            if task == "Main" and image_set == decode_set:
                decoded = dataset(grown, image_set=image_set)
                for i in range(len(tv)):
                    (xa, ya), (xb, yb) = decoded[i], tv[i]
                    assert as_bytes(xa) == as_bytes(xb) and ya == yb


# -- growing -------------------------------------------------------------------------------------
#: pack processes: 2 spawns a pool (seconds of start-up), so those cases run with the slow tests
WORKERS = [1, pytest.param(2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("form", PACK_FORMS)
def test_append_new_ids_reads_as_a_full_repack_and_as_torchvision(tmp_path, source, form, workers):
    source.cut()
    path = pack(source, tmp_path / "pack", form)
    before = hashes(path)
    packed = len(VOCPackReader(path))
    source.grow()

    result = append_voc(source.root, path, workers=workers)

    assert result.added == len(source.listed()) - packed > 0
    assert result.replaced == [] and result.retired == []
    assert result.num_samples == len(source.listed())
    # the pack's size as info reports it; a shard folder also keeps the previous catalog for
    # readers of the old manifest, which is not the pack's
    assert result.num_bytes == open_pack(path).nbytes
    if form == "shards":
        assert result.num_bytes < sum(p.stat().st_size for p in path.iterdir())
    assert_same_as_repack(path, source, tmp_path, form)
    assert_same_as_torchvision(path, source)
    after = hashes(path)
    if form == "shards":  # only new files: every existing shard byte-identical
        manifest = open_pack(path).manifest
        assert manifest is not None
        old_shards = {n: h for n, h in before.items() if n.startswith("shard-")}
        assert old_shards and all(after[n] == h for n, h in old_shards.items())
        assert set(after) - set(before) == {
            *(e.file for e in manifest.shards[len(old_shards) :]),
            manifest.catalog.file,  # type: ignore[union-attr]
        }
        assert (
            open_pack(path).manifest.pack_id
            == json.loads(  # type: ignore[union-attr]
                (path / "manifest.json").read_text()
            )["pack_id"]
        )
    assert open_pack(path).verify() == []


def test_a_shard_folder_grows_without_reading_its_shards(tmp_path, source, monkeypatch):
    # The image sets' class counts come from the catalog's object classes: no record of the
    # old shards is read (at a URL, none is downloaded), only the new ids' files are; the old
    # shards are only opened and checked, as a reader's first read checks them.
    source.cut()
    path = pack(source, tmp_path / "pack", "shards")
    old_shards = {str(p) for p in path.iterdir() if p.name.startswith("shard-")}
    read: list[str] = []
    for name in ("field", "index_rows", "record", "views", "read_records", "prefetch"):
        real = getattr(ContainerReader, name)

        def spy(self: ContainerReader, *a: Any, _real: Any = real, **k: Any) -> Any:
            read.append(self.path)
            return _real(self, *a, **k)

        monkeypatch.setattr(ContainerReader, name, spy)
    source.grow()

    result = append_voc(source.root, path)

    assert result.added > 0
    assert old_shards.isdisjoint(read)
    monkeypatch.undo()
    assert_same_as_repack(path, source, tmp_path, "shards")
    assert open_pack(path).verify() == []


def _flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x40
    path.write_bytes(bytes(data))


SHARD_DAMAGE = {
    "missing": lambda p: p.unlink(),
    "truncated": lambda p: os.truncate(p, p.stat().st_size - 100),
    "header": lambda p: _flip(p, 9),
    "metadata": lambda p: _flip(p, p.stat().st_size - 66),  # size and footer still match
}


@pytest.mark.parametrize("damage", sorted(SHARD_DAMAGE))
def test_a_damaged_old_shard_is_refused_and_nothing_is_written(tmp_path, source, damage):
    # Every reader refuses such a pack: an append must not build a new generation on it.
    source.cut()
    path = pack(source, tmp_path / "pack", "shards")
    shard = path / open_pack(path).entries[1].file
    SHARD_DAMAGE[damage](shard)
    before = snapshot(path)
    source.grow()
    with pytest.raises((FileNotFoundError, FormatError)) as err:
        append_voc(source.root, path)
    assert str(shard) in str(err.value) and "Nothing was appended" in str(err.value)
    assert "torch-serialized verify" in str(err.value)
    assert snapshot(path) == before
    assert sorted(os.listdir(path.parent)) == [path.name]


@pytest.mark.parametrize("form", PACK_FORMS)
@pytest.mark.parametrize("missing", ["OBJECT_CLASSES_ARRAY", "DIGEST_ARRAY"])
def test_a_pack_of_an_older_version_reads_and_its_append_is_refused(
    tmp_path, source, form, missing, monkeypatch
):
    # Packs written before the catalog kept every object's class or source digests read
    # (classes from the shards), but an append asks for a re-pack first.
    source.cut()
    options = {"image_storage": "raw"} if missing == "DIGEST_ARRAY" else {}
    path = pack(source, tmp_path / "fresh", form, **options)
    with monkeypatch.context() as m:  # written under another name: as if not written at all
        m.setattr(schema, missing, "objects/not-this-one")
        old = pack(source, tmp_path / "pack", form, **options)
    assert getattr(schema, missing) not in VOCPackReader(old).reader.arrays()
    classes = [VOCPackReader(p).object_classes() for p in (old, path)]
    assert all((a == b).all() for a, b in zip(*classes))
    before = snapshot(old)
    source.grow()
    with pytest.raises(WriteError, match="re-pack it once with pack_voc") as err:
        append_voc(source.root, old)
    assert str(VOCPackReader(old).name) in str(err.value) and snapshot(old) == before


def test_append_compares_the_resized_masks_of_a_max_size_pack(tmp_path) -> None:
    """A ``max_size`` pack stores its masks resized, so comparing them with the source files'
    bytes called every mask whose quick check failed (a touched file) "changed content".
    A mask is compared with what packing it again stores: a touched file is unchanged, a
    repainted one is still a change."""
    from PIL import Image

    root = make_synthetic_voc(tmp_path / "src", 8, year="2012", segmentation_every=2)
    path = pack_voc(root, tmp_path / "p.tser", year="2012", max_size=200).path
    mask = sorted((root / "VOCdevkit" / "VOC2012" / "SegmentationClass").glob("*.png"))[0]
    os.utime(mask, ns=(1_000_000_000, 1_000_000_000))
    result = append_voc(root, path)
    assert (result.added, result.replaced, result.retired) == (0, [], [])
    with Image.open(mask) as image:
        blank = Image.new("P", image.size)
        blank.putpalette(image.getpalette())
    blank.save(mask)
    with pytest.raises(SourceDataError, match=f"SegmentationClass/{mask.name} changed"):
        append_voc(root, path)


def test_append_compares_masks_of_max_size_packs_as_masks(tmp_path, monkeypatch):
    """Another Pillow may compress the same resized mask otherwise: not a change of the source
    when a touched mask file is checked again."""
    import io

    from PIL import Image

    from torch_serialized.voc import images, source

    def stored(data: bytes, path: str, scale: tuple[float, float]) -> bytes:
        with Image.open(io.BytesIO(images.resize_mask(data, path, scale))) as mask:
            out = io.BytesIO()
            mask.save(out, format="PNG", compress_level=1)
            return out.getvalue()

    root = make_synthetic_voc(tmp_path / "src", 8, year="2012", segmentation_every=2)
    with monkeypatch.context() as patch:
        patch.setattr(source, "resize_mask", stored)
        path = pack_voc(root, tmp_path / "p.tser", year="2012", max_size=200).path
    for mask in (root / "VOCdevkit" / "VOC2012" / "SegmentationClass").glob("*.png"):
        os.utime(mask, ns=(1_000_000_000, 1_000_000_000))
    result = append_voc(root, path)
    assert (result.added, result.replaced, result.retired) == (0, [], [])


def test_touched_masks_of_a_max_size_pack_are_compared_without_packing_again(
    tmp_path, monkeypatch
) -> None:
    """Every mask touched (a copy that did not keep modification times): each is compared by
    resizing it with its image's scale, read from the image's header, instead of loading the
    whole sample again (decoding, resizing and re-encoding its image: a re-pack's cost)."""
    from torch_serialized.voc import source as source_module

    root = make_synthetic_voc(tmp_path / "src", 8, year="2012", segmentation_every=2)
    path = pack_voc(root, tmp_path / "p.tser", year="2012", max_size=200).path
    voc = root / "VOCdevkit" / "VOC2012"
    masks = [
        *(voc / "SegmentationClass").glob("*.png"),
        *(voc / "SegmentationObject").glob("*.png"),
    ]
    assert len(masks) >= 8
    for mask in masks:
        os.utime(mask, ns=(1_000_000_000, 1_000_000_000))

    def no_reload(*args):
        raise AssertionError("an image was stored again to compare its masks")

    monkeypatch.setattr(source_module, "store_image", no_reload)
    result = append_voc(root, path)
    assert (result.added, result.replaced, result.retired) == (0, [], [])
    assert result.bytes_written > 0  # the touched files' statistics were recorded anew


def test_append_to_an_empty_path_says_so_and_touches_nothing(tmp_path, source, monkeypatch):
    """``append_voc(root, "")`` said "'.' is a folder without manifest.json": ``Path("")``
    is the current folder. It now names the empty path and what to pass."""
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="the pack path is empty: pass the .tser file"):
        append_voc(source.root, "")
    assert sorted(tmp_path.rglob("*")) == before


def test_prune_remote_on_a_local_path_says_what_pruning_is_for(tmp_path, source) -> None:
    """``prune_remote("local/path")`` said "is not a URL (a local path is read without
    RemoteStore)"; it now says what the CLI says, and for a folder which URL to pass."""
    from torch_serialized.remote.upload import prune_remote

    folder = pack(source, tmp_path / "pack", "shards")
    for path in (folder, tmp_path / "none.tser"):
        with pytest.raises(ValueError) as raised:
            prune_remote(str(path))
        text = " ".join(str(raised.value).split())
        assert f"{path} is a local path" in text and "RemoteStore" not in text
        assert "A local pack needs no pruning" in text
        assert (f"pass {folder.absolute().as_uri()}" in text) == path.is_dir()
    assert prune_remote(folder.absolute().as_uri(), dry_run=True) == []


@pytest.mark.parametrize("form", PACK_FORMS)
def test_append_with_nothing_new_writes_nothing(tmp_path, source, form):
    path = pack(source, tmp_path / "pack", form)
    before = snapshot(path)
    result = append_voc(source.root, path)
    assert (result.added, result.replaced, result.retired, result.bytes_written) == (0, [], [], 0)
    assert "up to date" in result.notes[0]
    assert snapshot(path) == before and result.num_samples == len(source.listed())
    image = source.file("JPEGImages", source.listed()[0])  # touched: its new time is recorded
    os.utime(image, ns=(image.stat().st_atime_ns, image.stat().st_mtime_ns + 10**9))
    assert append_voc(source.root, path).notes == []
    assert snapshot(path) != before
    assert_same_as_repack(path, source, tmp_path, form)
    assert "up to date" in append_voc(source.root, path).notes[0]


def test_single_file_keeps_its_records_bytes_and_pack_id(tmp_path, source):
    source.cut()
    path = pack(source, tmp_path / "pack", "single")
    old = open_pack(path)
    old_records = [
        [bytes(old.field(i, k)) for k in range(len(old.fields))] for i in range(len(old))
    ]
    pack_id = old.shard(0).meta["pack"]["pack_id"]
    source.grow()
    append_voc(source.root, path)
    new = open_pack(path)
    assert new.shard(0).meta["pack"]["pack_id"] == pack_id
    assert [
        [bytes(new.field(i, k)) for k in range(len(new.fields))] for i in range(len(old_records))
    ] == old_records


# -- changes -------------------------------------------------------------------------------------
def edit_annotation(source: Source, image_id: str, new_class: str = "helmet") -> None:
    path = source.file("Annotations", image_id)
    root = ET.fromstring(path.read_bytes())
    root.find("object/name").text = new_class  # type: ignore[union-attr]
    path.write_bytes(ET.tostring(root))


@pytest.mark.parametrize("form", PACK_FORMS)
def test_a_changed_id_is_an_error_naming_it_and_nothing_is_written(tmp_path, source, form):
    path = pack(source, tmp_path / "pack", form)
    before = snapshot(path)
    victim = source.listed()[3]
    edit_annotation(source, victim)
    with pytest.raises(
        SourceDataError, match=rf"{victim}.*Annotations/{victim}\.xml changed"
    ) as err:
        append_voc(source.root, path)
    assert "replace_changed=True" in str(err.value)
    assert "would also retire" not in str(err.value)  # every packed id is still listed
    assert snapshot(path) == before
    assert sorted(os.listdir(path.parent)) == [path.name]


@pytest.mark.parametrize(("keep", "warned"), [(0.75, False), (0.25, True)])
def test_the_changed_ids_message_says_what_the_append_would_also_retire(
    tmp_path, source, keep, warned
):
    """Another dataset whose ids overlap a few of the pack's reads as "a few ids changed":
    the refusal also says how many packed ids the same append would retire, and past half of
    them to check the folder, so that following its advice never retires most of a pack
    unannounced."""
    path = pack(source, tmp_path / "pack", "single")
    live = len(VOCPackReader(path).live)
    edit_annotation(source, source.listed()[0])
    source.cut(keep)
    unlisted = live - len(source.listed_now())
    with pytest.raises(SourceDataError, match="replace_changed=True") as err:
        append_voc(source.root, path)
    message = str(err.value)
    assert f"would also retire {unlisted} of the pack's {live} ids" in message
    assert ("check that this is the folder the pack was made from" in message) == warned


def _class_ids(pack: VOCPackReader, record: int) -> np.ndarray:
    return np.frombuffer(pack.field(record, schema.OBJECTS), schema.OBJECT_DTYPE)["class_id"]


def _live_record(pack: VOCPackReader, image_id: str) -> int:
    (record,) = [int(r) for r in pack.live if pack.id(int(r)) == image_id]
    return record


def _main_lists_without(source: Source, image_id: str) -> None:
    for path in (source.voc / "ImageSets" / "Main").glob("*.txt"):
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(x for x in lines if x.split()[:1] != [image_id]))


@pytest.mark.parametrize(
    ("folder", "flag"),
    [("SegmentationObject", schema.HAS_OBJECT_MASK), ("Annotations", schema.HAS_ANNOTATION)],
)
def test_a_removed_file_the_id_does_not_need_is_a_change(tmp_path, source, folder, flag):
    """A file an id may go without (an object mask; the annotation of an id listed only in
    Segmentation), packed then deleted from the source, is a change like any other: refused
    without ``replace_changed``, and with it the new record holds no such file."""
    image_id = "000003"  # a Segmentation id with an object mask
    if folder == "Annotations":
        _main_lists_without(source, image_id)
        source.grown = {p: p.read_bytes() for p in source.grown}
    path = pack(source, tmp_path / "pack", "single")
    field = schema.OBJECT_MASK if folder == "SegmentationObject" else schema.ANNOTATION
    before = VOCPackReader(path)
    assert bytes(before.field(_live_record(before, image_id), field)) != b""
    source.file(folder, image_id).unlink()
    with pytest.raises(SourceDataError, match=rf"{folder}/{image_id}\.\w+ was removed"):
        append_voc(source.root, path)
    assert append_voc(source.root, path, replace_changed=True).replaced == [image_id]
    grown = VOCPackReader(path)
    record = _live_record(grown, image_id)
    assert int(grown.columns[record]["flags"]) & flag == 0
    assert bytes(grown.field(record, field)) == b""


@pytest.mark.parametrize(
    ("form", "workers"),
    [("single", 1), ("shards", 1), pytest.param("shards", 2, marks=pytest.mark.slow)],
)
def test_replace_changed_stores_the_new_version_and_retires_the_old(
    tmp_path, source, form, workers
):
    source.cut()
    path = pack(source, tmp_path / "pack", form)
    packed = VOCPackReader(path)
    ids = [packed.id(r) for r in range(len(packed))]
    changed = [ids[1], ids[5]]
    edit_annotation(source, changed[0])
    image = source.file("JPEGImages", changed[1])
    image.write_bytes(source.file("JPEGImages", ids[0]).read_bytes())  # another image's bytes
    source.grow()

    result = append_voc(source.root, path, replace_changed=True, workers=workers)

    assert sorted(result.replaced) == sorted(changed)
    assert_same_as_repack(path, source, tmp_path, form)
    assert_same_as_torchvision(path, source, decode_set=None)
    grown = VOCPackReader(path)
    if form == "shards":  # the old records stay in their shards, retired
        assert sorted(grown.id(int(r)) for r in grown.retired) == sorted(changed)
        assert grown.meta["schema_version"] == schema.RETIRED_SCHEMA_VERSION
    else:  # a rewritten file leaves them out
        assert len(grown.retired) == 0 and len(grown) == len(source.listed())
    live_ids = [grown.id(int(r)) for r in grown.live]
    assert sorted(live_ids) == sorted(source.listed())
    # export rebuilds the source's devkit; verify and info agree
    out = export_voc(path, tmp_path / "export")
    for image_id in source.listed():
        for folder in ("JPEGImages", "Annotations"):
            rel = source.file(folder, image_id).relative_to(source.voc)
            assert (out / rel).read_bytes() == (source.voc / rel).read_bytes()
    assert open_pack(path).verify() == []
    assert main(["verify", str(path)]) == 0


def test_the_quick_path_stats_each_packed_file_once_and_opens_only_new_and_touched_ids(
    tmp_path, source, monkeypatch
):
    """An append makes jobs for, and reads the files of, only the new ids and the ids whose
    statistics differ; the files of the other packed ids are stat-ed once each, relative to
    their folder, and never opened."""
    from torch_serialized.voc import changes
    from torch_serialized.voc import records as pack_module
    from torch_serialized.voc.images import ImageOptions
    from torch_serialized.voc.layout import read_image_sets
    from torch_serialized.voc.source import Planned, survey

    source.cut()
    path = pack(source, tmp_path / "pack", "shards")
    packed = {VOCPackReader(path).id(r) for r in range(len(VOCPackReader(path)))}
    source.grow()
    new = [i for i in source.listed() if i not in packed]
    touched = sorted(packed)[1]
    xml = source.file("Annotations", touched)
    os.utime(xml, ns=(xml.stat().st_atime_ns, xml.stat().st_mtime_ns + 10**9))
    options = ImageOptions("original", None, False)
    jobs = survey(source.voc, read_image_sets(source.voc), options).jobs()
    files = sum(sum(job.reads) for job in jobs if job.id in packed)

    made, loaded, read, stats = [], [], [], []
    real_jobs, real_load, real_read = Planned.jobs, pack_module.load, changes.read_regular_file
    real_stat = os.stat

    def jobs(self: Planned, positions: Any) -> Any:
        made.extend(self.ids[i] for i in positions)
        return real_jobs(self, positions)

    def load(job: Any) -> Any:
        loaded.append(job.id)
        return real_load(job)

    def read_file(path: Any, *args: Any) -> Any:
        read.append(Path(path).stem)
        return real_read(path, *args)

    def counted_stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        stats.append((str(path), kwargs.get("dir_fd")))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(Planned, "jobs", jobs)
    monkeypatch.setattr(pack_module, "load", load)
    monkeypatch.setattr(changes, "read_regular_file", read_file)
    monkeypatch.setattr(changes.os, "stat", counted_stat)
    result = append_voc(source.root, path)
    monkeypatch.undo()
    assert result.added == len(new) and result.replaced == []
    assert sorted(made) == sorted([*new, touched])  # no job for an unchanged id
    assert sorted(loaded) == sorted(new)  # only new ids are loaded
    assert read == [touched]  # the touched annotation alone, compared by content
    quick = [name for name, folder in stats if folder is not None]
    assert len(quick) == files  # one stat per file a load would read, relative to its folder
    assert all(os.sep not in name for name in quick)
    by_path = {Path(name).stem for name, folder in stats if folder is None}
    assert by_path & packed <= {touched}  # only the touched id is looked at again, by path


def test_a_touched_file_is_not_a_change_and_its_time_is_recorded(tmp_path, source):
    path = pack(source, tmp_path / "pack", "shards")
    victim = source.listed()[2]
    xml = source.file("Annotations", victim)
    os.utime(xml, ns=(xml.stat().st_atime_ns, xml.stat().st_mtime_ns + 10**9))
    result = append_voc(source.root, path)
    assert (result.added, result.replaced) == (0, [])
    pack_ = VOCPackReader(path)
    record = [pack_.id(r) for r in range(len(pack_))].index(victim)
    mtimes = pack_.reader.arrays()[schema.MTIME_ARRAY]
    assert int(mtimes[record, 1]) == xml.stat().st_mtime_ns


def test_quick_check_trusts_size_and_time_and_checksum_reads_the_content(tmp_path, source):
    path = pack(source, tmp_path / "pack", "single")
    victim = source.listed()[0]
    xml = source.file("Annotations", victim)
    data = xml.read_bytes()
    st = xml.stat()
    edited = data.replace(b"<difficult>0</difficult>", b"<difficult>1</difficult>", 1)
    assert edited != data and len(edited) == len(data)
    xml.write_bytes(edited)
    os.utime(xml, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same time: as rsync, unseen
    assert append_voc(source.root, path).replaced == []
    with pytest.raises(SourceDataError, match=rf"{victim}.*changed content"):
        append_voc(source.root, path, checksum=True)
    result = append_voc(source.root, path, checksum=True, replace_changed=True)
    assert result.replaced == [victim]
    assert_same_as_repack(path, source, tmp_path, "single")


@pytest.mark.parametrize("form", PACK_FORMS)
def test_ids_that_left_the_lists_are_retired_and_export_rebuilds_the_source(tmp_path, source, form):
    path = pack(source, tmp_path / "pack", form)
    source.cut(0.5)
    result = append_voc(source.root, path)
    listed = list(dict.fromkeys(i for p in source.grown for i in p.read_text().split()))
    assert sorted(result.retired) == sorted(set(source.listed()) - set(listed))
    assert result.num_samples == len(listed)
    assert len(SerializedDataset(path)) == len(listed)
    out = export_voc(path, tmp_path / "export")
    exported = sorted(p.stem for p in (out / "JPEGImages").iterdir())
    assert exported == sorted(listed)
    fresh = pack(source, tmp_path / "fresh", form)
    assert VOCPackReader(path).files() == VOCPackReader(fresh).files()
    info = json.loads(_run_cli(["info", "--json", str(path)]))
    assert info["num_samples"] == len(listed)
    assert info["retired"] == (len(result.retired) if form == "shards" else 0)


def test_class_ids_and_labels_stay_and_new_classes_come_after(tmp_path, source):
    from torch_serialized.voc.classes import VOC_CLASSES

    source.cut()
    path = pack(source, tmp_path / "pack", "shards")
    before = VOCPackReader(path).classes
    labels_before = {
        rule: VOCSerializedDataset(
            path, image_set="trainval", target_format="tv_tensors", classes=rule
        ).label_names
        for rule in (None, "packed")
    }
    assert labels_before[None] == ["__background__", *VOC_CLASSES]  # all VOC classes
    packed_ids = {VOCPackReader(path).id(r) for r in range(len(VOCPackReader(path)))}
    new_ids = [i for i in source.listed() if i not in packed_ids]
    edit_annotation(source, new_ids[0], "helmet")
    source.grow()
    append_voc(source.root, path)
    after = VOCPackReader(path).classes
    assert after[: len(before)] == before and after[len(before) :] == ["helmet"]
    image_set = next(
        s
        for s in VOCPackReader(path).image_sets("Main")
        if new_ids[0] in VOCSerializedDataset(path, image_set=s).ids
    )
    for rule in (None, "packed"):  # every existing label kept, the new class after them
        ds = VOCSerializedDataset(
            path, image_set=image_set, target_format="tv_tensors", classes=rule
        )
        assert ds.label_names == [*labels_before[rule], "helmet"]
        index = list(ds.ids).index(new_ids[0])
        assert ds.label_names[ds[index][1]["labels"].tolist()[0]] == "helmet"
    # a later append adds after those, whatever the rule would say for a fresh pack
    source.cut(0.5)
    append_voc(source.root, path)
    edit_annotation(source, new_ids[0], "cone")
    source.grow()
    append_voc(source.root, path)
    ds = VOCSerializedDataset(
        path, image_set=image_set, target_format="tv_tensors", classes="packed"
    )
    assert ds.label_names == [*labels_before["packed"], "helmet", "cone"]


@pytest.mark.parametrize("name", ["tiny.tser", "tiny-shards"])
def test_a_0_1_0_pack_is_not_appended_to_but_re_packed(tmp_path, name):
    data = Path(__file__).parent / "data" / "v1"
    copy = shutil.copytree if name == "tiny-shards" else shutil.copyfile
    path = Path(copy(data / name, tmp_path / name))
    before = snapshot(path)
    root = Path(shutil.copytree(data / "devkit", tmp_path / "devkit"))
    with pytest.raises(WriteError, match="re-pack it once with pack_voc") as err:
        append_voc(root, path)
    assert str(path) in str(err.value) and "--overwrite" in str(err.value)
    assert snapshot(path) == before and sorted(os.listdir(tmp_path)) == ["devkit", name]


# -- failures ----------------------------------------------------------------------------------
@pytest.mark.parametrize("form", PACK_FORMS)
def test_an_error_while_appending_leaves_the_previous_pack_and_nothing_else(
    tmp_path, source, form, monkeypatch
):
    source.cut()
    path = pack(source, tmp_path / "pack", form)
    before = snapshot(path)
    source.grow()
    from torch_serialized.voc import records as pack_module

    calls = {"n": 0}
    real = pack_module.load

    def failing(job: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the new records
        return real(job)

    monkeypatch.setattr(pack_module, "load", failing)
    with pytest.raises(KeyboardInterrupt):
        append_voc(source.root, path, progress=False)
    assert snapshot(path) == before
    assert sorted(os.listdir(path.parent)) == [path.name]
    monkeypatch.undo()
    append_voc(source.root, path)
    assert_same_as_repack(path, source, tmp_path, form)


def test_files_of_an_interrupted_append_are_removed_by_the_next(tmp_path, source):
    source.cut()
    path = pack(source, tmp_path / "pack", "shards")
    stray_shard = path / "shard-00009-deadbeef.tser"
    stray_catalog = path / "catalog-deadbeef.tser"
    pid = dead_pid()
    stray_temp = path / f".manifest.json.tmp-{pid}-0badc0de"
    for stray in (stray_shard, stray_catalog, stray_temp):
        stray.write_bytes(b"left by a killed append")
    source.grow()
    append_voc(source.root, path)
    names = set(os.listdir(path))
    manifest = open_pack(path).manifest
    assert manifest is not None
    assert names == {
        "manifest.json",
        *manifest.files(),
        VOCPackReader(path).meta["previous_catalog"],
    }


def test_catalogs_older_than_the_previous_one_are_removed(tmp_path, source):
    source.cut(0.5)
    path = pack(source, tmp_path / "pack", "shards")
    catalogs = []
    for keep in (0.75, 1.0):
        catalogs.append(open_pack(path).manifest.catalog.file)  # type: ignore[union-attr]
        source.cut(keep)
        append_voc(source.root, path)
    present = {n for n in os.listdir(path) if n.startswith("catalog-")}
    assert present == {catalogs[-1], open_pack(path).manifest.catalog.file}  # type: ignore[union-attr]
    # a full pack over it still replaces it: the kept catalog is one of ours
    pack_voc(source.root, path, year=YEAR, max_samples_per_shard=5)


def test_another_append_running_is_refused(tmp_path, source):
    import fcntl

    source.cut()
    path = pack(source, tmp_path / "pack", "shards")
    source.grow()
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(WriteError, match="another process"):
            append_voc(source.root, path)
    finally:
        os.close(fd)


def test_bad_arguments(tmp_path, source):
    path = pack(source, tmp_path / "pack", "single")
    with pytest.raises(ValueError, match="on_error"):
        append_voc(source.root, path, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="URL"):
        append_voc(source.root, "https://example.invalid/pack")
    with pytest.raises(ValueError, match="2012"):
        append_voc(source.root, path, year="2012")


def test_a_devkit_of_another_year_is_named_as_such(tmp_path, source):
    """Appending a VOC2012 folder to a VOC2007 pack, the year left out (append takes the
    pack's): the message says the years differ, not "pass year='2012' or leave the year
    out" (which the user did, and whose advice fails next)."""
    from torch_serialized import SourceNotFoundError

    path = pack(source, tmp_path / "pack", "single")
    other = make_synthetic_voc(tmp_path / "other", 4, year="2012")
    for year in (None, "2012"):
        with pytest.raises(ValueError) as info:
            append_voc(other, path, year=year)
        message = str(info.value)
        assert "is VOC2012 but" in message and "holds VOC2007" in message
        assert "leave the year out" not in message
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceNotFoundError, match="No Pascal VOC 2007 folder found"):
        append_voc(tmp_path / "empty", path)  # no VOC folder at all: the first message


# -- the command line -------------------------------------------------------------------------
def _run_cli(argv: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def test_cli_append_and_info_history(tmp_path, source, capsys):
    source.cut()
    path = pack(source, tmp_path / "pack", "shards")
    source.grow()
    edit_annotation(source, source.listed()[0])
    assert main(["pack", str(source.root), str(path), "--append", "-q"]) == 2
    assert "--replace-changed" in capsys.readouterr().err
    text = _run_cli(["pack", str(source.root), str(path), "--append", "--replace-changed", "-q"])
    assert "1 changed sample replaced" in text
    info = _run_cli(["info", str(path)])
    assert "history" in info and "append" in info and "replaced 1" in info
    history = json.loads(_run_cli(["info", "--json", str(path)]))["history"]
    assert [e["action"] for e in history] == ["pack", "append"]
    assert history[1]["replaced"] == 1 and history[1]["added"] > 0
    assert main(["pack", str(source.root), str(path), "--append", "--shards", "2"]) == 2
    assert "--shards cannot be combined with --append" in capsys.readouterr().err
    assert main(["pack", str(source.root), str(tmp_path / "x.tser"), "--checksum"]) == 2
    assert "--checksum only applies with --append" in capsys.readouterr().err
    assert np.array_equal(VOCPackReader(path).retired, VOCPackReader(path).retired)


@pytest.mark.parametrize("form", PACK_FORMS)
def test_result_history_and_summary_count_added_replaced_and_retired_alike(tmp_path, source, form):
    # added: new ids; replaced: changed ids packed again; retired: ids no longer listed
    source.cut()
    path = pack(source, tmp_path / "pack", form)
    packed = {VOCPackReader(path).id(r) for r in range(len(VOCPackReader(path)))}
    source.grow()
    changed, gone = sorted(packed)[:2]
    edit_annotation(source, changed)
    for listed in (source.voc / "ImageSets").rglob("*.txt"):
        kept = [ln for ln in listed.read_text().splitlines() if ln.split(" ")[0] != gone]
        listed.write_text("".join(f"{ln}\n" for ln in kept))
    new = {i for i in source.listed() if i != gone} - packed
    (tmp_path / "copy").mkdir()
    copy = tmp_path / "copy" / path.name
    (shutil.copytree if path.is_dir() else shutil.copyfile)(path, copy)

    result = append_voc(source.root, path, replace_changed=True)
    assert (result.added, result.replaced, result.retired) == (len(new), [changed], [gone])
    assert result.num_samples == len(packed) + result.added - len(result.retired)
    history = VOCPackReader(path).meta["history"][-1]
    assert (history["added"], history["replaced"], history["retired"]) == (len(new), 1, 1)
    text = _run_cli(["pack", str(source.root), str(copy), "--append", "--replace-changed", "-q"])
    assert f"added    {len(new)} new samples, 1 changed sample replaced" in text
    assert "retired  1 sample no longer listed" in text
    info = _run_cli(["info", str(copy)])
    assert f"added {len(new)}, replaced 1, retired 1" in info


def test_a_changed_id_skipped_on_reload_is_counted_retired(tmp_path, source):
    """``replace_changed`` with ``on_error="skip"``: a changed id whose new file is broken is
    skipped, and its old record retired: the result and the history count it retired."""
    path = pack(source, tmp_path / "pack", "single")
    broken = source.listed()[2]
    source.file("JPEGImages", broken).write_bytes(b"not a jpeg")
    result = append_voc(source.root, path, replace_changed=True, on_error="skip")
    assert [s.id for s in result.skipped] == [broken]
    assert (result.replaced, result.retired) == ([], [broken])
    assert VOCPackReader(path).meta["history"][-1]["retired"] == 1
    assert broken not in {VOCPackReader(path).id(int(r)) for r in VOCPackReader(path).live}


# -- readers open while another process appends -------------------------------------------------
def _append_in_another_process(source: Source, path: Path) -> None:
    code = (
        "import sys; from torch_serialized import append_voc; append_voc(sys.argv[1], sys.argv[2])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(source.root), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def _epoch(loader: Any) -> list[tuple[str, bytes]]:
    return [(t["annotation"]["filename"], as_bytes(x)) for batch in loader for x, t in batch]


@pytest.mark.parametrize("form", PACK_FORMS)
def test_readers_open_during_an_append_in_another_process(tmp_path, source, form):
    from torch.utils.data import DataLoader

    from torch_serialized import FileChangedError, VOCSerializedIterableDataset

    source.cut()
    path = pack(source, tmp_path / "pack", form)
    mapped = VOCSerializedDataset(path, image_set="trainval", decode="none")
    stream = VOCSerializedIterableDataset(path, "trainval", decode="none")
    before = [(t["annotation"]["filename"], as_bytes(x)) for x, t in mapped]
    streamed = [(t["annotation"]["filename"], as_bytes(x)) for x, t in stream]

    def loader(dataset: Any, **kwargs: Any) -> Any:
        return DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=list, **kwargs)

    persistent = loader(mapped, persistent_workers=True)
    persistent_stream = loader(stream, persistent_workers=True)
    assert _epoch(persistent) == before  # workers started before the append
    assert sorted(_epoch(persistent_stream)) == sorted(streamed)

    source.grow()
    _append_in_another_process(source, path)

    assert [(t["annotation"]["filename"], as_bytes(x)) for x, t in mapped] == before
    assert _epoch(persistent) == before
    assert sorted(_epoch(persistent_stream)) == sorted(streamed)
    if form == "shards":  # workers started after the append still read the pack they opened
        assert _epoch(loader(mapped)) == before
        assert sorted(_epoch(loader(stream))) == sorted(streamed)
    else:  # the file was renamed over: an old reader in a new process is told to reopen
        with pytest.raises(FileChangedError, match="create the dataset again"):
            pickle.loads(pickle.dumps(mapped))[0]  # as a DataLoader worker receives it
    grown = VOCSerializedDataset(path, image_set="trainval", decode="none")
    assert len(grown) > len(before)
    assert_same_as_repack(path, source, tmp_path, form)


# -- killed and starved appends (slow) ------------------------------------------------------------
def _reads_as_before_or_as_grown(
    path: Path, before: dict[str, bytes], source: Source, tmp: Path, form: str
) -> str:
    """What a killed append left: the previous pack byte for byte (a shard folder may also hold
    files the killed append wrote and no manifest names: the next run removes them), or the
    complete grown one."""
    from torch_serialized.container import spec as fmt
    from torch_serialized.container.fileio import is_temporary

    state = snapshot(path)
    assert state is not None
    if state.get("manifest.json", state.get("")) == before.get("manifest.json", before.get("")):
        assert {name: state.get(name) for name in before} == before
        assert all(fmt.is_member_name(n) or is_temporary(n) for n in set(state) - set(before))
        return "previous"
    assert_same_as_repack(path, source, tmp, form)  # a complete append, nothing in between
    return "grown"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", PACK_FORMS)
def test_append_killed_at_random_moments_keeps_the_previous_or_the_grown_pack(tmp_path, form):
    import random
    import signal
    import time

    from _append_helpers import run_child

    source = Source(tmp_path / "src", 40)
    rng = random.Random(f"kill-append-{form}")
    delays = [0.02, *(rng.uniform(0.05, 1.2) for _ in range(4))]
    outcomes = []
    for run, delay in enumerate(delays):
        source.cut(0.5)
        path = pack(source, tmp_path / f"run{run}", form)
        before = snapshot(path)
        assert before is not None
        source.grow()
        proc = run_child("slow_append", str(source.root), str(path), "0.04")
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "started\n", proc.stderr.read() if proc.stderr else ""
            time.sleep(delay)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
        outcomes.append(
            _reads_as_before_or_as_grown(path, before, source, tmp_path / f"r{run}", form)
        )
        append_voc(source.root, path)  # the next run cleans up after the killed one
        assert sorted(os.listdir(path.parent)) == [path.name]
        if form == "shards":
            manifest = open_pack(path).manifest
            assert manifest is not None
            kept = VOCPackReader(path).meta.get("previous_catalog")
            assert set(os.listdir(path)) == {"manifest.json", *manifest.files(), kept}
        assert_same_as_repack(path, source, tmp_path / f"after{run}", form)
    assert "previous" in outcomes, outcomes


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", PACK_FORMS)
def test_disk_full_during_an_append_leaves_the_previous_pack(tmp_path, form):
    from _append_helpers import run_child

    source = Source(tmp_path / "src", 40)
    source.cut(0.5)
    path = pack(source, tmp_path / "pack", form)
    source.grow()
    size = sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size
    runs = []
    folder = tmp_path / "limited"
    folder.mkdir()
    proc = run_child("append_and_report", str(source.root), str(path), str(folder), str(256 << 10))
    runs.append(("EFBIG", proc))
    unshare = shutil.which("unshare")
    if unshare is not None and os.geteuid() == 0:
        small = tmp_path / "small"
        small.mkdir()
        script = (
            f'mount -t tmpfs -o size={size + (300 << 10)} tmpfs "$1" || exit 77; shift; exec "$@"'
        )
        wrap = [
            unshare,
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            str(small),
        ]
        runs.append(
            (
                "ENOSPC",
                run_child(
                    "append_and_report", str(source.root), str(path), str(small), "0", wrap=wrap
                ),
            )
        )
    checked = 0
    for expected, proc in runs:
        stdout, stderr = proc.communicate(timeout=200)
        if proc.returncode == 77 or (
            expected == "ENOSPC" and not stdout and "Traceback" not in stderr
        ):
            continue  # no private tmpfs here
        assert proc.returncode == 0, stderr
        report = json.loads(stdout)
        assert report["error"] is not None, report
        assert (
            report["error"]["type"] == "WriteError"
            and expected in __import__("errno").errorcode[report["error"]["errno"]]
        ), report
        assert report["unchanged"] and report["readable"] == len(VOCPackReader(path).live)
        assert report["left"] == [path.name]
        if form == "shards":
            assert set(report["inside"]) == set(os.listdir(path))
        checked += 1
    assert checked >= 1


def test_a_single_file_replaced_by_a_pack_of_the_same_size_is_not_grown(
    tmp_path, source, monkeypatch
):
    """The file an append opened, replaced meanwhile by another pack of exactly its size (a
    re-pack of the same folder): its records would be copied at the old file's offsets.
    The append was refused only for another size; the footer's metadata checksum tells."""
    from torch_serialized.voc import append as append_module

    source.cut(0.5)
    path = pack(source, tmp_path / "pack", "single")
    other = pack(source, tmp_path / "other", "single")  # the same folder packed again
    assert other.stat().st_size == path.stat().st_size  # the case: same size, another pack
    assert other.read_bytes() != path.read_bytes()
    real = append_module.classify

    def classify_then_repack(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        os.replace(other, path)  # another process's re-pack lands after this one opened it
        return plan

    monkeypatch.setattr(append_module, "classify", classify_then_repack)
    repacked = other.read_bytes()
    source.grow()
    with pytest.raises(WriteError, match="changed since it was opened"):
        append_voc(source.root, path)
    assert path.read_bytes() == repacked  # the re-pack, untouched


@pytest.mark.parametrize("form", PACK_FORMS)
def test_an_append_that_lost_a_race_writes_nothing(tmp_path, source, form, monkeypatch):
    from torch_serialized.voc import append as append_module

    source.cut(0.5)
    path = pack(source, tmp_path / "pack", form)
    real = append_module.classify
    raced = {"done": False}

    def classify_then_race(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        if not raced["done"]:  # another process appends after this one opened the pack
            raced["done"] = True
            source.cut(0.75)
            append_voc(source.root, path)
            source.grow()
        return plan

    monkeypatch.setattr(append_module, "classify", classify_then_race)
    source.grow()
    with pytest.raises(WriteError, match="changed since it was opened"):
        append_voc(source.root, path)
    monkeypatch.undo()
    source.cut(0.75)
    assert_same_as_repack(path, source, tmp_path, form)  # the other append's pack, whole
    source.grow()
    append_voc(source.root, path)
    assert_same_as_repack(path, source, tmp_path / "2", form)


def test_a_single_file_being_appended_to_is_refused(tmp_path, source):
    import fcntl

    source.cut()
    path = pack(source, tmp_path / "pack", "single")
    source.grow()
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(WriteError, match="another process"):
            append_voc(source.root, path)
    finally:
        os.close(fd)
    assert sorted(os.listdir(path.parent)) == [path.name]


@pytest.mark.parametrize("form", PACK_FORMS)
def test_on_error_skip_leaves_bad_new_ids_out_and_reports_them(tmp_path, source, form):
    source.cut()
    path = pack(source, tmp_path / "pack", form)
    source.grow()
    packed = {VOCPackReader(path).id(r) for r in range(len(VOCPackReader(path)))}
    bad = next(i for i in source.listed() if i not in packed)
    source.file("JPEGImages", bad).write_bytes(b"not an image")
    with pytest.raises(SourceDataError, match=bad):
        append_voc(source.root, path)
    result = append_voc(source.root, path, on_error="skip")
    assert [s.id for s in result.skipped] == [bad]
    assert result.report is not None and bad in result.report.read_text()
    fresh = pack_voc(
        source.root, tmp_path / out_name(form), year=YEAR, on_error="skip", **PACK_FORMS[form]
    )
    assert fresh.num_samples == result.num_samples
    for image_set in VOCPackReader(fresh.path).image_sets("Main"):
        assert list(VOCSerializedDataset(path, image_set=image_set).ids) == list(
            VOCSerializedDataset(fresh.path, image_set=image_set).ids
        )


def test_a_pack_of_transformed_images_compares_source_digests(tmp_path, source):
    path = pack(source, tmp_path / "pack", "shards", image_storage="raw", max_size=64)
    assert schema.DIGEST_ARRAY in VOCPackReader(path).reader.arrays()
    ids = source.listed()
    image = source.file("JPEGImages", ids[0])
    os.utime(image, ns=(image.stat().st_atime_ns, image.stat().st_mtime_ns + 10**9))
    assert append_voc(source.root, path).replaced == []  # touched, same content
    image.write_bytes(source.file("JPEGImages", ids[1]).read_bytes())
    with pytest.raises(SourceDataError, match=rf"JPEGImages/{ids[0]}\.jpg changed"):
        append_voc(source.root, path)
    assert append_voc(source.root, path, replace_changed=True).replaced == [ids[0]]
    fresh = pack(source, tmp_path / "fresh", "shards", image_storage="raw", max_size=64)
    for image_set in VOCPackReader(fresh).image_sets("Main"):
        a = VOCSerializedDataset(path, image_set=image_set, decode="none")
        b = VOCSerializedDataset(fresh, image_set=image_set, decode="none")
        assert [(as_bytes(x), y) for x, y in a] == [(as_bytes(x), y) for x, y in b]


# -- any sequence of source changes ----------------------------------------------------------------
_POOL = [f"{i:03d}" for i in range(8)]
_NAMES = ("dog", "cat", "helmet")
#: one step: each list's ids (duplicates allowed), and the ids whose annotation is rewritten
_step = st.tuples(
    st.lists(st.sampled_from(_POOL), min_size=1, max_size=8),
    st.lists(st.sampled_from(_POOL), max_size=6),
    st.lists(st.sampled_from(_POOL), max_size=2),
)


def _write_step(root: Path, step: tuple[list[str], list[str], list[str]], n: int) -> None:
    from vocfactory import Sample, jpeg, obj, voc_xml, write_voc

    train, val, edited = step
    samples = []
    for i, image_id in enumerate(_POOL):
        voc = root / "VOCdevkit" / f"VOC{YEAR}"
        xml = voc / "Annotations" / f"{image_id}.xml"
        if xml.exists() and image_id not in edited:
            continue  # untouched: same bytes, same time
        name = _NAMES[(i + n) % len(_NAMES)] if image_id in edited else _NAMES[i % 2]
        samples.append(
            Sample(
                image_id,
                jpeg(16 + i, 12, seed=i),
                voc_xml(f"{image_id}.jpg", 16 + i, 12, [obj(name, (1, 1, 9, 7))]),
            )
        )
    write_voc(root, YEAR, samples, {"Main": {"train": train, "val": val}})


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=st.lists(_step, min_size=1, max_size=3), form=st.sampled_from(sorted(PACK_FORMS)))
def test_any_sequence_of_changes_appends_to_what_a_full_pack_holds(tmp_path_factory, steps, form):
    tmp = tmp_path_factory.mktemp("seq")
    root = tmp / "src"
    _write_step(root, ([_POOL[0]], [], []), 0)
    path = pack_voc(root, tmp / out_name(form), year=YEAR, **PACK_FORMS[form]).path
    for n, step in enumerate(steps, start=1):
        _write_step(root, step, n)
        append_voc(root, path, replace_changed=True, retire_all=True)
        fresh = pack_voc(
            root, tmp / f"fresh{n}-{out_name(form)}", year=YEAR, **PACK_FORMS[form]
        ).path
        ours, theirs = VOCPackReader(path), VOCPackReader(fresh)
        assert ours.meta["splits"] == theirs.meta["splits"]
        assert ours.files() == theirs.files()
        for image_set in theirs.image_sets("Main"):
            a, b = ours.split("Main", image_set), theirs.split("Main", image_set)
            assert [ours.id(int(r)) for r in a] == [theirs.id(int(r)) for r in b]
            for ra, rb in zip(a.tolist(), b.tolist()):
                for field in (schema.IMAGE, schema.ANNOTATION, schema.TARGET):
                    assert bytes(ours.field(ra, field)) == bytes(theirs.field(rb, field))
                names_a = [ours.classes[c] for c in _class_ids(ours, ra)]
                names_b = [theirs.classes[c] for c in _class_ids(theirs, rb)]
                assert names_a == names_b
        assert sorted(ours.id(int(r)) for r in ours.live) == sorted(
            theirs.id(int(r)) for r in range(len(theirs))
        )
        assert open_pack(path).verify() == []


def test_max_file_bytes_bounds_the_files_an_append_reads(tmp_path, source, capsys):
    """An append reads new source files under the same cap as ``pack_voc`` (it was fixed
    at 1 GiB, and ``--max-file-size`` refused with ``--append``)."""
    source.cut()
    path = pack(source, tmp_path / "pack", "single")
    before = hashes(path)
    source.grow()
    with pytest.raises(SourceDataError, match="max_file_bytes|larger than"):
        append_voc(source.root, path, max_file_bytes=100)
    assert hashes(path) == before
    with pytest.raises(ValueError, match="max_file_bytes"):
        append_voc(source.root, path, max_file_bytes=0)
    out = _run_cli(["pack", str(source.root), str(path), "--append", "--max-file-size", "1GiB"])
    assert "appended to" in out and len(VOCPackReader(path)) == len(source.listed())


def _renamed_devkit(root: Path, out: Path, prefix: str) -> Path:
    """A copy of the devkit ``root`` whose every id carries ``prefix`` (files and lists)."""
    shutil.copytree(root, out)
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.parent.name in {
            "JPEGImages",
            "Annotations",
            "SegmentationClass",
            "SegmentationObject",
        }:
            path.rename(path.with_name(prefix + path.name))
        elif path.is_file() and path.suffix == ".txt":
            lines = path.read_text().splitlines()
            path.write_text("".join(f"{prefix}{line}\n" for line in lines if line.strip()))
    return out


@pytest.mark.parametrize("form", ["single", "shards"])
def test_an_append_from_an_unrelated_folder_is_refused(tmp_path, source, form):
    """A root that lists none of the pack's ids (the wrong folder, most likely) would retire
    every sample: refused, naming both and what to do, the pack left as it was, unless
    ``retire_all`` (``--retire-all``) says it is meant."""
    path = pack(source, tmp_path / "pack", form)
    before = snapshot(path)
    other = _renamed_devkit(source.root, tmp_path / "other", "x")
    with pytest.raises(SourceDataError, match="none of the .* ids .* retire every sample"):
        append_voc(other, path)
    status = main(["pack", str(other), str(path), "--append", "-q"])
    assert status != 0 and snapshot(path) == before
    assert main(["pack", str(other), str(path), "--append", "--retire-all", "-q"]) == 0
    ids = {VOCPackReader(path).id(int(r)) for r in VOCPackReader(path).live}
    assert ids == {"x" + i for i in source.listed()}


# -- GrowWriter itself, on a generic shard folder ----------------------------------------------
def _generic_folder(path: Path, ends: list[int], token: str | None = None) -> Any:
    """A shard folder of one field whose shards end after record counts ``ends``; its manifest."""
    from torch_serialized.container import spec as fmt
    from torch_serialized.container.manifest import read_manifest
    from torch_serialized.container.shardwriter import PackWriter

    with PackWriter(path, ["a"], shard_ends=ends, token=token) as writer:
        for i in range(ends[-1]):
            writer.add([bytes([i])])
    return read_manifest(path / fmt.MANIFEST_NAME)


def _grow(path: Path, manifest: Any, **options: Any) -> Any:
    from torch_serialized.container.append import GrowWriter

    limits = {"max_records_per_shard": None, "max_shard_bytes": None}
    return GrowWriter(
        path, manifest, np.empty(0, np.uint8), ["a"], columns=None, **{**limits, **options}
    )


def test_a_grow_without_limits_fills_new_shards_as_the_largest_existing_one(tmp_path):
    from torch_serialized.container import spec as fmt
    from torch_serialized.container.manifest import read_manifest

    path = tmp_path / "pack"
    manifest = _generic_folder(path, [3, 4])  # shards of 3 and 1 records
    with _grow(path, manifest) as writer:
        for _ in range(7):
            writer.add([b"new"])
    grown = read_manifest(path / fmt.MANIFEST_NAME)
    assert [s.num_records for s in grown.shards] == [3, 1, 3, 3, 1]


def test_a_grow_never_writes_over_a_file_of_its_new_names(tmp_path):
    """A token collision: a file the grow would write is there already, named by the manifest
    (a reader may hold it), so the grow stops naming it, and neither that file nor the pack
    changes."""
    path = tmp_path / "pack"
    manifest = _generic_folder(path, [2, 4], token="0badc0de")
    catalog = path / "catalog-0badc0de.tser"
    before = snapshot(path)
    writer = _grow(path, manifest, token="0badc0de")
    writer.add([b"new"])  # its new shard is shard-00002-0badc0de.tser: a free name
    with pytest.raises(WriteError, match=r"catalog-0badc0de\.tser exists; try again"):
        writer.close()
    assert manifest.catalog.file == catalog.name
    assert snapshot(path) == before


def test_a_failure_after_the_manifest_commit_keeps_the_grown_pack(tmp_path, monkeypatch, caplog):
    """Once the new manifest is in place its shards are the pack's: an error in the clean-up
    after it removes none of them, and is logged, not raised (it used to raise a WriteError
    saying "No partial output was left" for an append that had taken effect)."""
    import logging

    from torch_serialized.container import append as grow
    from torch_serialized.container import spec as fmt
    from torch_serialized.container.manifest import read_manifest
    from torch_serialized.container.shards import PackReader

    path = tmp_path / "pack"
    manifest = _generic_folder(path, [2, 4])

    real, calls = grow.strays, []

    def failing(folder: Any, keep: Any) -> Any:
        calls.append(1)
        if len(calls) > 1:  # the clean-up after the commit (the first: when the writer opens)
            raise OSError(5, "the disk went away", str(folder))
        return real(folder, keep)

    monkeypatch.setattr(grow, "strays", failing)
    with (
        caplog.at_level(logging.WARNING, "torch_serialized.container.append"),
        _grow(path, manifest) as w,
    ):
        for i in range(3):
            w.add([bytes([10 + i])])
    assert "appended, but files it no longer needs could not be removed" in caplog.text
    assert "the disk went away" in caplog.text
    monkeypatch.undo()
    grown = read_manifest(path / fmt.MANIFEST_NAME)
    assert grown.num_records == 7
    assert all((path / name).is_file() for name in grown.files())
    reader = PackReader(path)
    assert [bytes(reader.field(r, 0)) for r in range(7)] == [
        b"\0",
        b"\1",
        b"\2",
        b"\3",
        b"\n",
        b"\x0b",
        b"\x0c",
    ]
