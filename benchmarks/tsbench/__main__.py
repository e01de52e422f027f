"""``python -m tsbench``: the benchmark's command line."""

import sys

from tsbench.run import main

sys.exit(main())
