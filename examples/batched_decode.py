"""Read encoded images without decoding them, then decode whole batches at once (GPU if any).

    python examples/batched_decode.py [VOC_ROOT | PACK] [--batch-size 32] [--num-images 64]

With ``decode="none"`` the dataset returns each stored JPEG as a 1-D uint8 tensor, and with
``zero_copy=True`` that tensor is a read-only view of the mapped pack (no per-sample copy).
The main process gathers a batch of them and hands the list to one
``torchvision.io.decode_jpeg`` call: on a GPU that is nvJPEG decoding the batch, on the CPU
libjpeg. ``target_format="tv_tensors"`` gives boxes and labels ready for transforms v2
(VOC's labels, or a custom dataset's own classes). VOC_ROOT's year is found from the folder
names unless --year is given. Without PACK or VOC_ROOT a synthetic sample is generated into a
temporary folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torchvision
from torch.utils.data import BatchSampler, RandomSampler
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from torch_serialized import VOCSerializedDataset, pack_voc
from torch_serialized.tools import make_synthetic_voc

#: torchvision 0.19 and later decode a list of JPEGs in one call (nvJPEG's batched decode on
#: a GPU); older versions take one image per call.
BATCHED = tuple(int(part) for part in torchvision.__version__.split(".")[:2]) >= (0, 19)


def prepare(source: str | None, year: str | None, num_images: int, tmp: Path) -> Path:
    """A pack: the one given, or one packed from the VOC root given, or from a sample."""
    if source and (Path(source).suffix == ".tser" or (Path(source) / "manifest.json").is_file()):
        return Path(source)
    if source:
        root = Path(source)
    else:
        root = make_synthetic_voc(tmp / "voc", num_images, year=year or "2012")
    result = pack_voc(root, tmp / "voc.tser", year=year)
    print(f"packed {result.num_samples} samples of VOC{result.year} from {result.voc_root}")
    return result.path


def decode_batch(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """One ``decode_jpeg`` call for the whole batch (torchvision >= 0.19 takes a list; an
    older torchvision decodes the images one call each, the same pixels)."""
    with warnings.catch_warnings():  # torchvision 0.29 announces a move to TorchCodec
        warnings.simplefilter("ignore", DeprecationWarning)
        if BATCHED:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        return [decode_jpeg(image, mode=ImageReadMode.RGB, device=device) for image in data]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", help="a pack, or torchvision's VOC root")
    parser.add_argument("--year", help="VOC year of VOC_ROOT (default: found in its folders)")
    parser.add_argument("--image-set", default="trainval")
    parser.add_argument("--num-images", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    with tempfile.TemporaryDirectory(prefix="tser-example-") as tmp:
        pack = prepare(args.source, args.year, args.num_images, Path(tmp))
        dataset = VOCSerializedDataset(
            pack,
            image_set=args.image_set,
            decode="none",
            target_format="tv_tensors",
            zero_copy=True,
        )
        if len(dataset) == 0:
            sys.exit(f"error: image set {args.image_set!r} of {pack} is empty")
        resize = v2.Resize((224, 224), antialias=True)
        batches = BatchSampler(
            RandomSampler(dataset, generator=torch.Generator().manual_seed(0)),
            args.batch_size,
            drop_last=False,
        )
        read_s = decode_s = 0.0
        samples = 0
        for indices in batches:
            started = time.perf_counter()
            data, targets = zip(*(dataset[i] for i in indices))
            read_s += time.perf_counter() - started

            started = time.perf_counter()
            images = decode_batch(list(data), device)
            # Boxes follow the resize: tv_tensors carry their canvas size.
            resized = [
                resize(image, {"boxes": target["boxes"].to(device)})
                for image, target in zip(images, targets)
            ]
            batch = torch.stack([image for image, _ in resized])
            if device.type == "cuda":
                torch.cuda.synchronize()
            decode_s += time.perf_counter() - started
            samples += len(indices)
        print(
            f"{samples} samples on {device.type}: read {read_s * 1e6 / samples:.0f} µs/sample "
            f"(bytes + tv_tensors target), decode + resize {decode_s * 1e3 / samples:.2f} "
            f"ms/sample; last batch {tuple(batch.shape)}"
        )

        # The bytes decode to exactly what decode="tensor" returns (on the CPU: same libjpeg).
        reference = VOCSerializedDataset(pack, image_set=args.image_set, decode="tensor")
        checked = range(min(4, len(dataset)))
        first = decode_batch([dataset[i][0] for i in checked], torch.device("cpu"))
        same = all(torch.equal(first[i], reference[i][0]) for i in checked)
        print(f"batched decode equals decode='tensor': {same}")


if __name__ == "__main__":
    main()
