"""DeepSeek-V3 / Kimi-K2.5 forward math for extraction (prefill only, no KV cache).

Communication-free: every cut across ranks is a layer from parallel.py (column/row-parallel
linears, vocab-parallel embedding and head, the block all-reduce), so this file reads as
single-GPU code. Module and parameter names are transformers' DeepseekV3ForCausalLM names
(`model.layers.3.self_attn.q_b_proj.weight`), so the checkpoint maps onto it name for name,
except the routed experts, which are stacked per layer (`RoutedExperts`).

Shapes: B batch, T tokens, H hidden, n local heads (heads / tp), E_l local experts, I_l local
intermediate. The forward returns the final-normed state at ALL positions, and the decoder
layers are `model.layers` (a `LayerStack`, keyed by global layer id, so a model holding only
some layers keeps the checkpoint's names and the capture's layer ids) with `model.norm` after
them, so capture hooks see every position of every layer.

Numerics follow transformers (the reference the tests compare against), which matches
DeepSeek's own inference code: RMSNorm in fp32, router in fp32, YaRN frequencies in fp32,
softmax scale qk_head_dim^-0.5 * mscale^2, and q_a/kv_a layernorm eps 1e-6 (`latent_norm_eps`;
vLLM uses the config's rms_norm_eps there instead, 1e-5 for Kimi-K2.5: a difference far below
bf16 resolution since the latent's mean square is many orders above either eps).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from eagleforge.config import check_model_sizes
from eagleforge.draft.config import rope_theta_conflict
from eagleforge.errors import UserInputError
from eagleforge.extract.native import int4
from eagleforge.extract.native.parallel import (
    AllReduce,
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    expert_partition,
)
from eagleforge.kernels import int4_moe
from eagleforge.kernels.rms_norm import rms_norm
from eagleforge.modes import MOE_BACKENDS, PREFILL_ATTENTION_MODES

log = logging.getLogger(__name__)


@dataclass
class ModelArgs:
    """The language model's shape, from a deepseek_v3 text config (see `from_config`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    latent_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # How the model runs, not its shape (target.prefill_attention / target.moe_backend; never read
    # from a checkpoint's config): see PREFILL_BACKENDS and MOE_BACKENDS.
    prefill_attention: str = "auto"
    moe_backend: str = "auto"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_config(cls, text_config: dict, source: str = "config.json") -> "ModelArgs":
        """Read a deepseek_v3 text config dict; refuse what this backend does not compute."""
        checks = {"hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
        for key, expected in checks.items():
            value = text_config.get(key, expected)
            if value != expected:
                raise UserInputError(f"{source}: {key} = {value!r} is not supported by the native backend (expects {expected!r})")
        if text_config.get("attention_bias", False):
            raise UserInputError(f"{source}: attention_bias = true is not supported by the native backend")
        check_model_sizes(text_config, source)  # before any number sizes a loop or a tensor
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {k: text_config[k] for k in fields if k in text_config and k not in ("rope_scaling", "latent_norm_eps", "prefill_attention", "moe_backend")}
        required = [k for k, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in kwargs]
        if missing:
            raise UserInputError(f"{source}: missing keys {missing} in the text config")
        conflict = rope_theta_conflict(text_config.get)
        if conflict:
            raise UserInputError(f"{source}: {conflict}")
        rope = dict(text_config.get("rope_scaling") or text_config.get("rope_parameters") or {})
        if "rope_theta" in rope and "rope_theta" not in text_config:
            kwargs["rope_theta"] = rope["rope_theta"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise UserInputError(f"{source}: rope_scaling type {rope_type!r} is not supported (default or yarn)")
        kwargs["rope_scaling"] = rope if rope_type == "yarn" else {}
        if kwargs.get("n_group") is None:
            kwargs["n_group"] = 1
        if kwargs.get("topk_group") is None:
            kwargs["topk_group"] = 1
        _check_routing(kwargs, source)
        return cls(**kwargs)


def _check_routing(sizes: dict, source: str) -> None:
    """The counts that must fit each other: the experts a token takes among those there are, the
    expert groups, the dense layers among the layers; each within its own bound already."""
    experts, groups = sizes["n_routed_experts"], sizes["n_group"]
    relations = [
        ("num_experts_per_tok", sizes["num_experts_per_tok"], "n_routed_experts", experts),
        ("topk_group", sizes["topk_group"], "n_group", groups),
        ("first_k_dense_replace", sizes["first_k_dense_replace"], "num_hidden_layers", sizes["num_hidden_layers"]),
    ]
    for key, value, of, most in relations:
        if value > most:
            raise UserInputError(f"{source}: {key} = {value} is more than {of} = {most}")
    if experts % groups:
        raise UserInputError(f"{source}: n_routed_experts = {experts} does not split into n_group = {groups} equal groups")


# ---------------------------------------------------------------------------- RoPE (YaRN)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim/2] fp32, cos/sin scale), YaRN as DeepSeek-V3 and transformers."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # wavelength / 2pi, [dim/2]
    rope = args.rope_scaling
    if not rope:
        return 1.0 / pos_freqs, 1.0
    factor = rope["factor"]
    original = rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength makes `rotations` turns over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0 (high frequencies): extrapolate (keep); ramp 1 (low frequencies): interpolate by
    # `factor`. Written in the reference's operation order so fp32 rounding matches it bit for bit.
    keep = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def softmax_scale(args: ModelArgs) -> float:
    """qk_head_dim^-0.5, times mscale^2 under YaRN (mscale = 0.1 * mscale_all_dim * ln(factor) + 1)."""
    scale = args.qk_head_dim ** -0.5
    mscale_all_dim = args.rope_scaling.get("mscale_all_dim", 0) if args.rope_scaling else 0
    if mscale_all_dim:
        scale *= _yarn_mscale(args.rope_scaling["factor"], mscale_all_dim) ** 2
    return scale


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x [B, T, h, d] by angles cos/sin [T, d/2]; layout kept interleaved."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, d/2] broadcasts over heads
    return torch.stack((x_even * cos - x_odd * sin, x_odd * cos + x_even * sin), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.shard_spec: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' DeepseekV3RMSNorm; one Triton pass on CUDA (eagleforge.kernels.rms_norm)
        return rms_norm(x, self.weight, self.eps)


# Query rows per chunk where the attention runs unfused (CPU, fp32): the math kernel holds
# [n, chunk, T] scores. The fused CUDA kernels need no chunks (their memory is linear in T).
ATTENTION_CHUNK_TOKENS = 8192
# Prefill attention kernel on CUDA (bf16/fp16), measured by benchmarks/bench_prefill_attention.py
# (BENCHMARKS.md, "Prefill attention"):
#   auto        cuDNN's fused attention, one causal call, v at its own head dim (MLA: 128, no
#               padding to 192); where cuDNN refuses the inputs, flash_attn's kernel when the
#               package is installed, else FlashAttention-2 through SDPA with v padded
#   cudnn       the same as auto (the name says what is wanted)
#   flash       torch SDPA's own choice with v padded to d_qk (FlashAttention-2 for one causal
#               call in bf16), one call, or query chunks when chunk_tokens is given
#   flash_attn  the flash_attn package's kernel with v padded, one call or chunks as flash
PREFILL_BACKENDS = PREFILL_ATTENTION_MODES
_cudnn_refused: set[tuple] = set()  # (dtype, shapes) cuDNN refused once: not asked again


def _flash_attn_func():
    """flash_attn.flash_attn_func when the package is installed (CUDA only), else None."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def _cudnn_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """cuDNN's causal attention in one call, v unpadded: [B, T, n, d_v], or None where cuDNN
    refuses these inputs (then remembered, and the caller falls back)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    key = (q.dtype, tuple(q.shape), tuple(v.shape), q.device.index)
    if key in _cudnn_refused:
        return None
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, is_causal=True
            ).transpose(1, 2)  # [B, n, T, d_v] -> [B, T, n, d_v]
    except torch.OutOfMemoryError:
        raise  # not a refusal: the fallback pads v and needs more
    except RuntimeError as err:
        _cudnn_refused.add(key)
        log.warning("cuDNN attention refused q %s v %s (%s); prefill attention falls back to FlashAttention-2",
                    tuple(q.shape), tuple(v.shape), str(err).splitlines()[0][:200])
        return None


def _chunked_attention(q, k, v, scale: float, chunk: int, flash) -> torch.Tensor:
    """Query chunks [s, e) over keys [0, e), causal diagonal at the chunk's bottom right:
    flash_attn's kernel when given, else SDPA (causal_lower_right for chunks after the first).
    On CUDA, v is zero-padded to d_qk (the flash kernels want one head dim) and cut back."""
    T, d_v = q.shape[1], v.shape[-1]
    if q.is_cuda and d_v < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - d_v))
    out = torch.empty(q.shape[:-1] + (d_v,), dtype=q.dtype, device=q.device)
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        if flash is not None:  # [B, t, n, d] layout, bottom-right causal alignment
            part = flash(q[:, s:e], k[:, :e], v[:, :e], softmax_scale=scale, causal=True)
        else:
            mask = {"is_causal": True} if s == 0 else {"attn_mask": causal_lower_right(e - s, e)}
            part = F.scaled_dot_product_attention(
                q[:, s:e].transpose(1, 2), k[:, :e].transpose(1, 2), v[:, :e].transpose(1, 2), scale=scale, **mask
            ).transpose(1, 2)  # [B, n, t, d] -> [B, t, n, d]
        out[:, s:e] = part[..., :d_v]
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      chunk_tokens: int | None = None, backend: str | None = None) -> torch.Tensor:
    """Causal attention over a whole prompt: q, k [B, T, n, d_qk], v [B, T, n, d_v] -> [B, T, n, d_v].

    Right padding only, so a causal mask is all a batch needs. backend: one of PREFILL_BACKENDS
    (the model passes target.prefill_attention). On CUDA in bf16/fp16 the
    whole prompt is one fused call unless chunk_tokens is given (the chunks' bottom-right mask
    sends SDPA to a slower kernel than one causal call; measured: BENCHMARKS.md, "Prefill
    attention"); elsewhere queries go in chunks of chunk_tokens (default ATTENTION_CHUNK_TOKENS) so
    the math kernel's scores stay bounded.
    """
    backend = backend or "auto"
    if backend not in PREFILL_BACKENDS:
        raise UserInputError(f"prefill attention backend {backend!r} is not one of {PREFILL_BACKENDS} (target.prefill_attention)")
    fused = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    if not fused:
        return _chunked_attention(q, k, v, scale, chunk_tokens or ATTENTION_CHUNK_TOKENS, None)
    if backend in ("auto", "cudnn") and chunk_tokens is None:
        out = _cudnn_causal(q, k, v, scale)
        if out is not None:
            return out
    flash = _flash_attn_func() if backend in ("auto", "cudnn", "flash_attn") else None
    if backend == "flash_attn" and flash is None:
        raise UserInputError("prefill attention backend 'flash_attn' needs the flash_attn package (pip install flash-attn)")
    return _chunked_attention(q, k, v, scale, chunk_tokens or max(q.shape[1], 1), flash)


