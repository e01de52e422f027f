"""Run by tests/test_iterable_ddp.py under torchrun: iterate a pack on this rank, write what it
saw.

Usage: python -m torch.distributed.run --nproc_per_node=2 tests/_ddp_worker.py PACK OUT_DIR
Each rank writes OUT_DIR/rank<R>.json with its rank, world size, len() and the digests of the
image bytes of the samples it received (through a DataLoader with two workers), in order.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from torch_serialized.data.iterable import VOCSerializedIterableDataset


def digest(image: torch.Tensor) -> str:
    return hashlib.blake2b(image.numpy().tobytes(), digest_size=8).hexdigest()


def drop(target: object) -> int:
    return 0


def main(pack: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    try:
        ds = VOCSerializedIterableDataset(
            pack,
            "trainval",
            shuffle=True,
            seed=11,
            block_size=4,
            shuffle_buffer=6,
            decode="none",
            target_format="tv_tensors",
            transform=digest,
            target_transform=drop,
        )
        ds.set_epoch(1)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        seen = [d for d, _ in loader]
        report = {
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "len": len(ds),
            "ids": seen,
        }
        Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
