"""find_voc_root and read_image_sets must see exactly the ids torchvision's datasets list."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from torchvision.datasets import VOCDetection, VOCSegmentation
from vocfactory import build_corner_case_devkit, real_voc_roots, real_voc_skip_reason, write_voc

import torch_serialized as ts
from torch_serialized.errors import SourceDataError
from torch_serialized.voc.layout import find_voc_root, read_image_sets

LONG_ID = "BMW_3-Series_2013_47_17_230_30_6_71_54_181_18_RWD_4_2_Convertible_ZFP"


def torchvision_ids(root: Path, year: str, task: str, image_set: str) -> list[str]:
    """The ids torchvision's dataset for ``task`` builds, from its image paths."""
    dataset_class = VOCDetection if task == "Main" else VOCSegmentation
    dataset = dataset_class(str(root), year=year, image_set=image_set)
    return [os.path.basename(path)[:-4] for path in dataset.images]


@pytest.fixture(scope="module")
def corner_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_corner_case_devkit(tmp_path_factory.mktemp("corner"))


def make_lists(tmp_path: Path, lists: dict[str, str], task: str = "Main") -> Path:
    """A VOC2012 folder holding only ImageSets/<task>/<name>.txt with the given raw texts."""
    return write_voc(tmp_path, "2012", [], {task: lists})


# --- the id lists, with torchvision as the oracle -----------------------------------------------


def test_corner_case_lists_match_torchvision(corner_root: Path) -> None:
    voc_root, year = find_voc_root(corner_root, None)
    lists = read_image_sets(voc_root)
    assert year == "2007"
    assert list(lists) == ["Main", "Segmentation"]
    assert list(lists["Main"]) == ["train", "val", "trainval", "test", "mini"]
    assert list(lists["Segmentation"]) == ["train", "val", "trainval"]
    for task, names in lists.items():
        for name in set(names) - {"mini"}:
            assert lists[task][name] == torchvision_ids(corner_root, year, task, name), (task, name)


def test_corner_case_list_quirks(corner_root: Path) -> None:
    main = read_image_sets(corner_root / "VOCdevkit" / "VOC2007")["Main"]
    train = main["train"]
    assert train.count("000001") == 2  # duplicates kept, in place
    assert train[0] == "000001" and train[-1] == "000001"
    assert all(i == i.strip() and "\r" not in i for i in train)  # CRLF, trailing blanks gone
    assert "1" in train and "0001" in main["val"] and LONG_ID in train  # ids stay strings
    assert "000003" in train and "000003" in main["val"]
    assert main["mini"] == ["000001", "000002"]  # a custom split
    assert "dog_train" not in main  # a per-class file


@pytest.mark.parametrize(
    "root_year", real_voc_roots() or [None], ids=lambda r: getattr(r and r[0], "name", "")
)
def test_real_voc_lists_match_torchvision(root_year: tuple[Path, str] | None) -> None:
    if root_year is None:
        pytest.skip(real_voc_skip_reason())
    root, year = root_year
    voc_root, found_year = find_voc_root(root, None)
    assert (voc_root, found_year) == (root / "VOCdevkit" / f"VOC{year}", year)
    lists = read_image_sets(voc_root)
    assert lists["Main"]
    for task, names in lists.items():
        for name, ids in names.items():
            assert ids == torchvision_ids(root, year, task, name), (task, name)


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("a\nb\n", ["a", "b"]),
        ("a\nb", ["a", "b"]),
        ("a\r\nb\r\n", ["a", "b"]),
        ("a\rb\r", ["a", "b"]),
        (" a \t\n\tb  \n", ["a", "b"]),
        ("1\n0001\n000001\n1\n", ["1", "0001", "000001", "1"]),
        ("", []),
        ("my image\n", ["my image"]),  # torchvision would open "JPEGImages/my image.jpg"
    ],
)
def test_list_texts_match_torchvision(tmp_path: Path, text: str, ids: list[str]) -> None:
    make_lists(tmp_path, {"train": text})
    assert read_image_sets(tmp_path / "VOCdevkit" / "VOC2012") == {"Main": {"train": ids}}
    assert torchvision_ids(tmp_path, "2012", "Main", "train") == ids


