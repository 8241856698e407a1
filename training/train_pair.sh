#!/usr/bin/env bash
# Train the shipped pair in one go on one H200 (docs/training.md has the why of every setting):
#
#   python -m training.data --out .devcarry/corpus          # once, here: the tokenized corpus (25 MB)
#   OUT=DIR bash training/train_pair.sh                     # on the H200, from the repo root: ~9.5 minutes
#   OUT=DIR SMOKE=1 bash training/train_pair.sh             # CPU smoke run at tiny sizes (not the shipped pair)
#
# Drafters only, over an existing INT4 target (TARGET_CKPT; stage 1 skipped), in one or two calls:
#   OUT=DIR TARGET_CKPT=kdtree_jax/assets/target NUM_SEQS=65536 STAGES=data bash training/train_pair.sh
#   OUT=DIR TARGET_CKPT=kdtree_jax/assets/target STAGES=drafters DRAFTER_S=200 bash training/train_pair.sh
#   (STAGES: any of "target data drafters", default all three; WORK must be the same folder for both calls)
# Continue the shipped drafter, widened, on new continuations in one call (docs/training.md, "Width instead of depth"):
#   OUT=DIR TARGET_CKPT=kdtree_jax/assets/target DATA=CORPUS3 NUM_SEQS=49152 GEN_BATCH=512 SEED=8 BLOCKS=8 \
#     DRAFTER_S=380 STAGES="data drafters" \
#     DRAFTER_EXTRA="--init kdtree_jax/assets/drafter --grow-width 1536 --lr 1e-3 --warmup 50" bash training/train_pair.sh
#
# 1. target: training/train_target.py for TARGET_S seconds of steps (bf16 compute, float32 master weights),
#    then INT4 routed experts and the held-out bits per byte of both;
# 2. drafter data: the INT4 target continues random training windows (kj.generate, half greedy, half at
#    temperature 1) and held-out windows (the check sets);
# 3. two DFlash drafters, block 16 and block 8, trained side by side on the one GPU for the same time.
# Every stage's result is packed into OUT as soon as it exists (tar files under 16 MiB), so a run cut short
# still returns what it finished.
set -euo pipefail
: "${OUT:?set OUT to the output folder}"
DATA=${DATA:-.devcarry/corpus}
WORK=${WORK:-/tmp/kdtree_pair}
PY=${PYTHON:-python3}
DEADLINE_S=${DEADLINE_S:-575}   # whole script, seconds
TARGET_S=${TARGET_S:-220}       # target training steps (compile, eval and save not counted)
TARGET_CKPT=${TARGET_CKPT:-}    # an INT4 target checkpoint to train drafters for: no target stage
STAGES=${STAGES:-target data drafters}
NUM_SEQS=${NUM_SEQS:-8192}      # generated target continuations (the drafters' training data)
BLOCKS=${BLOCKS:-16 8}          # drafter block sizes, trained side by side
DRAFTER_S=${DRAFTER_S:-}        # seconds of drafter steps each (default: what the deadline leaves, <= 240)
GEN_BATCH=${GEN_BATCH:-}        # --gen-batch of the data generation (default: train_drafter's; 512 is faster on a GPU)
SEED=${SEED:-}                  # --seed of the data generation and of the drafters (default: train_drafter's)
read -r -a DRAFTER_EXTRA <<< "${DRAFTER_EXTRA:-}"  # more train_drafter arguments for every drafter (--init, --grow-width)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"

if [[ -n "${SMOKE:-}" ]]; then
  TARGET_ARGS=(--steps 30 --warmup 20 --batch 2 --seq-len 64 --hidden 64 --layers 3 --experts 4 --moe-width 32
               --eval-every 20 --eval-tokens 4096)
  NUM_SEQS=16
  GEN_ARGS=(--num-seqs "$NUM_SEQS" --gen-batch 8 --prompt-len 16 --new-tokens 24)
  DRAFTER_ARGS=(--steps 30 --warmup 20 --batch 4 --anchors 2 --width 128 --prompt-len 16 --eval-every 20)
