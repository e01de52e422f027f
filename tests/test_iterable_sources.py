"""VOCSerializedIterableDataset over several packs (issue #35): one epoch is every sample of
every source once, as ConcatDataset of torchvision's VOCDetection, split exactly across ranks and
workers, shuffled across sources; one label space for all sources."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.loopback import start_http_server
from torch.utils.data import ConcatDataset, DataLoader
from torchvision.datasets import VOCDetection, VOCSegmentation, wrap_dataset_for_transforms_v2
from vocfactory import real_voc_roots, real_voc_skip_reason

from torch_serialized import (
    VOCSerializedDataset,
    VOCSerializedIterableDataset,
    VOCSerializedSegmentation,
    pack_voc,
)
from torch_serialized.tools import make_synthetic_voc

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture(scope="module")
def two_years(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A VOC2007 devkit of 24 images and a VOC2012 one of 30 whose "dog" is renamed "helmet"
    (a class VOC lacks), each packed: 07 as one file, 12 as shards of 7."""
    tmp = tmp_path_factory.mktemp("sources")
    root07 = make_synthetic_voc(tmp / "v07", 24, year="2007", seed=1)
    root12 = make_synthetic_voc(tmp / "v12", 30, year="2012", seed=2)
    for xml in (root12 / "VOCdevkit" / "VOC2012" / "Annotations").glob("*.xml"):
        xml.write_text(xml.read_text().replace("<name>dog</name>", "<name>helmet</name>"))
    return {
        "roots": {"2007": root07, "2012": root12},
        "2007": pack_voc(root07, tmp / "voc07.tser", year="2007").path,
        "2012": pack_voc(root12, tmp / "voc12", year="2012", max_samples_per_shard=7).path,
    }


def key(image: Any, target: dict[str, Any]) -> tuple[str, str]:
    """A sample's identity: its pixels' hash and its target's text."""
    return hashlib.blake2b(image.tobytes(), digest_size=8).hexdigest(), repr(target)


def stream(packs: dict[str, Any], **kwargs: Any) -> VOCSerializedIterableDataset:
    kwargs.setdefault("block_size", 4)
    return VOCSerializedIterableDataset([packs["2007"], packs["2012"]], "trainval", **kwargs)


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_epoch_is_concat_of_torchvisions_datasets(two_years: dict[str, Any], shuffle: bool):
    roots = two_years["roots"]
    oracle = ConcatDataset(
        [VOCDetection(roots[year], year, "trainval") for year in ("2007", "2012")]
    )
    expected = Counter(key(*oracle[i]) for i in range(len(oracle)))
    ds = stream(two_years, shuffle=shuffle, seed=3)
    got = [key(image, target) for image, target in ds]
    assert len(ds) == len(oracle) == len(got)
    assert Counter(got) == expected
    if not shuffle:  # source after source, each in its list-file order, as ConcatDataset
        assert got == [key(*oracle[i]) for i in range(len(oracle))]
    else:  # mixed across sources, not one source after the other
        years = [target["annotation"]["folder"] for _, target in stream(two_years, shuffle=True)]
        first = years[: len(years) // 2]
        assert "VOC2007" in first and "VOC2012" in first


@pytest.mark.parametrize("world, workers", [(2, 2), (3, 1)])
def test_ranks_and_workers_split_several_sources_exactly(
    two_years: dict[str, Any], world: int, workers: int
) -> None:
    everything = Counter(key(*s) for s in stream(two_years))
    per_rank = []
    for rank in range(world):
        ds = stream(two_years, shuffle=True, seed=5, rank=rank, world_size=world, drop_last=True)
        loader = DataLoader(ds, batch_size=None, num_workers=workers, collate_fn=lambda s: s)
        per_rank.append([key(*s) for s in loader])
        assert len(per_rank[-1]) == len(ds)
    assert len({len(keys) for keys in per_rank}) == 1  # equal counts per rank
    seen = Counter(k for keys in per_rank for k in keys)
    assert max(seen.values()) == 1 and seen.keys() <= everything.keys()
    assert sum(seen.values()) == sum(everything.values()) // world * world  # drop_last's cut


def test_one_label_space_across_sources(two_years: dict[str, Any]) -> None:
    """Labels mean the same class in every source: the union of the sources' classes, the
    first source's first; a class one source lacks ("helmet" in VOC2007) is fine."""
    ds = stream(two_years, decode="none", target_format="tv_tensors")
    names = ds.label_names
    assert names[0] == "__background__" and "helmet" in names and "dog" in names
    assert names.index("helmet") > names.index("dog")  # VOC2007's classes come first
    dicts = stream(two_years, decode="none")
    for (_, tensors), (_, target) in zip(ds, dicts):
        objects = target["annotation"].get("object", [])
        assert [names[int(label)] for label in tensors["labels"]] == [o["name"] for o in objects]
    given = ["__background__", "helmet", *[n for n in names[1:] if n != "helmet"]]
    relabelled = stream(two_years, decode="none", target_format="tv_tensors", classes=given)
    assert relabelled.label_names == given


def test_sources_may_name_their_image_set(two_years: dict[str, Any]) -> None:
    ds = VOCSerializedIterableDataset(
        [(two_years["2007"], "train"), (two_years["2012"], "val")], "trainval"
    )
    roots = two_years["roots"]
    sizes = [len(VOCDetection(roots["2007"], "2007", "train"))]
    sizes.append(len(VOCDetection(roots["2012"], "2012", "val")))
    assert len(ds) == sum(sizes) == len(list(ds))
    assert "2007+2012" in repr(ds)


def test_a_resumed_epoch_over_several_sources_yields_the_rest(two_years: dict[str, Any]):
    full = [key(*s) for s in stream(two_years, shuffle=True, seed=9)]
    ds = stream(two_years, shuffle=True, seed=9)
    it = iter(ds)
    head = [key(*next(it)) for _ in range(11)]
    state = ds.state_dict()
    resumed = stream(two_years, shuffle=True, seed=9)
    resumed.load_state_dict(state)
    assert head + [key(*s) for s in resumed] == full
    other = VOCSerializedIterableDataset([two_years["2012"], two_years["2007"]], "trainval")
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="cannot resume"):
        next(iter(other))  # the sources in another order: other samples


