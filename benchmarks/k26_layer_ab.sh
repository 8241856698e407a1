#!/usr/bin/env bash
# An A/B of the K2.6 layer on a GPU: this working tree against an older one, one after the other on the same machine
# (timings from different machines do not compare: two H100s differed by 1-2% on the same code, session 32). From the
# repo root:
#
#   mkdir -p .devcarry/old && git archive REV kdtree_jax pallas_kernels benchmarks reference \
#       | tar x -C .devcarry/old --exclude=kdtree_jax/assets --exclude=benchmarks/results     # here; ~1 MB
#   OUT=DIR OLD=.devcarry/old [LIMIT_S=560] [TS=1,9] [SS=4096] bash benchmarks/k26_layer_ab.sh      # on the device,
#                                                                                # carrying .devcarry/old (git-ignored)
# The old tree runs as a copy of this one with OLD's files laid over it (its model, kernels and benchmark scripts).
# Steps, each in the time left (one not started with 20 s or less left is logged as skipped): the layer's device
# timeline for old, then new (bench_k26_slice.py --timeline: span and launches a call, each launch's time, each XLA
# fusion named), then the CUPTI slice for new, then old (the layer, its attention, MoE and rest against their floors),
# into OUT/{tl,sl}_{old,new}/; OUT/ab.log has each step's status and its table rows. Everything is packed into
# OUT/results.tgz after every step, so a call cut at its limit still returns what ran. Pass the commit as
# BENCH_GIT_COMMIT where the tree's git metadata is not the commit's. Exits 0 when every step ran and passed.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
: "${OLD:?set OLD to the older tree (kdtree_jax, pallas_kernels, benchmarks, reference of an earlier commit)}"
LIMIT_S=${LIMIT_S:-560}
TS=${TS:-1,9}
SS=${SS:-4096}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[[ -d "$OLD/kdtree_jax" ]] || { echo "k26_layer_ab: $OLD has no kdtree_jax/" >&2; exit 2; }
source "$(dirname "$0")/steps.sh"
steps_init ab.log
new_tree=$PWD
old_tree=$(mktemp -d /tmp/k26-ab-old.XXXXXX)
cp -r kdtree_jax pallas_kernels benchmarks reference "$old_tree"/
cp -r "$OLD"/. "$old_tree"/
step() {  # NAME TREE CAP_S ARGS...: bench_k26_slice.py ARGS run in TREE (its own code) into OUT/NAME, its table rows logged
    local name=$1 tree=$2 cap=$3; shift 3
    mkdir -p "$OUT/$name"
    steps_run "$name" "$cap" env -C "$tree" PYTHONPATH="$tree" $PY benchmarks/bench_k26_slice.py --out "$OUT/$name" \
        --layers 1 --ts "$TS" --ss "$SS" "$@"
    grep -hE "^\| [0-9]+ \| [0-9]+ \|" "$OUT/$name"/*.md 2>/dev/null | tee -a "$STEPS_LOG"
    steps_pack
}
step tl_old "$old_tree" 100 --timeline
step tl_new "$new_tree" 100 --timeline
step sl_new "$new_tree" 120 --no-baselines --deadline-s 80
step sl_old "$old_tree" 120 --no-baselines --deadline-s 80
rm -rf "$old_tree"
steps_exit
