"""Train on VOC2007 + VOC2012 trainval in one stream ("07+12"), then evaluate on VOC2007 test.

    python examples/train_07_12.py [VOC_ROOT] [--steps 5] [--num-images 32] [--year Y]

VOC_ROOT is torchvision's root (holding VOCdevkit/VOC2007 and VOCdevkit/VOC2012, as
``VOCDetection(VOC_ROOT, year, ...)`` takes it); each year found there is packed once (--year
keeps one), and one ``VOCSerializedIterableDataset`` streams the trainval sets of all of them,
shuffled across years, with one label space. Without VOC_ROOT, a synthetic root with both
years is generated into a temporary folder. Runs on the CPU; no weights are downloaded.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn
from torchvision.transforms import v2

from torch_serialized import VOCSerializedDataset, VOCSerializedIterableDataset, info, pack_voc
from torch_serialized.tools import make_synthetic_voc


def collate(batch: list[tuple[Any, Any]]) -> tuple[Any, ...]:
    return tuple(zip(*batch))


def pack_years(root: Path, years: list[str], out: Path) -> dict[str, Path]:
    """Each year's pack (a shard folder, as a large set would be packed)."""
    packs = {}
    for year in years:
        result = pack_voc(root, out / f"voc{year}", year=year, max_samples_per_shard=256)
        print(f"packed {result.num_samples} samples of VOC{year}")
        packs[year] = Path(result.path)
    return packs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", help="torchvision's VOC root (default: generated)")
    parser.add_argument("--year", help="use only this year of VOC_ROOT")
    parser.add_argument("--num-images", type=int, default=32, help="per generated year")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory(prefix="tser-example-") as tmp:
        root = Path(args.root) if args.root else Path(tmp, "voc")
        if not args.root:
            for year in ("2007", "2012"):
                make_synthetic_voc(root, args.num_images, year=year)
        found = sorted(p.name[3:] for p in (root / "VOCdevkit").glob("VOC20[0-9][0-9]"))
        years = [args.year] if args.year else found
        packs = pack_years(root, years, Path(tmp))

        transforms = v2.Compose(
            [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.SanitizeBoundingBoxes()]
        )
        train = VOCSerializedIterableDataset(
            [packs[year] for year in years],
            "trainval",
            shuffle=True,
            transforms=transforms,
            target_format="tv_tensors",
        )
        names = train.label_names
        print(f"streaming {len(years)} pack(s), VOC{train.year} trainval: {len(train)} samples")
        print(f"one label space for all: {len(names) - 1} classes after {names[0]!r}")
        batch_size = max(1, min(args.batch_size, len(train) // max(1, args.workers)))
        loader: DataLoader[Any] = DataLoader(
            train, batch_size=batch_size, num_workers=args.workers, collate_fn=collate
        )
        model = fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None,
            weights_backbone=None,
            num_classes=len(names),
            rpn_post_nms_top_n_train=256,  # fewer proposals: a CPU step near a second
            box_batch_size_per_image=64,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)
        model.train()
        step, epoch, started = 0, 0, time.perf_counter()
        while step < args.steps:
            train.set_epoch(epoch)
            for images, targets in loader:
                targets = [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets]
                loss = sum(model(list(images), targets).values())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                print(f"step {step}: loss {loss.item():.3f}")
                if step == args.steps:
                    break
            epoch += 1
        print(f"trained {step} steps in {time.perf_counter() - started:.1f} s")

        if "2007" not in packs:
            print("no VOC2007 pack: skipped the evaluation on VOC2007 test")
            return
        if "test" not in info(packs["2007"]).image_sets.get("Main", {}):
            print("VOC2007 has no test image set here: skipped the evaluation")
            return
        test = VOCSerializedDataset(  # labels as in training: classes=names
            packs["2007"],
            "2007",
            "test",
            transforms=transforms,
            target_format="tv_tensors",
            classes=names,
        )
        model.eval()
        detections = 0
        with torch.no_grad():
            for i in range(min(len(test), 8)):
                image, _ = test[i]
                detections += len(model([image])[0]["boxes"])
        print(f"evaluated on {min(len(test), 8)} VOC2007 test images: {detections} detections")


if __name__ == "__main__":
    main()
