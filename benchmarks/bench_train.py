"""Benchmark: one full EAGLE-3 draft training step (forward, backward, optimizer) at Kimi-K2.5's
draft shape, ours against SpecForge's own step, side by side in one process.

Shape (Kimi-K2.5 draft): hidden 7168, one layer, 64 query and 64 KV heads of 128, intermediate
18432, target vocabulary 163840, draft vocabulary Vd 32000, TTT 7, batch 1 x T tokens.

Our step mirrors the trainer (train/loop.py) with the memory changes measured here:

    emb   = embed(input_ids ++ [0] * K)             [T + K, H]; step j reads rows 1+j .. T+j (a view)
    h     = fc(aux)                                  [T, H]
    step j = 0..K-1 (Eagle3Draft.ttt_step_fn: checkpointed per the variant's ckpt, elementwise
                     pieces compiled with compile=1):
        q, k_j, v_j = midlayer.qkv(emb_j, h, RoPE(t + j))
        h = midlayer.finish(ttt_attention(q, k_0..k_j, v_0..v_j, mode=attn), h)   un-normed, fed to j+1
        normed_j = norm(h)                                                  [T, H]
    loss  = fused_soft_cross_entropy_ttt(normed_0..K-1, lm_head, last_hidden, teacher_head[Vd],
            weight [K, T], packed=packed)
                               teacher logits over Vd computed ONCE per position for all K steps;
                               weight = loss mask x (target argmax in the draft vocabulary) x 0.8^j
                               / (rows of step j); the target argmax comes with the shards
    loss.backward(); clip_grad_norm_(0.5); AdamW(fused=True).step(); zero_grad(set_to_none=True)

The step-only variants keep bf16 parameters and bf16 AdamW states (a benchmark variant: the
trainer's rows run the trainer itself, whose bf16 parameters step with fp32 masters and moments,
train/optimizer.py). SpecForge's step runs with its own trainer's optimizer, BF16Optimizer (fp32
masters and moments of its bf16 weights, its gradient clipping): the same update precision as the
trainer's. The frozen target embedding [163840, 7168] (2.2 GiB) stays on the
host by default (--embed-device cpu): only the T rows a batch uses are gathered there (into
pinned memory) and copied over, inside the timed step.

SpecForge's step is its own training step:
LlamaForCausalLMEagle3 in OnlineEagle3Model, flex_attention backend, its compact teacher from
hidden states over the FULL target vocabulary (163840) every step, BF16Optimizer.

FLOPs are counted here (model FLOPs, no recompute): 6 x (trainable parameters used per TTT step)
x K + fc + causal attention (fwd + bwd, 3 x 4 x T/2 x heads x head_dim per token and step) + the
teacher's forward logits: 2 H Vd per token for ours (once, shared over steps; the target argmax
comes from the shards), 2 H V for SpecForge (full vocabulary, as it does). MFU is against
--peak-tflops (H200 dense bf16, 989).

Variants (side by side in ONE run; --variants picks them, each a spec
`key=value,...` with ckpt = step | none | selective | selective_all (eagleforge.modes.CHECKPOINT_MODES),
attn = flex | merged | merged_cudnn | sdpa (draft.attention), compile = 0 | 1 (fused elementwise pieces),
packed = 0 | 1 (the loss's packed TTT form), fusegrad = 0 | 1 (midlayer weight gradients accumulated by the
GEMM itself, train/weight_grads.py, which the trainer runs with bf16 parameters)).
The trainer's Kimi configs run ckpt=selective_all,attn=merged_cudnn,compile=1 (packed = the
`train.loss_packed` option, off by default). Rows carry "vs SpecForge" ratios against SpecForge
measured in the same run (none without SpecForge installed).

    python benchmarks/bench_train.py --no-specforge --json $OUT/bench_train.json        # attention + all variants
    python benchmarks/bench_train.py --attention-bench --json $OUT/attn.json              # TTT attention only
    python benchmarks/bench_train.py --variants ckpt=selective,attn=merged,compile=1,packed=1 \
        --tokens 2048 8192 16384 32768 65536                                                # the full table

    make bench-train                                          # = python benchmarks/bench_train.py
    python benchmarks/bench_train.py --tokens 2048 8192 --no-specforge --json out.json
    python benchmarks/bench_train.py --cpu-check              # tiny shapes on the CPU: checks the script
    python benchmarks/bench_train.py --varying 24 --tokens 8192 --variants \
        ckpt=selective_all,attn=merged,compile=dynamic,packed=1 \
        ckpt=selective_all,attn=merged_cudnn,compile=dynamic,packed=1   # lengths changing every step

The SpecForge rows need specforge installed (and the Liger kernels it uses); without it they are
skipped and no ratio is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import gpu_busy_ms, host_syncs, import_eagleforge, memory_at_peak  # noqa: E402

import_eagleforge()  # a bare checkout runs without `pip install -e .`

from eagleforge.draft import Eagle3Config, Eagle3Draft  # noqa: E402
from eagleforge.draft.attention import ttt_attention  # noqa: E402
from eagleforge.kernels import soft_ce_ttt  # noqa: E402
from eagleforge.train import loss as reference_loss  # noqa: E402
from eagleforge.train.weight_grads import fuse_weight_grads  # noqa: E402

log = logging.getLogger("bench_train")

STEP_WEIGHT_DECAY = 0.8
GRAD_CLIP = 0.5

DEFAULT_VARIANTS = [
    "ckpt=step,attn=flex",  # whole-step checkpointing, flex attention: the simplest configuration
    "ckpt=selective,attn=merged",
    "ckpt=selective,attn=merged,compile=1,packed=1",
    "ckpt=selective_all,attn=merged,compile=1,packed=1",
    "ckpt=step,attn=merged,compile=1,packed=1",
    "ckpt=none,attn=merged,compile=1,packed=1",
    "ckpt=selective_all,attn=merged_cudnn,compile=1,packed=1,fusegrad=1",  # the fastest measured (BENCHMARKS.md)
]


@dataclass
class Shape:
    hidden: int = 7168
    heads: int = 64
    kv_heads: int = 64
    head_dim: int = 128
    intermediate: int = 18432
    vocab: int = 163840
    draft_vocab: int = 32000
    ttt: int = 7

    @classmethod
    def tiny(cls) -> "Shape":
        return cls(hidden=96, heads=4, kv_heads=2, head_dim=24, intermediate=160, vocab=1500, draft_vocab=997, ttt=3)

    def draft_config(self) -> Eagle3Config:
        return Eagle3Config(
            hidden_size=self.hidden, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate, vocab_size=self.vocab,
            draft_vocab_size=self.draft_vocab, target_hidden_size=self.hidden, aux_layer_ids=[1, 29, 57],
            rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=131072,
        )


# ----------------------------------------------------------------------------------------------
# FLOPs (counted, not measured)
# ----------------------------------------------------------------------------------------------


def flops_per_token(s: Shape, tokens: int, teacher_vocab: int) -> float:
    """Model FLOPs per token of one training step (forward + backward, no recompute)."""
    attn_params = s.heads * s.head_dim * 2 * s.hidden + 2 * s.kv_heads * s.head_dim * 2 * s.hidden \
        + s.heads * s.head_dim * s.hidden  # q, k, v from 2H; o_proj
    per_step = attn_params + 3 * s.hidden * s.intermediate + s.draft_vocab * s.hidden  # + MLP + lm_head
    fc = 3 * s.hidden * s.hidden
    attention = 3 * 4 * (tokens / 2) * s.heads * s.head_dim  # causal QK^T and PV, fwd + bwd, per step
    teacher = 2 * s.hidden * teacher_vocab  # forward only, no gradient
    return 6 * per_step * s.ttt + 6 * fc + s.ttt * attention + teacher


# ----------------------------------------------------------------------------------------------
# Inputs (random, at a trained model's scales) and memory/time helpers
# ----------------------------------------------------------------------------------------------


def use_compiled_block_masks() -> None:
    """Build the TTT flex block masks with create_block_mask(_compile=True): the draft's eager
    call evaluates the mask over all T x K*T pairs at once (7.5 GB of booleans at T = 32768,
    30 GB at 65536) before reducing it to blocks; the compiled one never materializes it. Same
    mask_mod as eagleforge.draft.attention._ttt_block_mask (which should adopt this)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from eagleforge.draft import attention as attention_module

    @functools.lru_cache(maxsize=64)
    def block_mask(seq_len: int, num_steps: int, device: str):
        def mask_mod(b, h, q_idx, kv_idx):
            step = kv_idx // seq_len
            pos = kv_idx % seq_len
            return ((step == 0) & (pos <= q_idx)) | ((step > 0) & (pos == q_idx))

        return create_block_mask(mask_mod, None, None, seq_len, num_steps * seq_len, device=device, _compile=True)

    attention_module._ttt_block_mask = block_mask


