"""worker_init_fn: finds our datasets in wrappers, reopens idempotently, works per start method."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _reliability_helpers import PidDataset, list_collate, pin_mmap_threshold, traced_peak
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torchvision import tv_tensors
from torchvision.datasets import wrap_dataset_for_transforms_v2
from torchvision.transforms.functional import pil_to_tensor

import torch_serialized
import torch_serialized as ts
from torch_serialized.data.workers import reopen_dataset, share_batch


def first_item(batch: list[Any]) -> Any:
    return batch[0]


def _bytes_of(sample: tuple[torch.Tensor, Any]) -> bytes:
    return sample[0].numpy().tobytes()


def test_reopen_finds_datasets_inside_wrappers(synthetic_packs: Any) -> None:
    ds = ts.VOCSerializedDataset(synthetic_packs.single, image_set="train", decode="none")
    seg = ts.VOCSerializedSegmentation(synthetic_packs.shards, image_set="train")
    it = ts.VOCSerializedIterableDataset(synthetic_packs.single, "train")
    assert reopen_dataset(ds) == 1
    assert reopen_dataset(Subset(ds, [0, 1])) == 1
    assert reopen_dataset(ConcatDataset([ds, seg])) == 2
    assert (
        reopen_dataset(
            wrap_dataset_for_transforms_v2(ts.VOCSerializedDataset(synthetic_packs.single))
        )
        == 1
    )
    assert reopen_dataset(it) == 1
    assert reopen_dataset(object()) == 0


def test_reopen_is_idempotent_in_one_process(synthetic_packs: Any) -> None:
    ds = ts.VOCSerializedDataset(synthetic_packs.single, image_set="train", decode="none")
    shard = ds.pack.reader.shard(0)
    before = shard._local
    reopen_dataset(ds)
    reopen_dataset(ds)
    assert shard._local is before  # same process: nothing to do, nothing dropped
    assert _bytes_of(ds[0]) == _bytes_of(
        ts.VOCSerializedDataset(synthetic_packs.single, image_set="train", decode="none")[0]
    )


@pytest.mark.parametrize(
    "method",
    [
        "fork",
        pytest.param("spawn", marks=pytest.mark.slow),
        pytest.param("forkserver", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(("use_init", "zero_copy"), [(True, False), (False, False), (False, True)])
def test_worker_init_fn_is_optional_and_harmless(
    synthetic_packs: Any, method: str, use_init: bool, zero_copy: bool
) -> None:
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"{method} is not available here")
    ds = Subset(
        ts.VOCSerializedDataset(
            synthetic_packs.shards, image_set="trainval", decode="none", zero_copy=zero_copy
        ),
        range(12),
    )
    expected = [_bytes_of(ds[i]) for i in range(len(ds))]
    loader = DataLoader(
        ds,
        batch_size=1,
        # one worker where each costs a torch import (the six such runs took 70 s of CI)
        num_workers=2 if method == "fork" else 1,
        collate_fn=first_item,
        multiprocessing_context=method,
        worker_init_fn=ts.worker_init_fn if use_init else None,
        persistent_workers=True,
    )
    for _ in range(2):  # persistent workers keep their maps across epochs
        assert [_bytes_of(sample) for sample in loader] == expected


def open_fds(pid: int) -> int:
    """How many descriptors ``pid`` holds once the count stops changing: right after a batch
    arrives, the worker still holds its shared-memory descriptor and the socket torch's
    resource sharer sent it over (seen: two sockets and a ``/dev/shm/torch_*`` segment),
    which a count taken at once mistook for a change between epochs (1 run in ~10 failed)."""
    count, steady, deadline = -1, 0, time.monotonic() + 5.0
    while steady < 5 and time.monotonic() < deadline:
        now = len(os.listdir(f"/proc/{pid}/fd"))
        steady = steady + 1 if now == count else 0
        count = now
        time.sleep(0.02)
    return count


def uss(pid: int) -> int:
    """Unique set size: private clean + private dirty bytes (``smaps_rollup``)."""
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        if key in ("Private_Clean", "Private_Dirty"):
            total += int(value.split()[0]) * 1024
    return total


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_twenty_epochs_with_persistent_workers_keep_fds_and_memory_flat(voc40_packs):
    if not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("needs /proc/<pid>/smaps_rollup (Linux >= 4.14)")
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("needs glibc's mallopt (see pin_mmap_threshold)")
    from torch.utils.data import DataLoader

    dataset = PidDataset(
        torch_serialized.VOCSerializedDataset(
            voc40_packs["single"], image_set="trainval", decode="tensor"
        )
    )
    loader = DataLoader(
        dataset,  # type: ignore[arg-type]
        batch_size=8,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        collate_fn=list_collate,
        worker_init_fn=pin_mmap_threshold,  # allocator caching is not a leak: see its doc
        # spawn, not fork: a forked worker's USS also grows as its refcount and GC writes copy
        # the pages it shares with this (test-suite-sized) parent, which says nothing of ours
        multiprocessing_context="spawn",
    )
    seen: dict[int, tuple[dict[int, tuple[int, int]], int]] = {}
    for epoch in range(1, 21):
        pids, count = set(), 0
        for batch in loader:
            for pid, (image, target) in batch:
                assert image.ndim == 3 and image.shape[0] == 3 and "annotation" in target
                pids.add(pid)
                count += 1
        assert count == len(dataset)
        if epoch in (2, 20):
            seen[epoch] = ({pid: (open_fds(pid), uss(pid)) for pid in pids}, open_fds(os.getpid()))
    workers_2, main_2 = seen[2]
    workers_20, main_20 = seen[20]
    assert len(workers_2) == 2 and set(workers_2) == set(workers_20)
    assert os.getpid() not in workers_2
    for pid, (fds, memory) in workers_2.items():
        assert workers_20[pid][0] == fds, f"worker {pid}: open fds {fds} -> {workers_20[pid][0]}"
        growth = workers_20[pid][1] - memory
        assert growth < 5 << 20, f"worker {pid}: USS grew {growth / 2**20:.1f} MiB"
    assert main_20 == main_2, f"main process: open fds {main_2} -> {main_20}"
    del loader


# --- share_batch: a batch's tensors in one block of shared memory ---------------------------------
_DTYPES = [torch.uint8, torch.bool, torch.int16, torch.int64, torch.float16, torch.float32]
_KINDS = [torch.Tensor, tv_tensors.Image, tv_tensors.Mask]


@st.composite
def batch_items(draw: st.DrawFn) -> Any:
    """A sample item: a tensor (contiguous, permuted, strided, empty, of a plain or a
    metadata tv_tensor type), or something else a sample holds."""
    choice = draw(
        st.sampled_from(["dense", "permuted", "strided", "expanded", "boxes", "grad", "other"])
    )
    if choice == "other":
        return draw(st.sampled_from([{"annotation": {"x": "1"}}, "text", 3, None]))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
    dtype = draw(st.sampled_from(_DTYPES))
    seed = draw(st.integers(0, 2**16))
    tensor = (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 100).to(dtype)
    if choice == "boxes":
        return tv_tensors.BoundingBoxes(
            torch.rand(draw(st.integers(0, 3)), 4), format="XYXY", canvas_size=(9, 9)
        )
    if choice == "grad":
        return torch.rand(3, requires_grad=True)
    if choice == "permuted" and tensor.dim() > 1:
        tensor = tensor.permute(*draw(st.permutations(range(tensor.dim()))))
    if choice == "strided" and tensor.dim() and tensor.shape[-1] > 1:
        tensor = tensor[..., ::2]
    if choice == "expanded" and tensor.dim() and tensor.shape[0] == 1:
        tensor = tensor.expand(3, *tensor.shape[1:])  # stride 0: elements overlap
    return tensor.as_subclass(draw(st.sampled_from(_KINDS)))


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().as_subclass(torch.Tensor)


def _eligible(item: Any) -> bool:
    """What ``share_batch`` moves, spelled out: plain CPU tensors (or tv_tensors without
    metadata) that fill their memory densely, hold elements, need no grad and are not shared."""
    if type(item) not in (torch.Tensor, tv_tensors.Image, tv_tensors.Mask, tv_tensors.Video):
        return False
    if item.requires_grad or item.numel() == 0 or item.is_shared():
        return False
    dense = sorted(range(item.dim()), key=lambda d: -item.stride(d))
    return bool(item.permute(dense).is_contiguous())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(batch_items(), min_size=1, max_size=3).map(tuple), max_size=6))
def test_share_batch_moves_tensors_into_one_block_and_keeps_each_value(
    samples: list[tuple[Any, ...]],
) -> None:
    before = [tuple(i.clone() if isinstance(i, torch.Tensor) else i for i in s) for s in samples]
    out = share_batch(list(samples))
    assert len(out) == len(samples)
    moved = [
        (s, j) for s, sample in enumerate(samples) for j, i in enumerate(sample) if _eligible(i)
    ]
    storages = set()
    for s, (sample, got) in enumerate(zip(samples, out)):
        assert type(got) is tuple and len(got) == len(sample)
        for j, (item, new) in enumerate(zip(sample, got)):
            if len(moved) < 2 or (s, j) not in moved:
                assert new is item  # left as it was
                continue
            assert type(new) is type(item) and new.dtype == item.dtype
            assert new.shape == item.shape and new.stride() == item.stride()
            assert torch.equal(
                new.as_subclass(torch.Tensor), before[s][j].as_subclass(torch.Tensor)
            )
            assert new.is_shared()
            storages.add(new.untyped_storage().data_ptr())
    assert len(storages) == (1 if len(moved) >= 2 else 0)
    # views of one block, yet no two share a byte: writing one leaves every other as it was
    for k, (s, j) in enumerate(moved if len(moved) >= 2 else []):
        out[s][j].as_subclass(torch.Tensor).fill_(k % 2 == 0)
        for s2, j2 in moved[k + 1 :]:
            assert torch.equal(_plain(out[s2][j2]), _plain(before[s2][j2]))
    for sample, original in zip(samples, before):  # the inputs are not written
        for item, kept in zip(sample, original):
            if isinstance(item, torch.Tensor):
                assert torch.equal(
                    item.detach().as_subclass(torch.Tensor), kept.detach().as_subclass(torch.Tensor)
                )


def test_a_batch_shared_as_made_hands_freed_pages_back_once(monkeypatch) -> None:
    """With the sizes known (decoded images), each image is copied into the block as it is
    made and freed; the worker then asks glibc to return the freed pages (``malloc_trim``),
    once per batch, so its heap does not keep them as its high-water mark (10-13 MB per
    worker in some benchmark runs before). Without the sizes the batch path is unchanged."""
    from torch_serialized.data import workers

    if workers._MALLOC_TRIM is None:
        pytest.skip("this C library has no malloc_trim")
    calls: list[int] = []
    monkeypatch.setattr(workers, "_MALLOC_TRIM", lambda pad: calls.append(pad) or 1)
    images = [torch.full((3, 4, 5), i, dtype=torch.uint8) for i in range(3)]
    made = share_batch(((image, {"i": i}) for i, image in enumerate(images)), [60] * 3)
    assert calls == [0]
    assert [torch.equal(a, b) and a.is_shared() for (a, _), b in zip(made, images)] == [True] * 3
    share_batch([(image, {}) for image in images])
    assert calls == [0], "no trim on the share_batch path"


def test_share_batch_moves_a_tensor_found_twice_once() -> None:
    """A transform that returns one tensor in two places (or two samples holding the same
    one) gets one view of one copy back in every place, as the main process gets the same
    object: not a copy per place, which would double its memory and break ``is``."""
    image, other = torch.arange(1000, dtype=torch.uint8), torch.ones(3, 5)
    out = share_batch([(image, image), (image, other)])
    assert out[0][0] is out[0][1] is out[1][0]
    assert out[0][0].is_shared() and torch.equal(out[0][0], image)
    assert torch.equal(out[1][1], other)
    block = out[0][0].untyped_storage()
    assert out[1][1].untyped_storage().data_ptr() == block.data_ptr()
    assert block.nbytes() == 1024 + 64, "the block holds each tensor once (64-byte aligned)"
    same = share_batch([(image, image)])  # one tensor, however often: torch shares it itself
    assert same[0][0] is same[0][1] is image


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(batch_items(), min_size=1, max_size=3).map(tuple), max_size=6))
def test_share_batch_never_hands_on_a_borrowed_tensor(samples: list[tuple[Any, ...]]) -> None:
    """``borrowed=0``: the first item of every sample, if a tensor, leaves as a new tensor of
    the same value (moved into the block, or copied when it is not); the rest as without it."""
    plain = share_batch(list(samples))
    out = share_batch(list(samples), borrowed=0)
    for sample, got, alike in zip(samples, out, plain):
        for j, (item, new, same) in enumerate(zip(sample, got, alike)):
            if not isinstance(item, torch.Tensor):
                assert new is item
            elif j == 0:
                assert new is not item and type(new) is type(item)
                assert torch.equal(_plain(new), _plain(item))
            else:
                assert (new is item) == (same is item)


def storages_seen_in_worker(batch: list[Any]) -> tuple[list[Any], int]:
    """collate_fn run in the worker: the batch, and how many storages its images use."""
    return batch, len({image.untyped_storage().data_ptr() for image, _ in batch})


@pytest.mark.parametrize(
    "kw",
    [
        {"decode": "none"},
        {"decode": "none", "zero_copy": True},
        {"decode": "tensor", "target_format": "tv_tensors"},
        {"decode": "pil", "transform": pil_to_tensor},
    ],
    ids=["none", "zero_copy", "tensor-tv", "pil-to-tensor"],
)
def test_dataloader_workers_send_a_batch_in_one_block(synthetic_packs: Any, kw: dict) -> None:
    """Through DataLoader workers a batch's images travel as views of one shared block (one
    segment per batch, not per image) and equal what the main process reads."""
    ds = ts.VOCSerializedDataset(synthetic_packs.shards, image_set="trainval", **kw)
    loader = DataLoader(ds, batch_size=5, num_workers=2, collate_fn=storages_seen_in_worker)
    got = []
    for batch, storages in loader:
        assert storages == 1
        got.extend(batch)
    assert len(got) == len(ds)
    for i, (image, target) in enumerate(got):
        expected_image, expected_target = ds[i]
        assert torch.equal(image, expected_image) and image.stride() == expected_image.stride()
        if isinstance(expected_target, dict) and "boxes" in expected_target:
            assert torch.equal(target["boxes"], expected_target["boxes"])
            assert torch.equal(target["labels"], expected_target["labels"])
        else:
            assert target == expected_target
    image, _ = ds.__getitems__([0, 1])[0]  # the main process: nothing moved
    assert not image.is_shared()


def _map_address(ds: Any, index: int) -> int:
    """Where the stored image of sample ``index`` lies in this process's map of the pack."""
    return int(np.frombuffer(ds.pack.field(ds._record(index)[1], 0), np.uint8).ctypes.data)


