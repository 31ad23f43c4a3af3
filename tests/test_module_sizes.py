"""No Python file of the repository runs past MAX_LINES lines: one that grows past it is split where
its concerns part (a class with its helpers, a family of checks, a data type and its parsing), as
the product's layers are, never by moving its tail into a second file.

Every ``.py`` file under the repository counts, tests and benchmarks included, tracked or
not; left out are hidden folders (``.git``, ``.venv*``, the tools' caches) and build outputs.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 450
# Folders that hold no source of the project: build outputs, the documentation site, caches.
BUILD_OUTPUTS = {"build", "dist", "site", "__pycache__", "node_modules", "runs", "fsdp_patch_traces"}


def _skipped(folder: str) -> bool:
    return folder.startswith(".") or folder in BUILD_OUTPUTS or folder.endswith(".egg-info")


def python_files() -> list[Path]:
    """Every ``.py`` file of the repository but those under a skipped folder, in path order."""
    found = []
    for root, folders, files in os.walk(REPO):
        folders[:] = sorted(folder for folder in folders if not _skipped(folder))
        found += [Path(root, name) for name in sorted(files) if name.endswith(".py")]
    return found


def test_no_python_file_is_longer_than_max_lines() -> None:
    files = python_files()
    assert Path(__file__) in files and len(files) > 100, f"the walk found {len(files)} files: {files[:5]}"
    sizes = {path.relative_to(REPO).as_posix(): len(path.read_text(encoding="utf-8").splitlines()) for path in files}
    over = sorted(((lines, path) for path, lines in sizes.items() if lines > MAX_LINES), reverse=True)
    listed = "\n".join(f"  {path}: {lines} lines" for lines, path in over)
    assert not over, f"{len(over)} Python file(s) over {MAX_LINES} lines; split each where its concerns part:\n{listed}"