def make_batch(s: Shape, tokens: int, device: torch.device, used_ids: torch.Tensor, seed: int = 0) -> dict:
    """One sample of T tokens as the shards hold it: aux [1, T, 3H], last hidden [1, T, H],
    input ids, loss mask (all ones, as SpecForge's step), target argmax (90% inside the draft vocab)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    input_ids = torch.randint(0, s.vocab, (1, tokens), generator=gen)
    in_vocab = used_ids[torch.randint(0, len(used_ids), (1, tokens), generator=gen)]
    argmax = torch.where(torch.rand(1, tokens, generator=gen) < 0.9, in_vocab, input_ids)
    return {
        "input_ids": input_ids,  # kept on the host too for the host-side embedding gather
        "input_ids_dev": input_ids.to(device),
        "aux": torch.randn(1, tokens, 3 * s.hidden, device=device, dtype=torch.bfloat16),
        "last": torch.randn(1, tokens, s.hidden, device=device, dtype=torch.bfloat16),
        "loss_mask": torch.ones(1, tokens, dtype=torch.uint8, device=device),
        "target_argmax": argmax.to(device),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_steps(step_fn, device: torch.device, warmup: int, iters: int) -> tuple[float, float | None]:
    """(mean seconds per step over `iters` after `warmup` steps, peak GiB allocated during them)."""
    for _ in range(warmup):
        step_fn()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(iters):
        step_fn()
    sync(device)
    seconds = (time.perf_counter() - t0) / iters
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return seconds, peak


def result_row(name: str, tokens: int, seconds: float, peak: float | None, flops_tok: float, peak_tflops: float) -> dict:
    tflops = tokens * flops_tok / seconds / 1e12
    return {"method": name, "tokens": tokens, "step_ms": round(seconds * 1e3, 1), "tokens_per_s": round(tokens / seconds),
            "peak_GiB": None if peak is None else round(peak, 2), "GFLOP_per_token": round(flops_tok / 1e9, 2),
            "TFLOPs": round(tflops, 1), "MFU": round(tflops / peak_tflops, 3)}


# ----------------------------------------------------------------------------------------------
# Our training step
# ----------------------------------------------------------------------------------------------


def ttt_layer_step(draft: Eagle3Draft, attention: str, n_prev: int, hidden, emb, cos, sin, *kv):
    """One TTT step of the midlayer. hidden, emb [1, T, H]; kv = n_prev keys then n_prev values
    [1, Hkv, T, D] of the earlier steps -> (un-normed output, normed output, k_j, v_j)."""
    return draft.ttt_step(attention, n_prev, hidden, emb, cos, sin, *kv)


def step_modes(ckpt: str, k_steps: int) -> list[str]:
    """A variant's ckpt -> one checkpoint mode per TTT step: "selective:4" (selective for steps
    0..3, step after; this script's own form), else eagleforge.modes.checkpoint_modes ("selective_all",
    "selective*3+selective_all*4")."""
    from eagleforge.modes import checkpoint_modes

    mode, _, first = ckpt.partition(":")
    if first:
        return [mode if j < int(first) else "step" for j in range(k_steps)]
    return checkpoint_modes(ckpt, k_steps)


@dataclass
class Variant:
    """One configuration of our step, parsed from "ckpt=selective,attn=merged,compile=1,packed=1"."""

    ckpt: str = "step"
    attn: str = "flex"
    compile: bool | str = False  # False, True (a graph per length) or "dynamic"
    packed: bool = False
    fusegrad: bool = False
    sync: bool = False  # two host syncs in the loss's backward (what they would cost; the loss makes none)

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        from eagleforge.modes import CHECKPOINT_MODES

        out = cls()
        for item in filter(None, spec.split(",")):
            key, _, value = item.partition("=")
            mode, _, first = value.partition(":")
            if key == "ckpt" and "+" in value:
                out.ckpt = value  # "selective*3+selective_all*4": one mode per TTT step (checked when built)
            elif key == "ckpt" and mode in CHECKPOINT_MODES and (first == "" or first.isdigit()):
                out.ckpt = value  # "selective:4": selective for the first 4 TTT steps, step for the rest
            elif key == "attn" and value in ("flex", "merged", "merged_cudnn", "sdpa", "reference", "fast", "auto"):
                out.attn = value
            elif key == "compile" and value == "dynamic":
                out.compile = "dynamic"  # one graph for every length (the trainer's setting)
            elif key in ("compile", "packed", "fusegrad", "sync") and value in ("0", "1"):
                setattr(out, key, value == "1")
            else:
                raise SystemExit(f"bench_train: bad variant item {item!r} in {spec!r} (ckpt={'|'.join(CHECKPOINT_MODES)}"
                                 f"[:N for the first N steps, step after], attn=flex|merged|merged_cudnn|sdpa, "
                                 f"compile=0|1, packed=0|1, fusegrad=0|1, sync=0|1)")
        return out

    @property
    def name(self) -> str:
        compiled = self.compile if self.compile == "dynamic" else int(self.compile)
        name = f"ckpt={self.ckpt},attn={self.attn},compile={compiled},packed={int(self.packed)}"
        return name + (",fusegrad=1" if self.fusegrad else "") + (",sync=1" if self.sync else "")

    def step(self, s: "Shape", device: torch.device, used_ids: torch.Tensor, embed_device: str,
             chunk_tokens: int | None) -> "OurStep":
        return OurStep(s, device, used_ids, self.ckpt, self.attn, embed_device, chunk_tokens, self.compile, self.packed,
                       self.fusegrad, self.sync)


def ttt_weights(loss_mask: torch.Tensor, target_argmax: torch.Tensor, t2d: torch.Tensor, steps: int) -> torch.Tensor:
    """weight [K, T] fp32 for fused_soft_cross_entropy_ttt (batch 1): the trainer's own
    (train.ttt_loss.ttt_loss_weights: loss row x teacher token in the draft vocabulary x 0.8^j / rows)."""
    from eagleforge.train.ttt_loss import ttt_loss_weights

    return ttt_loss_weights(loss_mask, target_argmax, t2d, steps, STEP_WEIGHT_DECAY)[0]


class OurStep:
    """Builds the draft (bf16), the optimizer and one training step over a batch."""

    def __init__(self, s: Shape, device: torch.device, used_ids: torch.Tensor, ckpt: str, attention: str,
                 embed_device: str, chunk_tokens: int | None, compile: bool = False, packed: bool = False,
                 fusegrad: bool = False, sync: bool = False):
        self.s, self.device, self.ckpt, self.attention, self.chunk = s, device, ckpt, attention, chunk_tokens
        self.compile, self.packed, self.sync = compile, packed, sync
        torch.manual_seed(0)
        with torch.device(device):
            draft = Eagle3Draft(s.draft_config())
        draft.to(torch.bfloat16)
        fuse_weight_grads(draft, fusegrad)  # midlayer weight gradients added into .grad by each GEMM
        d2t = used_ids - torch.arange(s.draft_vocab)
        t2d = torch.zeros(s.vocab, dtype=torch.bool)
        t2d[used_ids] = True
        draft.set_vocab_map(d2t.to(device), t2d.to(device))
        self.embed_weight = draft.embed_tokens.weight.detach()
        if embed_device == "cpu":
            # The frozen table lives on the host; the module keeps an empty placeholder.
            self.embed_weight = self.embed_weight.cpu()
            draft.embed_tokens.weight = torch.nn.Parameter(torch.empty(0, s.hidden, device=device, dtype=torch.bfloat16),
                                                           requires_grad=False)
            free_memory(device)
        self.draft = draft
        self.params = [p for p in draft.parameters() if p.requires_grad]
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(self.params, lr=1e-5, betas=(0.9, 0.95), fused=fused)
        # The target's lm_head rows of the draft vocabulary [Vd, H] (RUN/vocab/target_head.safetensors).
        self.teacher_head = torch.randn(s.draft_vocab, s.hidden, device=device, dtype=torch.bfloat16) * s.hidden**-0.5
        self.pinned: torch.Tensor | None = None

    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def embeddings(self, batch: dict) -> torch.Tensor:
        """embed(input_ids ++ [0] * K) [1, T + K, H] on the device (step j uses rows 1+j .. T+j)."""
        ids = batch["input_ids"][0] if self.embed_weight.device.type == "cpu" else batch["input_ids_dev"][0]
        ids = F.pad(ids, (0, self.s.ttt), value=0)
        if self.embed_weight.device.type != "cpu":
            return F.embedding(ids, self.embed_weight)[None]
        if self.pinned is None or self.pinned.shape[0] != ids.shape[0]:
            self.pinned = torch.empty(ids.shape[0], self.s.hidden, dtype=torch.bfloat16,
                                      pin_memory=self.device.type == "cuda")
        torch.index_select(self.embed_weight, 0, ids, out=self.pinned)
        return self.pinned.to(self.device, non_blocking=True)[None]

    def forward_loss(self, batch: dict):
        """-> (loss, step_losses [K], draft argmax [K, T]); the forward_ttt math, step by step."""
        draft, k_steps = self.draft, self.s.ttt
        tokens = batch["input_ids_dev"].shape[1]
        emb = self.embeddings(batch)  # [1, T + K, H]
        hidden = draft.fuse(batch["aux"])  # [1, T, H]
        rows = torch.arange(tokens, device=self.device)[None]
        modes = step_modes(self.ckpt, k_steps)
        step_fns = {m: draft.ttt_step_fn(self.attention, m, self.compile) for m in set(modes)}  # forward_ttt's
        keys, values, normed = [], [], []
        for j in range(k_steps):
            cos, sin = draft.rope(rows + j)
            hidden, out_j, k, v = step_fns[modes[j]](j, hidden, emb[:, 1 + j: 1 + j + tokens], cos, sin, *keys, *values)
            keys.append(k)
            values.append(v)
            normed.append(out_j[0])  # [T, H]
        del keys, values, hidden
        weight = ttt_weights(batch["loss_mask"], batch["target_argmax"], draft.t2d, k_steps)
        return soft_ce_ttt.fused_soft_cross_entropy_ttt(
            normed, draft.lm_head.weight, batch["last"][0], self.teacher_head, weight,
            teacher_shift=1, chunk_tokens=self.chunk, packed=self.packed,
            check_weight=self.sync)  # ttt_weights zeroes the rows without a teacher: no check, no host sync

    def step(self, batch: dict) -> torch.Tensor:
        loss, step_losses, argmax = self.forward_loss(batch)
        if self.sync and self.device.type == "cuda":
            # sync=1: a host wait before the backward, as a loss reading the upstream gradient
            # back (to test it for 1) would make
            torch.cuda.synchronize()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, GRAD_CLIP, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return step_losses


# ----------------------------------------------------------------------------------------------
# SpecForge's step
# ----------------------------------------------------------------------------------------------


class SpecForgeStep:
    def __init__(self, s: Shape, device: torch.device, used_ids: torch.Tensor):
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
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
        from specforge.optimizer import BF16Optimizer

        self.params = [p for p in draft.parameters() if p.requires_grad]
        # its trainer's optimizer: fp32 masters and moments, clipping at 0.5 as the trainer's configs
        self.opt = BF16Optimizer(draft, lr=1e-5, max_grad_norm=0.5, total_steps=1000)
        self.head = torch.randn(s.vocab, s.hidden, device=device, dtype=torch.bfloat16) * s.hidden**-0.5  # full target head

    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def step(self, batch: dict) -> None:
        tokens = batch["input_ids_dev"].shape[1]
        am = torch.ones(1, tokens, dtype=torch.bool, device=batch["aux"].device)
        lm = torch.ones(1, tokens, 1, device=batch["aux"].device)
        out = self.model(input_ids=batch["input_ids_dev"], attention_mask=am, target=None, loss_mask=lm,
                         hidden_states=batch["aux"], target_hidden_for_compact=batch["last"],
                         target_head_weight=self.head)
        loss = sum(0.8**i * l for i, l in enumerate(out[0]))
        loss.backward()
        self.opt.step()  # clips, steps the fp32 masters, copies them back, drops the gradients


# ----------------------------------------------------------------------------------------------
# Correctness checks at the benchmark's shapes
# ----------------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check_loss(ours: OurStep, batch: dict) -> dict:
    """Fused TTT loss (and its gradients) against the plain fp32 reference on the same hidden states."""
    s, draft = ours.s, ours.draft
    tokens = batch["input_ids_dev"].shape[1]
    gen = torch.Generator(device="cpu").manual_seed(1)
    hiddens = [(torch.randn(tokens, s.hidden, generator=gen) * 0.5).to(ours.device, torch.bfloat16).requires_grad_()
               for _ in range(s.ttt)]
    head = draft.lm_head.weight.detach().clone().requires_grad_()
    weight = ttt_weights(batch["loss_mask"], batch["target_argmax"], draft.t2d, s.ttt)
    ref, ref_steps, _ = reference_loss.soft_cross_entropy_ttt(hiddens, head, batch["last"][0], ours.teacher_head, weight)
    ref.backward()
    ref_grads = [x.grad.clone() for x in hiddens + [head]]
    out = {"tokens": tokens, "reference_loss": ref.item()}
    for packed in (False, True):
        for x in hiddens + [head]:
            x.grad = None
        loss, steps, _ = soft_ce_ttt.fused_soft_cross_entropy_ttt(hiddens, head, batch["last"][0], ours.teacher_head, weight,
                                                              chunk_tokens=ours.chunk, packed=packed)
        loss.backward()
        grad_errs = [rel_err(x.grad, g) for x, g in zip(hiddens + [head], ref_grads)]
        tag = "packed_" if packed else ""
        out.update({f"{tag}loss": loss.item(), f"{tag}loss_rel_err": abs(loss.item() - ref.item()) / abs(ref.item()),
                    f"{tag}step_loss_max_rel_err": ((steps - ref_steps).abs() / ref_steps.abs().clamp_min(1e-30)).max().item(),
                    f"{tag}grad_max_rel_err": max(grad_errs)})
    return out


def check_fused_weight_grads(ours: OurStep, batch: dict) -> dict:
    """The whole step's gradients with fused weight gradients (train/weight_grads.py) on against off (same weights,
    same batch): the largest relative error over the trainable tensors, and the loss of each."""
    out, grads = {"tokens": batch["input_ids_dev"].shape[1]}, {}
    for fused in (False, True):
        fuse_weight_grads(ours.draft, fused)
        loss, _, _ = ours.forward_loss(batch)
        loss.backward()
        out[f"loss_fused_{int(fused)}"] = loss.item()
        grads[fused] = [p.grad.float() for p in ours.params]
        ours.opt.zero_grad(set_to_none=True)
    out["grad_max_rel_err"] = max(rel_err(a, b) for a, b in zip(grads[True], grads[False]))
    return out


def attention_inputs(s: Shape, device: torch.device, tokens: int, seed: int):
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


def check_attention(s: Shape, device: torch.device, tokens: int, fast: str) -> dict:
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
    errs = [rel_err(a, b) for a, b in zip(results[fast], results["reference"])]
    return {"tokens": tokens, "steps": s.ttt, "fast": fast, "out_rel_err": errs[0], "grad_max_rel_err": max(errs[1:])}


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def run_method(name, build, s, tokens_list, device, used_ids, warmup, iters, peak_tflops, teacher_vocab, out):
    """Build the method once, time it at each T (largest last; an OOM is recorded and skipped)."""
    method = build()
    log.info("%s: %s trainable parameters", name, f"{method.trainable_params():,}")
    for tokens in tokens_list:
        batch = make_batch(s, tokens, device, used_ids)
        try:
            big = tokens >= 32768  # a few seconds per step: fewer repetitions
            seconds, peak = time_steps(lambda: method.step(batch), device, 1 if big else warmup, min(iters, 2) if big else iters)  # noqa: F821 (bound above; deleted only after the call)
            row = result_row(name, tokens, seconds, peak, flops_per_token(s, tokens, teacher_vocab), peak_tflops)
        except torch.OutOfMemoryError as err:
            row = {"method": name, "tokens": tokens, "error": "OOM: " + str(err).splitlines()[0][:200]}
        except Exception as err:  # noqa: BLE001 - a peer's failure must not end the run; it is recorded
            row = {"method": name, "tokens": tokens, "error": repr(err)[:300]}
        for p in getattr(method, "params", []):
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


def kimi_shaped_target_config(s: Shape) -> dict:
    """A DeepSeek-V3-style text config whose draft (Eagle3Config.from_target_config) is Shape's:
    MLA, so one key/value head per query head at the value head width."""
    return {"model_type": "deepseek_v3", "hidden_size": s.hidden, "num_attention_heads": s.heads, "kv_lora_rank": 512,
            "v_head_dim": s.head_dim, "qk_nope_head_dim": s.head_dim, "intermediate_size": s.intermediate,
            "vocab_size": s.vocab, "num_hidden_layers": 61, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
            "max_position_embeddings": 131072}


def write_kimi_shaped_run(run: Path, s: Shape, tokens: int, samples: int, used_ids: torch.Tensor) -> None:
    """RUN/hidden: `samples` samples of `tokens` tokens each (random bf16 states at the Kimi shape,
    target argmax 90% inside the draft vocabulary), written by eagleforge.shards.ShardWriter one
    sample per shard; RUN/vocab: d2t/t2d of `used_ids`, a random teacher head and embedding."""
    from eagleforge.shards import ShardWriter
    from eagleforge.vocab import TARGET_HEAD, VOCAB_MAP, save_vocab_file

    header = {"target": {"path": "kimi-shaped", "architecture": "DeepseekV3ForCausalLM", "num_layers": 61,
                         "hidden_size": s.hidden, "vocab_size": s.vocab, "config": kimi_shaped_target_config(s)},
              "aux_layer_ids": [1, 29, 57], "tokenizer": "none", "chat_template": None, "max_length": tokens,
              "has_target_argmax": True}
    writer = ShardWriter(run / "hidden", header, storage_dtype="bfloat16")
    for i in range(samples):
        batch = make_batch(s, tokens, torch.device("cpu"), used_ids, seed=100 + i)
        sample = {"input_ids": batch["input_ids"][0].int(), "loss_mask": batch["loss_mask"][0],
                  "aux_hidden_states": batch["aux"][0], "last_hidden_state": batch["last"][0],
                  "target_argmax": batch["target_argmax"][0].int()}
        writer.write_shard(i, [sample], [i])
    d2t = used_ids - torch.arange(s.draft_vocab)
    t2d = torch.zeros(s.vocab, dtype=torch.bool)
    t2d[used_ids] = True
    counts = t2d.long()
    gen = torch.Generator().manual_seed(7)
    meta = {"identity": "bench", "format": "pt"}
    (run / "vocab").mkdir(parents=True, exist_ok=True)
    save_vocab_file({"d2t": d2t, "t2d": t2d, "counts": counts}, run / "vocab" / VOCAB_MAP, meta)
    save_vocab_file({"lm_head": (torch.randn(s.draft_vocab, s.hidden, generator=gen) * s.hidden**-0.5).bfloat16(),
                     "embed_tokens": (torch.randn(s.vocab, s.hidden, generator=gen) * 0.02).bfloat16()},
                    run / "vocab" / TARGET_HEAD, meta)


def run_trainer(name: str, config_file: str | None, overrides: list[str], s: Shape, tokens_list: list[int],
                device: torch.device, used_ids: torch.Tensor, warmup: int, iters: int, peak_tflops: float,
                workdir: Path, out: list[dict], save=None) -> None:
    """The trainer's own step, Trainer.train_step(), as `make train` runs it with `config_file`'s
    train settings (+ `overrides`), at each T: on shards written by the project's writer (batches
    read, padded and copied ahead by the trainer's prefetch worker), then on the same first batch
    kept on the device ("synthetic batch": no reading at all). Two rows per T."""
    import shutil

    from eagleforge.config import load_config
    from eagleforge.train.loop import Trainer

    for tokens in tokens_list:
        big = tokens >= 32768
        steps_warm, steps_timed = (1, min(iters, 2)) if big else (warmup, iters)
        run = workdir / f"trainer-{tokens}"
        shutil.rmtree(run, ignore_errors=True)
        write_kimi_shaped_run(run, s, tokens, steps_warm + steps_timed, used_ids)
        cfg = load_config(config_file, [f"run_dir={run}", f"train.batch_tokens={tokens}", "train.holdout_samples=0",
                                        "train.epochs=4", f"train.device={device.type}", "train.save_every=0", *overrides])
        trainer = None
        for source in ("shards", "synthetic batch"):
            label = f"{name} ({source})"
            try:
                if trainer is None:
                    trainer = Trainer(cfg)
                if source == "synthetic batch":
                    # no reading at all: the feed is stopped and remade with a worker that hands
                    # over the same device batch for every slot (nothing read, padded or copied)
                    first = trainer.load_batch(trainer.schedule.epoch_batches(0)[0])
                    if trainer.feed is not None:
                        trainer.feed.close()
                        trainer.feed = None
                    trainer.read = lambda slot, first=first: first
                seconds, peak = time_steps(trainer.train_step, device, steps_warm, steps_timed)
                row = result_row(label, tokens, seconds, peak, flops_per_token(s, tokens, s.draft_vocab), peak_tflops)
                row["settings"] = {k: str(getattr(trainer, k, "")) for k in ("param_dtype", "parallel")}
                row["settings"].update(activation_checkpoint=trainer.step_plan.activation_checkpoint,
                                       compile=str(trainer.step_plan.compile), attention=cfg.train.attention,
                                       embedding="host" if trainer.host_embedding is not None else "device")
            except torch.OutOfMemoryError as err:
                row = {"method": label, "tokens": tokens, "error": "OOM: " + str(err).splitlines()[0][:200]}
            except Exception as err:  # noqa: BLE001 - recorded; the next T still runs
                row = {"method": label, "tokens": tokens, "error": repr(err)[:300]}
            log.info("%s", row)
            out.append(row)
            if save is not None:
                save()
        if trainer is not None:
            trainer.close()
        del trainer
        free_memory(device)
        shutil.rmtree(run, ignore_errors=True)


def varying_lengths(max_tokens: int, count: int, seed: int = 0) -> list[int]:
    """`count` lengths drawn uniformly from [max_tokens / 2, max_tokens] (seeded): the trainer's
    batches, whose T is the longest sample of each, change from step to step."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(max_tokens // 2, max_tokens + 1, (count,), generator=gen).tolist()