@pytest.mark.parametrize("cls", [VOCSerializedIterableDataset, VOCSerializedDataset])
def test_a_bare_pair_or_nothing_is_refused_by_name(two_years: dict[str, Any], cls: type) -> None:
    with pytest.raises(ValueError, match="no sources"):
        cls([], image_set="trainval")
    with pytest.raises(TypeError, match="a path or URL, or a"):
        cls([(two_years["2007"], "train", "x")], image_set="trainval")
    with pytest.raises(TypeError, match=r"pass a list of it: \[\("):  # not two sources
        cls((two_years["2007"], "train"), image_set="trainval")


# -- map-style: several packs as ConcatDataset ---------------------------------------------------


def oracle_of(two_years: dict[str, Any], cls: type = VOCDetection, split: str = "trainval"):
    roots = two_years["roots"]
    return ConcatDataset([cls(roots[year], year, split) for year in ("2007", "2012")])


def test_the_map_style_dataset_of_several_packs_is_torchvisions_concat(two_years: dict[str, Any]):
    oracle = oracle_of(two_years)
    ds = VOCSerializedDataset([two_years["2007"], two_years["2012"]], image_set="trainval")
    assert len(ds) == len(oracle)
    for i in [*range(len(oracle)), -1, -len(oracle)]:
        (image, target), (want_image, want_target) = ds[i], oracle[i]
        assert target == want_target, i
        assert image.mode == want_image.mode and image.tobytes() == want_image.tobytes(), i
    sets = oracle.datasets
    want = [Path(path).name for path in [*sets[0].targets, *sets[1].targets]]
    assert [Path(path).name for path in ds.targets] == want and ds.ids[-1] == want[-1][:-4]
    assert [Path(path).name for path in ds.images[-2:]] == [
        Path(p).name for p in sets[1].images[-2:]
    ]
    assert ds.year == "2007+2012" and ds.image_set == "trainval"
    with pytest.raises(IndexError, match=rf"index {len(ds)} is out of range.*voc07.*voc12"):
        ds[len(ds)]
    # through worker processes (batches read with __getitems__) and the v2 wrapper
    loader = DataLoader(ds, batch_size=5, num_workers=2, collate_fn=lambda batch: batch)
    got = [key(*sample) for batch in loader for sample in batch]
    assert got == [key(*oracle[i]) for i in range(len(oracle))]
    wrapped = wrap_dataset_for_transforms_v2(ds)
    expected = wrap_dataset_for_transforms_v2(sets[1])[len(sets[1]) - 1]
    assert str(wrapped[-1][1]) == str(expected[1])


