#!/usr/bin/env bash
# The tests a CPU CI cannot run, on a GPU host (the H200), from the repo root:
#
#   OUT=DIR [LIMIT_S=570] [RUNS="suite shipped"] [WORKERS=N] [DUMP_S=150] bash tests/gpu_host.sh
#
# Up to three pytest runs, one after the other (each alone on the GPU: side by side, the shipped-pair file and the
# suite's workers ran an 80 GB H100 out of memory, 2026-12-05), all within LIMIT_S seconds together, each streaming
# one line per finished test (-v, so a run cut short still names every result it got) into OUT:
#   gpu_suite.log    - 1. every test marked gpu (the kernels natively, the dispatcher on a GPU: what only this host can
#                      run), at most SUITE_S seconds (default 280);
#   shipped_gpu.log  - 2. tests/test_shipped_model.py on the GPU (the greedy invariant of the shipped pair on every
#                      held-out prompt, the acceptance floors, determinism for a seed), 3 workers;
#   gpu_suite.log    - 3. in the time left, the other kernels tests (interpret mode, also run by CI; the Mosaic GPU
#                      interpreter's attention tests left out: minutes under this host's load), so a cut run loses
#                      only tests CI covers.
# RUNS picks "suite" (1 and 3) and "shipped" (2). Each log ends with its runs' exit status ("rc=124": cut at the limit);
# the script exits 0 when every run it started passed and none was cut or left unstarted, else with the first other status.
# The suite runs WORKERS pytest workers: by default one per 16 GiB of the first GPU's memory, at most 12 (8 on an
# H200, 4 on an 80 GB H100; 12 workers there ran out of GPU memory in the K2.6-shape kernel tests, and 6 in one of 57,
# docs/kernels.md "Testing the kernels").
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
LIMIT_S=${LIMIT_S:-570}
SUITE_S=${SUITE_S:-280}
RUNS=${RUNS:-suite shipped}
PY=${PYTHON:-python3}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# One persistent compilation cache for every run and worker (a fresh folder a call unless set): a program that two
# workers compile is compiled once, and through it XLA's per-fusion autotuning cache (jax's
# persistent_cache_enable_xla_caches default) shares the float32 GEMM autotuning that dominates these tests' time.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$(mktemp -d /tmp/kdtree-jax-gpu-cache.XXXXXX)}
if [[ -z "${WORKERS:-}" ]]; then
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
    WORKERS=$(( ${mib:-0} / (16 * 1024) )); (( WORKERS > 12 )) && WORKERS=12; (( WORKERS < 1 )) && WORKERS=1
fi
# A test still running after DUMP_S seconds (default 150) dumps every thread's stack into the log and runs on: a call
# cut at its limit then still says where a slow or stuck test was (session 43's shipped run was cut inside one).
common=(-p no:cacheprovider -p no:benchmark -o addopts="-rfEs" -o faulthandler_timeout="${DUMP_S:-150}" -v
        --tb=short --durations=8)
end=$(( $(date +%s) + LIMIT_S ))
left() { echo $(( end - $(date +%s) )); }
suite_log="$OUT/gpu_suite.log" shipped_log="$OUT/shipped_gpu.log"
status=0
note() { (( status == 0 )) && status=$1; return 0; }  # note RC: the script's exit status is the first nonzero one
in_time_left() {  # LOG LABEL CMD...: CMD, its output appended to LOG, in the time left (not started with 10 s or less)
    local log=$1 label=$2 rc; shift 2
    if (( $(left) > 10 )); then
        timeout "$(left)" "$@" >> "$log" 2>&1
        rc=$?; note $rc; echo "rc=$rc${label:+ ($label)}" >> "$log"
    else
        note 124; echo "rc=124 (${label:+$label: }not started, no time left)" >> "$log"
    fi
}
# --dist load: the two long kernel files (MoE, tree build) spread over the workers
if [[ " $RUNS " == *" suite "* ]]; then
    t=$(left); (( t > SUITE_S )) && t=$SUITE_S
    timeout "$t" $PY -m pytest "${common[@]}" -n "$WORKERS" --dist load -m gpu tests > "$suite_log" 2>&1
    rc=$?; note $rc; echo "rc=$rc (-m gpu)" >> "$suite_log"
fi
# --dist loadgroup: the tests of one whole-generate module fixture run on one worker (their xdist_group), so no fixture
# is built twice
if [[ " $RUNS " == *" shipped "* ]]; then
    : > "$shipped_log"
    in_time_left "$shipped_log" "" $PY -m pytest "${common[@]}" -n 3 --dist loadgroup tests/test_shipped_model.py
fi
if [[ " $RUNS " == *" suite "* ]]; then
    in_time_left "$suite_log" "-m 'kernels and not gpu'" \
        $PY -m pytest "${common[@]}" -n "$WORKERS" --dist load -m "kernels and not gpu" -k "not mgpu_interpret" tests
fi
for log in "$suite_log" "$shipped_log"; do [[ ! -f "$log" ]] || grep -HE "FAILED|ERROR|rc=" "$log"; done | tail -n 40
exit "$status"
