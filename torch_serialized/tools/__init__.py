"""Beside the library: ``make_synthetic_voc`` (a deterministic VOCdevkit without the 2 GB
download), ``run_demo`` and ``run_benchmark`` (``torch-serialized demo`` and ``bench``)."""

from .bench import run_benchmark, run_demo
from .synthetic import make_synthetic_voc

__all__ = ["make_synthetic_voc", "run_benchmark", "run_demo"]
