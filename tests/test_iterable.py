"""Contracts of VOCSerializedIterableDataset: exact samples, exactly-once splits, order, resume."""

from __future__ import annotations

import hashlib
import json
import pickle
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _reliability_helpers import traced_peak
from torch.utils.data import DataLoader
from torchvision.transforms.functional import pil_to_tensor

import torch_serialized
import torch_serialized.data.pipeline
import torch_serialized.data.workers
from torch_serialized.data.datasets import VOCSerializedDataset, VOCSerializedSegmentation
from torch_serialized.data.iterable import VOCSerializedIterableDataset
from torch_serialized.data.topology import Topology

# DataLoader warns when asked for more workers than this machine's suggested maximum.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

NUM_IMAGES = 60


def digest(image: torch.Tensor) -> str:
    """Identity of a sample read with decode="none": a hash of its stored image bytes."""
    return hashlib.blake2b(image.numpy().tobytes(), digest_size=8).hexdigest()


def drop(target: Any) -> int:
    return 0


@pytest.fixture(scope="module")
def positions_of(stream_packs: dict[str, Path]) -> dict[tuple[str, str], dict[str, int]]:
    """digest -> position, per (pack kind, image set), from the map-style dataset."""
    table = {}
    for kind, path in stream_packs.items():
        for image_set in ("train", "trainval", "test"):
            ds = VOCSerializedDataset(path, image_set=image_set, decode="none", transform=digest)
            table[kind, image_set] = {ds[i][0]: i for i in range(len(ds))}
            assert len(table[kind, image_set]) == len(ds)
    return table


def cheap(path: Path, image_set: str, **kwargs: Any) -> VOCSerializedIterableDataset:
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("shuffle_buffer", 6)
    return VOCSerializedIterableDataset(
        path,
        image_set,
        decode="none",
        target_format="tv_tensors",
        transform=digest,
        target_transform=drop,
        **kwargs,
    )


def read_ids(ds: VOCSerializedIterableDataset, workers: int) -> list[str]:
    if workers == 0:
        return [d for d, _ in ds]
    return [d for d, _ in DataLoader(ds, batch_size=None, num_workers=workers)]


def expected_counts(n: int, world: int, drop_last: bool) -> tuple[int, int]:
    """(samples per rank, samples in all) as DistributedSampler."""
    per_rank = n // world if drop_last else -(-n // world)
    return per_rank, per_rank * world


# -- exactly once -----------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "kind,image_set,shuffle",
    [
        ("single", "trainval", False),
        ("single", "trainval", True),
        ("shards", "test", False),
        ("shards", "trainval", True),
    ],
)
def test_every_sample_once_plus_padding(
    stream_packs, positions_of, kind, image_set, shuffle, world, workers
) -> None:
    table = positions_of[kind, image_set]
    n = len(table)
    per_rank, total = expected_counts(n, world, drop_last=False)
    seen: list[int] = []
    for rank in range(world):
        ds = cheap(stream_packs[kind], image_set, shuffle=shuffle, rank=rank, world_size=world)
        ds.set_epoch(1)
        got = [table[d] for d in read_ids(ds, workers)]
        assert len(got) == len(ds) == per_rank
        planned = [
            int(p) for w in range(max(workers, 1)) for b in ds.blocks(w, max(workers, 1)) for p in b
        ]
        assert Counter(got) == Counter(planned)
        seen += got
    counts = Counter(seen)
    assert set(counts) == set(range(n))
    assert len(seen) == total
    assert sum(c - 1 for c in counts.values()) == total - n
    if not shuffle and world == 1 and workers == 0:
        assert seen == list(range(n))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("workers", [0, 2])
def test_drop_last_delivers_each_sample_at_most_once(
    stream_packs, positions_of, world, workers
) -> None:
    table = positions_of["shards", "trainval"]
    n = len(table)
    per_rank, total = expected_counts(n, world, drop_last=True)
    seen: list[int] = []
    for rank in range(world):
        ds = cheap(
            stream_packs["shards"],
            "trainval",
            shuffle=True,
            rank=rank,
            world_size=world,
            drop_last=True,
        )
        got = [table[d] for d in read_ids(ds, workers)]
        assert len(got) == len(ds) == per_rank
        seen += got
    assert len(seen) == len(set(seen)) == total