@pytest.mark.parametrize("layout", ["single", "shards"])
@pytest.mark.parametrize("target_format", ["dict", "tv_tensors"])
def test_a_workers_batch_copies_each_image_once(
    synthetic_packs: Any, monkeypatch: pytest.MonkeyPatch, layout: str, target_format: str
) -> None:
    """In a DataLoader worker, ``decode="none"`` images go from the map straight into the
    batch's shared block: no private copy of the batch first (Python allocates less than one
    image for the whole batch), and every image is the same value, shared, not the map."""
    ds = ts.VOCSerializedDataset(
        synthetic_packs.path(layout),
        image_set="trainval",
        decode="none",
        target_format=target_format,
    )
    indices = [5, 0, 3, 3, 9, 1]
    expected = [ds[i] for i in indices]
    monkeypatch.setattr(torch_serialized.data.datasets, "in_worker", lambda: True)
    ds.__getitems__(indices)  # the first call builds what later calls reuse
    got, peak = traced_peak(lambda: ds.__getitems__(indices))
    assert peak < min(image.numel() for image, _ in expected)
    assert len({image.untyped_storage().data_ptr() for image, _ in got}) == 1
    for i, (image, target), (expected_image, expected_target) in zip(indices, got, expected):
        assert image.is_shared() and torch.equal(image, expected_image)
        assert image.data_ptr() != _map_address(ds, i)
        if target_format == "dict":
            assert target == expected_target
        else:
            assert all(torch.equal(target[k], expected_target[k]) for k in expected_target)


