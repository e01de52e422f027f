"""``python -m torch_serialized.tools.benchmark``: the benchmark's command line."""

import sys

from .run import main

sys.exit(main())
