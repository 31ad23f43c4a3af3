"""Building the documentation from the tests: the real one, or a copy planted with a fault."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "docs" / "hooks" / "results_tables.py"


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of the project at ``root`` into ``site``, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )


def copy_docs(dest: Path) -> Path:
    """mkdocs.yml and docs/ copied into ``dest``, with the results the tables are built from; returns ``dest``."""
    shutil.copy2(REPO / "mkdocs.yml", dest / "mkdocs.yml")
    shutil.copytree(REPO / "docs", dest / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "benchmarks").mkdir()
    # The tables read these; linked rather than copied (the bug-pattern record is large).
    (dest / "benchmarks" / "results").symlink_to(REPO / "benchmarks" / "results", target_is_directory=True)
    return dest


def load_hook() -> ModuleType:
    """The tables hook as MkDocs loads it: by its path, not as a package of the project."""
    spec = importlib.util.spec_from_file_location("results_tables", HOOK)
    assert spec is not None and spec.loader is not None, f"expected a loadable module at {HOOK}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
