"""Benchmark: online training on one GPU (`make bench-online`): the Kimi-shaped extraction model
(benchmarks/kimi_shaped.py, as bench-extract builds it: real K2.5 dimensions, random INT4
experts, 1 dense + 3 MoE layers by default) feeding the Kimi-shaped draft (Eagle3Draft sized from
K2.5's config, Vd 32000, 7 TTT steps, the Kimi configs' step options, through the trainer's
DraftWithLoss + TTTLoss and AdamW, as train/loop.py runs it).

Three timings on the same batches of --tokens tokens (sequences of --seq tokens):
- extraction alone: the target forward with the capture hooks and the greedy head
  (extract/native/target.py forward_batch), the rows padded into a training batch on the device;
- training alone: optimizer steps on one captured batch;
- online: both, the target's forward of the next batch queued on a side stream by the trainer's
  own feed (train/prefetch.py Prefetcher) while the draft trains on the current one.
Prints tokens/s of each, the serial ideal 1 / (1/extract + 1/train) and online's ratio to it, and
the peak memory against train/online_plan.py's plan for this shape.

    python3 benchmarks/bench_online.py                        # one GPU, Kimi shapes
    python3 benchmarks/bench_online.py --tokens 16384 --json $OUT/online.json
    python3 benchmarks/bench_online.py --tiny                 # toy shapes on the CPU (a check that it runs)

The --tiny numbers only show that the script runs: on a shared 2-core CPU they swing several-fold
between runs, and the producer thread and the training share the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import import_eagleforge  # noqa: E402

import_eagleforge()
from kimi_shaped import KIMI_K25_TEXT, build_bench_model, kimi_args, tiny_args  # noqa: E402

from eagleforge.config import Config  # noqa: E402
from eagleforge.draft import Eagle3Config, Eagle3Draft  # noqa: E402
from eagleforge.extract.capture import HiddenStateCapture  # noqa: E402
from eagleforge.extract.native.target import forward_batch  # noqa: E402
from eagleforge.train.batching import pad_batch  # noqa: E402
from eagleforge.train.distributed import DraftWithLoss, clip_grad_norm  # noqa: E402
from eagleforge.train.loop import ttt_loss_of  # noqa: E402
from eagleforge.train.online_plan import GIB, plan_online  # noqa: E402
from eagleforge.train.prefetch import Prefetcher  # noqa: E402
from eagleforge.train.step_plan import resolve_param_dtype  # noqa: E402
from eagleforge.train.weight_grads import fuse_weight_grads  # noqa: E402


def overlap_report(target_tokens: int, target_seconds: float, train_tokens: int, train_seconds: float,
                   online_tokens: int, online_seconds: float) -> dict:
    """Rates in tokens/s and the online rate over the serial ideal 1 / (1/extract + 1/train):
    above 1 when the target's forwards overlap the draft's training."""
    extract = target_tokens / target_seconds if target_seconds else float("nan")
    train = train_tokens / train_seconds if train_seconds else float("nan")
    online = online_tokens / online_seconds if online_seconds else float("nan")
    serial = 1.0 / (1.0 / extract + 1.0 / train)
    return {"extract_tokens_per_s": extract, "train_tokens_per_s": train, "online_tokens_per_s": online,
            "serial_ideal_tokens_per_s": serial, "ratio_to_serial": online / serial}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per batch (train.batch_tokens = extract.batch_tokens)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=4, help="target layers (1 dense + the rest MoE)")
    p.add_argument("--steps", type=int, default=8, help="timed batches per mode")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=Config().train.prefetch, help="train.prefetch: forwards queued ahead (default: the trainer's)")
    p.add_argument("--tiny", "--cpu", dest="tiny", action="store_true", help="toy shapes on the CPU")
    p.add_argument("--json", default=None)
    opt = p.parse_args(argv)

    device = torch.device("cpu" if opt.tiny or not torch.cuda.is_available() else "cuda")
    if opt.tiny:
        opt.tokens, opt.seq = min(opt.tokens, 256), min(opt.seq, 64)
    args = tiny_args(3) if opt.tiny else kimi_args(opt.layers)
    aux = [0, 1, 2] if opt.tiny else [1, 2, 3]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target = build_bench_model(args, device=device, dtype=dtype)

    cfg = Config()
    tc = cfg.train
    tc.batch_tokens, tc.prefetch, tc.ttt_steps = opt.tokens, opt.prefetch, (3 if opt.tiny else 7)
    tc.bf16 = device.type == "cuda"
    tc.activation_checkpoint, tc.attention, tc.compile = ("none", "auto", False) if opt.tiny else \
        ("selective_all", "merged_cudnn", True)  # the Kimi configs' step options
    cfg.extract.batch_tokens, cfg.extract.aux_layers = opt.tokens, aux
    cfg.target.tp, cfg.data.max_length = 1, opt.seq
    cfg.vocab.draft_vocab_size = 256 if opt.tiny else 32000

    text = {**KIMI_K25_TEXT, **{k: getattr(args, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                             "num_attention_heads", "kv_lora_rank", "v_head_dim",
                                                             "qk_nope_head_dim")}}
    text["num_hidden_layers"] = args.num_hidden_layers
    vd = cfg.vocab.draft_vocab_size
    torch.manual_seed(0)
    param_dtype = resolve_param_dtype(tc, device, "none")  # as the trainer: bf16 parameters on CUDA
    draft = Eagle3Draft(Eagle3Config.from_target_config(text, vd, aux)).to(device, param_dtype)
    fuse_weight_grads(draft, param_dtype == torch.bfloat16)
    draft.set_vocab_map(torch.zeros(vd, dtype=torch.int64), torch.arange(args.vocab_size) < vd)  # draft ids = the first Vd
    draft.embed_tokens.weight.requires_grad_(False)
    if target.model.embed_tokens.weight.dtype == param_dtype:  # as the trainer at tp 1: the target's own tensor
        draft.embed_tokens.weight = torch.nn.Parameter(target.model.embed_tokens.weight, requires_grad=False)
    teacher_head = (torch.randn(vd, args.hidden_size, device=device) * 0.02).to(torch.bfloat16 if tc.bf16 else torch.float32)
    model = DraftWithLoss(draft, ttt_loss_of(cfg, teacher_head, device, tc.activation_checkpoint, tc.compile))
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))

    gen = torch.Generator().manual_seed(1)
    n_seq = max(1, opt.tokens // opt.seq)
    batches = [[torch.randint(0, args.vocab_size, (opt.seq,), generator=gen).tolist() for _ in range(n_seq)]
               for _ in range(opt.warmup + opt.steps)]
    tokens_per_batch = n_seq * opt.seq

    capture = HiddenStateCapture(target.model.layers, aux, target.model.norm).__enter__()

    def produce(i: int):
        """The online source's work for one batch: target forward, the rows padded on the device."""
        ids = batches[i]
        packed = forward_batch(target, capture, ids, device, write_target_argmax=True, keep=True)
        rows, row = [], 0
        for seq in ids:
            n = len(seq)
            rows.append({"input_ids": torch.tensor(seq, device=device), "loss_mask": torch.ones(n, dtype=torch.bool, device=device),
                         **{k: v[row:row + n] for k, v in packed.items()}})
            row += n
        return pad_batch(rows).to(device, param_dtype)  # the trainer's batch, in the draft's input dtype

    def train_step(batch) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss, _ = model(batch.aux_hidden_states, batch.input_ids, batch.last_hidden_state, batch.loss_mask,
                        batch.target_argmax)
        loss.backward()
        clip_grad_norm(params, 0.5)
        optimizer.step()

    def timed(fn) -> float:
        for i in range(opt.warmup):
            fn(i, warm=True)
        sync(device)
        start = time.perf_counter()
        for i in range(opt.warmup, opt.warmup + opt.steps):
            fn(i, warm=False)
        sync(device)
        return time.perf_counter() - start

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    extract_s = timed(lambda i, warm: produce(i))
    one = produce(0)
    train_s = timed(lambda i, warm: train_step(one))  # noqa: F821 (bound above; deleted only after the call)
    del one

    def online(first: int, count: int) -> None:
        """Train on `count` batches as the trainer does: with prefetch 0 each forward in line
        before its step; else fed by a fresh Prefetcher, whose queue starts empty, so the timing
        includes filling it (no forward is done before the clock starts)."""
        if opt.prefetch == 0:
            for i in range(first, first + count):
                train_step(produce(i))
            return
        prefetcher = Prefetcher(produce, list(range(first, first + count)), opt.prefetch, device, side_stream=True)
        try:
            for _ in range(count):
                train_step(prefetcher.get()[1])
        finally:
            prefetcher.close()

    online(0, opt.warmup)
    sync(device)
    start = time.perf_counter()
    online(opt.warmup, opt.steps)
    sync(device)
    online_s = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    # What the plan counts is memory in use on the device (the allocator's reserved peak, plus
    # the CUDA context and NCCL outside it): read both sides, as check_plan.py does for extraction.
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    in_use = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free - torch.cuda.memory_reserved(device) + reserved  # outside the allocator + its peak

    n = opt.steps * tokens_per_batch
    report = overlap_report(n, extract_s, n, train_s, n, online_s)
    plan = plan_online(cfg, world=1, args=args, quantized=True)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "tokens_per_batch": tokens_per_batch,
              "steps": opt.steps, "prefetch": opt.prefetch, "layers": args.num_hidden_layers, **report,
              "peak_allocated_gib": peak / GIB if peak is not None else None,
              "peak_reserved_gib": reserved / GIB if reserved is not None else None,
              "peak_in_use_gib": in_use / GIB if in_use is not None else None, "plan_gib": plan.total_bytes() / GIB}
    print(f"\nonline training, {result['device']}, {tokens_per_batch} tokens per batch, {opt.steps} batches, "
          f"{args.num_hidden_layers}-layer target, prefetch {opt.prefetch}")
    print(f"{'mode':<34}{'tokens/s':>12}")
    print(f"{'extraction alone':<34}{report['extract_tokens_per_s']:>12.0f}")
    print(f"{'training alone':<34}{report['train_tokens_per_s']:>12.0f}")
    print(f"{'serial ideal 1/(1/ex + 1/tr)':<34}{report['serial_ideal_tokens_per_s']:>12.0f}")
    print(f"{'online (overlapped)':<34}{report['online_tokens_per_s']:>12.0f}")
    print(f"{'online / serial ideal':<34}{report['ratio_to_serial']:>12.3f}")
    if peak is not None:
        print(f"peak allocated {peak / GIB:.2f} GiB, reserved {reserved / GIB:.2f} GiB, in use {in_use / GIB:.2f} GiB; "
              f"plan {plan.total_bytes() / GIB:.2f} GiB "
              f"(target {plan.target.total_bytes / GIB:.2f}, draft {plan.draft_bytes() / GIB:.2f}; the plan includes the runtime reserve)")
    else:
        print(f"plan {plan.total_bytes() / GIB:.2f} GiB (CPU run: no device peak to compare)")
    if opt.json:
        with open(opt.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
