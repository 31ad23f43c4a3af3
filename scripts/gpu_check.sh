#!/usr/bin/env bash
# The GPU check: what only a CUDA machine can show, in under 6 minutes on one GPU.
#
#   scripts/gpu_check.sh --out DIR [--python PY] [--wheels DIR] [--budget SECONDS] [--limit-scale K]
#
#   1. the test suite's CUDA-marked tests (pytest -m cuda): fully_shard against FSDP2 on CUDA, the
#      adapter bitwise against the hand-cast reference on CUDA, CUDA-event step timings;
#   2. `fsdp-patch demo` under `torchrun --nproc-per-node 1` on NCCL: 20 steps with a DCP
#      checkpoint, then --resume to step 30, telemetry on (or off, saying why, without OpenTelemetry);
#   3. the per-iteration origin checks' cost (benchmarks.origin_checks), the benchmark suite's
#      cases and the operation audit's and float32 shadow's cost (benchmarks.op_audit_cost) on the
#      GPU (BENCH_CASES below, one line each), timed with CUDA events, each writing its JSON, named
#      after the GPU, into DIR.
#
# What it needs: the checkout, an interpreter (--python, else python3) with torch >= 2.11, numpy,
# wrapt, pytest and pytest-timeout, and pip. It never installs torch nor anything into that
# interpreter's environment: the checkout is built (pip install --no-deps, from a copy, so the
# checkout gets no build files) into a temporary folder for this run only, and so is
# OpenTelemetry, where the machine has none, from --wheels DIR (made elsewhere by
# scripts/gpu_wheels.sh, which adds the setuptools and wheel wheels the build needs offline). The
# parts run from that temporary folder, so that the installed fsdp_patch is the one imported.
#
# Without CUDA it still runs: the CUDA tests skip (each saying why), the demo runs under torchrun
# on gloo for 2+1 steps, the benchmarks are skipped, and the summary says so. The test suite runs
# it that way (tests/test_gpu_check.py), so it keeps working between GPU runs.
#
# Every part has a time limit (and the whole run a budget, --budget, 345 s by default); a part that
# fails or runs out of time is recorded and the next one runs. The limits are sized for a GPU
# machine's few minutes; --limit-scale K multiplies them (a loaded CPU machine running the script
# to check it, not to time it: the test suite passes a large K and budget). Results, in DIR:
#   summary.md     what ran, on what, and how it went, with the benchmark tables (meant to be read
#                  and committed);
#   gpu_check.log  everything the run printed;  logs/PART.log  each part's own output;
#   suite-N-NAME-GPU.json  the benchmark figures (on a GPU).
# Exit status: 0 when no part failed.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"

usage() {
    echo "usage: scripts/gpu_check.sh --out DIR [--python PY] [--wheels DIR] [--budget SECONDS] [--limit-scale K]" >&2
    exit 2
}

OUT_DIR=""
PY="${PYTHON:-python3}"
WHEELS=""
BUDGET=345
LIMIT_SCALE=1
while [ $# -gt 0 ]; do
    [ $# -ge 2 ] || usage
    case "$1" in
        --out) OUT_DIR="$2" ;;
        --python) PY="$2" ;;
        --wheels) WHEELS="$2" ;;
        --budget) BUDGET="$2" ;;
        --limit-scale) LIMIT_SCALE="$2" ;;
        *) echo "gpu_check: unknown argument '$1'" >&2; usage ;;
    esac
    shift 2