def test_map_style_labels_share_one_space_with_the_stream(two_years: dict[str, Any]) -> None:
    packs = [two_years["2007"], two_years["2012"]]
    options: dict[str, Any] = dict(decode="none", target_format="tv_tensors")
    ds = VOCSerializedDataset(packs, image_set="trainval", **options)
    assert ds.label_names == stream(two_years, **options).label_names
    names, dicts = ds.label_names, oracle_of(two_years)
    for i in range(len(ds)):
        objects = dicts[i][1]["annotation"].get("object", [])
        assert [names[int(label)] for label in ds[i][1]["labels"]] == [o["name"] for o in objects]


def test_the_map_style_segmentation_of_several_packs_is_torchvisions_concat(
    two_years: dict[str, Any],
) -> None:
    oracle = oracle_of(two_years, VOCSegmentation, "train")
    packs = [two_years["2007"], two_years["2012"]]
    ds = VOCSerializedSegmentation(packs, image_set="train")
    assert len(ds) == len(oracle) > 0
    for i in range(len(oracle)):
        (image, mask), (want_image, want_mask) = ds[i], oracle[i]
        assert image.tobytes() == want_image.tobytes()
        assert mask.tobytes() == want_mask.tobytes() and mask.getpalette() == want_mask.getpalette()
    # and streamed: every pair once an epoch, shuffled across the sources
    mask_key = [(key(image, None), key(mask, None)) for image, mask in oracle]
    streamed = VOCSerializedIterableDataset(packs, "train", task="Segmentation", shuffle=True)
    got = [(key(image, None), key(mask, None)) for image, mask in streamed]
    assert Counter(got) == Counter(mask_key) and got != mask_key


# -- weights and epoch_size ---------------------------------------------------------------------


def plan_of(ds: VOCSerializedIterableDataset, epoch: int = 0) -> list[int]:
    """The positions of one epoch, every rank and worker of one process: no I/O."""
    ds.set_epoch(epoch)
    return [int(p) for block in ds.blocks(0, 1) for p in block]


def test_weights_draw_each_source_in_proportion(two_years: dict[str, Any]) -> None:
    """Shares within 1% of the weights over 10,000 samples; a source whose share exceeds its
    size repeats each sample as evenly as possible; a smaller share is a seeded subset that
    changes with the epoch; the same (seed, epoch) draws the same."""
    ds = stream(two_years, shuffle=True, seed=4, weights=[3, 1], epoch_size=10_000)
    n07 = int(ds._offsets[1])  # VOC2007's positions come first
    assert len(ds) == 10_000
    plan = plan_of(ds)
    assert len(plan) == 10_000
    from07 = sum(p < n07 for p in plan)
    assert abs(from07 / 10_000 - 0.75) <= 0.01
    counts = Counter(p for p in plan if p < n07)
    assert max(counts.values()) - min(counts.values()) <= 1 and len(counts) == n07  # even
    small = stream(two_years, shuffle=True, seed=4, weights=[1, 1], epoch_size=10)
    first, second = plan_of(small, 0), plan_of(small, 1)
    assert sum(p < n07 for p in first) == 5 and len(set(first)) == 10  # a subset, no repeats
    assert first != second and plan_of(small, 0) == first  # changes with the epoch only
    again = stream(two_years, shuffle=True, seed=4, weights=[1, 1], epoch_size=10)
    assert plan_of(again, 1) == second


def test_a_weighted_epoch_is_split_exactly_and_reads_what_it_plans(two_years: dict[str, Any]):
    def ids(ds: VOCSerializedIterableDataset) -> Counter[tuple[str, str]]:
        return Counter(key(*s) for s in ds)

    everything = {key(*s) for s in stream(two_years)}
    whole = stream(two_years, shuffle=True, seed=2, weights=[1, 3], epoch_size=100)
    read = ids(whole)
    assert sum(read.values()) == 100 and set(read) <= everything
    parts = Counter[tuple[str, str]]()
    for rank in range(2):
        ds = stream(two_years, shuffle=True, seed=2, weights=[1, 3], epoch_size=100)
        ds.rank, ds.world_size = rank, 2
        loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=lambda s: s)
        got = [key(*s) for s in loader]
        assert len(got) == len(ds) == 50
        parts.update(got)
    assert parts == read  # the same draw, each drawn sample once across ranks and workers


def test_epoch_size_alone_keeps_the_sources_proportions(two_years: dict[str, Any]) -> None:
    ds = stream(two_years, epoch_size=9)
    n07, total = int(ds._offsets[1]), int(ds._offsets[-1])
    plan = plan_of(ds)
    assert len(plan) == 9 and sum(p < n07 for p in plan) == round(9 * n07 / total)


