#!/usr/bin/env bash
# Sets up the project's virtual environment and installs fsdp_patch into it (editable, dev extras).
#
# Which environment: the active one ($VIRTUAL_ENV) if there is one, else .venv in the repository,
# created with `$PYTHON -m venv` (PYTHON defaults to python3). A virtual environment because
# Debian/Ubuntu's own python3 refuses pip installs into the system (PEP 668,
# "externally-managed-environment").
#
# torch: left alone if the environment already imports torch >= 2.13; otherwise torch==2.13.0,
# pinned. Never a range or an unpinned `torch`: that pulls a multi-GB CUDA build. pip's own
# configuration (PIP_INDEX_URL, PIP_FIND_LINKS, ...) decides where that build comes from.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PYTHON="${PYTHON:-python3}"
VENV="${VIRTUAL_ENV:-.venv}"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    if ! command -v "$BASE_PYTHON" >/dev/null 2>&1; then
        echo "setup: $BASE_PYTHON not found; install Python >= 3.10 (Debian/Ubuntu: apt-get install python3 python3-venv) or set PYTHON=/path/to/python3" >&2
        exit 1
    fi
    if ! "$BASE_PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        echo "setup: $BASE_PYTHON is Python $("$BASE_PYTHON" -c 'import platform; print(platform.python_version())'); fsdp_patch needs >= 3.10 (set PYTHON=/path/to/python3.10+)" >&2
        exit 1
    fi
    # Debian and Ubuntu ship venv's pip bootstrap (ensurepip) in a separate package.
    if ! "$BASE_PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        echo "setup: '$BASE_PYTHON -m venv' is not available; on Debian/Ubuntu install it with: apt-get install python3-venv (as root, or with sudo)" >&2
        exit 1
    fi
    echo "setup: creating the virtual environment $VENV with $BASE_PYTHON" >&2
    if ! "$BASE_PYTHON" -m venv "$VENV"; then
        rm -rf "$VENV"  # a half-made environment would be taken for a finished one next time
        echo "setup: '$BASE_PYTHON -m venv $VENV' failed (see above)" >&2
        exit 1
    fi
fi

if ! "$PY" -c 'import sys, torch; v = torch.__version__.split("+")[0].split("."); sys.exit(tuple(map(int, v[:2])) < (2, 13))' >/dev/null 2>&1; then
    echo "setup: installing torch==2.13.0 into $VENV" >&2
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
echo "setup: installing fsdp_patch (editable, with dev extras) into $VENV" >&2
"$PY" -m pip install --quiet -e ".[dev]"
