"""``python -m fsdp_patch``: the ``fsdp-patch`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
