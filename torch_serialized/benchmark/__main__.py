"""``python -m torch_serialized.benchmark``: the benchmark's command line."""

import sys

from .run import main

sys.exit(main())
