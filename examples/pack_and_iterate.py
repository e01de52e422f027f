"""Pack a Pascal VOC devkit, then read it map-style (drop-in VOCDetection) and as a stream.

    python examples/pack_and_iterate.py [VOC_ROOT] [--year 2007] [--num-images 64]

VOC_ROOT is torchvision's root (the folder holding VOCdevkit/) of any VOC-format dataset; its
year is found from the folder names unless --year is given. Without it a deterministic
synthetic sample of --num-images images is generated into a temporary folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from torchvision.datasets import VOCDetection
from torchvision.transforms import v2

from torch_serialized import VOCSerializedDataset, VOCSerializedIterableDataset, pack_voc
from torch_serialized.tools import make_synthetic_voc


def collate(batch: list[tuple[Any, Any]]) -> tuple[Any, ...]:
    """Detection images differ in size: keep a batch as (images, targets) tuples."""
    return tuple(zip(*batch))


def count(loader: DataLoader) -> tuple[str, float]:
    """("N samples in M batches", seconds) of one pass over ``loader``."""
    samples = batches = 0
    started = time.perf_counter()
    for images, _targets in loader:
        samples += len(images)
        batches += 1
    plural = "s" * (samples != 1), "es" * (batches != 1)
    done = f"{samples} sample{plural[0]} in {batches} batch{plural[1]}"
    return done, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", help="torchvision's VOC root (default: synthetic)")
    parser.add_argument("--year", help="VOC year of VOC_ROOT (default: found in its folders)")
    parser.add_argument("--num-images", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tser-example-") as tmp:
        if args.root:
            root = Path(args.root)
        else:
            root = make_synthetic_voc(Path(tmp) / "voc", args.num_images, year=args.year or "2012")

        # 1. Pack once: one file, and the same samples as shards of 16. Without a year,
        # pack_voc finds it from the folder names and says which it packed.
        single = pack_voc(root, Path(tmp) / "voc.tser", year=args.year)
        shards = pack_voc(root, Path(tmp) / "shards", year=args.year, max_samples_per_shard=16)
        print(
            f"packed {single.num_samples} samples of VOC{single.year}: {single.path.name} "
            f"{single.num_bytes / 1e6:.1f} MB in {single.seconds:.2f} s; "
            f"{len(list(shards.path.glob('*.tser')))} shards in {shards.path.name}/"
        )

        # 2. Map-style: a drop-in VOCDetection (same arguments, same samples, same order).
        dataset = VOCSerializedDataset(single.path, image_set="train")
        reference = VOCDetection(str(root), year=single.year, image_set="train")
        if len(dataset) == 0:
            sys.exit(f"error: the train image set of {root} is empty")
        image, target = dataset[0]
        same = target == reference[0][1] and image.tobytes() == reference[0][0].tobytes()
        objects = [o["name"] for o in target["annotation"].get("object", [])]
        print(
            f"map-style: {len(dataset)} train samples; sample 0 is {image.size[0]}x{image.size[1]} "
            f"with {objects}; identical to torchvision: {same}"
        )

        # With transforms v2 and tensor targets, through DataLoader workers.
        transforms = v2.Compose(
            [v2.ToImage(), v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True)]
        )
        dataset = VOCSerializedDataset(
            single.path, image_set="train", transforms=transforms, target_format="tv_tensors"
        )
        print(
            f"tv_tensors labels: {dataset.label_names[:6]}{' ...' * (len(dataset.label_names) > 6)}"
        )
        loader: DataLoader[Any] = DataLoader(
            dataset, batch_size=8, shuffle=True, num_workers=args.workers, collate_fn=collate
        )
        done, seconds = count(loader)
        print(f"map-style DataLoader: {done}, {seconds:.2f} s")

        # 3. Iterable: blocks of records read in storage order, shuffled per epoch, split
        # across DataLoader workers (and ranks under torch.distributed).
        stream = VOCSerializedIterableDataset(
            shards.path,
            "train",
            shuffle=True,
            seed=0,
            transforms=transforms,
            target_format="tv_tensors",
        )
        loader = DataLoader(stream, batch_size=8, num_workers=args.workers, collate_fn=collate)
        for epoch in range(2):
            stream.set_epoch(epoch)
            done, seconds = count(loader)
            print(f"iterable: epoch {epoch}: {done}, {seconds:.2f} s (len {len(stream)})")


if __name__ == "__main__":
    main()
