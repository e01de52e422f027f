"""Session-wide fixtures: small VOCdevkits and packs, written once for the whole run.

``corner_packs``: the corner-case devkit of ``vocfactory.build_corner_case_devkit`` (year 2007)
packed as one file and as shards of 5 samples. ``synthetic_packs``: 24 synthetic images (2007),
packed the same two ways. ``real_packs``: packs the real roots of ``vocfactory.real_voc_roots()``
on first use. ``stream_packs``: 60 synthetic images (2007), one file and shards of 7 (the
iterable's tests). ``container_packs``: 30 self-describing records (``write_pack``) written by
``PackWriter`` directly, one file and shards. ``voc40`` / ``voc8``: synthetic devkits of 40 and 8
images with different content (a pack and a "previous" pack); ``voc40_packs``; ``tiny_root``:
six tiny samples for fuzzing, ``tiny_packs`` its packs in both forms. Tests must treat all of
them as read-only (copy before damaging). ``bounded_memory`` caps the address space during one
test.
"""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _container_helpers import FORMS, write_pack
from _reliability_helpers import PACK_FORMS, out_name
from support.loopback import GCS_ENVIRONMENT
from vocfactory import Sample, build_corner_case_devkit, jpeg, obj, palette_mask, voc_xml, write_voc

from torch_serialized import pack_voc
from torch_serialized.tools import make_synthetic_voc

# Before any test imports gcsfs, which reads it then: the gs:// tests talk to an emulator
# (remote_fixtures.py), and this process and its children must never wait on gcsfs's gRPC.
os.environ.update(GCS_ENVIRONMENT)

CORNER_YEAR = "2007"
SYNTHETIC_YEAR = "2007"
SHARD_SAMPLES = 5
LAYOUTS = ("single", "shards")


@dataclass(frozen=True)
class Packed:
    """A devkit (``root`` as torchvision takes it) and its two packs."""

    root: Path
    year: str
    single: Path  # one .tser file
    shards: Path  # a shard folder, SHARD_SAMPLES samples a shard

    def path(self, layout: str) -> Path:
        """The pack of ``layout``: ``"single"`` or ``"shards"``."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        return self.single if layout == "single" else self.shards


def pack_both(root: Path, year: str, out: Path) -> Packed:
    """Pack ``root`` into ``out/single.tser`` and ``out/shards/``."""
    out.mkdir(parents=True, exist_ok=True)
    single = pack_voc(root, out / "single.tser", year=year).path
    shards = pack_voc(root, out / "shards", year=year, max_samples_per_shard=SHARD_SAMPLES).path
    return Packed(root=root, year=year, single=single, shards=shards)


@pytest.fixture(scope="session")
def corner_devkit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torchvision's root of the corner-case devkit (``VOCdevkit/VOC2007`` below it)."""
    return build_corner_case_devkit(tmp_path_factory.mktemp("corner"), CORNER_YEAR)


@pytest.fixture(scope="session")
def corner_packs(corner_devkit: Path, tmp_path_factory: pytest.TempPathFactory) -> Packed:
    return pack_both(corner_devkit, CORNER_YEAR, tmp_path_factory.mktemp("corner-packs"))


@pytest.fixture(scope="session")
def synthetic_devkit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """torchvision's root of a 24-image synthetic 2007 devkit (every 4th image has masks)."""
    return make_synthetic_voc(tmp_path_factory.mktemp("synthetic"), 24, year=SYNTHETIC_YEAR)


@pytest.fixture(scope="session")
def synthetic_packs(synthetic_devkit: Path, tmp_path_factory: pytest.TempPathFactory) -> Packed:
    return pack_both(synthetic_devkit, SYNTHETIC_YEAR, tmp_path_factory.mktemp("synthetic-packs"))


@pytest.fixture(scope="session")
def real_packs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str], Packed]:
    """``real_packs(root, year)``: the packs of a real root, written on first request."""
    cache: dict[Path, Packed] = {}

    def get(root: Path, year: str) -> Packed:
        if root not in cache:
            out = tmp_path_factory.mktemp(f"real-{root.name}")
            cache[root] = pack_both(root, year, out)
        return cache[root]

    return get


@pytest.fixture(scope="session")
def stream_packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """60 synthetic images (2007): ``"single"`` one file, ``"shards"`` shards of 7 samples."""
    tmp = tmp_path_factory.mktemp("stream")
    root = make_synthetic_voc(tmp / "src", 60, year="2007")
    single = pack_voc(root, tmp / "one.tser", year="2007").path
    shards = pack_voc(root, tmp / "shards", year="2007", max_samples_per_shard=7).path
    return {"single": Path(single), "shards": Path(shards)}


@pytest.fixture(scope="session")
def container_packs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 30-record ``write_pack`` pack in both forms (``FORMS``)."""
    folder = tmp_path_factory.mktemp("container-packs")
    return {form: write_pack(folder / form, 30, **limits) for form, limits in FORMS.items()}


@pytest.fixture(scope="session")
def voc40(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_synthetic_voc(tmp_path_factory.mktemp("voc40"), 40, year="2007")


@pytest.fixture(scope="session")
def voc8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Different content: what a 'previous' pack or a re-pack holds."""
    return make_synthetic_voc(tmp_path_factory.mktemp("voc8"), 8, year="2007", seed=1)


@pytest.fixture(scope="session")
def voc40_packs(voc40: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("voc40-packs")
    return {
        form: pack_voc(voc40, folder / out_name(form), year="2007", **limits).path
        for form, limits in PACK_FORMS.items()
    }


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six tiny samples (2007): small enough that fuzzing writes a few KiB per example."""
    root = tmp_path_factory.mktemp("tiny")
    ids = [f"00000{i}" for i in range(6)]
    samples = [
        Sample(
            image_id,
            jpeg(12 + i, 10, seed=i),
            voc_xml(f"{image_id}.jpg", 12 + i, 10, [obj(("dog", "cat")[i % 2], (1, 1, 8, 6))]),
            mask=palette_mask(12 + i, 10, seed=i) if i % 3 == 0 else None,
        )
        for i, image_id in enumerate(ids)
    ]
    sets = {"Main": {"train": ids[:3], "val": ids[3:], "trainval": ids}}
    sets["Segmentation"] = {"train": [ids[0]], "val": [ids[3]]}
    write_voc(root, "2007", samples, sets)
    return root


@pytest.fixture(scope="session")
def tiny_packs(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``tiny_root`` packed as ``"single"`` (one file) and ``"shards"`` (2 samples a shard)."""
    folder = tmp_path_factory.mktemp("tiny-packs")
    return {
        "single": pack_voc(tiny_root, folder / "tiny.tser", year="2007").path,
        "shards": pack_voc(tiny_root, folder / "tiny", year="2007", max_samples_per_shard=2).path,
    }


@pytest.fixture
def bounded_memory() -> Iterator[None]:
    """Cap this process's address space at its current size + 512 MiB while the test runs.

    The fuzzed files are a few KiB, so any allocation that size is a bug: it fails with
    MemoryError (a foreign exception, so the test fails) instead of swapping the machine.
    """
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs /proc/self/status")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    match = re.search(r"VmSize:\s+(\d+) kB", status.read_text())
    assert match is not None
    limit = int(match[1]) * 1024 + (512 << 20)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
