"""DistributedDataParallel on the CPU with a streaming VOCSerializedIterableDataset.

    torchrun --nproc_per_node=2 examples/ddp_iterable.py [PACK | VOC_ROOT] [--epochs 2]
    python examples/ddp_iterable.py [...]     # re-launches itself with torch.distributed.run

Each rank streams its own share of the image set (split by rank, then by DataLoader worker),
trains a tiny multi-label classifier wrapped in DDP (gloo backend) and reports how many samples
it read; rank 0 checks that the ranks together covered the image set. VOC_ROOT may be any
VOC-format dataset (its year found from the folder names unless --year is given; one output
per label name of the dataset). Without PACK or VOC_ROOT, rank 0 generates a synthetic sample
into a temporary folder and packs it for everyone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from torch_serialized import VOCSerializedIterableDataset, pack_voc
from torch_serialized.tools import make_synthetic_voc


def collate(batch: list[tuple[Any, Any]]) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """Stack the (same-size) images; keep the targets as a tuple of dicts."""
    images, targets = zip(*batch)
    return torch.stack(images), targets


def multi_hot(targets: tuple[dict[str, Any], ...], num_labels: int) -> torch.Tensor:
    """One row per image: 1 for every class present in it (label 0, the background, never)."""
    rows = torch.zeros(len(targets), num_labels)
    for row, target in zip(rows, targets):
        row[target["labels"]] = 1.0
    return rows


def prepare(source: str | None, year: str | None, num_images: int, tmp: Path) -> Path:
    """A pack to read: ``source`` if it is one, else ``source`` (or a sample) packed."""
    if source and (Path(source).suffix == ".tser" or Path(source, "manifest.json").exists()):
        return Path(source)
    if source:
        root = Path(source)
    else:
        root = make_synthetic_voc(tmp / "voc", num_images, year=year or "2012")
    result = pack_voc(root, tmp / "shards", year=year, max_samples_per_shard=16)
    print(f"packed {result.num_samples} samples of VOC{result.year} from {result.voc_root}")
    return result.path


def shared_pack(args: argparse.Namespace, rank: int) -> tuple[Path, Path | None]:
    """Rank 0 prepares the pack, the others wait for its path."""
    tmp = Path(tempfile.mkdtemp(prefix="tser-ddp-")) if rank == 0 else None
    holder = [str(prepare(args.source, args.year, args.num_images, tmp)) if tmp else None]
    dist.broadcast_object_list(holder, src=0)
    return Path(str(holder[0])), tmp


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path, tmp = shared_pack(args, rank)
    try:
        transforms = v2.Compose(
            [
                v2.ToImage(),
                v2.RandomHorizontalFlip(),
                v2.Resize((128, 128)),
                v2.ToDtype(torch.float32, scale=True),
            ]
        )
        # rank and world_size come from torch.distributed; each rank reads its own blocks.
        dataset = VOCSerializedIterableDataset(
            path, "train", shuffle=True, seed=0, transforms=transforms, target_format="tv_tensors"
        )
        if len(dataset.records) == 0:  # every rank sees it: all stop together
            raise SystemExit(f"error: the train image set of {path} is empty")
        loader = DataLoader(
            dataset, batch_size=args.batch_size, num_workers=args.workers, collate_fn=collate
        )
        torch.manual_seed(0)  # the same initial weights on every rank
        model = DistributedDataParallel(
            nn.Sequential(
                nn.Conv2d(3, 16, 5, stride=4),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(16, len(dataset.label_names)),
            )
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss_fn = nn.BCEWithLogitsLoss()
        for epoch in range(args.epochs):
            dataset.set_epoch(epoch)  # a new shuffle, the same on every rank
            samples = batches = 0
            last = "n/a"
            started = time.perf_counter()
            for images, targets in loader:
                loss = loss_fn(model(images), multi_hot(targets, len(dataset.label_names)))
                optimizer.zero_grad()
                loss.backward()  # gradients are averaged across ranks here
                optimizer.step()
                samples += len(images)
                batches += 1
                last = f"{loss.item():.3f}"
            seconds = time.perf_counter() - started
            print(
                f"rank {rank}/{world_size} epoch {epoch}: {samples} samples in {batches} batches, "
                f"{seconds:.2f} s, last loss {last}",
                flush=True,
            )
            total = torch.tensor([samples])
            dist.all_reduce(total)
            if rank == 0:
                listed = len(dataset.records)
                print(
                    f"epoch {epoch}: {int(total)} samples over {world_size} ranks for {listed} "
                    f"listed ({int(total) - listed} padding repeats so ranks stay in step)",
                    flush=True,
                )
        dist.barrier()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.destroy_process_group()


def rank_arguments(args: argparse.Namespace) -> list[str]:
    """The arguments each rank gets, spelled out in full. Not ``sys.argv``: torchrun reads
    every option after the script too, and refuses one that abbreviates its own
    (``--nproc`` of ``--nproc-per-node``), so the ranks would never start."""
    forwarded = [args.source] if args.source else []
    for name, value in vars(args).items():
        if name not in ("source", "nproc") and value is not None:
            forwarded += [f"--{name.replace('_', '-')}", str(value)]
    return forwarded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", help="a pack or torchvision's VOC root")
    parser.add_argument("--year", help="VOC year of VOC_ROOT (default: found in its folders)")
    parser.add_argument("--num-images", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2, help="ranks when re-launching")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:  # not started by torchrun: start it now
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            os.path.abspath(__file__),
            *rank_arguments(args),
        ]
        print("re-launching: " + " ".join(command[1:]), flush=True)
        sys.exit(subprocess.call(command))
    train(args)


if __name__ == "__main__":
    main()
