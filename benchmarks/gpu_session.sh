#!/usr/bin/env bash
# The whole GPU session in one command (benchmarks/README.md): run from any directory as
#
#   bash benchmarks/gpu_session.sh [--smoke] [env] [tests] [bench] [cascade] [profile] [gluon] [tune]
#
# Steps (all seven when none is named), each under its own `timeout` so that one slow step
# cannot eat the others, all inside one session deadline that fits the device tool's
# 10-minute command:
#   env    nvidia-smi (queries only), Python/torch/triton versions, CPU count
#   tests  python3 -m pytest tests/kernels on CUDA: TRITON_INTERPRET unset, so conftest
#          runs the compiled kernels (bf16 included); pytest-xdist/-timeout when present;
#          a run cut short lists the tests it did not finish ("tests that did not finish")
#   bench  benchmarks/bench_kernels.py: SPEC shape, sweep, decode, split decode
#   cascade benchmarks/time_cascade.py: plain against cascade attention on shared prefixes
#   profile Nsight Compute (ncu, where installed) on the SPEC prefill, one run per tile of
#          benchmarks/kernel_profile.py, into ncu-profile.txt; without ncu, timings only
#   gluon  benchmarks/gluon_pingpong.py --time: the Gluon ping-pong probe (not the library's
#          kernel) checked against the fp32 reference and timed on the goal shape's
#          cached-prefix attention, dense and paged, into the log (its correctness tests,
#          tests/kernels/test_gluon_pingpong.py, run in the tests step)
#   tune   benchmarks/tune_kernels.py, its budget cut to the time that is left
# Everything goes to $OUT (unset: benchmarks/results): gpu-session.log (all output), the
# kernels-, cascade- and tune-<device>.json/.md of the three scripts and ncu-profile.txt:
# 8 files at most (the device tool brings back 8).
# --smoke runs the same steps on tiny shapes (the interpreter without a GPU; tests: only
# tests/kernels/test_tiling.py; gluon: the probe's sm_90a compile and static model, as
# Gluon has no interpreter) to check the script itself; tests/kernels/test_bench_kernels.py
# runs it once and checks the bench's and the tune's smoke results in its $OUT.
#
# Environment: OUT, PYTHON (python3), SESSION_S (570: the deadline for all steps),
# TESTS_S (200), BENCH_S (170), CASCADE_S (90), PROFILE_S (240), GLUON_S (60), TUNE_S (400): caps per
# step, PROFILE_TILES (all four of kernel_profile.py), TUNE_SHAPES (all three), TEST_JOBS (8: xdist
# workers), TUNE_JOBS (compile processes of the tune), PREFIXKV_COMMIT (the commit to
# record, ahead of the copy's .git, which the device tool can leave stale).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
SMOKE=0
STEPS=()
for arg in "$@"; do
    case $arg in
        --smoke) SMOKE=1 ;;
        env | tests | bench | cascade | profile | gluon | tune) STEPS+=("$arg") ;;
        -h | --help) sed -n '2,34p' "$0"; exit 0 ;;
        *) echo "gpu_session.sh: unknown argument '$arg' (steps: env tests bench cascade profile gluon tune; --smoke)" >&2
           exit 2 ;;
    esac
done
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env tests bench cascade profile gluon tune)

PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/benchmarks/results}
mkdir -p "$OUT" || exit 2
LOG=$OUT/gpu-session.log
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS
DEADLINE=$((START + ${SESSION_S:-570}))
SMOKE_FLAG=()
[ "$SMOKE" = 1 ] && SMOKE_FLAG=(--smoke)
SUMMARY=()
FAILED=0