def test_pickled_copy_iterates_alike(stream_packs) -> None:
    """What spawn/forkserver workers get: a pickled copy that maps the pack on first use."""
    ds = cheap(stream_packs["shards"], "test", shuffle=True)
    ds.set_epoch(4)
    copy = pickle.loads(pickle.dumps(ds))
    assert torch_serialized.data.workers.reopen_dataset(copy) == 1  # what worker_init_fn does
    assert [d for d, _ in copy] == [d for d, _ in ds]


def test_fewer_samples_than_ranks_pads_by_repeating(stream_packs) -> None:
    ds = VOCSerializedDataset(stream_packs["single"], image_set="train", decode="none")
    n = len(ds)
    world = n + 2
    got = []
    for rank in range(world):
        it = cheap(stream_packs["single"], "train", rank=rank, world_size=world)
        assert len(it) == 1
        got.append(list(it.blocks()[0]))
    assert [p for g in got for p in g] == [*range(n), 0, 1]


def test_torch_distributed_defaults_to_one_rank(stream_packs) -> None:
    ds = cheap(stream_packs["single"], "train")
    assert len(ds) == len(VOCSerializedDataset(stream_packs["single"], image_set="train"))


# -- order ------------------------------------------------------------------------------------
def order(stream_packs, positions_of, *, seed=0, epoch=0, workers=2, rank=0, world=2) -> list[int]:
    ds = cheap(
        stream_packs["shards"], "trainval", shuffle=True, seed=seed, rank=rank, world_size=world
    )
    ds.set_epoch(epoch)
    return [positions_of["shards", "trainval"][d] for d in read_ids(ds, workers)]


def test_order_is_deterministic_and_changes_with_epoch_and_seed(stream_packs, positions_of) -> None:
    first = order(stream_packs, positions_of, epoch=3)
    assert first == order(stream_packs, positions_of, epoch=3)
    assert first != order(stream_packs, positions_of, epoch=4)
    assert first != order(stream_packs, positions_of, epoch=3, seed=1)


def test_each_worker_s_shuffle_buffer_mixes_its_own_way(stream_packs, monkeypatch) -> None:
    """The buffer is seeded by ``(seed, epoch, rank, worker)``: two workers handed the same
    blocks mix them differently, and each the same way again."""
    ds = cheap(stream_packs["single"], "trainval", shuffle=True, shuffle_buffer=16)
    blocks = ds.blocks()
    monkeypatch.setattr(ds, "_rank_blocks", lambda num_workers: [blocks] * num_workers)

    def mixed(worker: int, rank: int = 0) -> list[str]:
        here = Topology(rank=rank, world_size=2, worker=worker, num_workers=2)
        monkeypatch.setattr(ds, "_topology", lambda: here)
        return [d for d, _ in ds]

    first, second = mixed(0), mixed(1)
    assert sorted(first) == sorted(second) and len(first) == sum(len(b) for b in blocks)
    assert first != second
    assert mixed(0) == first and mixed(1) == second
    assert mixed(0, rank=1) not in (first, second)  # the rank seeds the buffer too


def test_order_independent_of_pack_layout(stream_packs) -> None:
    """Same blocks when the list visits shards in any order: trainval ignores shard cuts."""
    single = cheap(stream_packs["single"], "trainval", shuffle=True)
    shards = cheap(stream_packs["shards"], "trainval", shuffle=True)
    assert [list(b) for b in single.blocks()] == [list(b) for b in shards.blocks()]


def test_block_order_is_shared_by_ranks(stream_packs) -> None:
    """Rank slices of one epoch order: concatenated they are the whole padded order."""
    plans = [
        np.concatenate(
            cheap(stream_packs["shards"], "trainval", shuffle=True, rank=r, world_size=3).blocks()
        )
        for r in range(3)
    ]
    whole = np.concatenate(cheap(stream_packs["shards"], "trainval", shuffle=True).blocks())
    joined = np.concatenate(plans)
    assert list(joined[: len(whole)]) == list(whole)