@pytest.mark.parametrize("layout", ["single", "shards"])
@pytest.mark.parametrize("target_format", ["dict", "tv_tensors"])
def test_a_workers_batch_of_decoded_images_holds_one_at_a_time(
    synthetic_packs: Any, monkeypatch: pytest.MonkeyPatch, layout: str, target_format: str
) -> None:
    """``decode="tensor"`` in a worker: every decoded image of the batch stayed private until
    the whole batch was moved into shared memory, a batch of images (~18 MB at VOC sizes)
    that glibc then kept per worker. The pack's columns give each decoded size, so the
    block is made first and each image copied in as soon as it is decoded."""
    ds = ts.VOCSerializedDataset(
        synthetic_packs.path(layout),
        image_set="trainval",
        decode="tensor",
        target_format=target_format,
    )
    indices = [5, 0, 3, 3, 9, 1]
    expected = [ds[i] for i in indices]
    decode = ds.decoder.image
    made: list[weakref.ref[torch.Tensor]] = []
    alive: list[int] = []

    def counting(record: int, data: Any, **kw: Any) -> torch.Tensor:
        alive.append(sum(ref() is not None for ref in made))  # earlier private images
        image = decode(record, data, **kw)
        made.append(weakref.ref(image))
        return image

    monkeypatch.setattr(ds.decoder, "image", counting)
    monkeypatch.setattr(torch_serialized.data.datasets, "in_worker", lambda: True)
    got = ds.__getitems__(indices)
    assert len(alive) == len(indices) and max(alive) == 0
    assert len({image.untyped_storage().data_ptr() for image, _ in got}) == 1
    for (image, target), (expected_image, expected_target) in zip(got, expected):
        assert image.is_shared() and torch.equal(image, expected_image)
        assert image.stride() == expected_image.stride()
        if target_format == "dict":
            assert target == expected_target
        else:
            assert all(torch.equal(target[k], expected_target[k]) for k in expected_target)


