"""Train torchvision's LR-ASPP (MobileNetV3) for a few steps on packed VOC segmentation masks.

    python examples/segmentation.py [VOC_ROOT | PACK] [--steps 4] [--num-images 64]

``VOCSerializedSegmentation`` is a drop-in ``VOCSegmentation``: it returns the same PIL image
and palette mask, and ``wrap_dataset_for_transforms_v2`` turns the mask into a
``tv_tensors.Mask`` so one transforms v2 pipeline crops and flips image and mask together.
VOC_ROOT needs ImageSets/Segmentation lists and SegmentationClass masks whose values are class
indices below --num-classes (VOC: 21) or 255 (ignored). Its year is found from the folder
names unless --year is given. Without PACK or VOC_ROOT a synthetic sample is generated into a
temporary folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import tv_tensors
from torchvision.datasets import VOCSegmentation, wrap_dataset_for_transforms_v2
from torchvision.models.segmentation import lraspp_mobilenet_v3_large
from torchvision.transforms import v2

from torch_serialized import VOCSerializedSegmentation, pack_voc
from torch_serialized.tools import make_synthetic_voc

IGNORE = 255  # VOC's "void" border around objects


def prepare(source: str | None, year: str | None, num_images: int, tmp: Path) -> Path:
    """A pack to train on: ``source`` if it is one, else ``source`` (or a sample) packed."""
    if source and (Path(source).suffix == ".tser" or Path(source, "manifest.json").exists()):
        return Path(source)
    if source:
        root = Path(source)
    else:
        root = make_synthetic_voc(tmp / "voc", num_images, year=year or "2012")
    result = pack_voc(root, tmp / "voc.tser", year=year)
    print(f"packed {result.num_samples} samples of VOC{result.year} from {result.voc_root}")
    return result.path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", help="a pack or torchvision's VOC root")
    parser.add_argument("--year", help="VOC year of VOC_ROOT (default: found in its folders)")
    parser.add_argument("--num-images", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--crop", type=int, default=192)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-classes", type=int, default=21, help="mask classes (VOC: 21)")
    args = parser.parse_args()
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory(prefix="tser-example-") as tmp:
        path = prepare(args.source, args.year, args.num_images, Path(tmp))
        transforms = v2.Compose(
            [
                v2.ToImage(),
                v2.RandomResizedCrop((args.crop, args.crop), scale=(0.3, 1.0)),  # masks: nearest
                v2.RandomHorizontalFlip(),
                v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
                v2.ToDtype({tv_tensors.Mask: torch.int64, "others": None}),
            ]
        )
        try:
            dataset = VOCSerializedSegmentation(path, image_set="train", transforms=transforms)
        except ValueError:  # no Segmentation lists: a detection-only dataset
            sys.exit(
                f"error: {args.source or 'the sample'} has no Segmentation train list "
                "(ImageSets/Segmentation/train.txt); this example trains on SegmentationClass "
                "masks, so give it a dataset that has them"
            )
        drop_in = isinstance(dataset, VOCSegmentation)
        print(f"{len(dataset)} train masks in {path}; a VOCSegmentation: {drop_in}")
        if len(dataset) == 0:
            sys.exit(f"error: the Segmentation train image set of {path} is empty")
        dataset = wrap_dataset_for_transforms_v2(dataset)  # PIL mask -> tv_tensors.Mask
        # Every batch full (drop_last: a last batch of one image would give BatchNorm a
        # single value per channel deep in the network), so a set smaller than a batch
        # makes the batch smaller.
        batch_size = min(args.batch_size, len(dataset))
        if batch_size < args.batch_size:
            print(f"only {len(dataset)} train masks: batch size {batch_size}")
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=args.workers,
            drop_last=True,
        )
        model = lraspp_mobilenet_v3_large(
            weights=None, weights_backbone=None, num_classes=args.num_classes
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss(ignore_index=IGNORE)
        model.train()

        step, started = 0, time.perf_counter()
        while step < args.steps:
            for images, masks in loader:
                masks = masks.squeeze(1)  # (N, 1, H, W) -> (N, H, W) class indices
                labels = masks[masks != IGNORE]
                if labels.numel() and int(labels.max()) >= args.num_classes:
                    sys.exit(
                        f"error: a mask holds class {int(labels.max())}; pass --num-classes "
                        f"{int(labels.max()) + 1} (or more) for this dataset"
                    )
                loss = loss_fn(model(images)["out"], masks)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                labelled = (masks != IGNORE) & (masks != 0)
                print(
                    f"step {step}: loss {loss.item():.3f}, batch {tuple(images.shape)}, "
                    f"{labelled.float().mean().item():.0%} object pixels"
                )
                if step == args.steps:
                    break
        print(f"trained {step} steps in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
