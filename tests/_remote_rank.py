"""One rank of the shared-cache test: ``python _remote_rank.py SPEC_JSON`` (test_remote_datasets).

Streams a remote pack as rank ``rank`` of ``world_size`` through a DataLoader with ``workers``
workers (default 2; ``start``: fork or spawn), sharing ``cache_dir`` with the other rank, and
prints the digests of the image bytes it received, in order, as JSON.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
from torch.utils.data import DataLoader

from torch_serialized import VOCSerializedIterableDataset


def digest(image: torch.Tensor) -> str:
    return hashlib.blake2b(image.numpy().tobytes(), digest_size=8).hexdigest()


def drop(target: object) -> int:
    return 0


def main(spec: dict) -> None:
    ds = VOCSerializedIterableDataset(
        spec["url"],
        "trainval",
        shuffle=True,
        seed=5,
        block_size=4,
        shuffle_buffer=8,
        decode="none",
        transform=digest,
        target_transform=drop,
        rank=spec["rank"],
        world_size=spec["world_size"],
        storage_options=spec["storage_options"],
        cache_dir=spec["cache_dir"],
    )
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=spec.get("workers", 2),
        multiprocessing_context=spec.get("start", "fork"),
    )
    print(json.dumps([d for d, _ in loader]))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