@pytest.mark.parametrize("limit", ["default", "off"])
def test_a_workers_block_is_never_sized_past_the_pixel_limit(
    synthetic_packs: Any, monkeypatch: pytest.MonkeyPatch, limit: str
) -> None:
    """Review: the decoded sizes come from the pack's columns, which a crafted pack may set
    to anything: the block was allocated before any pixel check (the decode path checks
    first), and 2^32 x 2^32 columns raised torch's OverflowError in the worker only. Sizes
    past the limit now fall back to the batch path, which decodes the JPEG's own header."""
    from PIL import Image

    if limit == "off":
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    ds = ts.VOCSerializedDataset(synthetic_packs.single, image_set="trainval", decode="tensor")
    expected = [ds[i] for i in range(3)]
    sizes = ds.decoder._sizes.copy()
    sizes[:] = 2**32 - 1
    monkeypatch.setattr(ds.decoder, "_sizes", sizes)
    if limit == "default":
        assert ds.decoder.decoded_nbytes([0, 1]) is None
    monkeypatch.setattr(torch_serialized.data.datasets, "in_worker", lambda: True)
    got = ds.__getitems__([0, 1, 2])
    for (image, target), (expected_image, expected_target) in zip(got, expected, strict=True):
        assert torch.equal(image, expected_image) and target == expected_target


