"""``python -m torch_serialized``: the ``torch-serialized`` command line."""

import sys

from .cli import main

sys.exit(main())
