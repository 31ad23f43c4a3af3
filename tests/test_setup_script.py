"""scripts/setup.sh: which torch it keeps or installs, and its refusals.

- It refuses clearly when `python3 -m venv` cannot work (Debian without python3-venv): the
  interpreter handed to it hides ``ensurepip``, as Debian's python3 does until python3-venv is
  installed; setup must say which package to install and leave no half-made environment behind.
- Its torch choice runs against stand-in interpreters: each imports a ``torch`` that only has a
  ``__version__``, and its ``pip`` records what it was asked to install instead of installing, so
  every case (a CUDA build kept, an old torch replaced, ``--torch`` for an exact release, the base
  interpreter's torch seen through ``--system-site-packages``) runs in seconds.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

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


# A stand-in interpreter: `-m pip ...` and `-m venv ...` are recorded (venv also makes DIR/bin/python,
# another stand-in, which sees this one's torch with --system-site-packages and else none until pip
# installs one); anything else runs the real Python with the stand-in torch of its folder
# (torch_version: nothing there means no torch).
_STAND_IN = """#!/bin/sh
here=$(cd "$(dirname "$0")" && pwd)
echo "$0 $*" >> "{log}"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    for arg in "$@"; do case "$arg" in torch==*) echo "${{arg#torch==}}+stand-in" > "$here/torch_version" ;; esac; done
    exit 0
fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    for dir; do :; done
    mkdir -p "$dir/bin" && cp "$0" "$dir/bin/python" || exit 1
    case " $* " in *" --system-site-packages "*) [ -s "$here/torch_version" ] && cp "$here/torch_version" "$dir/bin/" ;; esac
    exit 0
fi
if [ -s "$here/torch_version" ]; then
    mkdir -p "$here/site/torch" && echo "__version__ = '$(cat "$here/torch_version")'" > "$here/site/torch/__init__.py"
    PYTHONPATH="$here/site" exec "{python}" "$@"
fi
mkdir -p "$here/no-torch/torch" && echo 'raise ImportError("No module named torch")' > "$here/no-torch/torch/__init__.py"
PYTHONPATH="$here/no-torch" exec "{python}" "$@"
"""


def _stand_in(folder: Path, log: Path, torch_version: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    python = folder / "python"
    python.write_text(_STAND_IN.format(log=log, python=sys.executable))
    python.chmod(0o755)
    if torch_version:
        (folder / "torch_version").write_text(torch_version + "\n")
    return python


def _setup(
    tmp_path: Path, *args: str, base_torch: str | None = None, env_torch: str | None = None
) -> tuple[str, list[str]]:
    """Runs setup.sh with a stand-in base interpreter (and environment, when ``env_torch``);
    returns its stderr and the stand-ins' pip/venv calls."""
    log = tmp_path / "calls.log"
    log.touch()
    base = _stand_in(tmp_path / "base", log, base_torch)
    venv = tmp_path / "venv"
    if env_torch is not None:
        _stand_in(venv / "bin", log, env_torch or None)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PYTHON"] = str(base)
    result = subprocess.run(
        ["bash", "scripts/setup.sh", "--venv", str(venv), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr}"
    calls = [
        " ".join(shlex.split(line)[1:])
        for line in log.read_text().splitlines()
        if " -m pip " in line or " -m venv " in line
    ]
    return result.stderr, calls


EDITABLE = "-m pip install --quiet -e .[dev,frameworks]"
# With --torch (a torch-range environment): the dev extras alone.
EDITABLE_RANGE = "-m pip install --quiet -e .[dev]"


@pytest.mark.parametrize(
    ("env_torch", "args", "want_calls", "want_said"),
    [
        ("2.11.0+cu130", (), [f"{EDITABLE} torch==2.11.0"], "keeping torch 2.11.0"),
        ("2.16.0a0+git123", (), [f"{EDITABLE} torch==2.16.0a0"], "keeping torch 2.16.0a0"),
        (
            "2.10.2",
            (),
            ["-m pip install --quiet torch==2.13.0", f"{EDITABLE} torch==2.13.0"],
            "its torch 2.10.2 is older than 2.11",
        ),
        ("", (), ["-m pip install --quiet torch==2.13.0", f"{EDITABLE} torch==2.13.0"], "installing torch==2.13.0"),
        (
            "2.13.0+cpu",
            ("--torch", "2.11.0"),
            ["-m pip install --quiet torch==2.11.0", f"{EDITABLE_RANGE} torch==2.11.0"],
            "(it has 2.13.0)",
        ),
        ("2.11.0+cu130", ("--torch", "2.11.0"), [f"{EDITABLE_RANGE} torch==2.11.0"], "with torch 2.11.0"),
    ],
)
def test_torch_kept_or_installed(
    tmp_path: Path, env_torch: str, args: tuple[str, ...], want_calls: list[str], want_said: str
) -> None:
    said, calls = _setup(tmp_path, *args, env_torch=env_torch)
    assert calls == want_calls, f"want pip calls {want_calls}, got {calls}"
    assert want_said in said, f"stderr {said!r} does not say {want_said!r}"


def test_base_interpreters_torch_is_used_not_replaced(tmp_path: Path) -> None:
    said, calls = _setup(tmp_path, base_torch="2.12.1+cu126")
    want = [f"-m venv --system-site-packages {tmp_path / 'venv'}", f"{EDITABLE} torch==2.12.1"]
    assert calls == want, f"want the base's torch seen and kept: {want}, got {calls}"
    assert "has torch 2.12.1: the environment uses it (--system-site-packages)" in said, said


def test_base_interpreter_without_torch_gets_a_plain_environment(tmp_path: Path) -> None:
    _, calls = _setup(tmp_path)
    want = [f"-m venv {tmp_path / 'venv'}", "-m pip install --quiet torch==2.13.0", f"{EDITABLE} torch==2.13.0"]
    assert calls == want, f"want {want}, got {calls}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--torch", "2.11"), "setup: --torch wants a release such as 2.11.0, got '2.11'"),
        (("--venv",), "usage: scripts/setup.sh [--venv DIR] [--torch X.Y.Z]"),
        (("--cuda",), "setup: unknown argument '--cuda'"),
    ],
)
def test_bad_arguments_exit_2(args: tuple[str, ...], message: str) -> None:
    result = subprocess.run(["bash", "scripts/setup.sh", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, f"exit {result.returncode}, stderr {result.stderr!r}"