if [ "$SMOKE" = 0 ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_session.sh: no CUDA device visible to $PY; use --smoke for the CPU check" >&2
    exit 2
fi

step_env() {
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu \
            --format=csv
    else
        echo "nvidia-smi: not found"
    fi
    "$PY" - << 'EOF'
import os, platform, sys
import torch, triton
print(f"python {platform.python_version()} ({sys.executable}), torch {torch.__version__}, triton {triton.__version__}")
print(f"cuda: {torch.cuda.is_available()}", torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print(f"cpus {os.cpu_count()}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}")
EOF
    # PREFIXKV_COMMIT first: the device tool's copy can carry a stale .git
    echo "commit: ${PREFIXKV_COMMIT:-$(git rev-parse HEAD 2> /dev/null || echo "unknown (no .git; set PREFIXKV_COMMIT)")}"
}

step_tests() {
    # A run cut short must name what it did not finish: tests/kernels/unfinished.py (from
    # conftest) lists the tests started and never finished and those never started;
    # faulthandler dumps every thread's stack of a test past 120 s (from a watchdog thread:
    # also a test blocked in C, which pytest-timeout's signal method never interrupts); the
    # thread method ends such a test's worker, and xdist names the test it crashed in.
    # The order is fixed (no pytest-randomly), so two runs lose the same tests.
    local args=(-q -rs -p no:cacheprovider -p no:randomly --durations=15 -o faulthandler_timeout=120)
    if [ "$SMOKE" = 1 ]; then
        "$PY" -m pytest "${args[@]}" tests/kernels/test_tiling.py
        return
    fi
    # loadgroup: the tests of one module-scoped fixture that runs a subprocess (the sm_90
    # compile, the smoke session) share a worker (xdist_group), instead of one run a worker.
    "$PY" -c "import xdist" 2> /dev/null && args+=(-n "${TEST_JOBS:-8}" --dist loadgroup)
    "$PY" -c "import pytest_timeout" 2> /dev/null && args+=(--timeout 150 -o timeout_method=thread)
    # Unset: conftest then runs every Triton test on CUDA tensors through compiled kernels.
    env -u TRITON_INTERPRET "$PY" -m pytest "${args[@]}" tests/kernels
}

step_bench() {
    "$PY" benchmarks/bench_kernels.py "${SMOKE_FLAG[@]}" --out-dir "$OUT"
}

step_cascade() {
    "$PY" benchmarks/time_cascade.py "${SMOKE_FLAG[@]}" --out-dir "$OUT"
}

step_profile() {
    local tiles=(${PROFILE_TILES:-256x128 128x64-qk 128x64 128x128}) tile rc=0
    [ "$SMOKE" = 1 ] && tiles=("${tiles[0]}")  # the smoke proves the script: one tile does
    if [ "$SMOKE" = 1 ] || ! command -v ncu > /dev/null; then
        [ "$SMOKE" = 0 ] && echo "ncu: not found; timing the tiles only"
        for tile in "${tiles[@]}"; do
            "$PY" benchmarks/kernel_profile.py "${SMOKE_FLAG[@]}" --tile "$tile" --launches 1 || rc=1
        done
        return $rc
    fi
    for tile in "${tiles[@]}"; do
        echo "=== ncu: tile $tile ===" >> "$OUT/ncu-profile.txt"
        timeout 120 ncu --clock-control none --kernel-name _paged_prefill_kernel --launch-skip 1 \
            --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
            --section LaunchStats --section SchedulerStats --section WarpStateStats \
            "$PY" benchmarks/kernel_profile.py --tile "$tile" --launches 3 >> "$OUT/ncu-profile.txt" 2>&1 || rc=1
        tail -3 "$OUT/ncu-profile.txt"
    done
    return $rc
}

step_gluon() {
    # Gluon has no interpreter: the smoke compiles the paged kernel for sm_90a and runs the
    # static model on its SASS (what benchmarks/results/kernels-sm90-gluon-pingpong.md reports)
    if [ "$SMOKE" = 1 ]; then
        env -u TRITON_INTERPRET "$PY" benchmarks/gluon_pingpong.py --layout paged
        return
    fi
    env -u TRITON_INTERPRET "$PY" benchmarks/gluon_pingpong.py --time
}

step_tune() {
    local limit=$1 jobs=()
    [ -n "${TUNE_JOBS:-}" ] && jobs=(--jobs "$TUNE_JOBS")
    [ -n "${TUNE_SHAPES:-}" ] && jobs+=(--shapes $TUNE_SHAPES)
    # The tune stops itself inside its budget; the margin covers start-up and writing.
    "$PY" benchmarks/tune_kernels.py "${SMOKE_FLAG[@]}" "${jobs[@]}" \
        --budget-s $((limit > 90 ? limit - 40 : limit / 2)) --out-dir "$OUT"
}

run_step() {
    local name=$1 cap=$2 left=$((DEADLINE - SECONDS - 10))
    local limit=$((cap < left ? cap : left)) t0=$SECONDS rc
    echo
    echo "=== $name (limit ${limit}s, $((SECONDS - START))s into the session) ==="
    if [ "$limit" -lt 30 ]; then
        echo "SKIPPED: only ${left}s left before the session deadline"
        SUMMARY+=("$name: skipped (no time left)")
        return
    fi
    # SIGINT first: pytest then still prints its summary; KILL 20 s later.
    timeout -s INT -k 20 "$limit" bash -c "$(declare -f "step_$name"); $(declare -p PY OUT SMOKE SMOKE_FLAG); step_$name $limit"
    rc=$?
    [ "$rc" -ne 0 ] && FAILED=1
    [ "$rc" -eq 124 ] && echo "TIMEOUT: $name passed its ${limit}s"
    SUMMARY+=("$name: rc $rc, $((SECONDS - t0))s")
}

for step in "${STEPS[@]}"; do
    case $step in
        env) run_step env 60 ;;
        tests) run_step tests "${TESTS_S:-200}" ;;
        bench) run_step bench "${BENCH_S:-170}" ;;
        cascade) run_step cascade "${CASCADE_S:-90}" ;;
        profile) run_step profile "${PROFILE_S:-240}" ;;
        gluon) run_step gluon "${GLUON_S:-60}" ;;
        tune) run_step tune "${TUNE_S:-400}" ;;
    esac
done

echo
echo "=== summary ($((SECONDS - START))s) ==="
printf '%s\n' "${SUMMARY[@]}"
echo "files in $OUT:"
ls -l "$OUT"
exit "$FAILED"
