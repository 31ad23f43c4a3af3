#!/usr/bin/env bash
# Downloads, into .whl/, the wheels the GPU machine's image lacks for scripts/gpu_check.sh: the
# OpenTelemetry API, SDK and semantic conventions, at the versions this environment has (so the GPU
# check runs what CI runs). Pure-Python wheels, about 200 KB; the device tool's `carry` takes .whl.
# Run here, in the repository's root, before calling the device tool (see scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST=.whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '.whl/' .gitignore || echo '/.whl/' >> .git/info/exclude
specs=()
for package in opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions; do
    version=$("$PY" -c "import importlib.metadata as m; print(m.version('$package'))")
    specs+=("$package==$version")
done
mkdir -p "$DEST"
# The device's python is 3.12 on x86-64 (library/device/KINDS.md); these wheels are pure Python.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$DEST" "${specs[@]}"
ls -1 "$DEST"
