#!/usr/bin/env bash
# Issue 20's targets in one call on a Hopper GPU (an H200 is the targets' device), from the repo root:
#
#   OUT=DIR [LIMIT_S=560] [BENCH_GIT_COMMIT=SHA] [STEPS="attn_t1 w4a16 ..."] bash benchmarks/gpu_targets.sh
#
# One after the other, each in the time left (a step not started with 20 s or less left is logged as skipped), each
# writing its results files (benchmarks/README.md: json + md + png with the run's record) into a folder under OUT:
#   attn_t1/      tree attention, S = 32768, T = 1: the tuned kernel (replicated schedule, 128 splits) vs XLA vs floor
#   attn_t33/     tree attention, S = 32768 and 4096, T = 33 (shared_qk, 4 splits)
#   attn_t129/    tree attention, S = 32768, T = 129 (shared_qk, 1 split)
#   w4a16/        dense W4A16 at K2.6's four shapes, M = 1 / 8 / 16, the tuned plan vs one without split, XLA, floor
#   moe/          routed MoE, one K2.6 layer, T = 1 / 9 / 33, three launches and gate + up fused, CUPTI and the wall
#                 clock in a jitted loop
#   moe_timeline/ that loop's device timeline at T = 1 and 9 (span, busy, gaps, one call's launches; no CUPTI)
#   k26/          the K2.6 layer slice (one MoE layer), T = 1 / 9 / 33 at S = 4096 / 32768, the AR step's extrapolation
#   attn_t1_4096/ the AR step's attention at S = 4096 (T = 1; XLA runs it there): the kernel at 16 / 32 / 64 splits,
#                 both schedules, vs XLA vs floor
#   k26_mosaic_t1/ the K2.6 layer at T = 1, S = 4096 with the Mosaic attention kernel in place of XLA's (against k26/'s
#                 T = 1, S = 4096 row of the same call: whether the AR step should run the kernel)
#   k26_timeline/ that layer's launches at T = 1 / 9, S = 4096, from the device's timeline (no CUPTI), each XLA fusion
#                 named from the layer's HLO (gzipped beside it)
# and OUT/targets.log: each step's start, end and exit status; after every step all of it packed as OUT/results.tgz (a
# device tool that returns few files then loses none: take the archive). Pass the commit as BENCH_GIT_COMMIT where the
# tree's git metadata is not the commit's (a copied working tree). Exits 0 when every step ran and passed.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
LIMIT_S=${LIMIT_S:-560}
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
source "$(dirname "$0")/steps.sh"
steps_init targets.log
steps_run attn_t1 60 $PY benchmarks/bench_tree_attention.py --out "$OUT/attn_t1" --budget-s 5 --shapes 32768:1 \
    --splits 128 --schedules replicated
steps_run attn_t33 70 $PY benchmarks/bench_tree_attention.py --out "$OUT/attn_t33" --budget-s 30 \
    --shapes 32768:33 4096:33 --splits 4 --schedules shared_qk
steps_run attn_t129 60 $PY benchmarks/bench_tree_attention.py --out "$OUT/attn_t129" --budget-s 5 --shapes 32768:129 \
    --splits 1 --schedules shared_qk
steps_run w4a16 110 $PY benchmarks/bench_w4a16.py --out "$OUT/w4a16" --deadline-s 70 --shapes 7168:18432 7168:2048 \
    18432:7168 2048:7168 --ms 1 8 16
steps_run moe 110 $PY benchmarks/bench_moe_mgpu.py --out "$OUT/moe" --ts 1,9,33 \
    --variants bn64:bk256:s4,bn64:bk256:s4+fused --loop-calls 20 --deadline-s 70
steps_run moe_timeline 80 $PY benchmarks/bench_moe_mgpu.py --out "$OUT/moe_timeline" --ts 1,9 \
    --variants bn64:bk256:s4,bn64:bk256:s4+fused --loop-calls 20 --timeline
steps_run k26 150 $PY benchmarks/bench_k26_slice.py --out "$OUT/k26" --layers 1 --ts 1,9,33 --ss 4096,32768 \
    --no-baselines --deadline-s 100
# (150 s: each of its six kernel variants compiles before its wall clock; in 60 s an H100 got two, 2026-12-07)
steps_run attn_t1_4096 150 $PY benchmarks/bench_tree_attention.py --out "$OUT/attn_t1_4096" --budget-s 30 \
    --shapes 4096:1 --splits 16 32 64 --schedules replicated shared_qk
steps_run k26_mosaic_t1 80 $PY benchmarks/bench_k26_slice.py --out "$OUT/k26_mosaic_t1" --layers 1 --ts 1 --ss 4096 \
    --no-baselines --attention mosaic_gpu --deadline-s 50
steps_run k26_timeline 90 $PY benchmarks/bench_k26_slice.py --timeline --out "$OUT/k26_timeline" --layers 1 --ts 1,9 \
    --ss 4096
gzip -f "$OUT"/k26_timeline/*.hlo.txt 2>/dev/null
steps_pack
steps_exit
