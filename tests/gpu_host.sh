#!/usr/bin/env bash
# The tests a CPU CI cannot run, on a GPU host (the H200), from the repo root:
#
#   OUT=DIR [LIMIT_S=420] [RUNS="suite shipped"] [WORKERS=N] bash tests/gpu_host.sh
#
# Two pytest runs side by side (RUNS picks them), each under LIMIT_S seconds, each streaming one line per finished test
# (-v, so a run cut short still names every result it got) into OUT:
#   gpu_suite.log    - every test marked gpu or kernels (the kernels natively, the dispatcher on a GPU), but the Mosaic
#                      GPU interpreter's attention tests (CPU tests, run by CI; minutes under this host's load): first
#                      the gpu-marked ones (what only this host can run), then, in the time left, the other kernels
#                      tests (interpret mode, also run by CI), so a cut run loses only tests CI covers;
#   shipped_gpu.log  - tests/test_shipped_model.py on the GPU (the greedy invariant of the shipped pair on
#                      every held-out prompt, the acceptance floors, determinism for a seed).
# Each log ends with the run's exit status ("rc=124": cut at the limit). The suite runs WORKERS pytest workers: by default
# one per 12 GiB of the first GPU's memory, at most 12 (11 on an H200, 6 on an 80 GB H100; there, 12 workers ran out of GPU memory
# in the K2.6-shape kernel tests, docs/kernels.md "Testing the kernels").
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
LIMIT_S=${LIMIT_S:-420}
RUNS=${RUNS:-suite shipped}
PY=${PYTHON:-python3}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# One persistent compilation cache for every worker of both runs (a fresh folder a call unless set): a program that
# two workers compile is compiled once, and through it XLA's per-fusion autotuning cache (jax's
# persistent_cache_enable_xla_caches default) shares the float32 GEMM autotuning that dominates these tests' time.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$(mktemp -d /tmp/kdtree-jax-gpu-cache.XXXXXX)}
if [[ -z "${WORKERS:-}" ]]; then
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
    WORKERS=$(( ${mib:-0} / (12 * 1024) )); (( WORKERS > 12 )) && WORKERS=12; (( WORKERS < 1 )) && WORKERS=1
fi
common=(-p no:cacheprovider -p no:benchmark -o addopts="-rfEs" -v --tb=short)
# --dist load: the two long kernel files (MoE, tree build) spread over the workers
[[ " $RUNS " == *" suite "* ]] && ( end=$(( $(date +%s) + LIMIT_S )); log="$OUT/gpu_suite.log"
    timeout "$LIMIT_S" $PY -m pytest "${common[@]}" -n "$WORKERS" --dist load -m gpu tests > "$log" 2>&1
    echo "rc=$? (-m gpu)" >> "$log"
    left=$(( end - $(date +%s) ))
    if (( left > 10 )); then
        timeout "$left" $PY -m pytest "${common[@]}" -n "$WORKERS" --dist load -m "kernels and not gpu" -k "not mgpu_interpret" \
            tests >> "$log" 2>&1
        echo "rc=$? (-m 'kernels and not gpu')" >> "$log"
    else
        echo "rc=124 (-m 'kernels and not gpu': not started, no time left)" >> "$log"
    fi ) &
# --dist loadgroup: the tests of one whole-generate module fixture run on one worker (their xdist_group), so no fixture
# is built twice
[[ " $RUNS " == *" shipped "* ]] && ( timeout "$LIMIT_S" $PY -m pytest "${common[@]}" -n 3 --dist loadgroup tests/test_shipped_model.py \
    > "$OUT/shipped_gpu.log" 2>&1; echo "rc=$?" >> "$OUT/shipped_gpu.log" ) &
wait
for log in "$OUT/gpu_suite.log" "$OUT/shipped_gpu.log"; do [[ -f "$log" ]] && grep -HE "FAILED|ERROR|rc=" "$log"; done | tail -n 40
