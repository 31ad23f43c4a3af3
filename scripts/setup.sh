#!/usr/bin/env bash
# Sets up a virtual environment and installs fsdp_patch into it (editable; dev and frameworks extras, dev only with --torch).
#
#   scripts/setup.sh [--venv DIR] [--torch X.Y.Z] [--constraints FILE]
#
# Which environment: DIR if given; else the active one ($VIRTUAL_ENV) if there is one; else .venv
# in the repository, created with `$PYTHON -m venv` (PYTHON defaults to python3). A virtual
# environment because Debian/Ubuntu's own python3 refuses pip installs into the system (PEP 668,
# "externally-managed-environment").
#
# torch (fsdp_patch supports 2.11 and newer, CPU and CUDA builds):
# - without --torch: an importable torch >= 2.11 is kept, the environment's own or, when the
#   environment is created here, the base interpreter's (the environment then sees the base's
#   packages: a cluster image's CUDA torch is used, not replaced). With none, torch==2.13.0 is
#   installed, pinned: never a range or an unpinned `torch`, which pulls a multi-GB CUDA build.
# - with --torch X.Y.Z: exactly that release (`make test` checks the oldest supported torch in an
#   environment of its own this way); installed unless the environment already has it.
# pip's own configuration (PIP_INDEX_URL, PIP_FIND_LINKS, ...) decides where torch comes from.
#
# --constraints FILE: pip constraints for the install (`make test` pins the oldest supported
# OpenTelemetry releases this way, scripts/oldest-opentelemetry.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PINNED_TORCH=2.13.0
OLDEST_TORCH=2.11

usage() {
    echo "usage: scripts/setup.sh [--venv DIR] [--torch X.Y.Z] [--constraints FILE]" >&2
    exit 2
}

VENV="${VIRTUAL_ENV:-.venv}"
WANT_TORCH=""
CONSTRAINTS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) [ $# -ge 2 ] || usage; VENV="$2"; shift 2 ;;
        --torch) [ $# -ge 2 ] || usage; WANT_TORCH="$2"; shift 2 ;;
        --constraints)
            [ $# -ge 2 ] || usage
            [ -f "$2" ] || { echo "setup: --constraints wants a pip constraints file, '$2' is not one" >&2; exit 2; }
            CONSTRAINTS=(--constraint "$2"); shift 2 ;;
        *) echo "setup: unknown argument '$1'" >&2; usage ;;
    esac
done
if [ -n "$WANT_TORCH" ] && ! [[ "$WANT_TORCH" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    echo "setup: --torch wants a release such as 2.11.0, got '$WANT_TORCH'" >&2
    exit 2
fi
BASE_PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"

# The release of the torch that interpreter $1 imports (2.11.0 for 2.11.0+cu130), or nothing.
torch_release() {
    "$1" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true
}

# Whether release $1 is at least $OLDEST_TORCH (a pre-release such as 2.16.0a0 counts as 2.16).
supported() {
    [[ "$1" =~ ^([0-9]+)\.([0-9]+) ]] || return 1
    local major="${BASH_REMATCH[1]}" minor="${BASH_REMATCH[2]}"
    [ "$major" -gt "${OLDEST_TORCH%%.*}" ] || { [ "$major" -eq "${OLDEST_TORCH%%.*}" ] && [ "$minor" -ge "${OLDEST_TORCH#*.}" ]; }
}

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
    venv_args=()
    if [ -z "$WANT_TORCH" ]; then
        base_torch=$(torch_release "$BASE_PYTHON")
        if supported "$base_torch"; then
            echo "setup: $BASE_PYTHON has torch $base_torch: the environment uses it (--system-site-packages)" >&2
            venv_args+=(--system-site-packages)
        fi
    fi
    echo "setup: creating the virtual environment $VENV with $BASE_PYTHON" >&2
    if ! "$BASE_PYTHON" -m venv "${venv_args[@]}" "$VENV"; then
        rm -rf "$VENV"  # a half-made environment would be taken for a finished one next time
        echo "setup: '$BASE_PYTHON -m venv $VENV' failed (see above)" >&2
        exit 1
    fi
fi

have_torch=$(torch_release "$PY")
if [ -n "$WANT_TORCH" ]; then
    if [ "$have_torch" != "$WANT_TORCH" ]; then
        echo "setup: installing torch==$WANT_TORCH into $VENV${have_torch:+ (it has $have_torch)}" >&2
        "$PY" -m pip install --quiet "torch==$WANT_TORCH"
    fi
elif supported "$have_torch"; then
    echo "setup: keeping torch $have_torch in $VENV" >&2
else
    echo "setup: installing torch==$PINNED_TORCH into $VENV${have_torch:+ (its torch $have_torch is older than $OLDEST_TORCH)}" >&2
    "$PY" -m pip install --quiet "torch==$PINNED_TORCH"
fi
# The torch just chosen stays: naming it keeps pip from replacing it while resolving the extras.
torch_now=$(torch_release "$PY")
# The frameworks of the zero-code tests (frameworks extra) only where the whole suite runs: not in
# an environment made for one torch release's range tests (--torch).
extras="dev,frameworks"
[ -n "$WANT_TORCH" ] && extras="dev"
echo "setup: installing fsdp_patch (editable, with the $extras extras) into $VENV, with torch $torch_now" >&2
"$PY" -m pip install --quiet "${CONSTRAINTS[@]}" -e ".[$extras]" "torch==$torch_now"