else
  TARGET_ARGS=(--time-budget-s "$TARGET_S")
  GEN_ARGS=(--num-seqs "$NUM_SEQS")
  DRAFTER_ARGS=()
fi

SEED_ARGS=()
[[ -z "$SEED" ]] || SEED_ARGS=(--seed "$SEED")
[[ -z "$GEN_BATCH" || -n "${SMOKE:-}" ]] || GEN_ARGS+=(--gen-batch "$GEN_BATCH")

stamp() { echo "[train_pair ${SECONDS}s] $*"; }
pack() {  # pack NAME DIR FILES...: DIR's FILES as OUT/NAME.tar (split into 15 MiB parts when larger)
  local name=$1 dir=$2; shift 2
  tar -C "$dir" -cf "$WORK/$name.tar" "$@"
  if (( $(stat -c %s "$WORK/$name.tar") > 15 * 1024 * 1024 )); then
    split -b 15M -d "$WORK/$name.tar" "$OUT/$name.tar.part"
  else
    cp "$WORK/$name.tar" "$OUT/$name.tar"
  fi
  stamp "packed $name"
}

has() { [[ " $STAGES " == *" $1 "* ]]; }
TARGET=${TARGET_CKPT:-$WORK/target/int4}
# The target trains alone; once its INT4 checkpoint exists the drafter data generation starts beside the
# target's held-out evaluation. Each process may take under half of the GPU's memory.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
target_pid=
if [[ -z "$TARGET_CKPT" ]] && has target; then
  stamp "target"
  $PY -m training.train_target --data "$DATA" "${TARGET_ARGS[@]}" --out "$WORK/target" > "$WORK/target.log" 2>&1 &
  target_pid=$!
  while [[ ! -f "$WORK/target/int4/config.json" ]]; do
    if ! kill -0 "$target_pid" 2>/dev/null; then cat "$WORK/target.log"; stamp "target training failed"; exit 1; fi
    sleep 2
  done
fi
if has data; then
  stamp "drafter data: $NUM_SEQS continuations by $TARGET"
  $PY -m training.train_drafter --target "$TARGET" --data "$DATA" "${GEN_ARGS[@]}" "${SEED_ARGS[@]}" --generate-only \
      --data-cache "$WORK/drafter_data.npz" --out "$WORK/gen" > "$WORK/gen.log" 2>&1 || { cat "$WORK/gen.log"; exit 1; }
  tail -n 2 "$WORK/gen.log"
fi
if [[ -n "$target_pid" ]]; then
  wait "$target_pid" || { cat "$WORK/target.log"; exit 1; }
  grep -v '^step=' "$WORK/target.log" | tail -n 6
  pack target "$WORK/target" int4 summary.json log.jsonl
fi
has drafters || { stamp "done (stages: $STAGES)"; exit 0; }

# the drafters share the GPU
left=$(( DEADLINE_S - SECONDS - 70 ))  # compile, final evaluation, save and pack
budget=${DRAFTER_S:-$(( left < 30 ? 30 : (left > 240 ? 240 : left) ))}
stamp "drafters $BLOCKS, ${budget}s of steps each"
pids=()
for block in $BLOCKS; do
  if [[ -n "${SMOKE:-}" ]]; then time_args=(); else time_args=(--time-budget-s "$budget"); fi
  $PY -m training.train_drafter --target "$TARGET" \
      --data-cache "$WORK/drafter_data.npz" --block-size "$block" "${DRAFTER_ARGS[@]}" "${SEED_ARGS[@]}" \
      "${DRAFTER_EXTRA[@]}" "${time_args[@]}" \
      --out "$WORK/drafter$block" > "$WORK/drafter$block.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
logs=()
for block in $BLOCKS; do
  tail -n 4 "$WORK/drafter$block.log"
  logs+=("drafter$block.log")
  [[ -d "$WORK/drafter$block/drafter" ]] && pack "drafter$block" "$WORK/drafter$block" drafter summary.json log.jsonl
done
for extra in target.log gen.log gen/log.jsonl; do [[ -f "$WORK/$extra" ]] && logs+=("$extra"); done
tar -C "$WORK" -cf "$OUT/logs.tar" "${logs[@]}"
stamp "done (status $status)"
exit $status
