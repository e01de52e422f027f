"""Remote streaming through an emulated WAN (``../shared/tools/netlink``), beside plain curl.

netlink serves a folder over three paths (20 ms + 100 MB/s, 20 ms alone, 100 MB/s alone) whose
wire costs almost no CPU, so a 2-core machine measures the loader, not a proxy. Start it first
(as root): ``netlink up --www DIR``; then::

    python benchmarks/netlink.py --www DIR            # 2,000 synthetic images, 3 repeats

It packs a synthetic VOC set into ``DIR/tsbench-remote`` (16 MiB shards), then per repeat and
path, interleaved: curl fetching the same files over one connection and 4 in parallel, and one
epoch of ``VOCSerializedIterableDataset(url, "trainval", decode="none")`` in a DataLoader, each
in a fresh process with an empty cache. It prints medians (min-max): MB/s over the epoch, the
first and second batch after ``iter(loader)`` (with 2 workers the second is the second
worker's first), and the bytes the server sent against the pack's size.
``--protocols http,s3`` also reads the pack as ``s3://tsbench-remote`` (netlink's path-style S3,
through s3fs: ``pip install s3fs``). ``--peers webdataset,mosaic,litdata`` writes the same images
in those formats and times their epochs beside ours (``netlink_peers.py``; they run in a
benchmark-only environment, never the package's).
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

from netlink_peers import EPOCH_HEAD, EPOCH_LOOP, PEER_EPOCHS, peer_url, write_peers

Rows = dict[tuple[str, str], list[float]]
PATHS = {"wan": "10.213.78.2", "lat": "10.213.79.2", "cap": "10.213.77.2"}
LOG = Path("/tmp/netlink/access.log")
EPOCH = (
    EPOCH_HEAD
    + r"""
from torch_serialized import VOCSerializedIterableDataset
url, shuffle, cache = sys.argv[1], sys.argv[3] == "1", sys.argv[4]
start = time.perf_counter()
ds = VOCSerializedIterableDataset(url, "trainval", decode="none", shuffle=shuffle, cache_dir=cache)
"""
    + EPOCH_LOOP
)


def log_size() -> int:
    return LOG.stat().st_size if LOG.exists() else 0


def sent_since(offset: int, host: str, folder: str) -> int:
    """Bytes sent for ``/folder/...`` on ``host`` since ``offset`` (others may share the log)."""
    with open(LOG, "rb") as f:
        f.seek(offset)
        lines = [line.split() for line in f.read().decode().splitlines()]
    mine = [w for w in lines if len(w) > 4 and w[0] == host and w[2].startswith(f"/{folder}/")]
    return sum(int(w[4]) for w in mine)


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


def epoch(
    url: str, workers: int, shuffle: bool, host: str, script: str = EPOCH
) -> dict[str, float] | None:
    """Run ``script`` (argv: url, workers, shuffle, cache) in a fresh process, empty cache;
    ``None``, with the error printed, when it fails (one failed system spoils no other row)."""
    endpoint = f"http://{host}"  # netlink's S3: any credentials work
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL_S3": endpoint,  # s3fs (ours) and boto3
        "AWS_ENDPOINT_URL": endpoint,  # boto3 (LitData's S3Client)
        "S3_ENDPOINT_URL": endpoint,  # Mosaic 0.13 (streaming/base/storage/download.py)
        **{"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "x"},
    }
    with tempfile.TemporaryDirectory(prefix="tsbench-cache-") as cache:
        argv = [sys.executable, "-c", script, url, str(workers), "1" if shuffle else "0", cache]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode:
        print(f"FAILED: {url[:80]}, {workers} workers:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.splitlines()[-1])


def record(
    rows: Rows, path: str, name: str, got: dict[str, float], size: int, offset: int, folder: str
) -> None:
    """Add one epoch's figures (MB/s of ``size`` bytes, first two batches, open, samples, the
    bytes sent for ``folder`` in the log since ``offset``)."""
    time.sleep(0.2)  # nginx writes its log line after the response
    rows.setdefault((path, name), []).append(size / got["epoch"] / 1e6)
    for key, what in (
        ("first", "first batch s"),
        ("second", "second batch s"),
        ("open", "open s"),
        ("samples", "samples"),
    ):
        rows.setdefault((path, f"{name}: {what}"), []).append(got[key])
    rows.setdefault((path, name + ": bytes sent / pack"), []).append(
        sent_since(offset, PATHS[path], folder) / size
    )


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
    parser.add_argument("--peers", default="", help="webdataset,mosaic,litdata (netlink_peers.py)")
    parser.add_argument("--pack-name", default="tsbench-remote", help="our pack's folder in --www")
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
    pack = args.www / args.pack_name
    pack_voc(root, pack, max_shard_bytes=16 << 20, overwrite=True)
    os.chmod(args.www, 0o755)
    for p in [pack, *pack.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    files = sorted(p.name for p in pack.iterdir())
    size = sum((pack / name).stat().st_size for name in files)
    print(
        f"pack: {len(files) - 2} shards, {size / 1e6:.1f} MB; {args.repeats} repeats, interleaved"
    )
    peers = [p for p in args.peers.split(",") if p]
    peer_sizes = write_peers(root, args.www, peers) if peers else {}
    for peer, peer_size in peer_sizes.items():
        print(f"{peer}: {peer_size / 1e6:.1f} MB ({peer_size / size:.3f} of our pack)")
    rows: Rows = {}
    for _ in range(args.repeats):
        for path in args.paths.split(","):
            base = f"http://{PATHS[path]}/{args.pack_name}"
            urls = [f"{base}/{name}" for name in files]
            for parallel in (1, 4):
                rows.setdefault((path, f"curl, {parallel} at once"), []).append(
                    size / curl(urls, parallel) / 1e6
                )
            for protocol in args.protocols.split(","):
                for workers in map(int, args.workers.split(",")):
                    offset = log_size()
                    url = base if protocol == "http" else f"s3://{args.pack_name}"
                    got = epoch(url, workers, args.shuffle, PATHS[path])
                    name = f"ours{'' if protocol == 'http' else ' ' + protocol}, {workers} workers"
                    if got:
                        record(rows, path, name, got, size, offset, args.pack_name)
            for peer in peers:
                for workers in map(int, args.workers.split(",")):
                    offset = log_size()
                    url = peer_url(peer, PATHS[path], args.www)
                    got = epoch(url, workers, False, PATHS[path], PEER_EPOCHS[peer])
                    if got:
                        name = f"{peer}, {workers} workers"
                        record(rows, path, name, got, peer_sizes[peer], offset, f"peers-{peer}")
    print("\n| path | what | median (min-max) |\n|---|---|---|")
    for (path, what), values in rows.items():
        unit = "" if ":" in what else " MB/s"
        fmt = "{:.0f}" if what.endswith("samples") else "{:.2f}" if ":" in what else "{:.1f}"
        print(f"| {path} | {what} | {spread(values, fmt)}{unit} |")
    listed = root / "VOCdevkit/VOC2012/ImageSets/Main/trainval.txt"
    expected = len(listed.read_text().split())
    for (path, what), values in rows.items():
        if what.endswith(": samples") and any(v != expected for v in values):
            print(f"INVALID: {path}, {what[:-9]} counted {values} samples, not {expected}")


if __name__ == "__main__":
    main()
