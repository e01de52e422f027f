"""Pack-level helpers of the reliability tests (atomic, reader, fuzz, pack), and what their
child processes import.

spawn children unpickle their target by importing its module, and ``python -c`` children call
``child_main`` from here, so everything run in another process lives at module level. Nothing
here imports torch: ``light_import`` loads ``torch_serialized``'s reader and packer without the
package ``__init__`` (which imports torch), so those children start in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import random
import resource
import signal
import subprocess
import sys
import time
import types
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
#: ``pack_voc`` limits of the two pack forms.
PACK_FORMS: dict[str, dict[str, Any]] = {"single": {}, "shards": {"max_samples_per_shard": 5}}
#: The pack id, file-name token and history time ``pinned_identity`` gives every pack.
PACK_ID, TOKEN, PACKED_AT = "5eed" * 8, "0badcafe", "2000-01-01T00:00:00Z"


@contextlib.contextmanager
def pinned_identity() -> Iterator[None]:
    """Every pack written inside gets the same pack id, file-name token (random otherwise) and
    history time (the clock otherwise), so two writes of the same records can be compared
    byte for byte."""
    from torch_serialized.container import spec as fmt
    from torch_serialized.voc import records as pack

    with (
        mock.patch.object(fmt, "new_pack_id", lambda: PACK_ID),
        mock.patch.object(fmt, "new_token", lambda: TOKEN),
        mock.patch.object(pack, "utc_now", lambda: PACKED_AT),
    ):
        yield


def out_name(form: str) -> str:
    return "voc" if form == "shards" else "voc.tser"


def snapshot(path: Path) -> dict[str, bytes] | None:
    """Every byte of a pack (file or shard folder), or None if nothing is there."""
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    if path.is_file():
        return {"": path.read_bytes()}
    return None


def read_records(reader: Any) -> list[list[bytes]]:
    return [
        [bytes(reader.field(i, k)) for k in range(len(reader.fields))] for i in range(len(reader))
    ]


def run_child(command: str, *args: str) -> subprocess.Popen:
    """``child_main(command, *args)`` of this module in a fresh interpreter (no torch)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    code = "import sys, _reliability_helpers as h; h.child_main(*sys.argv[1:])"
    return subprocess.Popen(
        [sys.executable, "-c", code, command, *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def dead_pid() -> int:
    """The pid of a process that has exited (as a killed writer's would be)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def light_import() -> None:
    """Make ``torch_serialized`` importable without running its ``__init__`` (no torch)."""
    if "torch_serialized" not in sys.modules:
        package = types.ModuleType("torch_serialized")
        package.__path__ = [str(ROOT / "torch_serialized")]  # type: ignore[attr-defined]
        sys.modules["torch_serialized"] = package


# -- spawn targets ------------------------------------------------------------------------------
def crc_reader(path: str, rank: int, passes: int, barrier: Any, results: Any) -> None:
    """Open the pack, wait for every reader, then CRC every field in a random order ``passes``
    times; report ``(rank, pid, {(record, field): crc}, changed, torch_loaded)``."""
    light_import()
    from torch_serialized.container.shards import open_pack

    reader = open_pack(path)
    order = [(i, k) for i in range(len(reader)) for k in range(len(reader.fields))]
    rng = random.Random(rank)
    barrier.wait(timeout=120)
    crcs: dict[tuple[int, int], int] = {}
    changed = 0  # a field that read differently on a later pass
    for _ in range(passes):
        rng.shuffle(order)
        for i, k in order:
            crc = zlib.crc32(reader.field(i, k))
            changed += crcs.setdefault((i, k), crc) != crc
    results.put((rank, os.getpid(), crcs, changed, "torch" in sys.modules))


def read_pickled(blob: bytes) -> tuple[Any, ...]:
    """Unpickle a reader in this fresh process and read every record, last first."""
    light_import()
    reader = pickle.loads(blob)
    try:
        data = [
            [bytes(reader.field(i, k)) for k in range(len(reader.fields))]
            for i in reversed(range(len(reader)))
        ]
    except Exception as exc:  # the test inspects it
        return ("error", type(exc).__name__, isinstance(exc, OSError), str(exc))
    return ("ok", data[::-1])


# -- DataLoader pieces (the DataLoader forks its workers; no torch import needed here) ---------
class PidDataset:
    """Wraps a map-style dataset; item ``i`` is ``(pid of the process that read it, item)``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        return os.getpid(), self.dataset[i]


def list_collate(batch: list[Any]) -> list[Any]:
    """Batches as plain lists: VOC targets are dicts of strings, not stackable."""
    return list(batch)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter, what MALLOC_MMAP_THRESHOLD_ sets


def pin_mmap_threshold(worker_id: int) -> None:
    """worker_init_fn: fix glibc's mmap threshold at its 128 KiB default.

    glibc raises the threshold each time a large mmapped block is freed, so later decoded
    images (~560 KB each) come from the heap, whose freed space the process keeps: a worker's
    USS climbs 15-30 MB over the first epochs and then plateaus. That is allocator caching, not
    a leak; pinning the threshold hands freed images back to the kernel, so what a leak test
    sees is what the code keeps alive.
    """
    ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024)


# -- ``python -c`` children -----------------------------------------------------------------------
def child_main(command: str, *args: str) -> None:
    """Entry point of the subprocesses the tests start (see each function)."""
    light_import()
    {"slow_pack": slow_pack, "pack_and_report": pack_and_report, "repack": repack}[command](*args)


def slow_pack(root: str, output: str, options: str, per_image: str) -> None:
    """``pack_voc`` with a pause before each image is read (a slow source disk), so that a
    SIGKILL sent at a random moment lands while the pack is being written."""
    from torch_serialized.voc import pack, records

    load, pause = records.load, float(per_image)

    def slow_load(job: Any, *args: Any) -> Any:
        time.sleep(pause)
        return load(job, *args)

    records.load = slow_load  # type: ignore[assignment]
    print("started", flush=True)
    with pinned_identity():  # the test compares what is left with packs it wrote itself
        pack.pack_voc(root, output, year="2007", **json.loads(options))
    print("done", flush=True)


def pack_and_report(root: str, folder: str, fsize: str, workers: str = "1") -> None:
    """Pack ``root`` into ``folder`` as one file and as shards with ``workers`` processes, the
    file size limited to ``fsize`` bytes (0: no limit; pack workers inherit the limit); print
    what each raised and what was left in ``folder``."""
    from torch_serialized.errors import WriteError
    from torch_serialized.voc.pack import pack_voc

    if int(fsize):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(fsize), hard))
    results: dict[str, Any] = {}
    for name, options in (("voc.tser", {}), ("voc", {"max_samples_per_shard": 5})):
        try:
            pack_voc(root, os.path.join(folder, name), year="2007", workers=int(workers), **options)  # type: ignore[arg-type]
            results[name] = None
        except WriteError as exc:
            results[name] = {
                "error": type(exc).__name__,
                "oserror": isinstance(exc, OSError),
                "errno": exc.errno,
                "message": str(exc),
            }
    results["left"] = sorted(os.listdir(folder))
    print(json.dumps(results), flush=True)


def repack(root: str, output: str, options: str, times: str) -> None:
    """Pack ``root`` over ``output`` ``times`` times in a row (another process re-packing)."""
    from torch_serialized.voc.pack import pack_voc

    print("started", flush=True)
    for _ in range(int(times)):
        pack_voc(root, output, year="2007", **json.loads(options))
        time.sleep(0.05)
    print("done", flush=True)


def traced_peak(call: Callable[[], Any]) -> tuple[Any, int]:
    """``call()``'s result and the peak of Python's allocations while it ran (``tracemalloc``:
    Python objects and numpy arrays, not torch's or the kernel's memory)."""
    import tracemalloc

    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