def run_varying(name, build, s, lengths, device, used_ids, peak_tflops, teacher_vocab, out):
    """One step at each of `lengths` in turn, every step timed (first-use costs of a new shape,
    such as cuDNN's plan per shape or a recompile, included): tokens/s over all of them."""
    method = build()
    batches = {t: make_batch(s, t, device, used_ids, seed=t) for t in sorted(set(lengths))}
    try:
        method.step(batches[lengths[0]])  # the first call's one-time setup (compile of the graphs) apart
        sync(device)
        t0 = time.perf_counter()
        for t in lengths:
            method.step(batches[t])
        sync(device)
        seconds = time.perf_counter() - t0
        total = sum(lengths)
        flops = sum(t * flops_per_token(s, t, teacher_vocab) for t in lengths)
        row = {"method": name, "tokens": f"{len(lengths)} lengths {min(lengths)}-{max(lengths)}",
               "step_ms": round(seconds * 1e3 / len(lengths), 1), "tokens_per_s": round(total / seconds),
               "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
               "GFLOP_per_token": round(flops / total / 1e9, 2), "TFLOPs": round(flops / seconds / 1e12, 1),
               "MFU": round(flops / seconds / 1e12 / peak_tflops, 3)}
    except Exception as err:  # noqa: BLE001 - recorded; the next variant still runs
        row = {"method": name, "tokens": "varying", "error": repr(err)[:300]}
    log.info("%s", row)
    out.append(row)
    del method, batches
    free_memory(device)


