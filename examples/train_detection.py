"""Train torchvision's Faster R-CNN (MobileNetV3, 320px) for a few steps on a packed VOC set.

    python examples/train_detection.py [VOC_ROOT | PACK] [--steps 5] [--num-images 64]

PACK is a .tser file or shard folder; VOC_ROOT (any VOC-format dataset, custom classes
included; its year is found from the folder names unless --year is given) is packed first.
Without either, a synthetic sample is generated into a temporary folder. Runs on the CPU; no
weights are downloaded. The dataset returns ``tv_tensors`` targets, so transforms v2 move the
boxes with the image; the model gets one output per label name of the dataset.
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
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn
from torchvision.transforms import v2

from torch_serialized import VOCSerializedDataset, pack_voc
from torch_serialized.tools import make_synthetic_voc


def collate(batch: list[tuple[Any, Any]]) -> tuple[Any, ...]:
    """Detection images differ in size: keep a batch as (images, targets) tuples."""
    return tuple(zip(*batch))


def prepare(source: str | None, year: str | None, num_images: int, tmp: Path) -> Path:
    """A pack to train on: ``source`` if it is one, else ``source`` (or a sample) packed."""
    if source is not None and (
        Path(source).suffix == ".tser" or Path(source, "manifest.json").exists()
    ):
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
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory(prefix="tser-example-") as tmp:
        path = prepare(args.source, args.year, args.num_images, Path(tmp))
        transforms = v2.Compose(
            [
                v2.ToImage(),
                v2.RandomHorizontalFlip(p=0.5),
                v2.ToDtype(torch.float32, scale=True),
                v2.SanitizeBoundingBoxes(),  # drops degenerate boxes and their "labels"
            ]
        )
        # Labels: 0 is the background, as the model expects, then VOC's 20 classes (or a
        # custom dataset's own classes): dataset.label_names says which.
        dataset = VOCSerializedDataset(
            path, image_set="train", transforms=transforms, target_format="tv_tensors"
        )
        if len(dataset) == 0:
            sys.exit(f"error: the train image set of {path} is empty; nothing to train on")
        # Every batch full (drop_last), so a set smaller than a batch makes the batch smaller.
        batch_size = min(args.batch_size, len(dataset))
        if batch_size < args.batch_size:
            print(f"only {len(dataset)} train samples: batch size {batch_size}")
        loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=args.workers,
            collate_fn=collate,
            drop_last=True,
        )
        # Fewer sampled proposals than the defaults (2000 / 512) keep a CPU step near a
        # second; drop these two arguments for real training.
        model = fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None,
            weights_backbone=None,
            num_classes=len(dataset.label_names),
            rpn_post_nms_top_n_train=256,
            box_batch_size_per_image=64,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)
        model.train()
        classes = len(dataset.label_names) - 1
        names = ", ".join(dataset.label_names[1:6]) + (
            ", ..." if len(dataset.label_names) > 6 else ""
        )
        print(
            f"training on {len(dataset)} samples of {path}, batch {batch_size}, CPU; "
            f"{classes} class{'es' * (classes != 1)} ({names})"
        )

        step, started = 0, time.perf_counter()
        while step < args.steps:
            for images, targets in loader:
                targets = [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets]
                losses = model(list(images), targets)
                loss = sum(losses.values())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                parts = ", ".join(
                    f"{k.removeprefix('loss_')} {v.item():.3f}" for k, v in losses.items()
                )
                print(f"step {step}: loss {loss.item():.3f} ({parts})")
                if step == args.steps:
                    break
        print(f"trained {step} steps in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
