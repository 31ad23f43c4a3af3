"""scripts/setup.sh refuses clearly when `python3 -m venv` cannot work (Debian without python3-venv).

The interpreter handed to it hides ``ensurepip``, as Debian's python3 does until python3-venv is
installed; setup must say which package to install and leave no half-made environment behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_setup_names_python3_venv_when_venv_cannot_work(tmp_path: Path) -> None:
    hidden = tmp_path / "hide"
    (hidden / "ensurepip").mkdir(parents=True)
    (hidden / "ensurepip" / "__init__.py").write_text('raise ImportError("No module named ensurepip")\n')
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{hidden}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    venv = tmp_path / "venv"
    env = {**os.environ, "PYTHON": str(python), "VIRTUAL_ENV": str(venv)}
    result = subprocess.run(["bash", "scripts/setup.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    want = f"setup: '{python} -m venv' is not available; on Debian/Ubuntu install it with: apt-get install python3-venv"
    assert result.returncode == 1, f"exit {result.returncode}, want 1: {result.stderr}"
    assert want in result.stderr, f"stderr {result.stderr!r} does not say {want!r}"
    assert not venv.exists(), "a half-made environment was left behind"
