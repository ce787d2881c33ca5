#!/usr/bin/env bash
# Issue 6 point 6 on nvidia-h200-x2: the Kimi-shaped 4-layer extraction benchmark at tp 1 (GPU 0)
# and then tp 2 (both GPUs, NCCL), back to back, about 4 minutes. Writes under $OUT:
#   extract_tp1.json / .log   forward, + head, + capture, + overlapped copy, + shard writes (T <= 16K),
#                             per-component ms, MFU, 61-layer 8-GPU projections
#   extract_tp2.json / .log   the same at tp 2 (no disk writes: the leader writes the same bytes),
#                             all-reduce ms, scaling efficiency 1 -> 2 against extract_tp1.json
#
#   bash benchmarks/extract_tp_gpu.sh                      # OUT defaults to runs/bench_extract
#   TOKENS="8192 16384" bash benchmarks/extract_tp_gpu.sh  # fewer lengths when time is short
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/bench_extract}
TOKENS=${TOKENS:-"8192 16384 32768"}
mkdir -p "$OUT"
# never NVLink multicast on the shared hosts (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c 'import torch; print("GPUs:", torch.cuda.device_count(), torch.__version__)'
start=$(date +%s)
# shellcheck disable=SC2086  # TOKENS is a list of numbers
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_extract.py --tokens $TOKENS --json "$OUT/extract_tp1.json" \
    2>&1 | tee "$OUT/extract_tp1.log"
echo "tp 1 took $(( $(date +%s) - start )) s"
# shellcheck disable=SC2086
torchrun --standalone --nproc-per-node 2 benchmarks/bench_extract.py --tokens $TOKENS --no-write \
    --baseline-json "$OUT/extract_tp1.json" --json "$OUT/extract_tp2.json" 2>&1 | tee "$OUT/extract_tp2.log"
echo "tp 1 + tp 2 took $(( $(date +%s) - start )) s"
