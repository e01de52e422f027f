"""Stream a packed VOC dataset from S3 (or any fsspec URL) through the local cache.

    python examples/stream_from_s3.py [VOC_ROOT] [--year 2007] [--num-images 200] [--workers 2]
    python examples/stream_from_s3.py --url s3://bucket/prefix/voc [--storage-options JSON]

With ``--url``, streams the pack already at that URL with your usual credentials (AWS_PROFILE,
~/.aws, ``--storage-options``). Without it, no credentials are needed: the script starts a local
S3 server (moto, on 127.0.0.1; ``pip install 'moto[server]' s3fs``), packs VOC_ROOT (its year
found from the folder names unless --year is given; or a generated synthetic sample) straight
to ``s3://<bucket>/voc`` with ``pack_voc``, then streams it with
``VOCSerializedIterableDataset`` in a DataLoader: the workers download the shards they read,
ahead in the order the DataLoader reads them (``--prefetch``), each shard once into a cache
folder they share, and the samples are checked against the same pack read from local disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from torch_serialized import VOCSerializedIterableDataset, list_cache, pack_voc
from torch_serialized.tools import make_synthetic_voc

BUCKET = "torch-serialized-example"


def ids(batch: list[tuple[Any, Any]]) -> list[str]:
    return [target["annotation"]["filename"] for _, target in batch]


def stream(url: str, options: dict[str, Any] | None, cache: Path | None, args: Any) -> list[str]:
    ds = VOCSerializedIterableDataset(
        url,
        "trainval",
        shuffle=True,
        seed=0,
        decode="none",
        storage_options=options,
        cache_dir=cache,
        prefetch=args.prefetch,
    )
    loader = DataLoader(ds, batch_size=8, num_workers=args.workers, collate_fn=ids)
    return [name for batch in loader for name in batch]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", help="a VOC root to pack (default: synthetic)")
    parser.add_argument("--year", help="VOC year of VOC_ROOT (default: found in its folders)")
    parser.add_argument("--url", help="stream this existing pack instead (your credentials)")
    parser.add_argument("--storage-options", type=json.loads, help="fsspec options (JSON)")
    parser.add_argument("--num-images", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    args = parser.parse_args()

    if args.url:
        started = time.perf_counter()
        names = stream(args.url, args.storage_options, None, args)
        print(
            f"streamed {len(names)} samples from {args.url} in "
            f"{time.perf_counter() - started:.1f} s"
        )
        return

    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's line per request
    work = Path(tempfile.mkdtemp(prefix="tser-"))
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        options = {
            "key": "testing",  # moto accepts any credentials; nothing leaves 127.0.0.1
            "secret": "testing",
            "endpoint_url": endpoint,
            "client_kwargs": {"region_name": "eu-west-1"},
        }
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(BUCKET)
        root = (
            Path(args.root)
            if args.root
            else make_synthetic_voc(work / "voc", args.num_images, year=args.year or "2007")
        )
        url = f"s3://{BUCKET}/voc"
        result = pack_voc(
            root, url, year=args.year, max_samples_per_shard=25, storage_options=options
        )
        print(
            f"packed {result.num_samples} samples of VOC{result.year} to {url} "
            f"(local S3 server {endpoint})"
        )
        cache = work / "cache"
        started = time.perf_counter()
        names = stream(url, options, cache, args)
        seconds = time.perf_counter() - started
        print(f"streamed {len(names)} samples with {args.workers} workers in {seconds:.1f} s")
        local = pack_voc(root, work / "local", year=args.year, max_samples_per_shard=25).path
        same = stream(str(local), None, None, args) == names
        print(f"same samples, same order as the local pack: {same}")
        for pack in list_cache(cache):
            print(f"cache: {pack.objects} files, {pack.bytes / 1e6:.1f} MB of {pack.url}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