@pytest.mark.parametrize(
    ("text", "line"),
    [("a\n\nb\n", 2), ("a\nb\n\n", 3), ("\n", 1), ("a\n  \t\r\nb", 2), ("a\r\n\r\n", 2)],
)
def test_blank_line_is_refused_with_its_number(tmp_path: Path, text: str, line: int) -> None:
    make_lists(tmp_path, {"val": "x\n", "train": text})
    with pytest.raises(SourceDataError, match=rf"Main[/\\]train\.txt, line {line}: blank line"):
        read_image_sets(tmp_path / "VOCdevkit" / "VOC2012")
    assert "" in torchvision_ids(tmp_path, "2012", "Main", "train")  # torchvision: JPEGImages/.jpg


def test_custom_and_per_class_files(tmp_path: Path) -> None:
    """Only VOC's per-class files (every line an id and -1, 0 or 1) are skipped; every other
    `.txt` is a list of ids, its lines read as torchvision reads `train.txt` (an id may hold
    spaces): a custom split was dropped unseen when one of its ids held a space."""
    make_lists(
        tmp_path,
        {
            "train": "a\nb\n",
            "minival": "b\n",
            "empty": "",
            "aeroplane_train": "a -1\nb  1\n",
            "dog_val": "a 0\r\nb\t-1\n\n",
            "fold1": "my img 1\nb\n",
            "fold2": "my img\n",
            "notes": "made by hand\n",
        },
    )
    assert read_image_sets(tmp_path / "VOCdevkit" / "VOC2012") == {
        "Main": {
            "train": ["a", "b"],
            "empty": [],
            "fold1": ["my img 1", "b"],
            "fold2": ["my img"],
            "minival": ["b"],
            "notes": ["made by hand"],
        }
    }


def test_segmentation_only(tmp_path: Path) -> None:
    make_lists(tmp_path, {"val": "2007_000033\n"}, task="Segmentation")
    lists = read_image_sets(tmp_path / "VOCdevkit" / "VOC2012")
    assert lists == {"Segmentation": {"val": ["2007_000033"]}}


def test_missing_image_sets(tmp_path: Path) -> None:
    with pytest.raises(SourceDataError, match=r"ImageSets' does not exist\. Create ImageSets/Main"):
        read_image_sets(tmp_path)


def test_no_list_files(tmp_path: Path) -> None:
    make_lists(tmp_path, {"aeroplane_train": "a -1\n"})
    with pytest.raises(SourceDataError, match=r"No list files in .*ImageSets.*Create them"):
        read_image_sets(tmp_path / "VOCdevkit" / "VOC2012")


def test_byte_order_mark_is_refused(tmp_path: Path) -> None:
    make_lists(tmp_path, {"train": "\ufeffa\nb\n"})
    with pytest.raises(SourceDataError, match=r"train\.txt, line 1: starts with a byte order mark"):
        read_image_sets(tmp_path / "VOCdevkit" / "VOC2012")
    assert torchvision_ids(tmp_path, "2012", "Main", "train")[0] == "\ufeffa"