def memory_phases(method: "OurStep", batch: dict) -> dict:
    """GiB allocated at the start of each phase of one step and the peak inside it (forward +
    loss, backward, clip + optimizer): where the step's peak is, without the allocator trace."""
    sync(method.device)
    gib = lambda b: round(b / 2**30, 3)  # noqa: E731
    out = {"start": gib(torch.cuda.memory_allocated())}

    def phase(name, fn):
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        sync(method.device)
        out[f"{name}_peak"], out[f"{name}_end"] = gib(torch.cuda.max_memory_allocated()), gib(torch.cuda.memory_allocated())
        return result

    loss, _, _ = phase("forward_loss", lambda: method.forward_loss(batch))
    phase("backward", loss.backward)
    del loss

    def update():
        torch.nn.utils.clip_grad_norm_(method.params, GRAD_CLIP, foreach=True)
        method.opt.step()
        method.opt.zero_grad(set_to_none=True)

    phase("optimizer", update)
    return out


def profile_step(name: str, method, s: Shape, tokens: int, device: torch.device, used_ids: torch.Tensor) -> dict:
    """Diagnose one training step (after two warm-up steps): the top CUDA kernels, the GPU's
    kernel time against the step's wall time (a launch-bound step shows a gap), the calls where
    the host waits for the GPU, and the blocks live at the step's peak memory."""
    from torch.profiler import ProfilerActivity, profile

    batch = make_batch(s, tokens, device, used_ids)
    for _ in range(2):
        method.step(batch)
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        method.step(batch)
        sync(device)
    print(f"=== profile: {name}, T = {tokens}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
    kernel_ms = gpu_busy_ms(prof)
    wall_ms = time_steps(lambda: method.step(batch), device, 0, 3)[0] * 1e3
    out = {"method": name, "tokens": tokens, "step_ms": round(wall_ms, 1), "gpu_busy_ms": round(kernel_ms, 1)}
    print(f"GPU busy (union of its kernels' intervals) {out['gpu_busy_ms']} ms of a {out['step_ms']} ms step (unprofiled)",
          flush=True)
    if device.type != "cuda":
        return out
    out["host_syncs"] = host_syncs(lambda: method.step(batch))
    print(f"host syncs per step: {json.dumps(out['host_syncs'])}", flush=True)
    if isinstance(method, OurStep):
        out["memory_phases"] = memory_phases(method, batch)
        print(f"memory by phase (GiB): {json.dumps(out['memory_phases'])}", flush=True)
    if getattr(method, "compile", False):
        # torch 2.11: the allocator's history with python stacks breaks compiled code inside a
        # checkpoint (SystemError in the backward, pytorch/pytorch#179536)
        print("memory at the peak by source line: skipped (compiled variant; see pytorch#179536)")
        return out
    try:
        mem = memory_at_peak(lambda: method.step(batch))
    except Exception as err:  # a diagnostic: report it, keep the run
        print(f"memory at the peak by source line failed: {err!r}")
        return out
    out["memory"] = mem
    print(f"memory: {mem['base_GiB']} GiB before the step, peak +{mem['peak_delta_GiB']} GiB at {mem['peak_at']} "
          f"(pre-existing freed by then: {mem['freed_preexisting_GiB']} GiB); live at the peak, allocated in the step:")
    for where, gib, count in mem["groups"]:
        print(f"    {gib:8.3f} GiB  {count:5d} blocks  {where}")
    return out


def attention_bench(s: Shape, device: torch.device, tokens_list: list[int], modes: list[str], warmup: int,
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
        if "error" in r or r["method"].startswith("specforge") or "step_ms" not in r:
            continue
        ref = measured.get(r["tokens"])
        if ref:
            r["vs_specforge_speed"] = round(r["tokens_per_s"] / ref[0], 3)
            r["vs_specforge_memory"] = None if r["peak_GiB"] is None else round(r["peak_GiB"] / ref[1], 3)


def print_table(rows: list[dict]) -> None:
    attention = [r for r in rows if r["method"].startswith("attention")]
    if attention:
        print("| T | attention | ms (7 steps, fwd+bwd) | ms / step | TFLOP/s | peak GiB over inputs |")
        print("|---|---|---|---|---|---|")
        for r in attention:
            if "error" in r:
                print(f"| {r['tokens']} | {r['method']} | {r['error']} | | | |")
            else:
                print(f"| {r['tokens']} | {r['method']} | {r['ms_all_steps']} | {r['ms_per_step']} | {r['TFLOPs']} | "
                      f"{r['peak_GiB_over_inputs']} |")
    rows = [r for r in rows if not r["method"].startswith("attention")]
    if not rows:
        return
    print("| T | method | step ms | tokens/s | peak GiB | GFLOP/token | TFLOP/s | MFU | vs SpecForge: speed, memory |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["tokens"], r["method"])):
        if "error" in r:
            print(f"| {r['tokens']} | {r['method']} | {r['error']} | | | | | | |")
        else:
            vs = f"{r['vs_specforge_speed']}x, {r['vs_specforge_memory']}x" \
                if "vs_specforge_speed" in r else ""
            print(f"| {r['tokens']} | {r['method']} | {r['step_ms']} | {r['tokens_per_s']} | {r['peak_GiB']} | "
                  f"{r['GFLOP_per_token']} | {r['TFLOPs']} | {r['MFU']} | {vs} |")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--specforge-tokens", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    ap.add_argument("--no-specforge", action="store_true")
    ap.add_argument("--variants", nargs="*", default=None,
                    help="our step's configurations, each 'ckpt=..,attn=..,compile=0|1,packed=0|1' (default: DEFAULT_VARIANTS)")
    ap.add_argument("--ckpt", nargs="+", default=None, choices=["step", "none", "selective", "selective_all"],
                    help="old interface: one variant per value with --attention, no compile, per-step loss")
    ap.add_argument("--no-ckpt-max-tokens", type=int, default=16384, help="ckpt=none variants run only up to this T")
    ap.add_argument("--attention", default="fast", help="with --ckpt: our TTT attention mode (fast = auto = merged_cudnn on CUDA)")
    ap.add_argument("--attention-bench", action="store_true", help="only time the TTT attention modes (--attention-modes)")
    ap.add_argument("--no-attention-bench", action="store_true",
                    help="skip the TTT attention timing that otherwise runs first, before the step variants")
    ap.add_argument("--attention-modes", nargs="+", default=["flex", "merged", "merged+compile", "merged_cudnn+compile"],
                    help="ttt_attention modes; '+compile' fuses the merged mode's elementwise work")
    ap.add_argument("--attention-tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--embed-device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--chunk-tokens", type=int, default=None, help="fused loss rows per chunk (default: its budget)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=2048, help="T of the loss check (attention check: 1024)")
    ap.add_argument("--no-checks", action="store_true", help="skip the correctness checks at the start")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--profile", type=int, default=0, help="only profile one step of each variant at this T")
    ap.add_argument("--varying", type=int, default=0, metavar="N",
                    help="only time N steps of lengths varying in [T/2, T] (T = the largest --tokens), per variant: "
                         "the trainer's case, with each new shape's first-use costs")
    ap.add_argument("--trainer-configs", nargs="*", default=["configs/kimi_k25_b300.yaml"],
                    help="the trainer's rows: Trainer.train_step with each config's train settings (none: skip)")
    ap.add_argument("--trainer-overrides", nargs="*", default=[], help="key=value overrides for the trainer rows")
    ap.add_argument("--workdir", type=Path, default=Path("runs/bench_train"), help="where the trainer rows' shards go")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cpu-check", action="store_true", help="tiny shapes on the CPU (checks the script)")
    return ap.parse_args(argv)


@dataclasses.dataclass
class Bench:
    """One run's shape, device, step variants, draft-vocabulary ids and report (saved as it grows)."""

    args: argparse.Namespace
    shape: Shape
    device: torch.device
    variants: list
    used_ids: torch.Tensor
    report: dict

    def save(self) -> None:
        if self.args.json:
            self.args.json.parent.mkdir(parents=True, exist_ok=True)
            self.args.json.write_text(json.dumps(self.report, indent=1))

    def our_step(self, v: "Variant"):
        return v.step(self.shape, self.device, self.used_ids, self.args.embed_device, self.args.chunk_tokens)


def set_up(args: argparse.Namespace) -> Bench:
    """The shape and device (tiny on the CPU with --cpu-check), the step variants, the report."""
    if args.cpu_check:
        s, device = Shape.tiny(), torch.device("cpu")
        args.tokens, args.specforge_tokens, args.check_tokens = [64, 150], [64], 150
        args.attention_tokens, args.attention_modes = [64, 150], ["merged", "merged+compile", "sdpa"]
        args.warmup, args.iters, args.embed_device = 1, 1, "cpu"
        args.trainer_overrides = ["train.attention=merged", "train.compile=false", *args.trainer_overrides]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_train: no CUDA device (use --cpu-check on a CPU machine)")
        s, device = Shape(), torch.device("cuda")
        use_compiled_block_masks()
    if args.ckpt:
        variants = [Variant(ckpt=c, attn=args.attention) for c in args.ckpt]
    else:
        variants = [Variant.parse(v) for v in (DEFAULT_VARIANTS if args.variants is None else args.variants)]
    if args.cpu_check:  # no flex on the CPU; compile stays on when asked (inductor's C++ backend)
        variants = [dataclasses.replace(v, attn="merged" if v.attn == "flex" else v.attn) for v in variants]
    used_ids = torch.sort(torch.randperm(s.vocab, generator=torch.Generator().manual_seed(0))[: s.draft_vocab]).values
    report: dict = {"shape": vars(s), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
                    "variants": [v.name for v in variants], "results": [], "checks": {}}
    return Bench(args, s, device, variants, used_ids, report)


def varying_mode(b: Bench) -> None:
    """--varying N: N steps of lengths varying in [T/2, T] per variant."""
    lengths = varying_lengths(max(b.args.tokens), b.args.varying)
    for v in b.variants:
        run_varying(f"ours {v.name}", lambda v=v: b.our_step(v), b.shape, lengths, b.device, b.used_ids,
                    b.args.peak_tflops, b.shape.draft_vocab, b.report["results"])
        b.save()
    print_table(b.report["results"])


def profile_mode(b: Bench) -> None:
    """--profile T: one profiled step of each variant (and SpecForge's) at T."""
    for v in b.variants:
        method = b.our_step(v)
        b.report["results"].append(profile_step(f"ours {v.name}", method, b.shape, b.args.profile, b.device, b.used_ids))
        b.save()
        del method
        free_memory(b.device)
    if not b.args.no_specforge:
        b.report["results"].append(profile_step("specforge", SpecForgeStep(b.shape, b.device, b.used_ids), b.shape,
                                                b.args.profile, b.device, b.used_ids))
        b.save()


def correctness_checks(b: Bench) -> None:
    """Correctness first, at the real head shapes (small T for the explicit-mask attention reference)."""
    s, device, used_ids, args, checks = b.shape, b.device, b.used_ids, b.args, b.report["checks"]
    for mode in sorted({v.attn for v in b.variants} - {"reference"}):
        checks[f"attention_{mode}"] = check_attention(s, device, min(1024, args.check_tokens), mode)
        log.info("attention check: %s", checks[f"attention_{mode}"])
    ours = OurStep(s, device, used_ids, "none", b.variants[0].attn if b.variants else "auto", args.embed_device, args.chunk_tokens)
    checks["loss"] = check_loss(ours, make_batch(s, args.check_tokens, device, used_ids, seed=3))
    log.info("loss check: %s", checks["loss"])
    del ours
    free_memory(device)
    fused = next((v for v in b.variants if v.fusegrad), None)
    if fused:
        ours = OurStep(s, device, used_ids, fused.ckpt, fused.attn, args.embed_device, args.chunk_tokens, fused.compile,
                       fused.packed)
        checks["fusegrad"] = check_fused_weight_grads(ours, make_batch(s, min(1024, args.check_tokens), device, used_ids, seed=4))
        log.info("fused weight-gradient check: %s", checks["fusegrad"])
        del ours
    free_memory(device)
    b.save()


def timing_rows(b: Bench) -> None:
    """The trainer's rows per --trainer-configs, each step-only variant, then SpecForge's step."""
    s, device, used_ids, args, results = b.shape, b.device, b.used_ids, b.args, b.report["results"]
    for config_file in args.trainer_configs:
        run_trainer(f"trainer {Path(config_file).stem}", config_file, args.trainer_overrides, s, args.tokens, device,
                    used_ids, args.warmup, args.iters, args.peak_tflops, args.workdir, results, b.save)
    for v in b.variants:
        tokens = [t for t in args.tokens if v.ckpt != "none" or t <= args.no_ckpt_max_tokens]
        run_method(f"step-only {v.name}", lambda v=v: b.our_step(v), s, tokens, device, used_ids, args.warmup, args.iters,
                   args.peak_tflops, s.draft_vocab, results)
        versus_specforge(results)
        b.save()
    # SpecForge last: rows measured after it in the same process carried ~10 GiB more fixed
    # memory (most likely its model kept alive by compile caches), so nothing of ours follows it.
    if not args.no_specforge:
        try:
            import specforge  # noqa: F401
        except ImportError as err:
            results.append({"method": "specforge", "tokens": 0, "error": f"not installed: {err}"})
        else:
            run_method("specforge 0.2.0", lambda: SpecForgeStep(s, device, used_ids), s, args.specforge_tokens, device,
                       used_ids, args.warmup, args.iters, args.peak_tflops, s.vocab, results)
        versus_specforge(results)
        b.save()


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    b = set_up(args)
    if args.attention_bench or not (args.no_attention_bench or args.profile or args.varying):
        b.report["results"] = attention_bench(b.shape, b.device, args.attention_tokens, args.attention_modes, args.warmup, args.iters)
        b.save()
        if args.attention_bench:
            print_table(b.report["results"])
            return b.report
    if args.varying:
        varying_mode(b)
        return b.report
    if args.profile:
        profile_mode(b)
        return b.report
    if not args.no_checks:
        correctness_checks(b)
    timing_rows(b)
    print_table(b.report["results"])
    print(json.dumps(b.report["checks"]))
    return b.report


if __name__ == "__main__":
    main()
