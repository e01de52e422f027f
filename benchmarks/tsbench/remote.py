"""The ``remote`` scenario: a sharded pack streamed from a loopback S3 server through a proxy.

Run only when asked (``--scenarios remote``; it needs the ``test`` extra's moto and s3fs). The
synthetic pack is cut into shards and uploaded to moto's S3 server on 127.0.0.1; every read
goes through the fault proxy (``tests/support/loopback.py``), which adds 20 ms to each request
and, for the capped rows, holds all responses together to 100 MB/s. Each remote epoch starts from an
empty cache. Side by side in one run:

* a 2-worker DataLoader epoch of ``VOCSerializedIterableDataset`` with ``decode="none"`` and
  with the default decode, under the cap (pack MB/s against the cap) and with the latency
  alone (samples/s against the same epoch from local disk with the page cache dropped);
* torchvision's ``VOCDetection`` reading the raw files through the same proxy, one request
  per file (``FsspecVOCDetection``, what a user without a pack would do), on a subset;
* bytes downloaded per epoch by 2 ranks x 2 workers sharing one cache, against the pack size;
* the proxy's own throughput without a cap (what the loopback servers can do on this machine).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tsbench.context import Bench
from tsbench.core import BATCH_SIZE, IMAGE_SET, MB, SEED, Row, Stat, rates
from tsbench.system import files_under

LATENCY = 0.020
CAP = 100e6
SHARD_BYTES = 8 << 20  # one ranged GET per shard (moto copies the object for every GET)
BUCKET = "tser-bench"
#: samples of the per-file torchvision baseline (each costs two requests of 20 ms)
TV_SAMPLES = 256
TARGET_CAP_SHARE = 0.8
TARGET_LOCAL_SHARE = 0.8
TARGET_TV = 10.0
TARGET_BYTES = 1.02


def _keep_lists(batch: list[tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
    images, targets = zip(*batch)
    return list(images), list(targets)


def _epoch(ds: Any, workers: int) -> int:
    """One DataLoader epoch over ``ds``; the samples seen."""
    from torch.utils.data import DataLoader

    loader = DataLoader(ds, batch_size=BATCH_SIZE, num_workers=workers, collate_fn=_keep_lists)
    return sum(len(images) for images, _ in loader)


def _stream(path: str, decode: Any, **kwargs: Any) -> Any:
    from torch_serialized import VOCSerializedIterableDataset

    return VOCSerializedIterableDataset(
        path, IMAGE_SET, shuffle=True, seed=SEED, decode=decode, **kwargs
    )


class FsspecVOCDetection:
    """``VOCDetection`` over files at a URL, one request per file, as torchvision parses them.

    What a user without a pack does: images and annotations fetched with fsspec
    (``cat_file``), then ``PIL.Image.open(...).convert("RGB")`` and
    ``VOCDetection.parse_voc_xml`` exactly as torchvision reads local files.
    """

    def __init__(self, url: str, ids: list[str], storage_options: dict[str, Any]) -> None:
        self.url, self.ids, self.storage_options = url.rstrip("/"), ids, storage_options
        self._fs: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.ids)

    def _filesystem(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            from fsspec.core import url_to_fs

            self._fs, self._root = url_to_fs(
                self.url, skip_instance_cache=True, **self.storage_options
            )
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_pid": -1}

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        import xml.etree.ElementTree as ET

        from PIL import Image
        from torchvision.datasets import VOCDetection

        fs = self._filesystem()
        image = fs.cat_file(f"{self._root}/JPEGImages/{self.ids[i]}.jpg")
        xml = fs.cat_file(f"{self._root}/Annotations/{self.ids[i]}.xml")
        img = Image.open(io.BytesIO(image)).convert("RGB")
        target = VOCDetection.parse_voc_xml(ET.fromstring(xml))
        return img, target


def _upload(store_url: str, options: dict[str, Any], files: list[tuple[Path, str]]) -> None:
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(store_url, **options)  # cached instance: one session for the run
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda f: fs.put_file(str(f[0]), f"{root}/{f[1]}"), files))


def _ranks(url: str, options: dict[str, Any], cache: Path, workers: int) -> int:
    """Two ranks (forked processes) with ``workers`` DataLoader workers each, one cache.

    Forked, not spawned: the row counts bytes, which do not depend on how a rank starts, and
    a spawned rank costs a torch import (a minute of the quick run for two ranks on 2 busy
    cores). tests/test_remote_datasets.py runs ranks as fresh interpreters.
    """
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                {
                    "url": url,
                    "options": options,
                    "cache": str(cache),
                    "rank": rank,
                    "workers": workers,
                },
            ),
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(1800)
        if proc.exitcode != 0:
            raise RuntimeError(f"remote benchmark rank failed with exit code {proc.exitcode}")
    return 0


def scenario_remote(b: Bench) -> list[Row]:
    tests = str(Path(__file__).resolve().parents[2] / "tests")
    if tests not in sys.path:  # the loopback servers of the tests (tests/support/loopback.py)
        sys.path.append(tests)
    from support.loopback import s3_storage_options, start_fault_proxy, start_s3_server

    from torch_serialized import pack_voc

    local = pack_voc(
        b.tv_root, b.work / "voc-remote-shards", year=b.year, max_shard_bytes=SHARD_BYTES
    ).path
    pack_files = sorted(Path(p) for p in files_under(local))
    pack_bytes = sum(p.stat().st_size for p in pack_files)
    workers = max(1, b.workers)
    tv_ids = [Path(p).stem for p in b.tv().images][:TV_SAMPLES]
    if b.quick:
        tv_ids = tv_ids[:32]
    caches = Path(tempfile.mkdtemp(prefix="caches-", dir=b.work))
    times: dict[str, list[float]] = {}
    sent: dict[str, list[int]] = {}
    details: dict[str, Any] = {"pack_bytes": pack_bytes, "shards": len(pack_files) - 2}

    def fresh_cache() -> Path:
        return Path(tempfile.mkdtemp(dir=caches))

    with start_s3_server() as server, start_fault_proxy(server.url) as proxy:
        direct = s3_storage_options(server.url)
        via_proxy = s3_storage_options(proxy.url)
        from fsspec.core import url_to_fs

        url_to_fs(f"s3://{BUCKET}", **direct)[0].mkdir(BUCKET)
        url = f"s3://{BUCKET}/voc"
        _upload(url, direct, [(p, p.name) for p in pack_files])
        voc = b.voc_root
        raw = [(voc / "JPEGImages" / f"{i}.jpg", f"JPEGImages/{i}.jpg") for i in tv_ids]
        raw += [(voc / "Annotations" / f"{i}.xml", f"Annotations/{i}.xml") for i in tv_ids]
        _upload(f"s3://{BUCKET}/raw", direct, raw)

        def timed(key: str, run: Any) -> None:
            proxy_stats = proxy.stats()
            t0 = time.perf_counter()
            n = run()
            times.setdefault(key, []).append(time.perf_counter() - t0)
            sent.setdefault(key, []).append(proxy.stats()["bytes_sent"] - proxy_stats["bytes_sent"])
            details.setdefault("samples", {})[key] = n

        def remote_epoch(decode: str) -> int:  # through the proxy, from an empty cache
            stream = _stream(url, decode, storage_options=via_proxy, cache_dir=fresh_cache())
            return _epoch(stream, workers)

        for _ in range(b.repeats):
            for decode in ("none", "pil"):
                b.cache.evict([str(p) for p in pack_files])
                timed(f"local_{decode}", lambda d=decode: _epoch(_stream(str(local), d), workers))
                proxy.configure(latency=LATENCY, bandwidth=None)
                timed(f"latency_{decode}", lambda d=decode: remote_epoch(d))
                proxy.configure(latency=LATENCY, bandwidth=CAP)
                timed(f"cap_{decode}", lambda d=decode: remote_epoch(d))
            proxy.configure(latency=LATENCY, bandwidth=CAP)
            tv = FsspecVOCDetection(f"s3://{BUCKET}/raw", tv_ids, via_proxy)
            timed("tv", lambda tv=tv: _epoch(tv, workers))
            proxy.configure(latency=0.0, bandwidth=None)
            timed("ranks", lambda: _ranks(url, via_proxy, fresh_cache(), workers))

            def pull() -> int:  # the proxy's own ceiling: every pack file, 4 at a time
                from fsspec.core import url_to_fs

                fs, root = url_to_fs(url, **via_proxy)
                names = [f"{root}/{p.name}" for p in pack_files]
                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(fs.cat_file, names))
                return 0

            timed("proxy", pull)
            shutil.rmtree(caches, ignore_errors=True)
            caches.mkdir()
    shutil.rmtree(caches, ignore_errors=True)

    n = details["samples"]["local_none"]
    mbps = lambda key: Stat.of([s / t / MB for s, t in zip(sent[key], times[key])])  # noqa: E731
    cap = Stat.of([CAP / MB])
    details.update(
        {
            "bytes_per_epoch": {k: v for k, v in sent.items()},
            "seconds": times,
            "latency_s": LATENCY,
            "cap_mb_s": CAP / MB,
            "workers": workers,
            "tv_samples": len(tv_ids),
        }
    )
    b.details["remote"] = details
    setup = f"S3 (moto) via proxy, {workers} workers, bs {BATCH_SIZE}, cold cache"
    tv_n = details["samples"]["tv"]
    return [
        Row(
            "remote_cap_mbps",
            "remote",
            f"{setup}, 20 ms + 100 MB/s cap, decode='none': pack MB/s",
            "MB/s",
            "rate",
            cap,
            mbps("cap_none"),
            target=TARGET_CAP_SHARE,
            note="baseline is the cap; ratio = share of the cap the epoch moves",
        ),
        Row(
            "remote_cap_pil",
            "remote",
            f"{setup}, 20 ms + 100 MB/s cap, default decode: pack MB/s",
            "MB/s",
            "rate",
            cap,
            mbps("cap_pil"),
            note="decode-bound on few cores: informative",
        ),
        Row(
            "remote_latency_none",
            "remote",
            f"{setup}, 20 ms, no cap, decode='none' vs local cold epoch",
            "samples/s",
            "rate",
            rates(n, times["local_none"]),
            rates(n, times["latency_none"]),
            target=TARGET_LOCAL_SHARE,
            note="baseline: the same iterable epoch from local disk, page cache dropped",
        ),
        Row(
            "remote_latency_pil",
            "remote",
            f"{setup}, 20 ms, no cap, default decode vs local cold epoch",
            "samples/s",
            "rate",
            rates(n, times["local_pil"]),
            rates(n, times["latency_pil"]),
            target=TARGET_LOCAL_SHARE,
        ),
        Row(
            "remote_vs_tv",
            "remote",
            f"{setup}, 20 ms + cap, decode='none' vs VOCDetection one request per file",
            "samples/s",
            "rate",
            rates(tv_n, times["tv"]),
            rates(n, times["cap_none"]),
            target=TARGET_TV,
            note=f"tv: fsspec reads of each image and XML, PIL decode, on {tv_n} samples",
        ),
        Row(
            "remote_bytes_2x2",
            "remote",
            "bytes downloaded per epoch, 2 ranks x 2 workers, one cache / pack size",
            "x",
            "limit",
            None,
            Stat.of([s / pack_bytes for s in sent["ranks"]]),
            target=TARGET_BYTES,
            note=f"pack {pack_bytes / MB:.1f} MB in {details['shards']} shards",
        ),
        Row(
            "remote_proxy_mbps",
            "remote",
            "the loopback S3 server + proxy alone, no cap: MB/s (4 parallel GETs)",
            "MB/s",
            "info",
            None,
            mbps("proxy"),
            note="the ceiling of the servers on this machine",
        ),
    ]


def _rank_main(spec: dict[str, Any]) -> None:
    ds = _stream(
        spec["url"],
        "none",
        storage_options=spec["options"],
        cache_dir=spec["cache"],
        rank=spec["rank"],
        world_size=2,
    )
    _epoch(ds, spec["workers"])
