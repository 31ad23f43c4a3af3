"""Building the documentation from the tests: the real one, or a copy planted with a fault."""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "docs" / "hooks" / "results_tables.py"


def make_docs_arguments() -> list[str]:
    """The arguments ``make docs`` gives mkdocs, read from the Makefile's recipe, so that the tests
    build exactly as it does (an option such as ``--quiet`` would hide the warnings strict mode
    fails on)."""
    lines = (REPO / "Makefile").read_text(encoding="utf-8").splitlines()
    recipe = shlex.split(lines[lines.index("docs: setup") + 1])
    assert recipe[0].endswith("/bin/mkdocs"), f"expected `make docs` to run mkdocs, its recipe is {recipe}"
    return recipe[1:]


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """The project at ``root`` built into ``site`` as ``make docs`` builds it, its output captured."""
    arguments = make_docs_arguments()
    at = arguments.index("--site-dir")
    arguments[at + 1] = str(site)
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", *arguments],
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
