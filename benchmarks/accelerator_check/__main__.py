"""``python -m benchmarks.accelerator_check``."""

import sys

from benchmarks.accelerator_check.command import main

sys.exit(main())
