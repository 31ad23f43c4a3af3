"""``python -m fsdp_patch``: the ``fsdp-patch`` command (the application layer's, ``fsdp_patch.app.cli``).

The program's entry point, which nothing imports: the one module of ``fsdp_patch/`` that names the
application layer above it.
"""

import sys

from .app.cli import main

if __name__ == "__main__":
    sys.exit(main())
