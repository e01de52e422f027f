"""The peers of ``netlink.py``: WebDataset, Mosaic Streaming and LitData over the same wire.

Issue #36: our remote streaming is only worth its numbers beside what users would use instead,
measured in the same run, on the same path, from the same images. ``write_peers`` writes the
synthetic VOC set that ``netlink.py`` packs into each peer's own format (about 16 MB shards,
JPEG bytes + the VOC target as JSON, in ``trainval`` order) under ``DIR/peers-<name>``;
``PEER_EPOCHS`` holds, per peer, the script that times one epoch in a fresh process with an
empty cache, printing the same JSON line as ours (open, first and second batch, epoch, samples).

How each peer reads from netlink (``HOST`` is the path's address):

- WebDataset: ``http://HOST/peers-webdataset/shard-NNNNNN.tar`` (its gopen pipes ``curl``).
- Mosaic: ``StreamingDataset(remote="s3://peers-mosaic")``; boto3, ``S3_ENDPOINT_URL``; the
  parent's client is dropped before the workers fork (see the script).
- LitData: ``StreamingDataset("s3://peers-litdata")``; boto3 (``AWS_ENDPOINT_URL``) for the
  index, obstore for the chunks, told to accept plain http.

The peers are never dependencies of the package: install them in a benchmark-only environment
(``pip install webdataset==1.0.2 mosaicml-streaming==0.13.0 litdata==0.2.76 boto3``).
"""

from __future__ import annotations

import json
import os
import shutil
import xml.etree.ElementTree as ET
from functools import partial
from pathlib import Path

PEERS = ("webdataset", "mosaic", "litdata")
SHARD_BYTES = 16_000_000

# An epoch script is EPOCH_HEAD, code making ``ds`` (and ``start``), then EPOCH_LOOP; argv:
# url, workers, shuffle, cache dir. It prints one JSON line: open, first and second batch (the
# second worker's first with 2 workers), epoch, samples.
EPOCH_LOOP = r"""
opened = time.perf_counter()
loader = DataLoader(ds, batch_size=32, num_workers=int(sys.argv[2]), collate_fn=len)
arrived, samples = [], 0
for n in loader:
    arrived.append(time.perf_counter() - opened)
    samples += n
print(json.dumps({"open": opened - start, "first": arrived[0], "second": arrived[1],
                  "epoch": time.perf_counter() - opened, "samples": samples}))
"""
EPOCH_HEAD = "import json, sys, time\nfrom torch.utils.data import DataLoader\n"
PEER_EPOCHS = {
    "webdataset": EPOCH_HEAD
    + r"""
import webdataset as wds
urls = json.loads(sys.argv[1])
start = time.perf_counter()
ds = wds.WebDataset(urls, shardshuffle=False).to_tuple("jpg", "json").map_tuple(bytes, json.loads)
"""
    + EPOCH_LOOP,
    "mosaic": EPOCH_HEAD
    + r"""
from streaming import StreamingDataset
start = time.perf_counter()
ds = StreamingDataset(remote=sys.argv[1], local=sys.argv[4], batch_size=32, shuffle=False)
# Mosaic 0.13 keeps the boto3 client that fetched index.json; forked workers would share its
# keep-alive socket (stalls of download_timeout, 60 s, and corrupt samples): drop it first.
for stream in ds.streams:
    stream._downloader.clean_up()
"""
    + EPOCH_LOOP,
    "litdata": EPOCH_HEAD
    + r"""
from litdata import StreamingDataset
from litdata.streaming import downloader
# obstore (LitData's chunk GETs) refuses plain http; real S3 is https, netlink has no TLS.
downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": True}
class Samples(StreamingDataset):
    def __getitem__(self, index):
        sample = super().__getitem__(index)
        return sample["image"], json.loads(sample["target"])
start = time.perf_counter()
ds = Samples(sys.argv[1], cache_dir=sys.argv[4])
"""
    + EPOCH_LOOP,
}


def peer_url(peer: str, host: str, www: Path) -> str:
    """The argument ``PEER_EPOCHS[peer]`` reads from: shard URLs (JSON) or an S3 prefix."""
    if peer == "webdataset":
        names = sorted(p.name for p in (www / "peers-webdataset").glob("*.tar"))
        return json.dumps([f"http://{host}/peers-webdataset/{name}" for name in names])
    return f"s3://peers-{peer}"


def voc_samples(voc_root: Path) -> tuple[list[str], list[str]]:
    """The ``trainval`` image and annotation paths, in list order (torchvision's lists)."""
    from torchvision.datasets import VOCDetection

    tv = VOCDetection(str(voc_root), year="2012", image_set="trainval")
    return tv.images, tv.annotations


def read_sample(images: list[str], annotations: list[str], index: int) -> tuple[bytes, str]:
    """JPEG bytes and torchvision's target dict as JSON, for sample ``index``."""
    from torchvision.datasets import VOCDetection

    root = ET.parse(annotations[index]).getroot()
    target = VOCDetection.parse_voc_xml(root)
    return Path(images[index]).read_bytes(), json.dumps(target)


def _litdata_item(images: list[str], annotations: list[str], index: int) -> dict[str, object]:
    image, target = read_sample(images, annotations, index)
    return {"image": image, "target": target}


def write_peers(voc_root: Path, www: Path, peers: list[str]) -> dict[str, int]:
    """Write each of ``peers``'s format under ``www/peers-<name>``; return its size in bytes."""
    images, annotations = voc_samples(voc_root)
    sizes = {}
    for peer in peers:
        out = www / f"peers-{peer}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        if peer == "webdataset":
            import webdataset as wds

            pattern = str(out / "shard-%06d.tar")
            with wds.ShardWriter(pattern, maxsize=SHARD_BYTES, verbose=0) as sink:
                for i in range(len(images)):
                    image, target = read_sample(images, annotations, i)
                    sink.write({"__key__": f"{i:06d}", "jpg": image, "json": target.encode()})
        elif peer == "mosaic":
            from streaming import MDSWriter

            columns = {"image": "bytes", "target": "json"}
            with MDSWriter(out=str(out), columns=columns, size_limit=SHARD_BYTES) as sink:
                for i in range(len(images)):
                    image, target = read_sample(images, annotations, i)
                    sink.write({"image": image, "target": json.loads(target)})
        elif peer == "litdata":
            from litdata import optimize

            item = partial(_litdata_item, images, annotations)
            optimize(
                fn=item,
                inputs=list(range(len(images))),
                output_dir=str(out),
                chunk_bytes=SHARD_BYTES,
                num_workers=1,
            )
        else:
            raise ValueError(f"unknown peer {peer!r}: choose from {', '.join(PEERS)}")
        files = [p for p in out.rglob("*") if p.is_file()]
        for p in [out, *out.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        sizes[peer] = sum(p.stat().st_size for p in files)
    return sizes