class MLA(nn.Module):
    """Multi-head latent attention, this rank's heads; o_proj all-reduces (one per block)."""

    def __init__(self, args: ModelArgs, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        self.args = args
        heads = args.num_attention_heads
        if heads % tp.size:
            raise UserInputError(f"num_attention_heads = {heads} cannot be split over tp = {tp.size} ranks; choose a tp that divides it")
        self.n_local_heads = heads // tp.size
        H, qk, what = args.hidden_size, args.qk_head_dim, "num_attention_heads"
        if args.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(H, args.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.latent_norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(args.q_lora_rank, heads * qk, tp, dtype, what, unit=qk)
        else:
            self.q_proj = ColumnParallelLinear(H, heads * qk, tp, dtype, what, unit=qk)
        self.kv_a_proj_with_mqa = ReplicatedLinear(H, args.kv_lora_rank + args.qk_rope_head_dim, dtype)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.latent_norm_eps, dtype)
        kv_unit = args.qk_nope_head_dim + args.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(args.kv_lora_rank, heads * kv_unit, tp, dtype, what, unit=kv_unit)
        self.o_proj = RowParallelLinear(heads * args.v_head_dim, H, tp, dtype, what, reduce=True, unit=args.v_head_dim)
        self.scale = softmax_scale(args)
        self.tp = tp

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The replicated (per-token, head-independent) part: x [N, H] -> normed kv latent
        [N, kv_lora], the shared rope key before rope [N, rope], and with q_lora the normed q
        latent [N, q_lora]."""
        a = self.args
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        out = (self.kv_a_layernorm(latent), k_rope)
        return out + (self.q_a_layernorm(self.q_a_proj(x)),) if a.q_lora_rank else out

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, n = self.args, self.n_local_heads
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        # each rank computes 1/tp of the tokens' latents, gathered (else every rank repeats them)
        kv_latent, k_rope, *q_latent = self.tp.split_rows(self.latents, flat, min_rows=self.tp.split_rows_min_tokens)
        q = self.q_b_proj(q_latent[0]) if a.q_lora_rank else self.q_proj(flat)
        q_nope, q_rope = q.view(B, T, n, a.qk_head_dim).split([a.qk_nope_head_dim, a.qk_rope_head_dim], -1)
        # normed kv latent [B*T, kv_lora] + one shared rope key, here [B, T, 1, rope]
        k_rope = apply_rope_interleaved(k_rope.view(B, T, 1, a.qk_rope_head_dim), cos, sin)
        kv = self.kv_b_proj(kv_latent).view(B, T, n, a.qk_nope_head_dim + a.v_head_dim)
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], -1)
        q = torch.cat([q_nope, apply_rope_interleaved(q_rope, cos, sin)], -1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, n, -1)], -1)
        out = prefill_attention(q, k, v, self.scale, backend=self.args.prefill_attention)  # [B, T, n, v_head]
        return self.o_proj(out.reshape(B, T, n * a.v_head_dim))


class MLP(nn.Module):
    """SiLU-gated MLP cut along its intermediate dim; `reduce` = all-reduce its output here."""

    def __init__(self, dim: int, intermediate: int, tp: TensorParallel, dtype: torch.dtype, reduce: bool, what: str):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(dim, intermediate, tp, dtype, what)
        self.up_proj = ColumnParallelLinear(dim, intermediate, tp, dtype, what)
        self.down_proj = RowParallelLinear(intermediate, dim, tp, dtype, what, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# torch.mm(..., out_dtype=) (bf16 inputs, fp32 output) exists on CUDA in torch >= 2.8.
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


class Router(nn.Module):
    """noaux_tc: sigmoid scores; the correction bias only chooses experts (per group first)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts, dtype=torch.float32), requires_grad=False)
        self.shard_spec: dict = {}

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> router logits [N, E] in fp32 (transformers keeps the router in fp32).

        bf16 x and weight on CUDA: one bf16 GEMM with fp32 output. Products of two bf16 numbers
        are exact in fp32 and the tensor cores accumulate in fp32, so this is the fp32 GEMM's
        result up to summation order, at tensor-core speed and without an fp32 copy of x (the
        fp32 GEMM against this one: BENCHMARKS.md, "INT4 MoE layer", routers alone)."""
        if x.is_cuda and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16 and _MM_OUT_DTYPE:
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.weight.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] fp32, expert ids [N, k])."""
        a = self.args
        scores = self.logits(x).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias
        if a.n_group > 1:
            # a group's score is the sum of its two best experts; keep the best topk_group groups
            grouped = choice.view(x.shape[0], a.n_group, a.n_routed_experts // a.n_group)  # explicit: N may be 0
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(a.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        ids = choice.topk(a.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)  # from the unbiased scores
        if a.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * a.routed_scaling_factor, ids


class RoutedExperts(nn.Module):
    """This rank's routed experts, stacked: ids [start, end), intermediate slice [i0, i1).

    INT4 (`quantized`): gate/up packed int32 [E_l, I_l, H/8] + bf16 scales [E_l, I_l, H/32],
    down packed [E_l, H, I_l/8] + scales [E_l, H, I_l/32]. Else plain weights of the model dtype.
    """

    PROJS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, args: ModelArgs, tp: TensorParallel, layout: str, dtype: torch.dtype, quantized: bool):
        super().__init__()
        (self.start, self.end), (self.i0, self.i1) = expert_partition(
            args.n_routed_experts, args.moe_intermediate_size, tp, layout, int4.GROUP_SIZE if quantized else 1
        )
        self.quantized, self.dtype = quantized, dtype
        self.backend = args.moe_backend  # one of MOE_BACKENDS
        E, H, I = self.end - self.start, args.hidden_size, self.i1 - self.i0
        shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
        for proj, (rows, cols) in shapes.items():
            if quantized:
                self.register_buffer(f"{proj}_packed", torch.empty(E, rows, cols // int4.PACK_FACTOR, dtype=torch.int32))
                self.register_buffer(f"{proj}_scale", torch.empty(E, rows, cols // int4.GROUP_SIZE, dtype=torch.bfloat16))
            else:
                self.register_buffer(f"{proj}_weight", torch.empty(E, rows, cols, dtype=dtype))

    def weight(self, proj: str, local_expert: int) -> torch.Tensor:
        """One expert's [out, in] weight in the compute dtype (dequantized just in time)."""
        if self.quantized:
            packed = getattr(self, f"{proj}_packed")[local_expert]
            return int4.dequantize_int4(packed, getattr(self, f"{proj}_scale")[local_expert], self.dtype)
        return getattr(self, f"{proj}_weight")[local_expert]


# Routed-expert implementation (target.moe_backend, MOE_BACKENDS): "auto" = the Triton W4A16 kernel for INT4
# experts on CUDA in bf16, else the loop below; "triton", "grouped_mm" (dequantize all,
# torch._grouped_mm) or "loop" force one.


def routed_experts_forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: RoutedExperts,
                           add: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [N, H], router weights/ids [N, k] -> this rank's partial sum [N, H] (fp32 or wider),
    or, with out_dtype, (that sum + add [N, H]) rounded once to out_dtype.

    The one place the expert matmuls happen. INT4 experts on CUDA go through
    eagleforge.kernels.int4_moe (tokens sorted by expert, fused dequantize + grouped GEMM; its
    combine adds `add` and rounds in the same pass); elsewhere (CPU, float64 tests, bf16
    experts) `routed_experts_loop`.
    """
    if add is not None and out_dtype is None:
        raise ValueError("routed_experts_forward: `add` needs `out_dtype` (the sum is rounded once, with it)")
    if out_dtype is not None:
        if _triton_experts(x, experts):
            return _int4_triton(x, weights, ids, experts, add=add, out_dtype=out_dtype)
        routed = routed_experts_forward(x, weights, ids, experts)
        return (routed if add is None else routed + add.to(routed.dtype)).to(out_dtype)
    backend = _moe_backend(x, experts)
    if backend == "loop" or not experts.quantized:
        return routed_experts_loop(x, weights, ids, experts)
    if backend == "triton":
        return _int4_triton(x, weights, ids, experts)
    if backend == "grouped_mm":
        return int4_moe.int4_moe_grouped_mm(x, weights, ids, *_packs(experts), expert_start=experts.start).float()
    raise UserInputError(f"target.moe_backend = {backend!r}: expected one of {MOE_BACKENDS}")


def _moe_backend(x: torch.Tensor, experts: RoutedExperts) -> str:
    if experts.backend != "auto":
        return experts.backend
    fast = experts.quantized and x.is_cuda and x.dtype == torch.bfloat16 and int4_moe.HAS_TRITON and _kernel_dims(experts)
    return "triton" if fast else "loop"


def _kernel_dims(experts: RoutedExperts) -> bool:
    """Whether the Triton kernel takes these experts' dims (Kimi-K2.5's do; small test models may not)."""
    intermediate, hidden = experts.gate_proj_packed.shape[1], experts.gate_proj_packed.shape[2] * int4_moe.PACK_FACTOR
    return int4_moe.supports(hidden, intermediate, hidden // experts.gate_proj_scale.shape[2],
                             intermediate // experts.down_proj_scale.shape[2])


def _triton_experts(x: torch.Tensor, experts: RoutedExperts) -> bool:
    return experts.quantized and _moe_backend(x, experts) == "triton"


def _packs(experts: RoutedExperts) -> list[torch.Tensor]:
    return [getattr(experts, f"{proj}_{part}") for proj in experts.PROJS for part in ("packed", "scale")]


def _int4_triton(x, weights, ids, experts: RoutedExperts, **kwargs) -> torch.Tensor:
    return int4_moe.int4_moe(x, weights, ids, *_packs(experts), expert_start=experts.start, **kwargs)


def routed_experts_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: RoutedExperts) -> torch.Tensor:
    """The plain path: tokens sorted by expert, each local expert dequantized and applied in turn."""
    acc = torch.promote_types(x.dtype, torch.float32)  # bf16 experts accumulate in fp32
    out = torch.zeros(x.shape[0], x.shape[1], dtype=acc, device=x.device)
    flat_ids = ids.flatten()  # [N*k]
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=experts.end).tolist()
    tokens = order // ids.shape[1]  # the token of each sorted (token, slot) pair
    begin = sum(counts[: experts.start])
    for local, count in enumerate(counts[experts.start:experts.end]):
        if count == 0:
            continue
        rows = order[begin:begin + count]
        token = tokens[begin:begin + count]
        h = x[token]
        h = F.silu(F.linear(h, experts.weight("gate_proj", local))) * F.linear(h, experts.weight("up_proj", local))
        y = F.linear(h, experts.weight("down_proj", local))
        out.index_add_(0, token, y.to(acc) * weights.flatten()[rows].unsqueeze(-1).to(acc))
        begin += count
    return out


class MoE(nn.Module):
    """Routed experts (this rank's share) + the shared expert, summed, then one all-reduce."""

    def __init__(self, args: ModelArgs, tp: TensorParallel, layout: str, dtype: torch.dtype, quantized: bool):
        super().__init__()
        self.gate = Router(args, dtype)
        self.experts = RoutedExperts(args, tp, layout, dtype, quantized)
        shared = args.moe_intermediate_size * args.n_shared_experts
        self.shared_experts = MLP(args.hidden_size, shared, tp, dtype, reduce=False, what="shared expert intermediate size")
        self.reduce = AllReduce(tp)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [B*T, H]
        weights, ids = self.tp.split_rows(self.gate, flat, min_rows=self.tp.split_rows_min_tokens)  # each rank routes 1/tp of the tokens
        # routed (fp32 sum over slots) + shared, rounded once to x's dtype; one pass on the GPU
        y = routed_experts_forward(flat, weights, ids, self.experts, add=self.shared_experts(flat), out_dtype=x.dtype)
        return self.reduce(y).view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, tp: TensorParallel, layout: str, dtype: torch.dtype, quantized: bool):
        super().__init__()
        self.self_attn = MLA(args, tp, dtype)
        if layer_id >= args.first_k_dense_replace:
            self.mlp = MoE(args, tp, layout, dtype, quantized)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, tp, dtype, reduce=True, what="intermediate_size")
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LayerStack(nn.ModuleDict):
    """Decoder layers keyed by their global layer id (0-indexed, as in the checkpoint's
    `model.layers.{i}` and the aux-layer convention), in ascending order; indexed by int."""

    def __getitem__(self, layer_id: int | str) -> nn.Module:
        return super().__getitem__(str(layer_id))

    def __contains__(self, layer_id: int | str) -> bool:
        return super().__contains__(str(layer_id))

    def ids(self) -> list[int]:
        return [int(key) for key in self.keys()]


class DeepseekV3TextModel(nn.Module):
    """Embedding, decoder layers, final norm: the `model.` part of the checkpoint. A pipeline
    stage holds `layers` only, the embedding on the first stage (`first`), the final norm on the
    last (`last`); by default the whole model."""

    def __init__(self, args: ModelArgs, tp: TensorParallel, layout: str, dtype: torch.dtype, quantized: bool,
                 layers: range | None = None, first: bool = True, last: bool = True):
        super().__init__()
        self.args = args
        layers = range(args.num_hidden_layers) if layers is None else layers
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp, dtype) if first else None
        self.layers = LayerStack({str(i): DecoderLayer(args, i, tp, layout, dtype, quantized) for i in layers})
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype) if last else None
        inv_freq, self.rope_scale = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope/2] of positions 0..T-1 (right-padded rows all start at 0), in `dtype`."""
        positions = torch.arange(length, device=self.inv_freq.device, dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq.float()[None, :]  # [T, rope/2], fp32 like the reference
        return (angles.cos() * self.rope_scale).to(dtype), (angles.sin() * self.rope_scale).to(dtype)

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [B, T, H] through this model's decoder layers, in layer order."""
        cos, sin = self.rope(x.shape[1], x.dtype)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        return x

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] (right-padded) -> final-normed hidden states [B, T, H], all positions."""
        return self.norm(self.run_layers(self.embed_tokens(input_ids)))


class DeepseekV3ForExtraction(nn.Module):
    """`model` + a vocab-parallel `lm_head` used only for the target's greedy token (on the last
    pipeline stage). `layers`, `first`, `last`: one pipeline stage's share, default all."""

    def __init__(self, args: ModelArgs, tp: TensorParallel, layout: str = "ep", dtype: torch.dtype = torch.bfloat16,
                 quantized: bool = True, layers: range | None = None, first: bool = True, last: bool = True):
        super().__init__()
        self.args, self.tp, self.layout, self.quantized = args, tp, layout, quantized
        self.first, self.last = first, last
        self.model = DeepseekV3TextModel(args, tp, layout, dtype, quantized, layers, first, last)
        self.lm_head = VocabParallelHead(args.vocab_size, args.hidden_size, tp, dtype) if last else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def greedy_tokens(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N] int32: argmax of the full-vocabulary logits."""
        return self.lm_head.argmax(normed_hidden)
