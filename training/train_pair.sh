#!/usr/bin/env bash
# Train the shipped pair in one go on one H200 (docs/training.md has the why of every setting):
#
#   python -m training.data --out .devcarry/corpus          # once, here: the tokenized corpus (25 MB)
#   OUT=DIR bash training/train_pair.sh                     # on the H200, from the repo root: ~9.5 minutes
#   OUT=DIR SMOKE=1 bash training/train_pair.sh             # CPU smoke run at tiny sizes (not the shipped pair)
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
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"

if [[ -n "${SMOKE:-}" ]]; then
  TARGET_ARGS=(--steps 30 --warmup 20 --batch 2 --seq-len 64 --hidden 64 --layers 3 --experts 4 --moe-width 32
               --eval-every 20 --eval-tokens 4096)
  GEN_ARGS=(--num-seqs 16 --gen-batch 8 --prompt-len 16 --new-tokens 24)
  DRAFTER_ARGS=(--steps 30 --warmup 20 --batch 4 --anchors 2 --width 128 --prompt-len 16 --eval-every 20)
else
  TARGET_ARGS=(--time-budget-s "$TARGET_S")
  GEN_ARGS=()
  DRAFTER_ARGS=()
fi

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

# The target trains alone; once its INT4 checkpoint exists the drafter data generation starts beside the
# target's held-out evaluation. Each process may take under half of the GPU's memory.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
stamp "target"
$PY -m training.train_target --data "$DATA" "${TARGET_ARGS[@]}" --out "$WORK/target" > "$WORK/target.log" 2>&1 &
target_pid=$!
while [[ ! -f "$WORK/target/int4/config.json" ]]; do
  if ! kill -0 "$target_pid" 2>/dev/null; then cat "$WORK/target.log"; stamp "target training failed"; exit 1; fi
  sleep 2
done
stamp "drafter data"
$PY -m training.train_drafter --target "$WORK/target/int4" --data "$DATA" "${GEN_ARGS[@]}" --generate-only \
    --data-cache "$WORK/drafter_data.npz" --out "$WORK/gen" > "$WORK/gen.log" 2>&1 || { cat "$WORK/gen.log"; exit 1; }
tail -n 2 "$WORK/gen.log"
wait "$target_pid" || { cat "$WORK/target.log"; exit 1; }
grep -v '^step=' "$WORK/target.log" | tail -n 6
pack target "$WORK/target" int4 summary.json log.jsonl

# the two drafters share the GPU
left=$(( DEADLINE_S - SECONDS - 70 ))  # compile, final evaluation, save and pack
budget=$(( left < 30 ? 30 : (left > 240 ? 240 : left) ))
stamp "drafters, ${budget}s of steps each"
pids=()
for block in 16 8; do
  if [[ -n "${SMOKE:-}" ]]; then time_args=(); else time_args=(--time-budget-s "$budget"); fi
  $PY -m training.train_drafter --target "$WORK/target/int4" \
      --data-cache "$WORK/drafter_data.npz" --block-size "$block" "${DRAFTER_ARGS[@]}" "${time_args[@]}" \
      --out "$WORK/drafter$block" > "$WORK/drafter$block.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
tail -n 4 "$WORK/drafter16.log" "$WORK/drafter8.log"
for block in 16 8; do
  [[ -d "$WORK/drafter$block/drafter" ]] && pack "drafter$block" "$WORK/drafter$block" drafter summary.json log.jsonl
done
tar -C "$WORK" -cf "$OUT/logs.tar" target.log gen.log drafter16.log drafter8.log gen/log.jsonl
stamp "done (status $status)"
exit $status