done
[ -n "$OUT_DIR" ] || { echo "gpu_check: --out DIR is required (where the summary and logs go)" >&2; usage; }
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "gpu_check: --budget wants whole seconds, got '$BUDGET'" >&2; exit 2; }
[[ "$LIMIT_SCALE" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check: --limit-scale wants a whole number >= 1, got '$LIMIT_SCALE'" >&2; exit 2; }
if [ -n "$WHEELS" ] && ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "gpu_check: --wheels $WHEELS holds no .whl files (scripts/gpu_wheels.sh --dest $WHEELS makes them)" >&2
    exit 2
fi
command -v "$PY" >/dev/null 2>&1 || { echo "gpu_check: interpreter '$PY' not found (--python PY)" >&2; exit 2; }
# Paths given relative to where the script was called from, before it moves to the checkout.
mkdir -p "$OUT_DIR/logs" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
[ -n "$WHEELS" ] && WHEELS="$(cd "$WHEELS" && pwd)"
[[ "$PY" == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
cd "$REPO"

# Wall-clock limits per part, in seconds (each also capped by what is left of the budget).
TESTS_LIMIT=100
DEMO_LIMIT=45
# Part 3's cases: NAME|LIMIT|python arguments. LIMIT is the case's seconds on an H200 with room
# to spare (case 6 runs three models on two microbatch counts: 47 s there). Telemetry's cost at
# its defaults comes first: on a model of about 1B parameters (with a profiler count of the CUDA
# synchronizations of an undiagnosed step) and on the host-bound structure. The script appends
# `--json FILE`; add a case with a line.
BENCH_CASES=(
    "host-cost-1b|150|-m benchmarks.host_cost --device cuda --preset 1b --rounds 10"
    "host-cost-host-bound|90|-m benchmarks.host_cost --device cuda --rounds 20 --layers 0 6 24"
    "origin-checks|60|-m benchmarks.origin_checks --device cuda --world-size 1 --steps 24"
    "suite-1-floor|40|-m benchmarks --device cuda --case 1"
    "suite-2-step|40|-m benchmarks --device cuda --case 2"
    "suite-3-scaling|40|-m benchmarks --device cuda --case 3"
    "suite-4-attachments|40|-m benchmarks --device cuda --case 4"
    "suite-5-telemetry|40|-m benchmarks --device cuda --case 5"
    "suite-6-end_to_end|75|-m benchmarks --device cuda --case 6"
    "op-audit-cost|60|-m benchmarks.op_audit_cost --device cuda --world-size 1 --steps 4"
)
# Cases that need torchao's float8 training (real float8 matmuls on a GPU of compute capability
# 8.9 or more, emulated below it): run where torchao imports, else recorded as skipped.
FLOAT8_CASES=(
    "float8-gather|40|-m benchmarks.float8_gather --device cuda --world-size 1 --layers 8 --width 4096 --steps 6"
    "float8-watch-cost|60|-m benchmarks.float8_watch_cost --device cuda --layers 8 --width 4096 --rounds 12"
)

export PYTHONUNBUFFERED=1
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
SITE="$SCRATCH/site"
# The installed checkout first; the checkout itself for tests/ and benchmarks/, which are not installed.
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"

declare -a SUMMARY=()
declare -a BENCH_LOGS=()
FAILED=0

record() {  # record PART STATUS DETAIL
    SUMMARY+=("$1|$2|$3")
    [ "$2" = FAIL ] && FAILED=1
    return 0
}

note_last() {  # note_last TEXT: appends TEXT to the detail of the last part recorded
    local last="${SUMMARY[-1]}"
    SUMMARY[-1]="$last; $1"
}

demo_outcome() {  # what a demo log says of its run: telemetry, the report's verdict, the last loss
    local log="$1" telemetry verdict loss
    telemetry=$(grep -q '^fsdp-patch demo: telemetry off' "$log" && echo "telemetry off" || echo "telemetry on")
    verdict=$(grep -Eo '^overall: [a-z]+' "$log" | tail -1)
    loss=$(grep -Eo '^step [0-9]+/[0-9]+ +loss [0-9.naif]+' "$log" | tail -1 | sed -E 's/ +/ /g')
    echo "$telemetry${verdict:+, $verdict}${loss:+, last $loss}"
}

checkout_id() {  # the commit checked, "+ local changes" when the tree differs from it (git reads only)
    local head
    head=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null) || { echo "unknown (not a git checkout)"; return; }
    if [ -n "$(GIT_OPTIONAL_LOCKS=0 git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
        head="$head + local changes"
    fi
    echo "$head"
}

slug_of() { echo "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g'; }

run_part() {  # run_part NAME LIMIT COMMAND...: runs it within its limit and the budget; PASS, FAIL or SKIP
    local name="$1" limit=$(($2 * LIMIT_SCALE))
    shift 2
    PART_LOG=""
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 10 ]; then
        echo
        echo "== $name: skipped, the ${BUDGET}s budget is spent"
        record "$name" SKIP "the ${BUDGET}s budget was spent before it"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local log="$OUT_DIR/logs/$(slug_of "$name").log"
    echo
    echo "== $name (limit ${limit}s): $*"
    local started=$SECONDS
    # timeout signals the command's whole process group: torchrun's and pytest's ranks go too.
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
    local code=${PIPESTATUS[0]}
    local took=$((SECONDS - started))
    PART_LOG="$log"
    if [ "$code" -eq 0 ]; then
        record "$name" PASS "${took}s"
    elif [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
        record "$name" FAIL "over its ${limit}s limit (log: logs/$(basename "$log"))"
    else
        record "$name" FAIL "exit $code after ${took}s (log: logs/$(basename "$log"))"
    fi
    return "$code"
}

install_wheels() {
    [ -n "$WHEELS" ] || return 0
    local otel=("$WHEELS"/opentelemetry*.whl)
    echo "== wheels: installing ${#otel[@]} OpenTelemetry wheels from $WHEELS into a temporary folder (nothing else is installed)"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check --target "$SITE" "${otel[@]}"
    else
        # No pip: a pure-Python wheel is a zip of what goes into site-packages.
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" "${otel[@]}"
    fi || { record "0 wheels" FAIL "could not install the wheels of $WHEELS"; return 1; }
    record "0 wheels" PASS "${#otel[@]} from $WHEELS"
}

install_checkout() {  # fsdp_patch built from a copy of the checkout into $SITE (telemetry/ and app/ become fsdp_patch.telemetry and fsdp_patch.app)
    local source="$SCRATCH/source" name
    mkdir -p "$source"
    for name in pyproject.toml setup.py README.md fsdp_patch telemetry app startup; do  # tests/package_source.py names the same
        cp -R "$REPO/$name" "$source/$name"
    done
    local index=()
    # Offline: the build's setuptools and wheel from the wheel folder.
    [ -n "$WHEELS" ] && index=(--no-index --find-links "$WHEELS")
    echo "== checkout: installing fsdp_patch from $REPO into a temporary folder${WHEELS:+ (build requirements from $WHEELS)}"
    if ! "$PY" -m pip install --quiet --no-deps --no-compile --disable-pip-version-check "${index[@]}" --target "$SITE" "$source"; then
        record "0 checkout" FAIL "pip could not build the checkout into a temporary folder (needs pip, and setuptools>=64 from the index or --wheels DIR)"
        return 1
    fi
    record "0 checkout" PASS "fsdp_patch $(checkout_id) installed for this run"
}

environment() {  # prints facts as "key: value" lines; records what is missing
    "$PY" - <<'EOF'
import importlib.metadata as metadata
import importlib.util
import platform

import torch

print(f"python: {platform.python_version()} ({platform.machine()})")
cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ", CPU build"
print(f"torch: {torch.__version__}{cuda}")
if torch.cuda.is_available():
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    print(f"device: {names}")
else:
    print("device: no CUDA device")
for package in ("numpy", "wrapt", "pytest", "pytest-timeout", "opentelemetry-api", "opentelemetry-sdk",
                "opentelemetry-instrumentation"):
    try:
        print(f"{package}: {metadata.version(package)}")
    except metadata.PackageNotFoundError:
        print(f"{package}: missing")
EOF
}

check() {
    echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), checkout $(checkout_id)"
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L
    install_wheels
    install_checkout
    if ! ENVIRONMENT=$(environment 2>&1); then
        echo "$ENVIRONMENT"
        record "0 environment" FAIL "$PY cannot import torch (see the log)"
        return
    fi
    echo "$ENVIRONMENT"
    local missing
    missing=$(echo "$ENVIRONMENT" | sed -n 's/^\([a-z-]*\): missing$/\1/p' | tr '\n' ' ')
    if [ -n "$missing" ]; then
        record "0 environment" FAIL "missing: $missing(OpenTelemetry: --wheels DIR from scripts/gpu_wheels.sh); the parts run anyway"
    else
        record "0 environment" PASS "$(echo "$ENVIRONMENT" | sed -n 's/^torch: //p')"
    fi
    if ! "$PY" -c 'import sys, torch; v = torch.__version__.split("+")[0].split("."); sys.exit(tuple(map(int, v[:2])) < (2, 11))'; then
        echo "gpu_check: WARNING: fsdp_patch supports torch >= 2.11; this torch is older, failures may come from that"
    fi

    # 1. CUDA-marked tests. Collected from tests/cuda only: the rest of the suite needs packages
    # (yaml, the exporters) that this check does not ask the machine for.
    local pytest=("$PY" -m pytest -m cuda -q -rs -p no:cacheprovider --import-mode=append --rootdir "$REPO" "$REPO/tests/cuda")
    if [ "$HAS_CUDA" = 1 ]; then
        run_part "1 CUDA tests" "$TESTS_LIMIT" "${pytest[@]}"
    else
        echo
        echo "== 1 CUDA tests: no CUDA device, so each CUDA test skips, saying why"
        if run_part "1 CUDA tests" "$TESTS_LIMIT" "${pytest[@]}"; then
            unset 'SUMMARY[-1]'  # it ran, but tested nothing: a skip, not a pass
            record "1 CUDA tests" SKIP "no CUDA device: $(grep -Eo '[0-9]+ skipped' "$PART_LOG" | tail -1), each saying why"
        fi
    fi

    # 2. The demo under torchrun: NCCL on a GPU, gloo otherwise; a checkpoint, then a resume.
    local work="$SCRATCH/demo" steps resume
    if [ "$HAS_CUDA" = 1 ]; then steps=20 resume=30; else steps=2 resume=3; fi
    [ "$HAS_CUDA" = 1 ] || { echo; echo "== 2 demo: no CUDA device, so it runs under torchrun on gloo (CPU), $steps+$((resume - steps)) steps"; }
    local demo=(-m fsdp_patch demo --progress lines --checkpoint-every 10 --checkpoint-dir "$work/ckpt" --trace-dir "$work/traces")
    run_part "2 demo, torchrun" "$DEMO_LIMIT" "$PY" -m torch.distributed.run --nproc-per-node 1 "${demo[@]}" --steps "$steps"
    [ -n "$PART_LOG" ] && note_last "$(demo_outcome "$PART_LOG")"
    run_part "2 demo, torchrun --resume" "$DEMO_LIMIT" "$PY" -m torch.distributed.run --nproc-per-node 1 "${demo[@]}" --steps "$resume" --resume
    [ -n "$PART_LOG" ] && note_last "$(demo_outcome "$PART_LOG")"

    # 3. GPU benchmark cases.
    if [ "$HAS_CUDA" != 1 ]; then
        echo
        echo "== 3 GPU benchmarks: no CUDA device, skipped (CPU figures: make bench)"
        record "3 GPU benchmarks" SKIP "no CUDA device"
        return
    fi
    local case name limit args cases=("${BENCH_CASES[@]}")
    if "$PY" -c "import torchao.float8" >/dev/null 2>&1; then
        cases+=("${FLOAT8_CASES[@]}")
    else
        record "3 bench float8" SKIP "torchao.float8 does not import here (the float8 benchmarks need it)"
    fi
    for case in "${cases[@]}"; do
        IFS='|' read -r name limit args <<<"$case"
        # shellcheck disable=SC2086 # the case's arguments are words by design
        run_part "3 bench $name" "$limit" "$PY" $args --json "$OUT_DIR/$name-$SLUG.json"
        [ -n "${PART_LOG:-}" ] && BENCH_LOGS+=("$PART_LOG")
    done
}

write_summary() {  # the readable record of the run, summary.md
    local file="$OUT_DIR/summary.md" row part status detail
    {
        echo "# GPU check on $SLUG"
        echo
        echo "$(date -u +%Y-%m-%d), checkout $(checkout_id), ${SECONDS}s in all (budget ${BUDGET}s)."
        echo
        echo '```'
        echo "${ENVIRONMENT:-environment unknown}"
        echo '```'
        echo
        echo "| part | status | detail |"
        echo "| --- | --- | --- |"
        for row in "${SUMMARY[@]}"; do
            IFS='|' read -r part status detail <<<"$row"
            echo "| $part | $status | $detail |"
        done
        echo
        [ "$FAILED" = 0 ] && echo "Result: no part failed." || echo "Result: FAILED (see logs/)."
        local log
        for log in "${BENCH_LOGS[@]}"; do
            echo
            echo "## $(basename "$log" .log)"
            echo
            grep -E '^\|' "$log" || echo "(no table: see logs/$(basename "$log"))"
        done
    } > "$file"
}

main() {
    HAS_CUDA=0
    SLUG=cpu
    if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        HAS_CUDA=1
        SLUG=$(slug_of "$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')")
    else
        echo "gpu_check: no CUDA device: running what runs without one, skipping the CUDA parts"
    fi
    mkdir -p "$SITE"
    cd "$SCRATCH" || return 1  # not the checkout: its fsdp_patch/ (without telemetry) would shadow the installed one
    check
    write_summary
    echo
    echo "== summary ($SECONDS s in all; $OUT_DIR/summary.md)"
    local row part status detail
    for row in "${SUMMARY[@]}"; do
        IFS='|' read -r part status detail <<<"$row"
        printf '%-28s %-5s %s\n' "$part" "$status" "$detail"
    done
    [ "$FAILED" = 0 ] && echo "gpu_check: no part failed" || echo "gpu_check: FAILED"
    return "$FAILED"
}

main 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
