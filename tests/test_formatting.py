"""The formatter the project enforces (``ruff format --check`` in ``make lint``) formats all of it:
no statement steps around it."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKERS = ("fmt: skip", "fmt: off", "fmt: on", "yapf: disable")


def test_no_source_file_steps_around_the_formatter() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    found = [
        f"{path}:{number}"
        for path in tracked
        if (REPO / path).exists()
        for number, line in enumerate((REPO / path).read_text(encoding="utf-8").splitlines(), start=1)
        if any(f"# {marker}" in line for marker in MARKERS)
    ]
    assert found == [], f"want no formatter markers, found {len(found)}: {found[:10]}"