@pytest.mark.parametrize(
    "weights, epoch_size, match",
    [
        ([1], None, "1 values for 2 sources"),
        ([1, -1], None, "finite, >= 0"),
        ([0, 0], None, "not all 0"),
        ([1, float("nan")], None, "finite"),
        (None, 0, "epoch_size must be an int >= 1"),
        ([1, 1], 2.5, "epoch_size must be an int"),
    ],
)
def test_bad_weights_are_refused_by_name(two_years, weights, epoch_size, match) -> None:
    with pytest.raises(ValueError, match=match):
        stream(two_years, weights=weights, epoch_size=epoch_size)


def test_a_weighted_state_resumes_only_with_the_same_shares(two_years: dict[str, Any]) -> None:
    ds = stream(two_years, shuffle=True, seed=1, weights=[1, 2], epoch_size=30)
    full = [key(*s) for s in ds]
    it = iter(ds)
    head = [key(*next(it)) for _ in range(7)]
    state = ds.state_dict()
    assert state["shares"] == [10, 20]
    resumed = stream(two_years, shuffle=True, seed=1, weights=[1, 2], epoch_size=30)
    resumed.load_state_dict(state)
    assert head + [key(*s) for s in resumed] == full
    other = stream(two_years, shuffle=True, seed=1, weights=[2, 1], epoch_size=30)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="shares"):
        next(iter(other))


@pytest.mark.skipif(not real_voc_roots(), reason=real_voc_skip_reason())
def test_real_datasets_streamed_from_a_url_while_they_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real datasets packed into small shards and streamed from a loopback HTTP server
    through two DataLoader workers: prefetched shards checked as their bytes arrive and read
    while in flight (in one process here, 8 of them), far records by a range of their own.
    The multiset of their VOCDetections."""
    monkeypatch.setattr("torch_serialized.remote.arrival.FAR", 0)  # the shards are small
    roots = real_voc_roots()
    (tmp_path / "www").mkdir()
    for i, (root, year) in enumerate(roots):
        pack_voc(root, tmp_path / "www" / str(i), year=year, max_shard_bytes=1 << 20)
    image_set = "trainval"
    oracle = ConcatDataset([VOCDetection(root, year, image_set) for root, year in roots])
    with start_http_server(tmp_path / "www") as server:
        urls = [f"{server.url}/{i}" for i in range(len(roots))]
        ds = VOCSerializedIterableDataset(
            urls, image_set, shuffle=True, seed=3, cache_dir=tmp_path / "cache"
        )
        got = Counter(key(*s) for s in DataLoader(ds, batch_size=None, num_workers=2))
    assert got == Counter(key(*oracle[i]) for i in range(len(oracle)))
    assert sum(1 for _ in (tmp_path / "www").rglob("shard-*")) > 2 * len(roots)  # several each


@pytest.mark.skipif(not real_voc_roots(), reason=real_voc_skip_reason())
def test_every_real_dataset_in_one_stream(tmp_path: Path) -> None:
    """The real VOC-format datasets (custom classes, VOC2007 layouts, float boxes) streamed as
    one: the multiset of ConcatDataset of their VOCDetections, and one label space in which
    every object's label names its class."""
    roots = real_voc_roots()
    packs = [
        pack_voc(root, tmp_path / f"{i}.tser", year=year).path
        for i, (root, year) in enumerate(roots)
    ]
    image_set = "trainval"
    oracle = ConcatDataset([VOCDetection(root, year, image_set) for root, year in roots])
    ds = VOCSerializedIterableDataset(packs, image_set, shuffle=True, seed=7)
    assert Counter(key(*s) for s in ds) == Counter(key(*oracle[i]) for i in range(len(oracle)))
    concat = VOCSerializedDataset(packs, image_set=image_set)  # map-style: index for index
    assert len(concat) == len(oracle)
    assert all(key(*concat[i]) == key(*oracle[i]) for i in range(len(oracle)))
    tensors = VOCSerializedIterableDataset(packs, image_set, target_format="tv_tensors")
    dicts = VOCSerializedIterableDataset(packs, image_set, decode="none")
    names = tensors.label_names
    for (_, t), (_, d) in zip(tensors, dicts):
        objects = d["annotation"].get("object", [])
        assert [names[int(label)] for label in t["labels"]] == [o["name"] for o in objects]
