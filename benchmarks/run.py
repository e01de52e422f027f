"""Benchmark torch_serialized against torchvision's VOCDetection (see benchmarks/README.md).

python benchmarks/run.py --num-images 2000 --out-dir benchmarks/out
"""

import sys

from torch_serialized.tools.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
