"""Session-wide fixtures: small VOCdevkits written once, and their packs.

``corner_packs``: the corner-case devkit of ``vocfactory.build_corner_case_devkit`` (year 2007)
packed as one file and as shards of 5 samples. ``synthetic_packs``: 24 synthetic images (2007),
packed the same two ways. ``real_packs``: packs the real roots of ``vocfactory.real_voc_roots()``
on first use. Tests must treat all of them as read-only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from vocfactory import build_corner_case_devkit

from torch_serialized import pack_voc
from torch_serialized.tools import make_synthetic_voc

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
