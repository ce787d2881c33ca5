#!/usr/bin/env bash
# Every GPU benchmark of eagleforge, on the GPUs of this machine, one after the other; each prints
# its table (BENCHMARKS.md says what each measures). Installs nothing: run it where the package and
# its GPU extras are installed (`pip install -e ".[gpu,test]"`; the optional comparison rows need
# liger-kernel for bench-loss and SpecForge for bench-train and quality-specforge, and are skipped without them).
#
#   make bench-gpu                                   # = bash benchmarks/run_all.sh
#   bash benchmarks/run_all.sh moe loss              # a subset, by name:
#        moe loss train attention prefill extract pipeline plan train-dist online quality quality-specforge
#   OUT=runs/bench PYTHON=python3 bash benchmarks/run_all.sh
#
# Single-GPU benchmarks run on GPU 0; with two or more GPUs, extract, plan and train-dist also
# run over all of them (torchrun). Logs and JSON records go to $OUT (default
# runs/bench); the GPU, torch and triton versions to $OUT/versions.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"

GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())') || exit 1
if [ "$GPUS" -lt 1 ]; then
  echo "no CUDA GPU here; the CPU benchmarks are in BENCHMARKS.md, \"CPU\"" >&2
  exit 1
fi
$PY - <<'EOF' | tee "$OUT/versions.txt"
import importlib.util, torch
tv = __import__("triton").__version__ if importlib.util.find_spec("triton") else "not installed"
names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
print(f"{torch.cuda.device_count()} x {', '.join(names)}; torch {torch.__version__} (CUDA {torch.version.cuda}); triton {tv}")
EOF

TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS")
ONE=(env CUDA_VISIBLE_DEVICES=0 "$PY")
failed=()

run() {  # run NAME COMMAND...: prints and logs the output, remembers a failure
  local name=$1
  shift
  echo
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$name")
}

for bench in ${*:-moe loss train attention prefill extract pipeline plan train-dist online quality quality-specforge}; do
  case $bench in
    moe)  # one Kimi-K2.5 MoE layer: INT4 kernels vs bf16 grouped_mm
      run moe "${ONE[@]}" benchmarks/bench_moe.py --tokens 4096 16384 --json "$OUT/moe.json" ;;
    loss)  # the fused EAGLE-3 loss, 7 TTT steps
      run loss "${ONE[@]}" benchmarks/bench_loss.py --json "$OUT/loss.json" ;;
    train)  # the trainer's step on the Kimi-shaped draft as the B300 config sets it, beside SpecForge's
      run train "${ONE[@]}" benchmarks/bench_train.py --no-attention-bench --tokens 2048 8192 16384 32768 \
        --specforge-tokens 2048 8192 16384 32768 --warmup 2 --iters 4 --json "$OUT/train.json" ;;
    attention)  # the draft's TTT attention alone, by mode
      run attention "${ONE[@]}" benchmarks/bench_train.py --attention-bench --attention-tokens 2048 8192 32768 \
        --attention-modes merged+compile merged_cudnn+compile flex --json "$OUT/attention.json" ;;
    prefill)  # the native extraction's MLA prefill attention by kernel
      run prefill "${ONE[@]}" benchmarks/bench_prefill_attention.py --json "$OUT/prefill.json" ;;
    extract)  # the native extraction on a Kimi-shaped 4-layer model: tp 1, then tp = all GPUs
      run extract_tp1 "${ONE[@]}" benchmarks/bench_extract.py --json "$OUT/extract_tp1.json"
      if [ "$GPUS" -ge 2 ]; then
        run "extract_tp$GPUS" "${TORCHRUN[@]}" benchmarks/bench_extract.py --tokens 16384 32768 \
          --baseline-json "$OUT/extract_tp1.json" --json "$OUT/extract_tp$GPUS.json"
      fi ;;
    pipeline)  # pipeline stages: the loop at pp 1, two stages in turn against pp 1, the pilot's projection
      run pipeline "${ONE[@]}" benchmarks/bench_pipeline.py --json "$OUT/pipeline.json" ;;
    plan)  # the memory planner against the extraction loop's memory per GPU
      run plan_tp1 "${ONE[@]}" benchmarks/check_plan.py --batch-tokens 8192 16384 32768 --json "$OUT/plan_tp1.json"
      if [ "$GPUS" -ge 2 ]; then
        run "plan_tp$GPUS" "${TORCHRUN[@]}" benchmarks/check_plan.py --layouts ep tp --batch-tokens 16384 32768 \
          --json "$OUT/plan_tp$GPUS.json"
      fi ;;
    train-dist)  # the trainer's own step on 1 GPU, then on all of them (FSDP2)
      if [ "$GPUS" -ge 2 ]; then
        run train-dist "$PY" benchmarks/bench_train.py --launch 1 "$GPUS" --tokens 8192 --warmup 2 --iters 6 \
          --no-attention-bench --no-checks --no-specforge --json "$OUT/train_dist.json"
      else
        echo "=== train-dist: skipped (needs 2 GPUs)"
      fi ;;
    online)  # online training: the Kimi-shaped target feeding the Kimi-shaped draft on one GPU
      for t in 8192 16384; do
        run "online-$t" "${ONE[@]}" benchmarks/bench_online.py --tokens "$t" --steps 8 --warmup 3 --json "$OUT/online_$t.json"
      done ;;
    quality)  # the SmolLM2 GPU config end to end: data, extract, vocab, train, eval on 40 HumanEval prompts
      run quality env CUDA_VISIBLE_DEVICES=0 PYTHON="$PY" EVAL_PROMPTS=40 bash benchmarks/smollm2_gpu.sh "$OUT/smollm2_gpu" ;;
    quality-specforge)  # the same SmolLM2 run's shards trained by the trainer and by SpecForge's step, both evaluated
      if [ ! -f "$OUT/smollm2_gpu/vocab/vocab_map.safetensors" ]; then  # not after `quality`: data, extract, vocab first
        run quality-prepare env CUDA_VISIBLE_DEVICES=0 PYTHON="$PY" STAGES="data extract vocab" \
          bash benchmarks/smollm2_gpu.sh "$OUT/smollm2_gpu"
      fi
      run quality-specforge "${ONE[@]}" benchmarks/bench_quality.py --config configs/smollm2_gpu.yaml \
        --run "$OUT/smollm2_gpu" --json "$OUT/quality_specforge.json" ;;
    *)
      echo "unknown benchmark '$bench' (moe loss train attention prefill extract pipeline plan train-dist online quality quality-specforge)" >&2
      failed+=("$bench") ;;
  esac
done

echo
echo "results and logs: $OUT"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