def test_unshuffled_blocks_follow_storage_and_shards(stream_packs) -> None:
    ds = cheap(stream_packs["shards"], "test", block_size=4)
    starts = ds.pack.reader.starts
    for block in ds.blocks():
        records = ds.records[block]
        assert list(block) == list(range(block[0], block[-1] + 1))
        shards = np.searchsorted(starts, records, side="right") - 1
        assert len(set(shards.tolist())) == 1
        assert len(block) <= 4


# -- samples ----------------------------------------------------------------------------------
def _pixels(sample: tuple[Any, Any]) -> bytes:
    return sample[0].tobytes()


@pytest.mark.parametrize("kind", ["single", "shards"])
def test_samples_equal_the_map_style_dataset(stream_packs, kind) -> None:
    reference = VOCSerializedDataset(stream_packs[kind], image_set="trainval")
    by_pixels = {_pixels(reference[i]): i for i in range(len(reference))}
    ds = VOCSerializedIterableDataset(stream_packs[kind], "trainval", shuffle=True, block_size=5)
    ds.set_epoch(2)
    seen = []
    for img, target in ds:
        i = by_pixels[img.tobytes()]
        ref_img, ref_target = reference[i]
        assert img.mode == ref_img.mode and img.size == ref_img.size
        assert target == ref_target
        seen.append(i)
    assert sorted(seen) == list(range(len(reference)))


# torchvision 0.29 deprecates torchvision.io decoding (used by decode="tensor").
@pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")
@pytest.mark.parametrize("decode", ["tensor", "none"])
def test_tensor_paths_equal_the_map_style_dataset(stream_packs, decode) -> None:
    kw = {"decode": decode, "target_format": "tv_tensors", "classes": "packed"}
    reference = VOCSerializedDataset(stream_packs["shards"], image_set="test", **kw)
    ds = VOCSerializedIterableDataset(stream_packs["shards"], "test", block_size=3, **kw)
    got = list(ds)
    assert len(got) == len(reference)
    for i, (img, target) in enumerate(got):
        ref_img, ref_target = reference[i]
        assert torch.equal(img, ref_img)
        assert target.keys() == ref_target.keys()
        for key in target:
            assert torch.equal(target[key], ref_target[key])
        assert target["boxes"].canvas_size == ref_target["boxes"].canvas_size


def test_segmentation_task_equals_the_map_style_dataset(stream_packs) -> None:
    reference = VOCSerializedSegmentation(stream_packs["shards"], image_set="trainval")
    ds = VOCSerializedIterableDataset(
        stream_packs["shards"], "trainval", task="Segmentation", checked=True
    )
    got = list(ds)
    assert len(got) == len(reference) == len(ds)
    for i, (img, mask) in enumerate(got):
        ref_img, ref_mask = reference[i]
        assert img.tobytes() == ref_img.tobytes()
        assert mask.mode == ref_mask.mode == "P"
        assert mask.tobytes() == ref_mask.tobytes()
        assert mask.getpalette() == ref_mask.getpalette()


def _name(target: dict[str, Any]) -> str:
    return target["annotation"]["filename"]


def _both(img: Any, target: dict[str, Any]) -> tuple[Any, Any]:
    return pil_to_tensor(img), _name(target)


@pytest.mark.parametrize(
    "kw", [{"transform": pil_to_tensor, "target_transform": _name}, {"transforms": _both}]
)
def test_transforms_applied_as_the_map_style_dataset(stream_packs, kw) -> None:
    reference = VOCSerializedDataset(stream_packs["single"], image_set="train", **kw)
    got = list(VOCSerializedIterableDataset(stream_packs["single"], "train", **kw))
    for i, (img, name) in enumerate(got):
        ref_img, ref_name = reference[i]
        assert torch.equal(img, ref_img)
        assert name == ref_name


