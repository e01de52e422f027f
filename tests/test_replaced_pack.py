"""A dataset opened before its pack is replaced (re-packed to the same path, or appended to)
keeps reading the pack it opened, exactly, through every read path: ``__getitem__`` (views),
``__getitems__`` (read hints, then views) and the iterable (cache probes, read hints and
scatter reads), which are what a DataLoader's persistent workers run. README, "Updating a
pack"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _reliability_helpers import PACK_FORMS, out_name

from torch_serialized import (
    VOCSerializedDataset,
    VOCSerializedIterableDataset,
    append_voc,
    pack_voc,
)
from torch_serialized.tools import make_synthetic_voc


def key(sample: tuple[Any, Any]) -> tuple[bytes, str]:
    """A decode="none" sample: its stored image bytes and its target."""
    image, target = sample
    return image.numpy().tobytes(), json.dumps(target, sort_keys=True)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("replaced-sources")
    return {
        "old": make_synthetic_voc(folder / "old", 10, year="2007"),
        "grown": make_synthetic_voc(folder / "grown", 14, year="2007"),  # same first ten
        "other": make_synthetic_voc(folder / "other", 6, year="2007", seed=3),
    }


@pytest.mark.parametrize("change", ["repack", "append"])
@pytest.mark.parametrize("form", PACK_FORMS)
def test_a_dataset_opened_before_a_replace_reads_the_old_pack(tmp_path, sources, form, change):
    out = tmp_path / out_name(form)
    pack_voc(sources["old"], out, year="2007", **PACK_FORMS[form])
    ds = VOCSerializedDataset(out, image_set="trainval", decode="none")
    it = VOCSerializedIterableDataset(out, "trainval", decode="none")
    n = len(ds)
    old = [key(ds[i]) for i in range(n)]  # maps every shard of a folder; no other read yet
    for s in range(it.pack.reader.num_shards):
        it.pack.reader.shard(s)  # a shard first mapped after a re-pack is refused (by design)

    if change == "repack":
        pack_voc(sources["other"], out, year="2007", **PACK_FORMS[form])
    else:
        append_voc(sources["grown"], out, replace_changed=True)
    assert (
        len(VOCSerializedDataset(out, image_set="trainval", decode="none")) != n
    )  # a new pack there

    assert [key(ds[i]) for i in range(n)] == old
    assert [key(s) for s in ds.__getitems__(list(range(n))[::-1])] == old[::-1]
    assert sorted(key(s) for s in it) == sorted(old)
