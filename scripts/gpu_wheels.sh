#!/usr/bin/env bash
# Downloads the wheels scripts/gpu_check.sh needs on a machine that has torch, numpy, wrapt and
# pytest but no OpenTelemetry and no network: the API, the SDK, the semantic conventions and the
# instrumentation base, at the versions this environment has (so that the GPU check runs what the
# test suite runs here), and setuptools and wheel, which build the checkout offline there
# (pip install --no-index --find-links DIR --no-deps .). Pure-Python wheels, about 2 MB together.
#
#   scripts/gpu_wheels.sh --dest DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64] [--python PY]
#
# --python-version and --platform describe the machine the wheels are for (pip download's options
# of the same names); --python is the interpreter whose installed versions are copied (python3 by
# default). Afterwards: scripts/gpu_check.sh --wheels DIR --out RESULTS on that machine.
set -euo pipefail

usage() {
    echo "usage: scripts/gpu_wheels.sh --dest DIR [--python-version X.Y] [--platform TAG] [--python PY]" >&2
    exit 2
}

DEST=""
PY_VERSION=3.12
PLATFORM=manylinux_2_28_x86_64
PY="${PYTHON:-python3}"
while [ $# -gt 0 ]; do
    [ $# -ge 2 ] || usage
    case "$1" in
        --dest) DEST="$2" ;;
        --python-version) PY_VERSION="$2" ;;
        --platform) PLATFORM="$2" ;;
        --python) PY="$2" ;;
        *) echo "gpu_wheels: unknown argument '$1'" >&2; usage ;;
    esac
    shift 2
done
[ -n "$DEST" ] || { echo "gpu_wheels: --dest DIR is required (where the wheels go)" >&2; usage; }
[[ "$PY_VERSION" =~ ^[0-9]+\.[0-9]+$ ]] || { echo "gpu_wheels: --python-version wants X.Y (such as 3.12), got '$PY_VERSION'" >&2; exit 2; }

specs=()
for package in opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-instrumentation; do
    if ! version=$("$PY" -c "import importlib.metadata as m; print(m.version('$package'))" 2>/dev/null); then
        echo "gpu_wheels: $PY has no $package to copy the version of; run it with the project's environment (--python .venv/bin/python)" >&2
        exit 1
    fi
    specs+=("$package==$version")
done
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform "$PLATFORM" -d "$DEST" "${specs[@]}"
# What pyproject.toml's [build-system] requires, for building the checkout without an index.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform "$PLATFORM" -d "$DEST" "setuptools>=64" wheel
ls -1 "$DEST"
