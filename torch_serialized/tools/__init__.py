"""What the main job needs beside the library: the demo and the synthetic VOC generator.

They ship because ``torch-serialized demo`` and ``bench`` are commands, and examples and tests
need a VOCdevkit without the 2 GB download. The library never imports this package (only the
command line dispatches to it). Its entry points, imported on first use (PEP 562):

- ``make_synthetic_voc(root, num_images, *, year, seed, ...)``: a deterministic VOCdevkit;
- ``run_demo(*, num_images=200, workers=2, ...)``: the demo (``torch-serialized demo``);
- ``run_benchmark(root=None, *, quick=False, ...)``: a short measurement of your own data
  against torchvision (``torch-serialized bench``).

The full benchmark lives in ``benchmarks/`` of a checkout, the test servers in ``tests/support/``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .bench import run_benchmark
    from .demo import run_demo
    from .synthetic import make_synthetic_voc

#: public name -> module that defines it
_LAZY = {
    "make_synthetic_voc": ".synthetic",
    "run_benchmark": ".bench",
    "run_demo": ".demo",
}

__all__ = ["make_synthetic_voc", "run_benchmark", "run_demo"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_serialized.tools' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
