"""The Kimi-K2.5 shapes every benchmark and test uses, and a Kimi-shaped model built in memory
with random weights (no download).

One table: the target's text config is the product's (extract/native/plan.py
`KIMI_K25_TEXT_CONFIG`, docs/kimi-k25.md); the draft side (draft vocabulary, TTT steps, aux
layers) is configs/kimi_k25_b300.yaml's, and `DraftShape.kimi()` is the draft the trainer derives
from both (Eagle3Config.from_target_config). `TINY_TEXT`: the same structure at toy size.

The model (`build_bench_model(kimi_args(num_layers=4), device="cuda")`): INT4 group-32 experts
(random nibbles, scales giving weights of std ~0.02), only the layer count cut (default 1 dense +
3 MoE); drawn on the device, a 4-layer model (~37 GB) builds in seconds on a GPU. Not part of the
installed package: benchmarks and tests put benchmarks/ on sys.path.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import ROOT, import_eagleforge  # noqa: E402

import_eagleforge()
from eagleforge.config import load_config  # noqa: E402
from eagleforge.draft import Eagle3Config  # noqa: E402
from eagleforge.extract.native.model import DeepseekV3ForExtraction, ModelArgs  # noqa: E402
from eagleforge.extract.native.parallel import TensorParallel, tensor_parallel  # noqa: E402
from eagleforge.extract.native.plan import KIMI_K25_TEXT_CONFIG  # noqa: E402
from eagleforge.layout import Layout, init_layout, use_expandable_segments, world_size_from_env  # noqa: E402

KIMI_K25_TEXT = KIMI_K25_TEXT_CONFIG
# one MoE layer: hidden, expert width, routed experts, experts per token
KIMI_MOE = tuple(KIMI_K25_TEXT[k] for k in ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"))
KIMI_CONFIG = ROOT / "configs" / "kimi_k25_b300.yaml"
TINY_TEXT = {**KIMI_K25_TEXT, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 192, "moe_intermediate_size": 64,
             "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 16, "num_experts_per_tok": 4,
             "kv_lora_rank": 64, "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}


@dataclasses.dataclass(frozen=True)
class DraftShape:
    """The draft's dimensions as the trainer builds them from a target text config, with the TTT
    steps and aux layers of its training."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    ttt: int
    aux_layers: tuple
    text: dict = dataclasses.field(repr=False, compare=False)  # the target's text config

    @classmethod
    def of(cls, text: dict, draft_vocab: int, ttt: int, aux_layers) -> "DraftShape":
        c = Eagle3Config.from_target_config(text, draft_vocab, aux_layers)
        return cls(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
                   c.vocab_size, c.draft_vocab_size, ttt, tuple(aux_layers), text)

    @classmethod
    def kimi(cls) -> "DraftShape":
        """Kimi-K2.5's draft: hidden 7168, 64 heads of 128 (MLA: as many kv heads), intermediate
        18432, vocabulary 163840, draft vocabulary 32000, 7 TTT steps, aux layers [1, 29, 57]."""
        cfg = load_config(KIMI_CONFIG)
        return cls.of(KIMI_K25_TEXT, cfg.vocab.draft_vocab_size, cfg.train.ttt_steps, cfg.extract.aux_layers)

    @classmethod
    def tiny(cls) -> "DraftShape":
        return cls.of({**TINY_TEXT, "num_hidden_layers": 4}, 97, 3, [0, 1, 2])

    def draft_config(self) -> Eagle3Config:
        return Eagle3Config.from_target_config(self.text, self.draft_vocab, list(self.aux_layers))


def bench_layout(cpu_check: bool) -> tuple[Layout, TensorParallel]:
    """The job (one process, or torchrun's) as one tensor-parallel group over all its ranks, on
    the GPUs (NCCL, the allocator set up as extraction sets it) or on the CPU (gloo)."""
    if not cpu_check:
        use_expandable_segments()
    layout = init_layout("cpu" if cpu_check else "cuda", tp=world_size_from_env())
    return layout, tensor_parallel(layout)


def kimi_args(num_layers: int = 4, text: dict = KIMI_K25_TEXT, **overrides) -> ModelArgs:
    """Kimi-K2.5's text shape with `num_layers` layers (the first `first_k_dense_replace` dense)."""
    return dataclasses.replace(ModelArgs.from_config({**text, "num_hidden_layers": num_layers}), **overrides)


def tiny_args(num_layers: int = 3) -> ModelArgs:
    """The same structure at toy size (CPU checks of the benchmark scripts)."""
    return kimi_args(num_layers, TINY_TEXT)


def random_rows(vocab: int, batch_tokens: int, length: int, batches: int, seed: int = 0) -> list[dict]:
    """`batches` batches' worth of extraction rows {"id", "input_ids", "loss_mask"}: batch_tokens //
    length samples of `length` random ids per batch (the same on every rank: drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    return [{"id": j, "input_ids": torch.randint(0, vocab, (length,), generator=gen).tolist(), "loss_mask": [1] * length}
            for j in range(max(1, batch_tokens // length) * batches)]


@torch.no_grad()
def randomize_(model: DeepseekV3ForExtraction, seed: int = 0, std: float = 0.02) -> DeepseekV3ForExtraction:
    """Fill every weight in place: normal(0, std) for matrices, random nibbles for INT4 experts.

    INT4 nibbles are uniform over [-8, 7] (std about 4.6), so scales of std / 4.6 give dequantized
    weights of std ~`std`; norms stay 1 and the router's correction bias small, so routing is
    close to uniform over experts (the load a balanced real router sees). Each tensor draws from
    its own seed (from its name), so every tp rank holds the same replicated weights and routes
    the same way.
    """
    gen = torch.Generator(device=next(model.buffers()).device)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("inv_freq") or name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            continue
        # one stream per tensor name: replicated tensors (q_a, kv_a, router) get the same numbers
        # on every tensor-parallel rank whatever the shapes of the sharded tensors drawn before
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if t.dtype == torch.int32:  # packed nibbles: all 32 bits random
            t.copy_(torch.randint(-2**31, 2**31 - 1, t.shape, generator=gen, device=t.device, dtype=torch.int64).to(torch.int32))
        elif name.endswith("_scale"):
            t.copy_(torch.rand(t.shape, generator=gen, device=t.device).mul_(0.2).add_(0.9).mul_(std / 4.6))
        elif name.endswith("e_score_correction_bias"):
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device) * 1e-3)
        else:
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).mul_(std))
    return model


def build_bench_model(args: ModelArgs, device: str | torch.device = "cuda", tp: TensorParallel | None = None,
                      layout: str = "ep", dtype: torch.dtype = torch.bfloat16, quantized: bool = True,
                      seed: int = 0) -> DeepseekV3ForExtraction:
    """This rank's share of a random Kimi-shaped model on `device` (eval, no grad)."""
    with torch.device(device):
        model = DeepseekV3ForExtraction(args, tp or TensorParallel(), layout, dtype, quantized)
    # every rank draws the same full-model numbers for replicated weights: same seed everywhere
    return randomize_(model.eval().requires_grad_(False), seed)
