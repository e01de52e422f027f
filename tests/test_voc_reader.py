"""VOCPackReader: a pack seen through the VOC schema, and refusals of what is not a VOC pack."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _container_helpers import Contents, rebuild_pack
from torchvision.datasets import VOCDetection

from torch_serialized import (
    SerializedDataset,
    VOCSerializedDataset,
    VOCSerializedIterableDataset,
    VOCSerializedSegmentation,
    append_voc,
    export_voc,
    open_pack,
)
from torch_serialized.cli import main
from torch_serialized.container.shardwriter import PackWriter
from torch_serialized.data import iterable
from torch_serialized.errors import ChecksumError, FormatError, UnsupportedVersionError
from torch_serialized.voc import schema
from torch_serialized.voc.classes import label_classes
from torch_serialized.voc.packed import VOCPackReader


def test_ids_splits_and_columns_are_the_source_s(synthetic_packs: Any) -> None:
    for layout in ("single", "shards"):
        pack = VOCPackReader(synthetic_packs.path(layout))
        assert pack.year == "2007" and pack.base_dir == "VOCdevkit/VOC2007"
        assert sorted(pack.image_sets("Main")) == ["test", "train", "trainval", "val"]
        tv = VOCDetection(synthetic_packs.root, "2007", "val")
        ids = [pack.id(int(r)) for r in pack.split("Main", "val")]
        assert ids == [Path(p).stem for p in tv.images]
        assert len(pack.columns) == len(pack) and set(pack.columns.dtype.names) >= {"width"}


def test_list_files_come_back_byte_for_byte(synthetic_packs: Any) -> None:
    files = VOCPackReader(synthetic_packs.single).files()
    voc = synthetic_packs.root / "VOCdevkit" / "VOC2007"
    on_disk = {p.relative_to(voc).as_posix() for p in (voc / "ImageSets").rglob("*.txt")}
    assert set(files) == on_disk
    for name, data in files.items():
        assert (voc / name).read_bytes() == data


def test_an_unknown_image_set_names_the_ones_there(synthetic_packs: Any) -> None:
    pack = VOCPackReader(synthetic_packs.single)
    with pytest.raises(ValueError, match=r"'nope' is not in .*'train'.*pick one of those"):
        pack.split("Main", "nope")


def forge(path: Path, fields: tuple[str, ...] = schema.FIELDS, **user: Any) -> Path:
    """A pack without records whose user metadata is ``user`` (by default, the VOC keys and
    arrays a reader needs)."""
    meta = {
        "schema": schema.SCHEMA,
        "schema_version": schema.SCHEMA_VERSION,
        "year": "2007",
        "base_dir": "VOCdevkit/VOC2007",
        "voc_folder": "VOC2007",
        "num_samples": 0,
        "splits": {},
        "classes": [],
        "image_storage": "original",
        **user,
    }
    with PackWriter(path, fields, columns=schema.COLUMNS) as writer:
        writer.add_array("ids", np.zeros(0, np.uint8))
        writer.add_array("id_offsets", np.zeros(1, "<u8"))
        writer.close({k: v for k, v in meta.items() if v is not None})
    return path


def test_a_forged_minimal_pack_opens(tmp_path: Path) -> None:
    pack = VOCPackReader(forge(tmp_path / "ok.tser"))
    assert len(pack) == 0 and pack.classes == [] and pack.image_storage == "original"


@pytest.mark.parametrize(
    ("fields", "user", "message"),
    [
        (schema.FIELDS, {"schema": None}, "not a VOC pack"),
        (schema.FIELDS, {"schema": "coco"}, "not a VOC pack"),
        (schema.FIELDS, {"schema_version": schema.SCHEMA_VERSION + 1}, "newer than this"),
        (schema.FIELDS, {"schema_version": "1"}, r"'schema_version'.*an integer from 1.*'1'"),
        (schema.FIELDS, {"schema_version": 0}, r"'schema_version'.*an integer from 1.*found 0"),
        (schema.FIELDS, {"schema_version": -1}, r"'schema_version'.*found -1; .*re-pack it"),
        (("image", "target"), {}, r"'fields'.*expected \['image', 'annotation'"),
    ],
)
def test_what_is_not_a_voc_pack_is_refused(
    tmp_path: Path, fields: tuple[str, ...], user: dict[str, Any], message: str
) -> None:
    """Only a version above ours says "upgrade" (``UnsupportedVersionError``); any other
    value is damage, never a reason to upgrade."""
    path = forge(tmp_path / "x.tser", fields, **user)
    with pytest.raises(FormatError, match=message) as info:
        VOCPackReader(path)
    assert str(path) in str(info.value)
    newer = isinstance(info.value, UnsupportedVersionError)
    assert newer == ("upgrade" in str(info.value)) == (message == "newer than this")


def _member_file(folder: Path, member: str) -> Path:
    return sorted(folder.glob(f"{member}-*.tser"))[-1]


@pytest.mark.parametrize(
    ("member", "what"), [("shard", "shard 3 of 3"), ("catalog", "the catalog")]
)
def test_one_file_of_a_shard_folder_names_the_pack_to_pass(
    tmp_path: Path, tiny_root: Path, tiny_packs: dict[str, Path], member: str, what: str
) -> None:
    """Every VOC reader refuses a shard or catalog, saying whose it is, never that the
    (healthy) pack is damaged or needs re-packing."""
    folder = tiny_packs["shards"]
    path = _member_file(folder, member)
    opens = [
        VOCPackReader,
        VOCSerializedDataset,
        VOCSerializedIterableDataset,
        lambda p: export_voc(p, tmp_path / "out"),
        lambda p: append_voc(tiny_root, p),
    ]
    for open_ in opens:
        with pytest.raises(FormatError) as info:
            open_(path)
        message = str(info.value)
        assert message == (
            f"{path} is {what} of the pack at {folder}, not a pack by itself; "
            f"pass the folder {folder}"
        )
    assert not (tmp_path / "out").exists()


def test_an_earlier_catalog_or_a_copied_out_shard_says_so(
    tmp_path: Path, tiny_packs: dict[str, Path]
) -> None:
    folder = tmp_path / "pack"
    shutil.copytree(tiny_packs["shards"], folder)
    catalog = _member_file(folder, "catalog")
    earlier = folder / "catalog-00000000.tser"  # as an append keeps the previous one
    shutil.copyfile(catalog, earlier)
    with pytest.raises(
        FormatError, match=f"a catalog of an earlier version of the pack at {folder}"
    ):
        VOCPackReader(earlier)
    alone = tmp_path / "alone.tser"
    shutil.copyfile(_member_file(folder, "shard"), alone)
    with pytest.raises(FormatError, match="shard 3 of a shard folder .* belongs to") as info:
        VOCPackReader(alone)
    assert "re-pack" not in str(info.value)


# -- issue #11 item 5: the VOC schema is validated at open, never trusted -------------------
def _user(**changes: Any) -> Any:
    def edit(c: Contents) -> None:
        for key, value in changes.items():
            if value is _DELETE:
                del c.user[key]
            else:
                c.user[key] = value

    return edit


def _array(name: str, value: Any) -> Any:
    def edit(c: Contents) -> None:
        if value is _DELETE:
            del c.arrays[name]
        else:
            c.arrays[name] = value(c.arrays[name]) if callable(value) else value

    return edit


_DELETE = object()
_SPLIT = "split/Main/train"


def _ids_not_utf8(c: Contents) -> None:
    c.arrays["ids"] = c.arrays["ids"].copy()
    c.arrays["ids"][0] = 0xFF


def _label_base(change: Any, prefix: int | None = None) -> Any:
    """Metadata ``label_base`` as the first append writes it for the pack's first ``prefix``
    classes, then ``change(base)``."""

    def edit(c: Contents) -> None:
        before = c.user["classes"][:prefix]
        base = {rule: label_classes(rule, before, None) for rule in ("default", "packed")}
        change(base)
        c.user["label_base"] = base

    return edit


def _retired(records: Any) -> Any:
    """Retired records ``records(contents)`` (with the schema version they need)."""

    def edit(c: Contents) -> None:
        c.user["schema_version"] = max(c.user["schema_version"], schema.RETIRED_SCHEMA_VERSION)
        c.arrays[schema.RETIRED_ARRAY] = records(c)

    return edit


METADATA_CASES = {
    "year missing": (_user(year=_DELETE), "'year'"),
    "year a number": (_user(year=2007), "'year'"),
    "classes missing": (_user(classes=_DELETE), "'classes'"),
    "classes a string": (_user(classes="dogcat"), "'classes'"),
    "classes repeated": (_user(classes=["dog", "dog"]), "'classes'"),
    "splits null": (_user(splits=None), "'splits'"),
    "splits of another task": (_user(splits={"Layout": {}}), "'splits'"),
    "split count a string": (_user(splits={"Main": {"train": "3"}}), "splits.Main"),
    "image_storage unknown": (_user(image_storage="jpeg"), "'image_storage'"),
    "max_size negative": (_user(max_size=-1), "'max_size'"),
    "num_samples wrong": (_user(num_samples=5), "'num_samples'"),
    "base_dir a number": (_user(base_dir=3), "'base_dir'"),
    "class_counts of a class not packed": (
        _user(class_counts={"Main/train": {"unicorn": 1}}),
        "'class_counts'",
    ),
    "options a list": (_user(options=[]), "'options'"),
    "options.max_samples_per_shard a string": (
        _user(options={"max_samples_per_shard": "x"}),
        "'options.max_samples_per_shard'",
    ),
    "options.max_shard_bytes 0": (_user(options={"max_shard_bytes": 0}), "options.max_shard"),
    "options.max_samples_per_shard 1.5": (
        _user(options={"max_samples_per_shard": 1.5}),
        "options.max_samples",
    ),
    "label_base with a phantom class": (
        _label_base(lambda b: b["packed"].insert(0, "ghost")),
        "'label_base'",
    ),
    "label_base lacking a class": (_label_base(lambda b: b["default"].pop(0)), "'label_base'"),
    "label_base packed not sorted": (
        _label_base(lambda b: b["packed"].reverse()),
        "'label_base'",
    ),
    "source_bytes a string": (_user(source_bytes="abc"), "'source_bytes'"),
    "source_bytes negative": (_user(source_bytes=-1), "'source_bytes'"),
    "ids missing": (_array("ids", _DELETE), "'ids'"),
    "ids not UTF-8": (_ids_not_utf8, "'ids'"),
    "id_offsets missing": (_array("id_offsets", _DELETE), "'id_offsets'"),
    "id_offsets shifted": (_array("id_offsets", lambda a: a + 1), "'id_offsets'"),
    "id_offsets descending": (_array("id_offsets", lambda a: a[::-1].copy()), "'id_offsets'"),
    "a split lists record 10**9": (_array(_SPLIT, lambda a: a + 10**9), _SPLIT),
    "a split lists record -1": (_array(_SPLIT, lambda a: a - 100), _SPLIT),
    "a split of int32": (_array(_SPLIT, lambda a: a.astype("<i4")), _SPLIT),
    "a split missing": (_array(_SPLIT, _DELETE), "'splits'"),
    "a split not in the metadata": (_array("split/Main/extra", np.zeros(0, "<i8")), "'splits'"),
    "columns missing": (_array("records", _DELETE), "'records'"),
    "a split lists a retired record": (_retired(lambda c: c.arrays[_SPLIT][:1]), _SPLIT),
    "retired past the records": (
        _retired(lambda c: np.array([len(c.records)], "<i8")),
        "'retired'",
    ),
    "retired -1": (_retired(lambda c: np.array([-1], "<i8")), "'retired'"),
    "retired descending": (_retired(lambda c: np.array([4, 3], "<i8")), "'retired'"),
    "retired of int32": (_retired(lambda c: np.array([3], "<i4")), "'retired'"),
    "a list file of int32": (
        _array("file/ImageSets/Main/train.txt", np.zeros(2, "<i4")),
        "file/ImageSets",
    ),
}


@pytest.mark.parametrize("form", ["single", "shards"])
@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_invalid_voc_metadata_is_refused_at_open_naming_the_field(
    tmp_path: Path, tiny_packs: dict[str, Path], form: str, case: str
) -> None:
    """Issue #11 item 5: missing keys, wrong types, out-of-range split records... raised
    KeyError, AttributeError, IndexError or read silently wrong labels; now every reader
    refuses them at open with FormatError naming the file and the field."""
    edit, field = METADATA_CASES[case]
    limits = {"max_records_per_shard": 2} if form == "shards" else {}
    path = rebuild_pack(tiny_packs[form], tmp_path / "bad", edit, **limits)
    for open_it in (
        lambda: VOCPackReader(path),
        lambda: VOCSerializedDataset(path, image_set="train"),
        lambda: VOCSerializedIterableDataset(path, "train"),
        lambda: SerializedDataset(path),
    ):
        with pytest.raises(FormatError) as info:
            open_it()
        assert str(path) in str(info.value) and field in str(info.value)


def test_a_valid_rebuild_opens(tmp_path: Path, tiny_packs: dict[str, Path]) -> None:
    """The edits above start from a pack that reads: only the edit is refused."""
    path = rebuild_pack(tiny_packs["single"], tmp_path / "same.tser")
    assert len(VOCSerializedDataset(path, image_set="trainval")) == 6


def test_a_label_base_of_the_first_classes_opens(
    tmp_path: Path, tiny_packs: dict[str, Path]
) -> None:
    """``label_base`` as an append writes it: the lists of a prefix of the classes (those the
    pack had then); the classes after it get the next labels."""
    classes = VOCPackReader(tiny_packs["single"]).classes
    path = rebuild_pack(tiny_packs["single"], tmp_path / "base.tser", _label_base(id, 1))
    data = VOCSerializedDataset(
        path, image_set="trainval", target_format="tv_tensors", classes="packed"
    )
    assert data.label_names == ["__background__", *classes]  # new classes after, in pack order


def _objects(record: int, class_id: int) -> Any:
    def edit(c: Contents) -> None:
        rows = np.frombuffer(c.records[record][schema.OBJECTS], schema.OBJECT_DTYPE).copy()
        rows["class_id"] = class_id
        c.records[record][schema.OBJECTS] = rows.tobytes()

    return edit


def _field(record: int, field: int, data: bytes) -> Any:
    def edit(c: Contents) -> None:
        c.records[record][field] = data

    return edit


READ_CASES = {
    "class id 99": (_objects(1, 99), "tv_tensors", "classes"),
    "class id -1": (_objects(1, -1), "tv_tensors", "classes"),
    "target not JSON": (_field(1, schema.TARGET, b"{not json"), "dict", "not valid JSON"),
    "target a list": (_field(1, schema.TARGET, b"[1, 2]"), "dict", "not a JSON object"),
}


def _flags(record: int, flags: int) -> Any:
    def edit(c: Contents) -> None:
        c.arrays["records"]["flags"][record] = flags

    return edit


COLUMN_CASES = {
    "objects not whole rows": (_field(1, schema.OBJECTS, b"\x00" * 5), "num_objects rows"),
    "a row more than counted": (
        lambda c: c.records[1].__setitem__(schema.OBJECTS, c.records[1][schema.OBJECTS] * 2),
        "num_objects rows",
    ),
    "a mask without its flag": (_field(1, schema.MASK, b"x"), "a mask exactly when flag 2"),
    "flag 2 without a mask": (_flags(1, 1 | 2), "a mask exactly when flag 2"),
    "an object mask without its flag": (
        _field(1, schema.OBJECT_MASK, b"x"),
        "an object mask exactly when flag 4",
    ),
    "annotation bytes without flag 1": (_flags(1, 0), "annotation bytes only when flag 1"),
    "no annotation bytes for flag 1": (
        _field(1, schema.ANNOTATION, b""),
        "annotation bytes when flag 1 is set without flag 16",
    ),
    "no target for flag 1": (_field(1, schema.TARGET, b""), "a target exactly when flag 1"),
    "a target without flag 1": (
        lambda c: (_flags(1, 0)(c), _field(1, schema.ANNOTATION, b"")(c)),
        "a target exactly when flag 1",
    ),
}


@pytest.mark.parametrize("form", ["single", "shards"])
@pytest.mark.parametrize("case", sorted(COLUMN_CASES))
def test_record_columns_that_contradict_the_fields_are_refused(
    tmp_path: Path, tiny_packs: dict[str, Path], form: str, case: str
) -> None:
    """The ``records`` columns say what each record holds (export, counts and ``tv_tensors``
    targets go by them); columns its own bytes contradict, in a pack whose checksums are all
    valid, are refused: a single file at open, a shard when it is first read (and by
    ``verify``), naming the file and the record."""
    edit, expected = COLUMN_CASES[case]
    limits = {"max_records_per_shard": 2} if form == "shards" else {}
    path = rebuild_pack(tiny_packs[form], tmp_path / "bad", edit, **limits)
    match = rf"record 1's columns contradict its fields.*expected {expected}"
    if form == "single":
        for open_it in (VOCPackReader, lambda p: VOCSerializedDataset(p, image_set="train")):
            with pytest.raises(FormatError, match=match) as info:
                open_it(path)
            assert str(path) in str(info.value)
    else:
        dataset = VOCSerializedDataset(path, image_set="trainval", decode="none")
        index = [int(r) for r in dataset.records].index(1)
        with pytest.raises(FormatError, match=match) as info:
            dataset[index]
        assert "shard 0 named by" in str(info.value)
    assert main(["verify", str(path)]) == 1


@pytest.mark.parametrize("case", sorted(READ_CASES))
def test_a_damaged_record_raises_our_error_naming_it_on_every_read_path(
    tmp_path: Path, tiny_packs: dict[str, Path], case: str
) -> None:
    """Per-record content is checked as it is read: class id -1 used to label an object with
    the last class, 99 raised IndexError (and ended ``for x in dataset`` early)."""
    edit, target_format, message = READ_CASES[case]
    path = rebuild_pack(tiny_packs["single"], tmp_path / "bad.tser", edit)
    pack = VOCPackReader(path)
    where = f"record 1 (id {pack.id(1)!r})"
    classes = "packed" if target_format == "tv_tensors" else None
    dataset = VOCSerializedDataset(
        path, image_set="train", target_format=target_format, classes=classes
    )
    assert int(dataset.records[1]) == 1
    dataset[0]  # the other records read
    with pytest.raises(FormatError, match=message) as info:
        dataset[1]
    assert str(path) in str(info.value) and where in str(info.value)
    with pytest.raises(FormatError):  # iteration does not stop early: it raises
        list(dataset)
    stream = VOCSerializedIterableDataset(
        path, "train", target_format=target_format, classes=classes
    )
    with pytest.raises(FormatError, match=message):
        list(stream)


def test_info_on_a_damaged_pack_exits_2_with_one_line(
    tmp_path: Path, tiny_packs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``torch-serialized info`` died with a traceback and exit 1 (verify's "damaged" status)
    on a class id out of range (info counts classes from the catalog's class ids, not from
    the records' objects fields: those are the readers' and verify's to check)."""
    out_of_range = _array(schema.OBJECT_CLASSES_ARRAY, lambda a: np.full_like(a, 99))
    for case, edit in (("ids", _array("id_offsets", _DELETE)), ("classes", out_of_range)):
        path = rebuild_pack(tiny_packs["single"], tmp_path / f"{case}.tser", edit)
        assert main(["info", str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and str(path) in err


@pytest.mark.parametrize("form", ["single", "shards"])
def test_a_checked_read_of_a_damaged_record_names_the_sample(
    tmp_path: Path, tiny_packs: dict[str, Path], form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``checked=True`` named only the file's own record number ("record 3" of a shard,
    neither the pack's record nor the id): every read path now names the pack, the record,
    its id and the field, and the file the damage is in. A stream reads views of tiny packs
    and copies (``read_records``) of packs with many shards: both paths are checked."""
    path = tmp_path / "pack"
    if form == "single":
        shutil.copyfile(tiny_packs[form], path)
    else:
        shutil.copytree(tiny_packs[form], path)
    record = 3
    container, local = open_pack(path).locate(record)
    offset = int(container.index_rows([local])["offset"][0, schema.IMAGE])
    with open(container.path, "r+b") as f:  # one byte of the record's image, flipped
        f.seek(offset + 10)
        byte = f.read(1)[0]
        f.seek(offset + 10)
        f.write(bytes([byte ^ 0xFF]))
    id_ = VOCPackReader(path).id(record)
    dataset = VOCSerializedDataset(path, image_set="trainval", checked=True, decode="none")
    index = [int(r) for r in dataset.records].index(record)
    segmentation = VOCSerializedSegmentation(path, image_set="val", checked=True)
    assert int(segmentation.records[0]) == record
    named = rf"record {record} \(id '{id_}'\): its image field fails its checksum"
    named += r" \(in .*shard-.*\.tser\); " if form == "shards" else "; "
    reads = {
        "getitem": lambda: dataset[index],
        "getitems": lambda: dataset.__getitems__([0, index]),
        "segmentation": lambda: segmentation[0],
        "stream": lambda: list(
            VOCSerializedIterableDataset(path, "trainval", checked=True, decode="none")
        ),
        "export": lambda: export_voc(path, tmp_path / "out"),
        "stream (copies)": lambda: list(
            VOCSerializedIterableDataset(path, "trainval", checked=True, decode="none")
        ),
    }
    for name, read in reads.items():
        if name == "stream (copies)":
            monkeypatch.setattr(iterable, "views_fit", lambda reader, in_flight: False)
        with pytest.raises(ChecksumError, match=named) as info:
            read()
        assert str(path) in str(info.value), name
        assert info.value.record == record and info.value.field == "image"
    assert open_pack(path).verify() == [record]
