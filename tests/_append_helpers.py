"""What the append reliability tests run in other processes (``python -c`` children): an
append slowed per image (to be killed at random moments) and an append under a file size
limit or on a small file system, reporting what it raised and what it left."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _reliability_helpers import ROOT, TESTS, light_import


def run_child(command: str, *args: str, wrap: list[str] | None = None) -> subprocess.Popen:
    """``child_main(command, *args)`` of this module in a fresh interpreter, optionally run
    through ``wrap`` (a command line that ends by executing the rest)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    code = "import sys, _append_helpers as h; h.child_main(*sys.argv[1:])"
    return subprocess.Popen(
        [*(wrap or []), sys.executable, "-c", code, command, *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def child_main(command: str, *args: str) -> None:
    light_import()
    {"slow_append": slow_append, "append_and_report": append_and_report}[command](*args)


def slow_append(root: str, pack: str, per_image: str) -> None:
    """``append_voc`` with a pause before each new image is read (a slow source disk)."""
    from torch_serialized.voc import records as pack_module
    from torch_serialized.voc.append import append_voc

    load, pause = pack_module.load, float(per_image)

    def slow_load(job: Any, *args: Any) -> Any:
        time.sleep(pause)
        return load(job, *args)

    pack_module.load = slow_load  # type: ignore[assignment]
    print("started", flush=True)
    append_voc(root, pack)
    print("done", flush=True)


def hashes(path: Path) -> dict[str, str]:
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def append_and_report(root: str, source_pack: str, folder: str, fsize: str) -> None:
    """Copy ``source_pack`` into ``folder``, append ``root`` to it with files limited to
    ``fsize`` bytes (0: no limit), print what it raised, whether the pack is unchanged and
    readable, and what ``folder`` holds."""
    from torch_serialized.voc.append import append_voc
    from torch_serialized.voc.packed import VOCPackReader

    src = Path(source_pack)
    pack = Path(folder) / src.name
    if src.is_dir():
        shutil.copytree(src, pack)
    else:
        shutil.copyfile(src, pack)
    before = hashes(pack)
    if int(fsize):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(fsize), hard))
    report: dict[str, Any] = {"error": None}
    try:
        append_voc(root, pack)
    except OSError as exc:
        report["error"] = {"type": type(exc).__name__, "errno": exc.errno, "message": str(exc)}
    report["unchanged"] = hashes(pack) == before
    report["readable"] = len(VOCPackReader(pack).live)
    report["left"] = sorted(os.listdir(folder))
    report["inside"] = sorted(os.listdir(pack)) if pack.is_dir() else []
    print(json.dumps(report), flush=True)
