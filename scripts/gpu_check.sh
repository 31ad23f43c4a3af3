#!/usr/bin/env bash
# The prepared GPU check: under 5 minutes on one GPU, run at once whenever a GPU machine is lent.
#
#   1. the test suite's CUDA-marked tests (pytest -m cuda): fully_shard against FSDP2 on CUDA, the
#      adapter bitwise against the hand-cast reference on CUDA, CUDA-event step timings;
#   2. `fsdp-patch demo` under `torchrun --nproc-per-node 1` on NCCL: 20 steps with a DCP
#      checkpoint, then --resume to step 30;
#   3. the benchmark suite's cases on the GPU (BENCH_CASES below, one line each: python -m benchmarks
#      --device cuda --case N), timed with CUDA events, each writing JSON named after the GPU into
#      benchmarks/results/.
#
# Without CUDA it still runs: the CUDA tests skip (each saying why), the demo runs under torchrun
# on gloo for 2+1 steps, and the benchmarks are skipped; it says so. CI runs it that way
# (tests/test_gpu_check.py), so it keeps working between GPU sessions.
#
# Outputs: the log (gpu_check.log) and every benchmark JSON go to $OUT when it is set (the device
# tool returns what is written there) and, on a GPU, to benchmarks/results/ as well
# (GPU_CHECK_RESULTS_DIR moves that). Python: $PYTHON, else python3; the checkout is put on
# PYTHONPATH, so an installed fsdp_patch is not needed.
#
# On the lent machine, whose image lacks OpenTelemetry: run scripts/gpu_wheels.sh here first, then
#   run(command="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; bash scripts/gpu_check.sh",
#       carry=[".whl"], timeout_s=420)
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
RESULTS_DIR="${GPU_CHECK_RESULTS_DIR:-benchmarks/results}"
# Wall-clock limits per part, in seconds: together under 5 minutes.
TESTS_LIMIT=100
DEMO_LIMIT=45
BENCH_LIMIT=40

# Part 3's cases: NAME|python arguments. The script appends `--json FILE`; add a case with a line.
BENCH_CASES=(
    "suite-1-floor|-m benchmarks --device cuda --case 1"
    "suite-2-step|-m benchmarks --device cuda --case 2"
    "suite-3-scaling|-m benchmarks --device cuda --case 3"
    "suite-4-attachments|-m benchmarks --device cuda --case 4"
    "suite-5-telemetry|-m benchmarks --device cuda --case 5"
    "suite-6-end_to_end|-m benchmarks --device cuda --case 6"
)

export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

declare -a SUMMARY=()
FAILED=0

record() {  # record PART STATUS DETAIL
    SUMMARY+=("$(printf '%-28s %-5s %s' "$1" "$2" "$3")")
    [ "$2" = FAIL ] && FAILED=1
    return 0
}

run_part() {  # run_part NAME LIMIT COMMAND...: runs it with a time limit, records PASS or FAIL
    local name="$1" limit="$2"
    shift 2
    echo
    echo "== $name: $*"
    local started=$SECONDS
    timeout "$limit" "$@"
    local code=$?
    local took=$((SECONDS - started))
    if [ "$code" -eq 0 ]; then
        record "$name" PASS "${took}s"
    elif [ "$code" -eq 124 ]; then
        record "$name" FAIL "over its ${limit}s limit"
    else
        record "$name" FAIL "exit $code after ${took}s"
    fi
}

