"""A real two-process torchrun (gloo, CPU): ranks split an epoch exactly once plus padding."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import torch_serialized
from torch_serialized.data.datasets import VOCSerializedDataset
from torch_serialized.tools import make_synthetic_voc

WORKER = Path(__file__).with_name("_ddp_worker.py")
REPO = Path(__file__).resolve().parents[1]


def digest(image: torch.Tensor) -> str:
    """As the worker script's: a hash of the stored image bytes."""
    return hashlib.blake2b(image.numpy().tobytes(), digest_size=8).hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform == "win32", reason="torchrun with gloo on Linux/macOS")
def test_two_ranks_with_two_workers_each_see_every_sample_once(tmp_path: Path) -> None:
    root = make_synthetic_voc(tmp_path / "src", 30, year="2007")
    pack = torch_serialized.pack_voc(
        root, tmp_path / "shards", year="2007", max_samples_per_shard=5
    ).path
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(WORKER),
        str(pack),
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    reference = VOCSerializedDataset(pack, image_set="trainval", decode="none")
    position = {digest(reference[i][0]): i for i in range(len(reference))}
    n = len(reference)
    assert n % 2 == 1  # so rank 1 gets a padding repeat
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    per_rank = -(-n // 2)
    assert [(r["rank"], r["world_size"]) for r in reports] == [(0, 2), (1, 2)]
    assert [len(r["ids"]) for r in reports] == [r["len"] for r in reports] == [per_rank] * 2
    counts = Counter(position[d] for r in reports for d in r["ids"])
    assert set(counts) == set(range(n))
    assert sum(counts.values()) - n == 2 * per_rank - n
