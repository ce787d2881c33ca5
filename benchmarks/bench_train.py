"""Benchmark: one full EAGLE-3 draft training step (forward over the TTT steps, fused loss,
backward, clipping, optimizer) at Kimi-K2.5's draft shape (kimi_shaped.DraftShape.kimi(): hidden
7168, 64 heads of 128, intermediate 18432, V 163840, Vd 32000, TTT 7), batch 1 x T tokens: the
trainer's own step beside SpecForge's, in one process. BENCHMARKS.md, "Draft training step".

The trainer's rows: Trainer.train_step() as `make train` runs it, with the train settings of each
--trainer-configs file plus each --variants entry (config overrides, one set a row:
"train.activation_checkpoint=selective train.attention=flex"; "" = the config as it is), on
Kimi-shaped shards written by the project's ShardWriter and read ahead by the trainer's feed
("shards"), then on the first batch kept on the device ("synthetic batch": nothing read).
--launch N...: the same rows under torchrun on N GPUs each, --tokens per GPU, with the scaling.

SpecForge's rows: its own step (LlamaForCausalLMEagle3 in OnlineEagle3Model, flex attention, its
compact teacher over the FULL vocabulary, its trainer's BF16Optimizer), last in the process; the
trainer's rows carry speed and memory ratios against it (none without specforge installed).

FLOPs are counted (model FLOPs, no recompute; `flops_per_token`); MFU against --peak-tflops
(H200 dense bf16, 989).

    make bench-train                                          # = python benchmarks/bench_train.py
    python benchmarks/bench_train.py --no-attention-bench --tokens 8192 \
        --variants "" "train.activation_checkpoint=selective" "train.attention=flex"    # settings side by side
    python benchmarks/bench_train.py --attention-bench        # the TTT attention alone, by mode
    python benchmarks/bench_train.py --profile 8192           # one profiled step: kernels, host syncs, peak memory
    python benchmarks/bench_train.py --launch 1 2 --tokens 8192 --no-attention-bench --no-specforge
    python benchmarks/bench_train.py --cpu-check              # tiny shapes on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import gpu_busy_ms, host_syncs, memory_at_peak, sync  # noqa: E402
from kimi_shaped import DraftShape  # noqa: E402  (imports eagleforge from a bare checkout)

from eagleforge.draft.attention import ttt_attention  # noqa: E402
from eagleforge.layout import init_layout, use_expandable_segments  # noqa: E402

log = logging.getLogger("bench_train")


def flops_per_token(s: DraftShape, tokens: int, teacher_vocab: int) -> float:
    """Model FLOPs per token of one training step (forward + backward, no recompute); the teacher's
    logits once per position, over the draft vocabulary (the trainer) or the full one (SpecForge)."""
    attn_params = s.heads * s.head_dim * 2 * s.hidden + 2 * s.kv_heads * s.head_dim * 2 * s.hidden \
        + s.heads * s.head_dim * s.hidden  # q, k, v from 2H; o_proj
    per_step = attn_params + 3 * s.hidden * s.intermediate + s.draft_vocab * s.hidden  # + MLP + lm_head
    fc = 3 * s.hidden * s.hidden
    attention = 3 * 4 * (tokens / 2) * s.heads * s.head_dim  # causal QK^T and PV, fwd + bwd, per step
    teacher = 2 * s.hidden * teacher_vocab  # forward only, no gradient
    return 6 * per_step * s.ttt + 6 * fc + s.ttt * attention + teacher


def make_batch(s: DraftShape, tokens: int, device: torch.device, used_ids: torch.Tensor, seed: int = 0) -> dict:
    """One sample of T tokens as the shards hold it: aux [1, T, 3H], last hidden [1, T, H],
    input ids, loss mask (all ones, as SpecForge's step), target argmax (90% inside the draft vocab)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    input_ids = torch.randint(0, s.vocab, (1, tokens), generator=gen)
    in_vocab = used_ids[torch.randint(0, len(used_ids), (1, tokens), generator=gen)]
    argmax = torch.where(torch.rand(1, tokens, generator=gen) < 0.9, in_vocab, input_ids)
    return {"input_ids": input_ids.to(device), "aux": torch.randn(1, tokens, 3 * s.hidden, device=device, dtype=torch.bfloat16),
            "last": torch.randn(1, tokens, s.hidden, device=device, dtype=torch.bfloat16),
            "loss_mask": torch.ones(1, tokens, dtype=torch.uint8, device=device), "target_argmax": argmax.to(device)}


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_steps(step_fn, device: torch.device, warmup: int, iters: int, line_up=None) -> tuple[float, float | None]:
    """(mean seconds per step over `iters` after `warmup` steps, peak GiB allocated during them);
    `line_up` (the ranks' barrier) runs before the clock starts."""
    for _ in range(warmup):
        step_fn()
    sync(device)
    if line_up is not None:
        line_up()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(iters):
        step_fn()
    sync(device)
    seconds = (time.perf_counter() - t0) / iters
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return seconds, peak


def result_row(name: str, tokens, seconds: float, peak: float | None, step_tokens: float, step_flops: float,
               peak_tflops: float) -> dict:
    """A row of `seconds` per step of `step_tokens` tokens and `step_flops` model FLOPs (means over the steps)."""
    tflops = step_flops / seconds / 1e12
    return {"method": name, "tokens": tokens, "step_ms": round(seconds * 1e3, 1), "tokens_per_s": round(step_tokens / seconds),
            "peak_GiB": None if peak is None else round(peak, 2), "GFLOP_per_token": round(step_flops / step_tokens / 1e9, 2),
            "TFLOPs": round(tflops, 1), "MFU": round(tflops / peak_tflops, 3)}


# ----------------------------------------------------------------------------------------------
# SpecForge's step
# ----------------------------------------------------------------------------------------------


class SpecForgeStep:
    def __init__(self, s: DraftShape, device: torch.device, used_ids: torch.Tensor):
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from specforge.optimizer import BF16Optimizer
        from transformers import LlamaConfig

        cfg = LlamaConfig(hidden_size=s.hidden, intermediate_size=s.intermediate, num_attention_heads=s.heads,
                          num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab, num_hidden_layers=1,
                          rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=131072, hidden_act="silu",
                          pad_token_id=0)
        cfg.draft_vocab_size = s.draft_vocab
        torch.manual_seed(0)
        draft = LlamaForCausalLMEagle3(cfg, attention_backend="flex_attention").to(torch.bfloat16).to(device)
        used = used_ids.to(device)
        draft.t2d.zero_()
        draft.t2d[used] = True
        draft.d2t.copy_(used - torch.arange(s.draft_vocab, device=device))
        draft.embed_tokens.weight.requires_grad_(False)
        self.model = OnlineEagle3Model(draft, length=s.ttt, attention_backend="flex_attention")
        self.params = [p for p in draft.parameters() if p.requires_grad]
        # its trainer's optimizer: fp32 masters and moments, clipping at 0.5 as the trainer's configs
        self.opt = BF16Optimizer(draft, lr=1e-5, max_grad_norm=0.5, total_steps=1000)
        self.head = torch.randn(s.vocab, s.hidden, device=device, dtype=torch.bfloat16) * s.hidden**-0.5  # full target head

    def step(self, batch: dict) -> None:
        tokens = batch["input_ids"].shape[1]
        am = torch.ones(1, tokens, dtype=torch.bool, device=batch["aux"].device)
        lm = torch.ones(1, tokens, 1, device=batch["aux"].device)
        out = self.model(input_ids=batch["input_ids"], attention_mask=am, target=None, loss_mask=lm,
                         hidden_states=batch["aux"], target_hidden_for_compact=batch["last"],
                         target_head_weight=self.head)
        loss = sum(0.8**i * l for i, l in enumerate(out[0]))
        loss.backward()
        self.opt.step()  # clips, steps the fp32 masters, copies them back, drops the gradients


def run_specforge(b: "Bench") -> None:
    """SpecForge's step at each --specforge-tokens (an OOM or error is recorded and the next T runs)."""
    s, device, args, out = b.shape, b.device, b.args, b.report["results"]
    try:
        method = SpecForgeStep(s, device, b.used_ids)
    except ImportError as err:
        out.append({"method": "specforge", "tokens": 0, "error": f"not installed: {err}"})
        return
    name = "specforge 0.2.0"
    log.info("%s: %s trainable parameters", name, f"{sum(p.numel() for p in method.params):,}")
    for tokens in args.specforge_tokens:
        batch = make_batch(s, tokens, device, b.used_ids)
        try:
            seconds, peak = time_steps(lambda: method.step(batch), device, *b.repetitions(tokens))  # noqa: F821 (bound above)
            row = result_row(name, tokens, seconds, peak, tokens, tokens * flops_per_token(s, tokens, s.vocab), args.peak_tflops)
        except Exception as err:  # noqa: BLE001 - recorded (an OOM too); the next T still runs
            row = {"method": name, "tokens": tokens, "error": repr(err)[:300]}
        for p in method.params:
            p.grad = None
        del batch
        free_memory(device)
        log.info("%s", row)
        out.append(row)
    del method
    free_memory(device)


# ----------------------------------------------------------------------------------------------
# The trainer itself: Trainer.train_step on shards written by the project's writer
# ----------------------------------------------------------------------------------------------


def write_kimi_shaped_run(run: Path, s: DraftShape, lengths: list[int], used_ids: torch.Tensor) -> None:
    """RUN/hidden: one sample per length (random bf16 states at the shape, target argmax 90% inside
    the draft vocabulary), written by eagleforge.shards.ShardWriter one sample per shard, under a
    header whose target config is the shape's text config; RUN/vocab: d2t/t2d of `used_ids`, a
    random teacher head and embedding."""
    from eagleforge.shards import ShardWriter
    from eagleforge.vocab import TARGET_HEAD, VOCAB_MAP, save_vocab_file

    text = s.text
    header = {"target": {"path": "kimi-shaped", "architecture": "DeepseekV3ForCausalLM", "num_layers": text["num_hidden_layers"],
                         "hidden_size": s.hidden, "vocab_size": s.vocab, "config": text},
              "aux_layer_ids": list(s.aux_layers), "tokenizer": "none", "chat_template": None, "max_length": max(lengths),
              "has_target_argmax": True}
    writer = ShardWriter(run / "hidden", header, storage_dtype="bfloat16")
    for i, tokens in enumerate(lengths):
        batch = make_batch(s, tokens, torch.device("cpu"), used_ids, seed=100 + i)
        sample = {"input_ids": batch["input_ids"][0].int(), "loss_mask": batch["loss_mask"][0],
                  "aux_hidden_states": batch["aux"][0], "last_hidden_state": batch["last"][0],
                  "target_argmax": batch["target_argmax"][0].int()}
        writer.write_shard(i, [sample], [i])
    t2d = torch.zeros(s.vocab, dtype=torch.bool)
    t2d[used_ids] = True
    gen = torch.Generator().manual_seed(7)
    meta = {"identity": "bench", "format": "pt"}
    (run / "vocab").mkdir(parents=True, exist_ok=True)
    save_vocab_file({"d2t": used_ids - torch.arange(s.draft_vocab), "t2d": t2d, "counts": t2d.long()}, run / "vocab" / VOCAB_MAP, meta)
    save_vocab_file({"lm_head": (torch.randn(s.draft_vocab, s.hidden, generator=gen) * s.hidden**-0.5).bfloat16(),
                     "embed_tokens": (torch.randn(s.vocab, s.hidden, generator=gen) * 0.02).bfloat16()},
                    run / "vocab" / TARGET_HEAD, meta)


def make_trainer(b: "Bench", config_file: str, variant: str, lengths: list[int]):
    """The trainer as `make train` builds it from `config_file` + the --trainer-overrides + `variant`,
    over a fresh run directory holding one shard per length (one batch each: train.batch_tokens =
    the longest)."""
    from eagleforge.config import load_config
    from eagleforge.train.loop import Trainer

    run, layout = b.args.workdir / "trainer", b.layout
    if layout.is_main:  # under torchrun: a batch per rank and step, all read from rank 0's shards
        shutil.rmtree(run, ignore_errors=True)
        write_kimi_shaped_run(run, b.shape, lengths * layout.world_size, b.used_ids)
    layout.barrier()
    cfg = load_config(config_file, [f"run_dir={run}", f"train.batch_tokens={max(lengths)}", "train.holdout_samples=0",
                                    "train.epochs=4", f"train.device={b.device.type}", "train.save_every=0",
                                    *b.args.trainer_overrides, *variant.split()])
    return Trainer(cfg, layout if layout.distributed else None)


def run_trainer(b: "Bench", name: str, config_file: str, variant: str) -> None:
    """Trainer.train_step() at each T: on the shards (read, padded and copied ahead by the
    trainer's feed), then on the same first batch kept on the device ("synthetic batch": the feed
    stopped, nothing read, padded or copied). Two rows per T. Under torchrun: T per rank, the
    slowest rank's time and the largest peak."""
    s, device, out, world = b.shape, b.device, b.report["results"], b.layout.world_size
    for tokens in b.args.tokens:
        warm, timed = b.repetitions(tokens)
        trainer = None
        for source in ("shards", "synthetic batch"):
            label = f"{name} ({source})"
            try:
                if trainer is None:
                    trainer = make_trainer(b, config_file, variant, [tokens] * (warm + timed))
                if source == "synthetic batch":
                    first = trainer.load_batch(trainer.schedule.epoch_batches(0)[0])
                    if trainer.feed is not None:
                        trainer.feed.close()
                        trainer.feed = None
                    trainer.read = lambda slot, first=first: first
                seconds, peak = time_steps(trainer.train_step, device, warm, timed, b.layout.barrier)
                seconds, peak = b.slowest(seconds), None if peak is None else b.slowest(peak)
                row = result_row(label, tokens, seconds, peak, tokens * world,
                                 world * tokens * flops_per_token(s, tokens, s.draft_vocab), b.args.peak_tflops * world)
                row.update(gpus=world, settings={
                    "param_dtype": str(trainer.param_dtype), "parallel": trainer.parallel, "attention": trainer.cfg.train.attention,
                    "activation_checkpoint": trainer.step_plan.activation_checkpoint, "compile": str(trainer.step_plan.compile),
                    "embedding": "host" if trainer.host_embedding is not None else "device"})
            except Exception as err:  # noqa: BLE001 - recorded (an OOM too); the next T still runs
                if b.layout.distributed:
                    raise  # the other ranks would wait for this one in a collective
                row = {"method": label, "tokens": tokens, "gpus": world, "error": repr(err)[:300]}
            log.info("%s", row)
            out.append(row)
            b.save()
        if trainer is not None:
            trainer.close()
        del trainer
        free_memory(device)


def profile_step(name: str, step_fn, tokens: int, device: torch.device, compiled: bool) -> dict:
    """Diagnose one training step (after two warm-up steps): the top CUDA kernels, the GPU's
    kernel time against the step's wall time (a launch-bound step shows a gap), the calls where
    the host waits for the GPU, and the blocks live at the step's peak memory."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step_fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_fn()
        sync(device)
    print(f"=== profile: {name}, T = {tokens}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    wall_ms = time_steps(step_fn, device, 0, 3)[0] * 1e3
    out = {"method": name, "tokens": tokens, "step_ms": round(wall_ms, 1), "gpu_busy_ms": round(gpu_busy_ms(prof), 1)}
    print(f"GPU busy (union of its kernels' intervals) {out['gpu_busy_ms']} ms of a {out['step_ms']} ms step (unprofiled)",
          flush=True)
    if device.type != "cuda":
        return out
    out["host_syncs"] = host_syncs(step_fn)
    print(f"host syncs per step: {json.dumps(out['host_syncs'])}", flush=True)
    if compiled:
        # torch 2.11: the allocator's history with python stacks breaks compiled code inside a
        # checkpoint (SystemError in the backward, pytorch/pytorch#179536)
        print("memory at the peak by source line: skipped (compiled step; see pytorch#179536)")
        return out
    try:
        out["memory"] = mem = memory_at_peak(step_fn)
    except Exception as err:  # a diagnostic: report it, keep the run
        print(f"memory at the peak by source line failed: {err!r}")
        return out
    print(f"memory: {mem['base_GiB']} GiB before the step, peak +{mem['peak_delta_GiB']} GiB at {mem['peak_at']} "
          f"(pre-existing freed by then: {mem['freed_preexisting_GiB']} GiB); live at the peak, allocated in the step:")
    for where, gib, count in mem["groups"]:
        print(f"    {gib:8.3f} GiB  {count:5d} blocks  {where}")
    return out


def profile_mode(b: Bench) -> None:
    """--profile T: one profiled step of the trainer, per config and variant."""
    tokens, results = b.args.profile, b.report["results"]
    for name, config_file, variant in b.trainer_rows():
        trainer = make_trainer(b, config_file, variant, [tokens] * 4)
        results.append(profile_step(name, trainer.train_step, tokens, b.device, bool(trainer.step_plan.compile)))
        trainer.close()
        del trainer
        free_memory(b.device)
        b.save()


# ----------------------------------------------------------------------------------------------
# The TTT attention alone, and its check against the explicit-mask reference
# ----------------------------------------------------------------------------------------------


def attention_inputs(s: DraftShape, device: torch.device, tokens: int, seed: int):
    """Random bf16 TTT attention inputs at the draft's head shape: q [1, heads, T, D], K steps'
    keys and values [1, kv_heads, T, D] (all requiring grad) and an upstream gradient like q."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device, torch.bfloat16).requires_grad_()

    q = rnd(1, s.heads, tokens, s.head_dim)
    keys = [rnd(1, s.kv_heads, tokens, s.head_dim) for _ in range(s.ttt)]
    values = [rnd(1, s.kv_heads, tokens, s.head_dim) for _ in range(s.ttt)]
    upstream = torch.randn(1, s.heads, tokens, s.head_dim, generator=gen).to(device, torch.bfloat16)
    return q, keys, values, upstream


def check_attention(s: DraftShape, device: torch.device, tokens: int, fast: str) -> dict:
    """TTT attention at the draft's head shape, all K steps: the explicit-mask reference against
    the fast kernel (forward and the gradients of q and of every step's keys/values)."""
    q, keys, values, upstream = attention_inputs(s, device, tokens, seed=2)
    results = {}
    for mode in ("reference", fast):
        out = ttt_attention(q, keys, values, s.head_dim**-0.5, mode=mode)
        (out.float() * upstream.float()).sum().backward()
        results[mode] = [out.detach()] + [x.grad.clone() for x in [q] + keys + values]
        for x in [q] + keys + values:
            x.grad = None
    errs = [((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
            for a, b in zip(results[fast], results["reference"])]
    return {"tokens": tokens, "steps": s.ttt, "fast": fast, "out_rel_err": errs[0], "grad_max_rel_err": max(errs[1:])}


def attention_bench(s: DraftShape, device: torch.device, tokens_list: list[int], modes: list[str], warmup: int,
                    iters: int) -> list[dict]:
    """TTT attention alone as training runs it: for j = 0..K-1, forward over the keys of steps
    0..j and backward, per mode (flex: flex_attention over the concatenated keys; merged: flash + diagonal
    merge). Time per full set of K steps, peak memory above the inputs, attention TFLOP/s
    (causal QK^T and PV, forward + backward = 3 x 4 x T/2 x heads x D per token and step)."""
    rows = []
    for tokens in tokens_list:
        q, keys, values, upstream = attention_inputs(s, device, tokens, seed=5)
        flops = s.ttt * tokens * 3 * 4 * (tokens / 2) * s.heads * s.head_dim
        for mode in modes:
            def run(mode=mode):
                name, _, compiled = mode.partition("+")
                for j in range(s.ttt):
                    out = ttt_attention(q, keys[: j + 1], values[: j + 1], s.head_dim**-0.5, mode=name,  # noqa: F821 (bound above; deleted only after the call)
                                        compile=compiled == "compile")
                    out.backward(upstream)  # noqa: F821 (bound above; deleted only after the call)
                for x in [q, *keys, *values]:  # noqa: F821 (bound above; deleted only after the call)
                    x.grad = None
            try:
                sync(device)
                base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
                seconds, peak = time_steps(run, device, warmup, iters)
                row = {"method": f"attention {mode}", "tokens": tokens, "ms_all_steps": round(seconds * 1e3, 2),
                       "ms_per_step": round(seconds * 1e3 / s.ttt, 2), "TFLOPs": round(flops / seconds / 1e12, 1),
                       "peak_GiB_over_inputs": None if peak is None else round(peak - base / 2**30, 2)}
            except Exception as err:  # noqa: BLE001 - recorded; the other mode still runs
                row = {"method": f"attention {mode}", "tokens": tokens, "error": repr(err)[:300]}
            log.info("%s", row)
            rows.append(row)
            free_memory(device)
        del q, keys, values, upstream
        free_memory(device)
    return rows


def versus_specforge(rows: list[dict]) -> None:
    """Add speed and memory ratios against SpecForge measured in this run (at the same T)."""
    measured = {r["tokens"]: (r["tokens_per_s"], r["peak_GiB"]) for r in rows
                if r["method"].startswith("specforge") and "error" not in r}
    for r in rows:
        ref = measured.get(r["tokens"])
        if ref and "step_ms" in r and not r["method"].startswith("specforge"):
            r["vs_specforge_speed"] = round(r["tokens_per_s"] / ref[0], 3)
            r["vs_specforge_memory"] = None if r["peak_GiB"] is None else round(r["peak_GiB"] / ref[1], 3)


def print_table(rows: list[dict]) -> None:
    attention = [r for r in rows if r["method"].startswith("attention")]
    if attention:
        print("| T | attention | ms (all TTT steps, fwd+bwd) | ms / step | TFLOP/s | peak GiB over inputs |")
        print("|---|---|---|---|---|---|")
        for r in attention:
            cells = [r["error"], "", "", ""] if "error" in r else \
                [r["ms_all_steps"], r["ms_per_step"], r["TFLOPs"], r["peak_GiB_over_inputs"]]
            print(f"| {r['tokens']} | {r['method']} | " + " | ".join(map(str, cells)) + " |")
    rows = [r for r in rows if not r["method"].startswith("attention")]
    if rows:
        print("| T | method | step ms | tokens/s | peak GiB | GFLOP/token | TFLOP/s | MFU | vs SpecForge: speed, memory |")
        print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["tokens"], r["method"])):
        if "error" in r:
            print(f"| {r['tokens']} | {r['method']} | {r['error']} | | | | | | |")
        else:
            vs = f"{r['vs_specforge_speed']}x, {r['vs_specforge_memory']}x" if "vs_specforge_speed" in r else ""
            print(f"| {r['tokens']} | {r['method']} | {r['step_ms']} | {r['tokens_per_s']} | {r['peak_GiB']} | "
                  f"{r['GFLOP_per_token']} | {r['TFLOPs']} | {r['MFU']} | {vs} |")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--specforge-tokens", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    ap.add_argument("--no-specforge", action="store_true")
    ap.add_argument("--trainer-configs", nargs="*", default=["configs/kimi_k25_b300.yaml"],
                    help="the trainer's rows: Trainer.train_step with each config's train settings (none: skip)")
    ap.add_argument("--variants", nargs="+", default=[""],
                    help="sets of config overrides, one set a row per config, each 'key=value key=value' ('': the config as is)")
    ap.add_argument("--trainer-overrides", nargs="*", default=[], help="key=value overrides for every trainer row")
    ap.add_argument("--attention-bench", action="store_true", help="only time the TTT attention modes (--attention-modes)")
    ap.add_argument("--no-attention-bench", action="store_true",
                    help="skip the TTT attention timing that otherwise runs first, before the steps")
    ap.add_argument("--attention-modes", nargs="+", default=["flex", "merged", "merged+compile", "merged_cudnn+compile"],
                    help="ttt_attention modes; '+compile' fuses the merged mode's elementwise work")
    ap.add_argument("--attention-tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=1024, help="T of the attention modes' check against the reference")
    ap.add_argument("--no-checks", action="store_true", help="skip the attention check at the start")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--profile", type=int, default=0, help="only profile one step of each trainer row at this T")
    ap.add_argument("--launch", type=int, nargs="+", default=None, metavar="N",
                    help="run the trainer's rows under torchrun on each number of GPUs (--tokens per GPU), then a scaling table")
    ap.add_argument("--workdir", type=Path, default=Path("runs/bench_train"), help="where the trainer rows' shards go")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cpu-check", action="store_true", help="tiny shapes on the CPU (checks the script)")
    return ap.parse_args(argv)


@dataclasses.dataclass
class Bench:
    """One run's shape, device (this rank's, under torchrun), draft-vocabulary ids and report (saved as it grows)."""

    args: argparse.Namespace
    shape: DraftShape
    device: torch.device
    used_ids: torch.Tensor
    report: dict
    layout: object

    def save(self) -> None:
        if self.args.json and self.layout.is_main:
            self.args.json.parent.mkdir(parents=True, exist_ok=True)
            self.args.json.write_text(json.dumps(self.report, indent=1))

    def repetitions(self, tokens: int) -> tuple[int, int]:
        """(warm-up, timed) steps at T: fewer from 32K on (a few seconds per step)."""
        return (1, min(self.args.iters, 2)) if tokens >= 32768 else (self.args.warmup, self.args.iters)

    def slowest(self, value: float) -> float:
        """The largest of the ranks' values (this rank's alone in one process)."""
        layout = self.layout
        return max(layout.all_reduce_sum([value if r == layout.rank else 0.0 for r in range(layout.world_size)]))

    def trainer_rows(self) -> list[tuple[str, str, str]]:
        """(name, config file, variant) of each trainer row."""
        return [(f"trainer {Path(c).stem}" + (f" [{v}]" if v else ""), c, v)
                for c in self.args.trainer_configs for v in self.args.variants]


def set_up(args: argparse.Namespace) -> Bench:
    """The shape and device (tiny on the CPU with --cpu-check), the draft vocabulary, the report."""
    if args.cpu_check:
        s, device = DraftShape.tiny(), torch.device("cpu")
        args.tokens, args.specforge_tokens, args.check_tokens = [64, 150], [64], 150
        args.attention_tokens, args.attention_modes = [64, 150], ["merged", "merged+compile", "sdpa"]
        args.warmup, args.iters = 1, 1
        args.trainer_overrides = ["train.attention=merged", "train.compile=false", *args.trainer_overrides]
    else:
        use_expandable_segments()  # the allocator the train stage sets up, for SpecForge's rows too
        if not torch.cuda.is_available():
            raise SystemExit("bench_train: no CUDA device (use --cpu-check on a CPU machine)")
        s, device = DraftShape.kimi(), torch.device("cuda")
    layout = init_layout(device.type)  # one process, or torchrun's world (--launch)
    device = layout.device
    used_ids = torch.sort(torch.randperm(s.vocab, generator=torch.Generator().manual_seed(0))[: s.draft_vocab]).values
    report: dict = {"shape": {k: v for k, v in vars(s).items() if k != "text"},
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
                    "args": {k: str(v) for k, v in vars(args).items()}, "results": [], "checks": {}}
    return Bench(args, s, device, used_ids, report, layout)


def launch(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    """--launch N...: this command's trainer rows under torchrun on N GPUs each (no attention
    bench, checks or SpecForge there), each row's scaling against its 1-GPU row, as a table."""
    forwarded, skip = [], False
    for item in argv:  # the command line less --launch N... and --json PATH
        if item.startswith("--"):
            skip = item in ("--launch", "--json")
        if not skip:
            forwarded.append(item)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.launch:
            out = Path(tmp) / f"{n}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), __file__,
                   *forwarded, "--no-attention-bench", "--no-checks", "--no-specforge", "--json", str(out)]
            log.info("%s", " ".join(cmd))
            done = subprocess.run(cmd, check=False)
            rows += json.loads(out.read_text())["results"] if done.returncode == 0 and out.is_file() else \
                [{"method": f"{n} GPUs", "tokens": "", "gpus": n, "error": f"exit code {done.returncode}"}]
    one = {(r["method"], r["tokens"]): r["tokens_per_s"] for r in rows if r["gpus"] == 1 and "error" not in r}
    print("| GPUs | method | tokens per GPU | step ms | tokens/s | scaling vs 1 GPU | peak GiB | MFU |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if (r["method"], r["tokens"]) in one and "error" not in r:
            r["scaling"] = round(r["tokens_per_s"] / one[(r["method"], r["tokens"])], 3)
        cells = [r["error"]] if "error" in r else [r["step_ms"], r["tokens_per_s"], r.get("scaling", ""), r["peak_GiB"], r["MFU"]]
        print(f"| {r['gpus']} | {r['method']} | {r['tokens']} | " + " | ".join(map(str, cells)) + " |")
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    if args.launch:
        report = {"args": {k: str(v) for k, v in vars(args).items()},
                  "results": launch(args, sys.argv[1:] if argv is None else list(argv))}
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))
        return report
    b = set_up(args)
    results = b.report["results"]
    if args.profile:
        profile_mode(b)
        return b.report
    if not args.no_checks:
        for mode in sorted({m.partition("+")[0] for m in args.attention_modes}):
            b.report["checks"][f"attention_{mode}"] = check_attention(b.shape, b.device, args.check_tokens, mode)
            log.info("attention check: %s", b.report["checks"][f"attention_{mode}"])
    if args.attention_bench or not args.no_attention_bench:
        results += attention_bench(b.shape, b.device, args.attention_tokens, args.attention_modes, args.warmup, args.iters)
        b.save()
    if not args.attention_bench:
        for name, config_file, variant in b.trainer_rows():
            run_trainer(b, name, config_file, variant)
        # SpecForge last: rows measured after it in the same process carried ~10 GiB more fixed
        # memory (most likely its model kept alive by compile caches), so nothing of ours follows it.
        if not args.no_specforge:
            run_specforge(b)
        versus_specforge(results)
        b.save()
    b.layout.barrier()
    if b.layout.is_main:
        shutil.rmtree(args.workdir / "trainer", ignore_errors=True)
        print_table(results)
        print(json.dumps(b.report["checks"]))
    b.layout.shutdown()
    return b.report


if __name__ == "__main__":
    main()