check() {
    local has_cuda="$1" slug="$2"
    echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), python $("$PY" -c 'import platform; print(platform.python_version())'), torch $("$PY" -c 'import torch; print(torch.__version__)')"
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L
    if ! "$PY" -c 'import sys, torch; v = torch.__version__.split("+")[0].split("."); sys.exit(tuple(map(int, v[:2])) < (2, 13))'; then
        echo "gpu_check: WARNING: fsdp_patch targets torch >= 2.13; this torch is older, failures may come from that"
    fi
    local missing
    missing=$("$PY" - <<'EOF'
import importlib.util
names = {"opentelemetry.sdk": "opentelemetry-sdk", "opentelemetry.semconv": "opentelemetry-semantic-conventions",
         "wrapt": "wrapt", "pytest": "pytest", "pytest_timeout": "pytest-timeout", "numpy": "numpy"}
missing = []
for module, package in names.items():
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        missing.append(package)
print(" ".join(missing))
EOF
)
    if [ -n "$missing" ]; then
        record "packages" FAIL "missing: $missing (on the device machine: scripts/gpu_wheels.sh, then carry .whl)"
        return
    fi

    # 1. CUDA-marked tests.
    if [ "$has_cuda" = 1 ]; then
        run_part "1 CUDA tests" "$TESTS_LIMIT" "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider tests
    else
        echo
        echo "== 1 CUDA tests: no CUDA device, so each CUDA test skips, saying why"
        run_part "1 CUDA tests (skipped)" "$TESTS_LIMIT" "$PY" -m pytest -m cuda -q -rs -p no:cacheprovider tests
    fi

    # 2. The demo under torchrun: NCCL on a GPU, gloo otherwise; a checkpoint, then a resume.
    local work steps resume
    work=$(mktemp -d)
    if [ "$has_cuda" = 1 ]; then steps=20 resume=30; else steps=2 resume=3; fi
    [ "$has_cuda" = 1 ] || { echo; echo "== 2 demo: no CUDA device, so it runs under torchrun on gloo (CPU), $steps+$((resume - steps)) steps"; }
    local demo=(-m fsdp_patch demo --progress lines --checkpoint-every 10 --checkpoint-dir "$work/ckpt" --trace-dir "$work/traces")
    run_part "2 demo, torchrun" "$DEMO_LIMIT" "$PY" -m torch.distributed.run --nproc-per-node 1 "${demo[@]}" --steps "$steps"
    run_part "2 demo, torchrun --resume" "$DEMO_LIMIT" "$PY" -m torch.distributed.run --nproc-per-node 1 "${demo[@]}" --steps "$resume" --resume
    rm -rf "$work"

    # 3. GPU benchmark cases.
    if [ "$has_cuda" != 1 ]; then
        echo
        echo "== 3 GPU benchmarks: no CUDA device, skipped (CPU figures: make bench)"
        record "3 GPU benchmarks" SKIP "no CUDA device"
        return
    fi
    mkdir -p "$RESULTS_DIR"
    local case name args file
    for case in "${BENCH_CASES[@]}"; do
        name="${case%%|*}"
        args="${case#*|}"
        file="$RESULTS_DIR/$name-$slug.json"
        # shellcheck disable=SC2086 # the case's arguments are words by design
        run_part "3 bench $name" "$BENCH_LIMIT" "$PY" $args --json "$file"
        [ -n "${OUT:-}" ] && [ -f "$file" ] && cp "$file" "$OUT/"
    done
}

main() {
    local has_cuda=0 slug=cpu
    if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        has_cuda=1
        slug=$("$PY" -c 'import re, torch; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-"))')
    fi
    local logs=()
    [ -n "${OUT:-}" ] && mkdir -p "$OUT" && logs+=("$OUT/gpu_check.log")
    [ "$has_cuda" = 1 ] && mkdir -p "$RESULTS_DIR" && logs+=("$RESULTS_DIR/gpu_check-$slug.log")
    {
        [ "$has_cuda" = 1 ] || echo "gpu_check: no CUDA device: running what runs without one, skipping the CUDA parts"
        check "$has_cuda" "$slug"
        echo
        echo "== summary ($SECONDS s in all)"
        printf '%s\n' "${SUMMARY[@]}"
        [ "$FAILED" = 0 ] && echo "gpu_check: all parts passed" || echo "gpu_check: FAILED"
        exit "$FAILED"
    } 2>&1 | tee "${logs[@]}"
    return "${PIPESTATUS[0]}"
}

main "$@"
