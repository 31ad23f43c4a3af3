"""``fsdp-patch report --json`` over a trace directory, run as a user runs it, parsed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def report_json(traces: Path) -> dict[str, Any]:
    """The report of ``traces`` as JSON; fails the test, with the report's stderr, if it exits non-zero."""
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_patch", "report", "--json", str(traces)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"report of {traces} exited {result.returncode}:\n{result.stderr[-2000:]}"
    return json.loads(result.stdout)