def test_arguments_are_checked(stream_packs) -> None:
    path = stream_packs["single"]
    with pytest.raises(ValueError, match="Only transforms or transform"):
        VOCSerializedIterableDataset(path, transforms=_both, transform=pil_to_tensor)
    with pytest.raises(ValueError, match="task"):
        VOCSerializedIterableDataset(path, task="Action")
    with pytest.raises(ValueError, match="Main.* only"):
        VOCSerializedIterableDataset(path, task="Segmentation", target_format="tv_tensors")
    with pytest.raises(ValueError, match="block_size"):
        VOCSerializedIterableDataset(path, block_size=0)
    with pytest.raises(ValueError, match="rank"):
        VOCSerializedIterableDataset(path, rank=2, world_size=2)
    with pytest.raises(ValueError, match="image_set"):
        VOCSerializedIterableDataset(path, "nope")
    assert "Image set: train" in repr(VOCSerializedIterableDataset(path, transform=pil_to_tensor))


# -- resumption -------------------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_mid_epoch_matches_an_uninterrupted_epoch(
    stream_packs, positions_of, shuffle
) -> None:
    table = positions_of["shards", "trainval"]

    def make() -> VOCSerializedIterableDataset:
        ds = cheap(stream_packs["shards"], "trainval", shuffle=shuffle, rank=1, world_size=2)
        ds.set_epoch(5)
        return ds

    full = [table[d] for d, _ in make()]
    assert len(full) == 16
    for stop in (0, 1, 5, 9, len(full) - 1, len(full)):
        first = make()
        it = iter(first)
        head = [table[next(it)[0]] for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))
        assert (state["epoch"], state["yielded"]) == (5, stop)
        resumed = cheap(stream_packs["shards"], "trainval", shuffle=shuffle, rank=1, world_size=2)
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
        tail = [table[d] for d, _ in resumed]
        assert head + tail == full, stop
        # the resume applies once: the next pass is the whole epoch again
        assert [table[d] for d, _ in resumed] == full


def test_resume_rejects_other_settings(stream_packs) -> None:
    ds = cheap(stream_packs["single"], "trainval", shuffle=True, rank=0, world_size=2)
    state = ds.state_dict()
    other = cheap(stream_packs["single"], "trainval", shuffle=True, rank=0, world_size=2, seed=7)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        iter(other)
    with pytest.raises(ValueError, match="version"):
        other.load_state_dict({"epoch": 0, "yielded": 0})


def test_resume_refuses_another_pack_of_the_same_size(stream_packs, tmp_path) -> None:
    """A state names the pack it was saved on: a re-pack of the same source (same count, same
    settings) gets a new pack id, so resuming on it would mix two packs in one epoch."""
    source = stream_packs["single"].parent / "src"
    again = torch_serialized.pack_voc(source, tmp_path / "again.tser", year="2007").path
    ds = cheap(stream_packs["single"], "trainval", shuffle=True)
    it = iter(ds)
    next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    other = cheap(Path(again), "trainval", shuffle=True)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="saved on other samples"):
        iter(other)
    # a state saved before the key existed resumes as before
    same = cheap(stream_packs["single"], "trainval", shuffle=True)
    same.load_state_dict({k: v for k, v in state.items() if k != "pack"})
    assert len(list(same)) == len(list(cheap(stream_packs["single"], "trainval"))) - 1


def test_resume_with_another_number_of_workers_is_refused(stream_packs, monkeypatch) -> None:
    """A worker's state holds its place: a resume with more workers would split the epoch
    otherwise, and repeat or skip samples."""
    ds = cheap(stream_packs["single"], "trainval", shuffle=True)
    monkeypatch.setattr(ds, "_topology", lambda: Topology(worker=1, num_workers=2))
    next(iter(ds))
    state = json.loads(json.dumps(ds.state_dict()))
    assert (state["worker"], state["num_workers"], state["yielded"]) == (1, 2, 1)
    other = cheap(stream_packs["single"], "trainval", shuffle=True)
    monkeypatch.setattr(other, "_topology", lambda: Topology(worker=1, num_workers=3))
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="num_workers: saved 2, now 3"):
        iter(other)


