#!/usr/bin/env bash
# The SmolLM2 GPU quality run (configs/smollm2_gpu.yaml): data regeneration, extraction,
# vocabulary, training and evaluation on one GPU, timing each stage. Usage:
#   bash benchmarks/smollm2_gpu.sh [RUN] [extra section.key=value ...]
#   EVAL_PROMPTS=40 bash benchmarks/smollm2_gpu.sh runs/g     # the full 40-prompt eval (~6 min more)
#   STAGES="data extract vocab train" bash benchmarks/smollm2_gpu.sh runs/g   # eval elsewhere (e.g. a CPU)
# Writes RUN/timings.txt beside the stages' own outputs, and RUN/eval/acceptance_curve.csv
# (+ .png): the simulated acceptance length at k=5 at the end of each epoch against the
# training tokens seen (per-TTT-step accuracies of RUN/train_log.csv), written right after
# training so it exists even when the eval is cut short.
set -uo pipefail
RUN=${1:-runs/smollm2_gpu}; shift || true
PY=${PYTHON:-python3}
CFG=configs/smollm2_gpu.yaml
EVAL_PROMPTS=${EVAL_PROMPTS:-16}  # 40 takes ~6 minutes more (batch-1 decoding is Python-bound)
mkdir -p "$RUN"
start=$(date +%s)
for stage in ${STAGES:-data extract vocab train eval}; do
  t0=$(date +%s)
  extra=()
  [ "$stage" = eval ] && extra=(eval.n_prompts="$EVAL_PROMPTS")
  $PY -m eagleforge.$stage --config $CFG run_dir="$RUN" "${extra[@]}" "$@" || { echo "stage $stage failed"; exit 1; }
  echo "$stage $(( $(date +%s) - t0 )) s" | tee -a "$RUN/timings.txt"
  [ "$stage" = train ] && $PY -m eagleforge.eval.plots "$RUN" 5 | tee -a "$RUN/timings.txt"
done
echo "total $(( $(date +%s) - start )) s" | tee -a "$RUN/timings.txt"
