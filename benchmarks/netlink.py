"""Remote streaming through an emulated WAN (``../shared/tools/netlink``), beside plain curl.

netlink serves a folder over three paths (20 ms + 100 MB/s, 20 ms alone, 100 MB/s alone) whose
wire costs almost no CPU, so a 2-core machine measures the loader, not a proxy. Start it first
(as root): ``netlink up --www DIR``; then::

    python benchmarks/netlink.py --www DIR            # 2,000 synthetic images, 3 repeats

It packs a synthetic VOC set into ``DIR/tsbench-remote`` (16 MiB shards), then per repeat and
path, interleaved: curl fetching the same files over one connection and 4 in parallel, and one
epoch of ``VOCSerializedIterableDataset(url, "trainval", decode="none")`` in a DataLoader, each
in a fresh process with an empty cache. It prints medians (min-max): MB/s over the epoch, the
first batch after ``iter(loader)``, and the bytes the server sent against the pack's size.
``--protocols http,s3`` also reads the pack as ``s3://tsbench-remote`` (netlink's path-style S3,
through s3fs: ``pip install s3fs``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PATHS = {"wan": "10.213.78.2", "lat": "10.213.79.2", "cap": "10.213.77.2"}
LOG = Path("/tmp/netlink/access.log")
EPOCH = r"""
import json, sys, time
from torch.utils.data import DataLoader
from torch_serialized import VOCSerializedIterableDataset
url, workers, shuffle, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
start = time.perf_counter()
ds = VOCSerializedIterableDataset(url, "trainval", decode="none", shuffle=shuffle, cache_dir=cache)
opened = time.perf_counter()
loader = DataLoader(ds, batch_size=32, num_workers=workers, collate_fn=len)
first, samples = None, 0
for n in loader:
    first = time.perf_counter() - opened if first is None else first
    samples += n
print(json.dumps({"open": opened - start, "first": first, "epoch": time.perf_counter() - opened,
                  "samples": samples}))
"""


def log_size() -> int:
    return LOG.stat().st_size if LOG.exists() else 0


def sent_since(offset: int) -> int:
    with open(LOG, "rb") as f:
        f.seek(offset)
        return sum(int(line.split()[4]) for line in f.read().splitlines() if len(line.split()) > 4)


def curl(urls: list[str], parallel: int) -> float:
    """Seconds for curl to GET ``urls`` (one connection in turn, or ``parallel`` at once)."""
    args = ["curl", "-s", "--no-progress-meter", "--fail"]
    if parallel > 1:
        args += ["--parallel", "--parallel-max", str(parallel)]
    for url in urls:
        args += ["-o", "/dev/null", url]
    start = time.perf_counter()
    subprocess.run(args, check=True)
    return time.perf_counter() - start


def epoch(url: str, workers: int, shuffle: bool, host: str) -> dict[str, float]:
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL_S3": f"http://{host}",  # netlink's S3: any credentials work
        **{"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "x"},
    }
    with tempfile.TemporaryDirectory(prefix="tsbench-cache-") as cache:
        argv = [sys.executable, "-c", EPOCH, url, str(workers), "1" if shuffle else "0", cache]
        out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.splitlines()[-1])


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    low, mid, high = (fmt.format(v) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid} ({low}-{high})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--www", type=Path, required=True, help="the folder netlink serves")
    parser.add_argument("--num-images", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paths", default="wan,lat,cap")
    parser.add_argument("--workers", default="2,0", help="DataLoader workers, comma-separated")
    parser.add_argument("--shuffle", action="store_true", help="shuffle=True epochs")
    parser.add_argument("--protocols", default="http", help="http, s3 or both, comma-separated")
    parser.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "tsbench-netlink"
    )
    args = parser.parse_args()
    if not LOG.exists():
        sys.exit("netlink is not up: run `../shared/tools/netlink/netlink up --www DIR` as root")
    from torch_serialized import pack_voc
    from torch_serialized.tools.synthetic import make_synthetic_voc

    root = args.work_dir / f"voc-{args.num_images}"
    if not (root / "VOCdevkit").is_dir():
        make_synthetic_voc(root, args.num_images, year="2012", segmentation_every=0)
    pack = args.www / "tsbench-remote"
    pack_voc(root, pack, max_shard_bytes=16 << 20, overwrite=True)
    os.chmod(args.www, 0o755)
    for p in [pack, *pack.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    files = sorted(p.name for p in pack.iterdir())
    size = sum((pack / name).stat().st_size for name in files)
    print(
        f"pack: {len(files) - 2} shards, {size / 1e6:.1f} MB; {args.repeats} repeats, interleaved"
    )
    rows: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for path in args.paths.split(","):
            base = f"http://{PATHS[path]}/tsbench-remote"
            urls = [f"{base}/{name}" for name in files]
            for parallel in (1, 4):
                rows.setdefault((path, f"curl, {parallel} at once"), []).append(
                    size / curl(urls, parallel) / 1e6
                )
            for protocol in args.protocols.split(","):
                for workers in map(int, args.workers.split(",")):
                    offset = log_size()
                    url = base if protocol == "http" else "s3://tsbench-remote"
                    got = epoch(url, workers, args.shuffle, PATHS[path])
                    time.sleep(0.2)  # nginx writes its log line after the response
                    name = f"ours{'' if protocol == 'http' else ' ' + protocol}, {workers} workers"
                    rows.setdefault((path, name), []).append(size / got["epoch"] / 1e6)
                    rows.setdefault((path, name + ": first batch s"), []).append(got["first"])
                    rows.setdefault((path, name + ": bytes sent / pack"), []).append(
                        sent_since(offset) / size
                    )
    print("\n| path | what | median (min-max) |\n|---|---|---|")
    for (path, what), values in rows.items():
        unit = "" if ":" in what else " MB/s"
        fmt = "{:.2f}" if ":" in what else "{:.1f}"
        print(f"| {path} | {what} | {spread(values, fmt)}{unit} |")


if __name__ == "__main__":
    main()
