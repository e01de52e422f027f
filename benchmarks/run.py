"""Benchmark torch_serialized against torchvision's VOCDetection (see benchmarks/README.md).

python benchmarks/run.py --num-images 2000     # results in benchmarks/out/
"""

import sys
from pathlib import Path

from tsbench import main

if __name__ == "__main__":
    sys.exit(main(default_out_dir=Path(__file__).resolve().parent / "out"))
