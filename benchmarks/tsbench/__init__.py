"""Side-by-side benchmark: torch_serialized against ``torchvision.datasets.VOCDetection``
and a plain LMDB store of the same samples (``PEER``; ``lmdb_store``).

All read the same data (a generated synthetic VOCdevkit, or a real one), in the same process,
in the same run, with the same index order; every figure is the median of ``repeats``
measurements (min and max kept) and every claim is a ratio to torchvision (and to LMDB)
measured alongside, so a noisy machine moves all sides together. The variants of one scenario
are interleaved within each repeat. Scenarios (``SCENARIOS``):

- ``pack``: pack time with 1 and ``workers`` processes (outputs must be byte-identical) and
  size on disk against the source folder.
- ``append``: ``append_voc`` of 1% new images to a one-file and a shard-folder pack, against
  a full re-pack of the grown source and against packing the new images alone.
- ``bytes``: warm random access without image decode: torchvision's open + read + ``ET.parse``
  + ``parse_voc_xml`` against ``decode="none"`` (dict target, and ``"tv_tensors"`` target).
- ``decoded``: warm random access to PIL images, against ``VOCDetection`` and against a bare
  PIL decode of in-memory bytes (our overhead over the decode itself).
- ``tensor``: CHW uint8 tensors: ``VOCDetection`` + ``pil_to_tensor`` against
  ``decode="tensor"`` on the original JPEGs and on a raw-pixel pack.
- ``attributes``: ``dataset.images[i]`` / ``annotations[i]`` per access at 10,000 images.
- ``dataloader``: epochs of a ``DataLoader`` (``workers`` workers, batch 32, list collate).
- ``cold``: page cache evicted (``posix_fadvise(DONTNEED)``, checked with ``mincore``) before
  each run: map-style random access (single, batches, ``BlockShuffleSampler`` order) including
  opening, iterable epochs shuffled and in storage order, and the disk's own bandwidth.
- ``gpu``: DataLoader workers reading bytes, one batched ``decode_jpeg`` on CUDA per batch
  ("n/a (no GPU)" without CUDA).
- ``memory``: USS/PSS/anonymous memory of each DataLoader worker from ``smaps_rollup`` at the
  start and end of its first epoch.

Results go to ``out_dir``: ``results.md`` (the table), ``results.json`` (everything, with the
environment) and ``results.png`` (ratios; needs matplotlib, imported only here). Run it with
``python benchmarks/run.py`` from a checkout (development tooling, not in the wheel; the wheel's
``torch-serialized bench`` is a short measurement of the demo's rows).
"""

from __future__ import annotations

from tsbench.core import PEER, SCENARIOS, Row, Stat
from tsbench.report import render_markdown
from tsbench.run import main, run_benchmark
from tsbench.system import PageCache

__all__ = [
    "SCENARIOS",
    "PEER",
    "run_benchmark",
    "main",
    "render_markdown",
    "Stat",
    "Row",
    "PageCache",
]
