#!/usr/bin/env bash
# The SmolLM2 GPU quality run (configs/smollm2_gpu.yaml): data regeneration, extraction,
# vocabulary, training and evaluation on one GPU, timing each stage. Usage:
#   bash benchmarks/smollm2_gpu.sh [RUN] [extra section.key=value ...]
# Writes RUN/timings.txt beside the stages' own outputs.
set -uo pipefail
RUN=${1:-runs/smollm2_gpu}; shift || true
PY=${PYTHON:-python3}
CFG=configs/smollm2_gpu.yaml
mkdir -p "$RUN"
start=$(date +%s)
for stage in data extract vocab train eval; do
  t0=$(date +%s)
  $PY -m eagleforge.$stage --config $CFG run_dir="$RUN" "$@" || { echo "stage $stage failed"; exit 1; }
  echo "$stage $(( $(date +%s) - t0 )) s" | tee -a "$RUN/timings.txt"
done
echo "total $(( $(date +%s) - start )) s" | tee -a "$RUN/timings.txt"
