"""``Bench``: what every scenario shares (data, packs, settings, details, page cache)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tsbench.core import IMAGE_SET, SEED
from tsbench.system import PageCache


@dataclass
class Bench:
    tv_root: Path
    year: str
    work: Path
    repeats: int
    quick: bool
    workers: int
    pack: Path | None = None
    raw_pack: Path | None = None
    raw_pack_seconds: float | None = None
    lmdb_path: Path | None = None
    lmdb_seconds: list[float] = field(default_factory=list)  # each build of the LMDB store
    details: dict[str, Any] = field(default_factory=dict)
    cache: PageCache = field(default_factory=PageCache)

    # Datasets are built on demand and not kept: a live dataset would pin its mmap, and
    # mapped pages cannot be evicted by the cold-cache scenario.
    def tv(self, **kwargs: Any) -> Any:
        from torchvision.datasets import VOCDetection

        return VOCDetection(str(self.tv_root), year=self.year, image_set=IMAGE_SET, **kwargs)

    def ours(self, path: Path | None = None, **kwargs: Any) -> Any:
        from torch_serialized import VOCSerializedDataset

        return VOCSerializedDataset(path or self.packed(), image_set=IMAGE_SET, **kwargs)

    def packed(self) -> Path:
        if self.pack is None:
            from torch_serialized import pack_voc

            self.pack = pack_voc(self.tv_root, self.work / "voc.tser", year=self.year).path
        return self.pack

    def raw_packed(self) -> Path:
        if self.raw_pack is None:
            from torch_serialized import pack_voc

            result = pack_voc(
                self.tv_root, self.work / "voc-raw.tser", year=self.year, image_storage="raw"
            )
            self.raw_pack, self.raw_pack_seconds = result.path, result.seconds
        return self.raw_pack

    @property
    def lmdb_missing(self) -> str | None:
        """Why there is no LMDB baseline (``lmdb`` not installed), or None."""
        from tsbench import lmdb_store

        return lmdb_store.available()

    def lmdb(self) -> Path | None:
        """The LMDB store of the same image set (built on first use), or None without lmdb."""
        if self.lmdb_path is None and self.lmdb_missing is None:
            from tsbench import lmdb_store

            path = self.work / "voc.lmdb"
            self.lmdb_seconds.append(lmdb_store.build(self.tv(), path))
            self.lmdb_path = path
        return self.lmdb_path

    @property
    def voc_root(self) -> Path:
        from torch_serialized.voc.layout import find_voc_root

        return find_voc_root(self.tv_root, self.year)[0]

    def indices(self, n: int, limit: int | None = None) -> list[int]:
        """A fixed random order over ``n`` samples (the first ``limit`` of it)."""
        perm = np.random.default_rng(SEED).permutation(n)
        return [int(i) for i in perm[:limit]]
