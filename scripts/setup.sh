#!/usr/bin/env bash
# Installs fsdp_patch with its dev extras into the current Python.
# torch: an installed torch is left alone; otherwise the pinned CPU build is installed, since an
# unpinned `torch` pulls a multi-GB CUDA build on machines that have no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[dev]"
