#!/usr/bin/env bash
# What the CPU default's training recipe can give up: the embedded default's data, extract and
# vocab stages made once on a GPU (the same config, the target on CUDA), then trainings that see
# fewer tokens, take larger or smaller steps, another learning rate, fewer positions or a smaller
# draft vocabulary, each with the choices the CPU resolves (fp32 parameters, no checkpointing,
# eager), two seeds each; the held-out simulated acceptance at k = 5 per row, paired with the
# default's recipe (BENCHMARKS.md, "Training tokens against acceptance"). Usage:
#   bash benchmarks/default_recipe.sh [RUN] [section.key=value ...]   # ~10 minutes on one H100, rows four at a time
#   DEVICE=cpu bash benchmarks/default_recipe.sh runs/r data.num_prompts=160 data.max_new_tokens=8 train.max_steps=2   # a check of the script
# A larger held-out set than the default's 32 samples (128) makes the figures steadier; every row
# trains on the same 772 samples.
set -uo pipefail
RUN=${1:-runs/default_recipe}; shift || true
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
OUT=$RUN/recipe
mkdir -p "$OUT"
for stage in data extract vocab; do
  $PY -m eagleforge.$stage run_dir="$RUN" target.device=$DEVICE data.gen_batch_size=256 "$@" || { echo "stage $stage failed"; exit 1; }
done
# The same shards with a 2048-token draft vocabulary, for the row that tries it.
mkdir -p "$RUN-vd2048" && ln -sfn "$(realpath "$RUN")/data" "$RUN-vd2048/data" && ln -sfn "$(realpath "$RUN")/hidden" "$RUN-vd2048/hidden"
$PY -m eagleforge.vocab run_dir="$RUN-vd2048" target.device=$DEVICE vocab.draft_vocab_size=2048 "$@" || exit 1

CPU_CHOICES="train.device=$DEVICE train.param_dtype=float32 train.activation_checkpoint=none train.compile=false
  train.save_every=0 train.holdout_samples=128"
EXTRA=("$@")  # the command line's overrides, for every row too
row() {  # row LABEL RUN section.key=value...: one row of two seeds, its log and JSON under OUT
  local label=$1 run=$2; shift 2
  $PY benchmarks/bench_quality.py --run "$run" --no-eval --only ours --seeds 0 1 --label "$label" \
    --out "$OUT/$label" --json "$OUT/$label.json" $CPU_CHOICES "$@" "${EXTRA[@]}" > "$OUT/$label.log" 2>&1
}
row "6 epochs (default)" "$RUN" &
row "5 epochs" "$RUN" train.epochs=5 &
row "4 epochs, lr 1.5e-3" "$RUN" train.epochs=4 train.lr=1.5e-3 &
row "3 epochs" "$RUN" train.epochs=3 &
wait
row "3 epochs, lr 2e-3" "$RUN" train.epochs=3 train.lr=2e-3 &
row "2 epochs, lr 2e-3" "$RUN" train.epochs=2 train.lr=2e-3 &
row "2 epochs, lr 3e-3" "$RUN" train.epochs=2 train.lr=3e-3 &
row "3 epochs, lr 2e-3, 4096-token batches" "$RUN" train.epochs=3 train.lr=2e-3 train.batch_tokens=4096 &
wait
row "6 epochs, 1024-token batches" "$RUN" train.batch_tokens=1024 &
row "5 epochs, 1024-token batches" "$RUN" train.epochs=5 train.batch_tokens=1024 &
row "4 epochs, 1024-token batches" "$RUN" train.epochs=4 train.batch_tokens=1024 &
row "3 epochs, 1024-token batches" "$RUN" train.epochs=3 train.batch_tokens=1024 &
wait
row "3 epochs, 1024-token batches, lr 7e-4" "$RUN" train.epochs=3 train.batch_tokens=1024 train.lr=7e-4 &
row "2 epochs, 1024-token batches" "$RUN" train.epochs=2 train.batch_tokens=1024 &
row "6 epochs, answers' tokens only" "$RUN" train.loss_positions=assistant &
row "6 epochs, Vd 2048" "$RUN-vd2048" vocab.draft_vocab_size=2048 &
wait
$PY benchmarks/bench_quality.py --summarize "$OUT"/*.json --baseline "6 epochs (default)" | tee "$OUT/summary.md"