def test_set_epoch_to_another_epoch_drops_a_loaded_position(stream_packs) -> None:
    """As ``BlockShuffleSampler``: ``set_epoch`` with another epoch after ``load_state_dict``
    starts that epoch from its beginning."""
    ds = cheap(stream_packs["single"], "trainval", shuffle=True)
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = ds.state_dict()
    resumed = cheap(stream_packs["single"], "trainval", shuffle=True)
    resumed.load_state_dict(state)
    resumed.set_epoch(4)
    fresh = cheap(stream_packs["single"], "trainval", shuffle=True)
    fresh.set_epoch(4)
    assert [d for d, _ in resumed] == [d for d, _ in fresh]


def test_a_resume_reads_none_of_the_samples_it_skips(stream_packs, monkeypatch) -> None:
    """The replay of a resume plans the skipped blocks without reading them."""
    ds = cheap(stream_packs["shards"], "trainval")  # blocks of 4, no shuffle buffer
    it = iter(ds)
    for _ in range(8):
        next(it)
    state = ds.state_dict()
    read: list[int] = []
    real = torch_serialized.data.pipeline.read_block

    def counted(reader: Any, records: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        read.extend(np.asarray(records).tolist())
        return real(reader, records, *args, **kwargs)

    monkeypatch.setattr(torch_serialized.data.pipeline, "read_block", counted)
    resumed = cheap(stream_packs["shards"], "trainval")
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert len(tail) == len(resumed.records) - 8
    assert len(read) == len(tail)  # not the 8 samples skipped


def test_set_epoch_resets_progress(stream_packs) -> None:
    ds = cheap(stream_packs["single"], "train")
    it = iter(ds)
    next(it)
    assert ds.state_dict()["yielded"] == 1
    ds.set_epoch(1)
    assert (ds.state_dict()["epoch"], ds.state_dict()["yielded"]) == (1, 0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11
def test_resume_through_stateful_dataloader(stream_packs, positions_of) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    table = positions_of["shards", "trainval"]

    def loader() -> Any:
        ds = cheap(stream_packs["shards"], "trainval", shuffle=True)
        ds.set_epoch(2)
        return stateful.StatefulDataLoader(
            ds, batch_size=3, num_workers=2, collate_fn=lambda batch: [d for d, _ in batch]
        )

    full = [table[d] for batch in loader() for d in batch]
    assert sorted(full) == list(range(len(table)))
    first = loader()
    it = iter(first)
    head = [table[d] for _ in range(4) for d in next(it)]
    state = first.state_dict()
    del it
    second = loader()
    second.load_state_dict(state)
    tail = [table[d] for batch in second for d in batch]
    assert head + tail == full


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_persistent_workers_follow_set_epoch(stream_packs, context) -> None:
    # A persistent worker keeps its copy of the dataset across epochs: set_epoch in the main
    # process must still reach it, or every epoch would repeat the first one's order.
    ds = cheap(stream_packs["single"], "trainval", shuffle=True, seed=3)
    loader = DataLoader(
        ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context=context
    )
    seen = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        fresh = cheap(stream_packs["single"], "trainval", shuffle=True, seed=3)
        fresh.set_epoch(epoch)
        expected = read_ids(fresh, workers=2)
        seen.append([d for d, _ in loader])
        assert seen[-1] == expected, f"epoch {epoch} differs from a fresh loader's"
    assert seen[0] != seen[1] != seen[2]


def test_plain_pickle_keeps_the_epoch_number(stream_packs) -> None:
    ds = cheap(stream_packs["single"], "trainval", shuffle=True)
    ds.set_epoch(7)
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.epoch == 7
    copy.set_epoch(8)  # an independent copy: no shared memory outside DataLoader workers
    assert ds.epoch == 7


def test_copied_reads_yield_what_views_yield(stream_packs, monkeypatch) -> None:
    """A pack of many tiny shards is streamed from private copies (``views_fit``: views would
    keep a map, and a descriptor, per shard in flight): the samples are the same."""
    import torch_serialized.data.iterable as iterable_module
    from torch_serialized.container.shards import open_pack
    from torch_serialized.data.pipeline import views_fit

    reader = open_pack(stream_packs["shards"], max_open_shards=1)
    assert reader.num_shards > 1
    assert not views_fit(reader, reader.num_records)
    assert views_fit(open_pack(stream_packs["shards"], max_open_shards=reader.num_shards), 10**9)

    def samples() -> list[Any]:
        ds = VOCSerializedIterableDataset(stream_packs["shards"], "trainval", shuffle=True, seed=3)
        return [(bytes(pil_to_tensor(img).numpy()), target) for img, target in ds]

    views = samples()
    monkeypatch.setattr(iterable_module, "views_fit", lambda reader, in_flight: False)
    assert samples() == views


@pytest.mark.parametrize("kind", ["single", "shards"])
@pytest.mark.parametrize("copy", [False, True])
def test_read_blocks_yields_each_records_fields_in_block_order(
    stream_packs: dict[str, Path], kind: str, copy: bool
) -> None:
    """``read_blocks`` items are ``(record, fields)`` in block order, repeats included (the
    one-file view path looks a block up at once; the others run by run), with the bytes
    ``read_block`` gives; a closed gate yields the records without reading."""
    from torch_serialized.data.pipeline import Gate, read_block, read_blocks
    from torch_serialized.voc import schema

    ds = VOCSerializedIterableDataset(stream_packs[kind], "trainval", decode="none")
    reader, records = ds.pack.reader, ds.records
    fields = (schema.IMAGE, schema.TARGET)
    n = len(records)
    blocks = [np.array([5, 1, 1, 3]), np.arange(n - 6, n), np.array([0])]  # unsorted, repeats
    items = list(read_blocks(blocks, records, reader, fields, copy=copy))
    expected = records[np.concatenate(blocks)].tolist()
    assert [record for record, _ in items] == expected
    for record, data in items:
        assert type(data) is list and len(data) == 2
        alone = read_block(reader, np.array([record]), fields)[record]
        assert [bytes(d) for d in data] == [bytes(d) for d in alone]
    closed = list(read_blocks(blocks, records, reader, fields, Gate(open=False), copy=copy))
    assert closed == [(record, None) for record in expected]


# --- through DataLoader workers: runs of samples in one shared block --------------------------


def storages_seen_in_worker(batch: list[Any]) -> tuple[list[bytes], int]:
    """collate_fn run in the worker: the batch's image bytes, and the storages they used."""
    storages = {image.untyped_storage().data_ptr() for image, _ in batch}
    return [image.numpy().tobytes() for image, _ in batch], len(storages)


@pytest.mark.parametrize("layout", ["single", "shards"])
def test_worker_streams_send_each_run_in_one_block(stream_packs, layout, monkeypatch) -> None:
    """In a DataLoader worker each run of ``SHARED_RUN`` samples travels in one shared block
    (one segment per batch when the batch size is the run's, not one per image), and the
    samples are the stream's."""
    monkeypatch.setattr(torch_serialized.data.iterable, "SHARED_RUN", 4)  # forked workers see it
    ds = VOCSerializedIterableDataset(stream_packs[layout], "trainval", decode="none")
    expected = sorted(image.numpy().tobytes() for image, _ in ds)
    loader = DataLoader(
        ds, batch_size=4, num_workers=2, collate_fn=storages_seen_in_worker, timeout=60
    )
    got = []
    for images, storages in loader:
        assert storages == 1
        got.extend(images)
    assert sorted(got) == expected


@pytest.mark.parametrize("layout", ["single", "shards"])
def test_a_worker_stream_copies_each_image_once(stream_packs, layout, monkeypatch) -> None:
    """In a DataLoader worker, ``decode="none"`` images go from the map straight into their
    run's shared block (no private copy first: Python allocates a fraction of the run's
    image bytes, for planning the reads), and a last run of one sample gets an image of its
    own, never a map view."""
    monkeypatch.setattr(torch_serialized.data.iterable, "in_worker", lambda: True)
    alone = list(VOCSerializedIterableDataset(stream_packs[layout], "trainval", decode="none"))
    run = len(alone) - 1  # a run of all but one sample, then a run of one
    monkeypatch.setattr(torch_serialized.data.iterable, "SHARED_RUN", run)
    ds = VOCSerializedIterableDataset(stream_packs[layout], "trainval", decode="none")
    it = iter(ds)
    first, peak = traced_peak(lambda: next(it))  # the whole first run is read and moved here
    got = [first, *it]
    assert peak < sum(image.numel() for image, _ in alone[:run]) / 4
    assert len({image.untyped_storage().data_ptr() for image, _ in got[:run]}) == 1
    assert all(image.is_shared() for image, _ in got[:run])
    assert len(got) == len(alone)
    for (image, target), (expected, expected_target) in zip(got, alone):
        assert torch.equal(image, expected) and target == expected_target
    last = got[-1][0]
    assert not last.is_shared()
    last.add_(1)  # writable: a view of the read-only map would crash the process here
    assert not torch.equal(last, alone[-1][0])


@pytest.mark.parametrize("layout", ["single", "shards"])
def test_a_worker_stream_holds_one_decoded_image_at_a_time(
    stream_packs, layout, monkeypatch
) -> None:
    """``decode="tensor"`` in a worker: a run of 32 decoded images stayed private until the
    run was moved into its shared block (what glibc then kept as the worker's heap). The
    block is now made first from the pack's columns and each image copied in as it is
    decoded; a last run of one sample is left for torch to share."""
    alone = list(VOCSerializedIterableDataset(stream_packs[layout], "trainval", decode="tensor"))
    monkeypatch.setattr(torch_serialized.data.iterable, "in_worker", lambda: True)
    run = len(alone) - 1
    monkeypatch.setattr(torch_serialized.data.iterable, "SHARED_RUN", run)
    ds = VOCSerializedIterableDataset(stream_packs[layout], "trainval", decode="tensor")
    decode = ds.decoder.image
    made: list[weakref.ref[torch.Tensor]] = []
    alive: list[int] = []

    def counting(record, data, **kw):
        alive.append(sum(ref() is not None for ref in made))  # earlier private images
        image = decode(record, data, **kw)
        made.append(weakref.ref(image))
        return image

    monkeypatch.setattr(ds.decoder, "image", counting)
    got = list(ds)
    # at most the one the decoding generator still holds while the next is decoded
    assert len(alive) == len(alone) and max(alive) <= 1
    assert len({image.untyped_storage().data_ptr() for image, _ in got[:run]}) == 1
    assert all(image.is_shared() for image, _ in got[:run]) and not got[-1][0].is_shared()
    for (image, target), (expected, expected_target) in zip(got, alone, strict=True):
        assert torch.equal(image, expected) and target == expected_target


def test_a_worker_stream_counts_only_samples_handed_out(stream_packs, monkeypatch) -> None:
    """Runs are read ahead of their samples, yet ``state_dict`` counts what left the stream,
    so a checkpoint taken mid-run resumes at the next sample."""
    monkeypatch.setattr(torch_serialized.data.iterable, "in_worker", lambda: True)
    ds = VOCSerializedIterableDataset(stream_packs["single"], "trainval", decode="none")
    alone = [
        image
        for image, _ in VOCSerializedIterableDataset(
            stream_packs["single"], "trainval", decode="none"
        )
    ]
    it = iter(ds)
    head = [next(it)[0] for _ in range(5)]
    assert ds.state_dict()["yielded"] == 5
    assert all(image.is_shared() for image in head)
    resumed = VOCSerializedIterableDataset(stream_packs["single"], "trainval", decode="none")
    resumed.load_state_dict(ds.state_dict())
    tail = [image for image, _ in resumed]
    assert len(head) + len(tail) == len(alone)
    for a, b in zip(head + tail, alone):
        assert torch.equal(a, b)
