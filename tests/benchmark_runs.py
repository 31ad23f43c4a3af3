"""A benchmark run as its tests run it: ``python -m benchmarks.<name> ARGS`` from the repository root,
in this interpreter, its output captured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_benchmark(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python -m <module> ARGS`` (``module``: ``benchmarks`` or one of its modules) from the
    repository root."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