def test_non_utf8_list_is_refused(tmp_path: Path) -> None:
    voc_root = make_lists(tmp_path, {"train": "a\n"})
    (voc_root / "ImageSets" / "Main" / "train.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(SourceDataError, match=r"train\.txt: not UTF-8 text"):
        read_image_sets(voc_root)


# --- finding the VOC folder ---------------------------------------------------------------------


def test_find_from_torchvision_root_and_from_the_folder(corner_root: Path) -> None:
    voc_root = corner_root / "VOCdevkit" / "VOC2007"
    assert find_voc_root(corner_root, "2007") == (voc_root, "2007")
    assert find_voc_root(str(corner_root), None) == (voc_root, "2007")
    assert find_voc_root(voc_root, None) == (voc_root, "2007")
    assert find_voc_root(voc_root, "2007") == (voc_root, "2007")
    assert find_voc_root(corner_root / "VOCdevkit", None) == (voc_root, "2007")
    assert find_voc_root(corner_root / "VOCdevkit", "2007") == (voc_root, "2007")


def test_find_2011_under_trainval(tmp_path: Path) -> None:
    write_voc(tmp_path / "TrainVal", "2011", [], {"Main": {"train": ["a"]}})
    voc_root = tmp_path / "TrainVal" / "VOCdevkit" / "VOC2011"
    assert find_voc_root(tmp_path, "2011") == (voc_root, "2011")
    assert find_voc_root(tmp_path, None) == (voc_root, "2011")
    assert torchvision_ids(tmp_path, "2011", "Main", "train") == ["a"]
    write_voc(tmp_path, "2011", [], {"Main": {"train": ["b"]}})  # torchvision still reads TrainVal
    assert find_voc_root(tmp_path, "2011") == (voc_root, "2011")


def test_find_several_years_needs_a_year(tmp_path: Path) -> None:
    for year in ("2007", "2012"):
        write_voc(tmp_path, year, [], {"Main": {"train": ["a"]}})
    with pytest.raises(SourceDataError, match=r"several VOC folders .*VOC2007.*VOC2012.*year="):
        find_voc_root(tmp_path, None)
    assert find_voc_root(tmp_path, "2012") == (tmp_path / "VOCdevkit" / "VOC2012", "2012")


def test_find_not_found_lists_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(SourceDataError, match=r"No Pascal VOC 2012 folder found: looked for .*"):
        find_voc_root(tmp_path, "2012")
    with pytest.raises(SourceDataError, match=r"looked for VOCdevkit/VOC<year>"):
        find_voc_root(tmp_path, None)
    write_voc(tmp_path, "2007", [], {"Main": {"train": ["a"]}})
    with pytest.raises(SourceDataError, match=r"VOCdevkit[/\\]VOC2012"):
        find_voc_root(tmp_path, "2012")
    with pytest.raises(SourceDataError, match="not a directory"):
        find_voc_root(tmp_path / "missing", None)
    with pytest.raises(SourceDataError, match="4 digits"):
        find_voc_root(tmp_path, "07")


def test_a_year_not_there_names_the_years_that_are(tmp_path: Path) -> None:
    """``--year 2007`` on a root holding only VOC2012 listed where it looked, not what it found."""
    write_voc(tmp_path, "2012", [], {"Main": {"train": ["a"]}})
    found = tmp_path / "VOCdevkit" / "VOC2012"
    for root in (tmp_path, tmp_path / "VOCdevkit", found):
        with pytest.raises(SourceDataError, match="No Pascal VOC 2007 folder found") as info:
            find_voc_root(root, "2007")
        text = str(info.value)
        assert f"Found VOC2012 ({str(found)!r})" in text
        assert "pass year='2012'" in text
    write_voc(tmp_path, "2008", [], {"Main": {"train": ["a"]}})
    with pytest.raises(SourceDataError, match="Found VOC2008, VOC2012 ") as info:
        find_voc_root(tmp_path, "2007")
    assert "pass year='2008' or '2012' (--year on the command line)" in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SourceDataError, match="No Pascal VOC 2007 folder found") as info:
        find_voc_root(empty, "2007")
    assert "Found" not in str(info.value)


@pytest.mark.parametrize("year", [2012, 2012.0, b"2012", None])
def test_a_year_that_is_not_a_string_is_a_value_error_as_in_torchvision(
    tmp_path: Path, year: object
) -> None:
    """torchvision's VOCDetection refuses ``year=2012`` with ``ValueError`` ("Expected type
    str for argument year"); so does ``pack_voc``, naming the type and the string to pass
    (``SourceDataError`` is a ``ValueError``: ``except ValueError`` catches both alike)."""
    write_voc(tmp_path, "2012", [], {"Main": {"train": ["a"]}})
    if year is None:
        assert find_voc_root(tmp_path, None)[1] == "2012"
        return
    with pytest.raises(ValueError, match=f"year must be a string .*, got {type(year).__name__} "):
        find_voc_root(tmp_path, year)  # type: ignore[arg-type]
    with pytest.raises(ValueError) as info:
        ts.pack_voc(tmp_path, tmp_path / "out.tser", year=year)  # type: ignore[arg-type]
    assert "pass year='2012'" in str(info.value) and not (tmp_path / "out.tser").exists()


def test_corner_case_devkit_loads_in_torchvision(corner_root: Path) -> None:
    """Every listed sample of the factory's devkit opens in torchvision, quirks intact."""
    for image_set in ("trainval", "test"):
        dataset = VOCDetection(str(corner_root), year="2007", image_set=image_set)
        for index in range(len(dataset)):
            image, target = dataset[index]
            assert image.mode == "RGB" and isinstance(target["annotation"]["object"], list)
    test = VOCDetection(str(corner_root), year="2007", image_set="test")
    assert [Path(p).stem for p in test.images][1] == "000017"
    assert test[1][0].size == (64, 32)  # EXIF orientation 6 is not applied
    segmentation = VOCSegmentation(str(corner_root), year="2007", image_set="trainval")
    for index in range(len(segmentation)):
        image, mask = segmentation[index]
        assert mask.mode == "P" and mask.size == image.size
        assert set(np.unique(np.asarray(mask)).tolist()) <= {*range(21), 255}
