#!/usr/bin/env bash
# An end-to-end A/B of two drafters for the shipped target on one GPU: the base drafter (the shipped one unless BASE
# says otherwise) and a candidate. From the repo root, on the device:
#
#   OUT=DIR CANDIDATE=PATH [BASE=kdtree_jax/assets/drafter] [CANDIDATE_DTYPE=bfloat16] [TAG=NAME] [DL=198] \
#       [PRECISION=BF16_BF16_F32_X9] [LIMIT_S=560] [STEPS="paired e2e_base e2e_candidate"] bash benchmarks/drafter_ab.sh
#
# CANDIDATE_DTYPE: the dtype the candidate computes in (default the target's, float32):
# CANDIDATE=kdtree_jax/assets/drafter CANDIDATE_DTYPE=bfloat16 is the shipped drafter in float32 against itself in
# bfloat16 (docs/ddtree.md, "1. Draft").
#
# CANDIDATE (and BASE) is a drafter checkpoint folder, or a .tar holding one as drafter/ (what training/train_pair.sh
# packs: the device returns no folder as deep as an Orbax checkpoint, so a trained drafter travels as a tar).
# Steps (benchmarks/steps.sh), each in the time left of the call, the same protocol (batch 1, greedy and temperature
# 1, 8 held-out prompts x 128 new tokens, budgets 7 / 15 / 31, sampled points over 2 seeds, at most DL seconds of
# measuring each):
#   paired        - benchmarks/ab_e2e.py: both drafters in one process, each prompt's calls alternating base and
#                   candidate over 6 repeats, with a control row (the base against itself): the ratio a decision
#                   reads, with the protocol's own noise beside it (two processes differed by up to 3% in AR alone,
#                   session 41), into OUT/paired/ab_<TAG>.{json,md};
#   e2e_base, e2e_candidate - bench_e2e.py with each drafter, one process after the other (median of 3), the full
#                   tables with AR and the speedups, into OUT/e2e_{base,candidate}/ (tagged <TAG>_base / _candidate).
# Name the device, batch and precision in TAG (e.g. h200_b1_s41_X9); STEPS=paired runs the paired step alone.
# OUT/ab.log has each step's status and its table rows; everything is packed into OUT/results.tgz after every step.
# Exits 0 when every selected step ran and passed.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
: "${CANDIDATE:?set CANDIDATE to the candidate drafter (a checkpoint folder, or a .tar holding drafter/)}"
BASE=${BASE:-kdtree_jax/assets/drafter}
TAG=${TAG:-ab}
DL=${DL:-198}
PRECISION=${PRECISION:-BF16_BF16_F32_X9}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"

# a tar unpacks into a git-ignored folder of the tree, so the results files name a repo-relative path (no /tmp)
unpacked=.devcarry/drafter_ab
rm -rf "$unpacked" && mkdir -p "$unpacked"
trap 'rm -rf "$unpacked"' EXIT
checkpoint() {  # NAME PATH: PATH itself if a checkpoint folder, else its tar's drafter/ unpacked; refused otherwise
    local name=$1 path=$2
    if [[ -f "$path" && "$path" == *.tar ]]; then
        mkdir -p "$unpacked/$name" && tar -xf "$path" -C "$unpacked/$name" \
            || { echo "drafter_ab: cannot unpack $path" >&2; exit 2; }
        path=$unpacked/$name/drafter
    fi
    [[ -f "$path/config.json" ]] || { echo "drafter_ab: $2 is no drafter checkpoint (no config.json)" >&2; exit 2; }
    echo "$path"
}
base=$(checkpoint base "$BASE") || exit 2
candidate=$(checkpoint candidate "$CANDIDATE") || exit 2

source "$(dirname "$0")/steps.sh"
steps_init ab.log
echo "base $BASE, candidate $CANDIDATE${CANDIDATE_DTYPE:+ computing in $CANDIDATE_DTYPE}, precision $PRECISION" \
    | tee -a "$STEPS_LOG"
# the protocol every step measures with (ab_e2e.py and bench_e2e.py take these options alike)
PROTOCOL=(--matmul-precision "$PRECISION" --num-prompts 8 --max-new-tokens 128 --temperatures 0 1 --budgets 7 15 31
          --seeds 2 --deadline-s "$DL")
step() {  # NAME DRAFTER [ARGS...]: bench_e2e.py with DRAFTER (and ARGS) into OUT/NAME, its table rows logged
    local name=$1 drafter=$2; shift 2
    mkdir -p "$OUT/$name"
    steps_run "$name" $(( DL + 120 )) $PY benchmarks/bench_e2e.py --out "$OUT/$name" --tag "${TAG}_${name#e2e_}" \
        --drafter "$drafter" "${PROTOCOL[@]}" --batches 1 --repeats 3 "$@"
    grep -hE "^\| 1 \| [01] \|" "$OUT/$name"/*.md 2>/dev/null | sed "s/^/$name /" | tee -a "$STEPS_LOG"
    steps_pack
}
mkdir -p "$OUT/paired"
steps_run paired $(( DL + 120 )) $PY benchmarks/ab_e2e.py --out "$OUT/paired" --tag "$TAG" --a "$base" \
    --b "$candidate" ${CANDIDATE_DTYPE:+--b-dtype "$CANDIDATE_DTYPE"} "${PROTOCOL[@]}" --repeats 6
grep -hE "^\| [01] \|" "$OUT/paired"/*.md 2>/dev/null | sed "s/^/paired /" | tee -a "$STEPS_LOG"
steps_pack
step e2e_base "$base"
step e2e_candidate "$candidate" ${CANDIDATE_DTYPE:+--drafter-dtype "$CANDIDATE_DTYPE"}
steps_exit