@pytest.mark.parametrize("decode", ["none", "tensor"])
def test_a_workers_batch_of_raw_pixels_copies_each_image_once(
    synthetic_devkit: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decode: str
) -> None:
    """Raw-pixel packs too: a worker's batch copies each image once, from the map into the
    shared block (CHW views keep their strides), equal to what the main process reads."""
    raw = ts.pack_voc(synthetic_devkit, tmp_path / "raw.tser", image_storage="raw").path
    ds = ts.VOCSerializedDataset(raw, image_set="trainval", decode=decode)
    indices = [4, 1, 7]
    expected = [ds[i] for i in indices]
    monkeypatch.setattr(torch_serialized.data.datasets, "in_worker", lambda: True)
    ds.__getitems__(indices)
    got, peak = traced_peak(lambda: ds.__getitems__(indices))
    assert peak < min(image.numel() for image, _ in expected)
    for i, (image, target), (expected_image, expected_target) in zip(indices, got, expected):
        assert image.is_shared() and torch.equal(image, expected_image)
        assert image.stride() == expected_image.stride() and target == expected_target
        assert image.data_ptr() != _map_address(ds, i)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_workers_batch_of_one_owns_its_image(
    synthetic_packs: Any, monkeypatch: pytest.MonkeyPatch, zero_copy: bool
) -> None:
    """A batch with a single tensor is left for torch to share: its image is then a copy
    of its own (a read-only view of the map must never leave a worker's ``__getitems__``,
    even with ``zero_copy``: a collate_fn may write into it)."""
    ds = ts.VOCSerializedDataset(
        synthetic_packs.single, image_set="trainval", decode="none", zero_copy=zero_copy
    )
    monkeypatch.setattr(torch_serialized.data.datasets, "in_worker", lambda: True)
    [(image, target)] = ds.__getitems__([2])
    assert torch.equal(image, ds[2][0]) and target == ds[2][1]
    assert image.data_ptr() != _map_address(ds, 2) and not image.is_shared()
    image.add_(1)  # writable: a view of the read-only map would crash the process here
    assert not torch.equal(image, ds[2][0])
