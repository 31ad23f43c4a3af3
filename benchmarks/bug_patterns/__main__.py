"""``python -m benchmarks.bug_patterns``: the bug-pattern suite (see :mod:`benchmarks.bug_patterns.run`)."""

import sys

from .run import main

sys.exit(main())
