"""``images``, ``annotations``, ``masks``, ``targets`` and ``ids``: lazy read-only sequences
equal to torchvision's lists, on the corner-case devkit and on real data.

torchvision builds its paths from the ``root`` it is given; ours are relative to that root (a
pack does not know where its source folder was), so both sides are built with ``root=""``
from inside the devkit's root folder: then torchvision's lists are exactly ours.
"""

from __future__ import annotations

import os
import pickle
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from test_datasets import (
    CORNER_SETS,
    LAYOUTS,
    REAL_PARAMS,
    our_dataset,
    standard_sets,
    torchvision_dataset,
)

from torch_serialized.voc.names import RecordNames

if TYPE_CHECKING:
    from conftest import Packed

ATTRIBUTES = {
    "Main": ("images", "annotations", "targets"),
    "Segmentation": ("images", "masks", "targets"),
}


def assert_same_sequence(ours: Any, expected: list[str]) -> None:
    """``ours`` behaves as the list ``expected`` in every read-only way a list is used."""
    assert isinstance(ours, RecordNames)
    n = len(expected)
    assert len(ours) == n
    assert ours == expected and expected == ours
    assert not ours != expected  # noqa: SIM202 (__ne__ of its own)
    assert list(ours) == expected and [*iter(ours)] == expected
    for i in [*range(n), *range(-n, 0)]:
        assert ours[i] == expected[i]
    for i in (n, n + 3, -n - 1):
        with pytest.raises(IndexError):
            ours[i]
    for s in (
        slice(None, 3),
        slice(1, None, 2),
        slice(None, None, -1),
        slice(5, 2),
        slice(-4, None),
    ):
        part = ours[s]
        assert isinstance(part, RecordNames) and part == expected[s] and list(part) == expected[s]
        assert len(part) == len(expected[s])
    for value in {*expected[:3], *expected[-2:]}:
        assert value in ours
        assert ours.index(value) == expected.index(value)
        assert ours.count(value) == expected.count(value)
    assert "no/such/path.jpg" not in ours
    with pytest.raises(ValueError):
        ours.index("no/such/path.jpg")
    if n > 1:
        assert ours != expected[:-1] and ours != [*expected[:-1], "x"]
    assert ours != tuple(expected) or n == 0  # as a list: never equal to a tuple
    with pytest.raises(TypeError):
        ours[0] = "x"  # type: ignore[index]
    with pytest.raises(TypeError):
        hash(ours)


def check_attributes(task: str, root: Path, year: str, image_set: str, pack: Path) -> None:
    tv = torchvision_dataset(task, "", year, image_set)  # type: ignore[arg-type]
    ours = our_dataset(task, pack, image_set)
    for name in ATTRIBUTES[task]:
        assert_same_sequence(getattr(ours, name), getattr(tv, name))
    jpeg = os.path.join("VOCdevkit", f"VOC{year}", "JPEGImages", "")
    assert_same_sequence(ours.ids, [p[len(jpeg) : -len(".jpg")] for p in tv.images])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("task", "image_set"), CORNER_SETS)
def test_attributes_equal_torchvision_lists(
    corner_packs: Packed, monkeypatch: pytest.MonkeyPatch, task: str, image_set: str, layout: str
) -> None:
    monkeypatch.chdir(corner_packs.root)
    check_attributes(
        task, corner_packs.root, corner_packs.year, image_set, corner_packs.path(layout)
    )


@pytest.mark.parametrize(("root", "year"), REAL_PARAMS)
def test_attributes_equal_torchvision_lists_on_real_data(
    real_packs: Callable[[Path, str], Packed],
    monkeypatch: pytest.MonkeyPatch,
    root: Path,
    year: str,
) -> None:
    packed = real_packs(root, year)
    monkeypatch.chdir(root)
    for task, image_set in standard_sets(root, year):
        for layout in LAYOUTS:
            check_attributes(task, root, year, image_set, packed.path(layout))


def test_attributes_are_read_only_and_not_lists(corner_packs: Packed) -> None:
    ds = our_dataset("Main", corner_packs.single, "trainval")
    assert ds.images is ds.images  # one object per dataset, made at open
    for name in ("images", "annotations", "targets", "ids"):
        with pytest.raises(AttributeError):
            setattr(ds, name, [])
        assert not isinstance(getattr(ds, name), list)
        assert not hasattr(getattr(ds, name), "__dict__")  # slots only: no hidden list


def test_indexing_reads_the_id_table_once(corner_packs: Packed, monkeypatch) -> None:
    """O(1) access: the id table is looked up once, then each item is one slice of it."""
    ds = our_dataset("Main", corner_packs.shards, "trainval")
    calls = []
    table = type(ds.pack).id_table

    def counted(self: Any) -> Any:
        calls.append(1)
        return table(self)

    monkeypatch.setattr(type(ds.pack), "id_table", counted)
    names = ds.images
    for i in range(len(names)):
        names[i]
    list(names)
    assert len(calls) <= 1


def test_no_per_process_copy_of_the_names(synthetic_packs: Packed) -> None:
    """Indexing every name keeps nothing: memory after the loop is what it was before."""
    ds = our_dataset("Main", synthetic_packs.single, "trainval")
    names = ds.annotations
    names[0]  # the table is made once
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            for i in range(len(names)):
                names[i]
            for _name in names:
                pass
        assert tracemalloc.get_traced_memory()[0] - before < 1024
    finally:
        tracemalloc.stop()


def test_pickled_names_equal_and_repr(corner_packs: Packed) -> None:
    ds = our_dataset("Segmentation", corner_packs.shards, "trainval")
    names = ds.masks
    copy = pickle.loads(pickle.dumps(names))
    assert copy == names and list(copy) == list(names)
    assert pickle.loads(pickle.dumps(ds)).masks == names
    text = repr(names)
    assert text.startswith("RecordNames([") and repr(names[0]) in text
    if len(names) > 6:
        assert f"{len(names)} items" in text and "..." in text
    short: Sequence[str] = names[:2]
    assert repr(short) == f"RecordNames({list(short)!r})"
    six = names[:6]
    assert len(six) == 6 and repr(six) == f"RecordNames({list(six)!r})"  # 6 items: all shown
    # two slices of one pack: equal only when they hold the same records
    assert names[:2] != names[1:3] and list(names[:2]) != list(names[1:3])
    assert names[1:3] == names[1:3] and names[::-1][::-1] == names
