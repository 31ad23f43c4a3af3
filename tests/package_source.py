"""What ``pip install .`` reads from a checkout, copied for the tests that install the package themselves."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The metadata (pyproject.toml, setup.py, which puts the start-up hook's .pth beside the packages),
# the README the metadata names, and the package folders.
PACKAGE_FILES = ("pyproject.toml", "setup.py", "README.md", "fsdp_patch", "telemetry", "app", "startup")


def copy_package_source(dest: Path) -> Path:
    """Copy :data:`PACKAGE_FILES` into ``dest`` (a build there leaves nothing in the checkout); returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in PACKAGE_FILES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, dest / name)
    return dest
