"""Beside the library: ``make_synthetic_voc`` (a deterministic VOCdevkit without the 2 GB
download), ``run_demo`` and ``run_benchmark`` (``torch-serialized demo`` and ``bench``),
loaded on first use (PEP 562) so that reading ``bench``'s options imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .bench import run_benchmark
    from .demo import run_demo
    from .synthetic import make_synthetic_voc

__all__ = ["make_synthetic_voc", "run_benchmark", "run_demo"]
_MODULES = {"make_synthetic_voc": ".synthetic", "run_benchmark": ".bench", "run_demo": ".demo"}


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'torch_serialized.tools' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name], __name__), name)
