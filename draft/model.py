"""The EAGLE-3 draft: one Llama decoder layer over [token embedding ; fused target state].

    embed_tokens [V, H] (the target's, frozen)      fc [H, k*Ht] (fuses the k aux states)
    fuse:      h = fc(aux)  (fc_norm: fc(cat_i fc_norm[i](aux_i)), aux_i [.., Ht])  (B, T, H)
    midlayer:  x = cat(input_layernorm(embed(token)), hidden_norm(h))          (B, T, 2H)
               r = h  (norm_before_residual: r = hidden_norm(h))               (B, T, H)
               r = r + o_proj(attn(q/k/v_proj(x), RoPE))                      (B, T, H)
               r = r + mlp(post_attention_layernorm(r))                       (B, T, H)
    norm(r) -> lm_head [Vd, H] -> draft logits; draft id i is target id i + d2t[i].
    Fed back to the next step: r (norm_output: norm(r)). The switches are Eagle3Config's (draft/
    config.py), read as vLLM reads them; all off is standard EAGLE-3, fc_norm alone EAGLE-3.1.

Training-time test (forward_ttt), K steps over a sequence of T rows:
    step j, row t: token input_ids[t+1+j] (0 past the end), predicts token t+2+j, RoPE position
    t+j; hidden = fuse(aux[t]) at j = 0, else what step j-1 feeds back at row t;
    attention sees step-0 keys at rows <= t and the keys of steps 1..j at row t only.
    Options for training speed/memory: checkpoint (none | step | selective | selective_all, per
    TTT step) and compile (torch.compile of the elementwise work between the matmuls).
Serving (KV cache, batch 1 is enough): new_cache, extend (verified rows), propose (k target
ids by greedy chain from the last row; the chain's KV entries are discarded), rollback.

Training-only machinery sits apart: the TTT attention variants in attention.py, activation
checkpointing in checkpointing.py.

Example:
    from eagleforge.draft import Eagle3Draft
    model = Eagle3Draft.from_pretrained("RUN/draft", embed_tokens=target.get_input_embeddings().weight)
    cache = model.new_cache()
    model.extend(cache, aux_hidden_states, next_tokens)   # [1, n, k*Ht], [1, n]
    proposal = model.propose(cache, 5)                     # [1, 5] target token ids
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eagleforge.draft.attention import many_graphs, repeat_kv, ttt_attention
from eagleforge.draft.checkpointing import checkpointed
from eagleforge.draft.config import Eagle3Config
from eagleforge.modes import COMPILE_MODES, checkpoint_modes


def rope_parameters(config: Eagle3Config) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] fp32, attention_scaling) for the config's rope_theta/rope_scaling."""
    with torch.device("cpu"):  # also when the model is built under a meta/cuda device context
        return _rope_parameters(config)


def _rope_parameters(config: Eagle3Config) -> tuple[torch.Tensor, float]:
    dim = config.head_dim
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return inv_freq.float(), 1.0
    # Scaled variants (linear, llama3, yarn, ...): transformers' definitions, which vLLM matches.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported (known: {sorted(ROPE_INIT_FUNCTIONS)})")
    hf = LlamaConfig(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta, rope_scaling={**scaling, "rope_type": rope_type},
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ---------------------------------------------------------------------- elementwise pieces of a step
# The midlayer's elementwise math, as plain functions of tensors: the modules below run them (serving
# and TTT alike), and torch.compile fuses them (fullgraph) without tracing modules.


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalize in fp32, cast back, then scale (as transformers and vLLM)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.weight, self.eps)


def ttt_input_ids(input_ids: torch.Tensor, ttt_steps: int) -> torch.Tensor:
    """[B, T] -> [B, T + K]: the ids whose embeddings the K TTT steps read (id 0 past the end)."""
    return F.pad(input_ids, (0, ttt_steps), value=0)


def _norm_cat(embeds, hidden, w_embeds, w_hidden, eps: float) -> torch.Tensor:
    """[B, T, H] x 2 -> cat(input_layernorm(embeds), hidden_norm(hidden)) [B, T, 2H]."""
    return torch.cat([_rms(embeds, w_embeds, eps), _rms(hidden, w_hidden, eps)], dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [1, 1, T, D] in x's dtype."""
    return x * cos + rotate_half(x) * sin


def _add_norm(residual, update, weight, eps: float):
    """-> (residual + update, RMSNorm of it), both [B, T, H]."""
    h = residual + update
    return h, _rms(h, weight, eps)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


_ELEMENTWISE = {"rms": _rms, "norm_cat": _norm_cat, "rope": _rope, "add_norm": _add_norm, "silu_mul": _silu_mul}


@functools.lru_cache(maxsize=2)
def _compiled_elementwise(dynamic: bool = False) -> dict:
    """torch.compile'd twins of _ELEMENTWISE (built on first use: compiling needs a C++ compiler
    on the CPU and Triton on CUDA). Static shapes (one graph per batch shape, what bench-train
    measures) or dynamic (one graph for every shape: a trainer's batches vary in length)."""
    def under_limits(compiled):
        def call(*args):
            with many_graphs():
                return compiled(*args)

        return call

    return {name: under_limits(torch.compile(fn, fullgraph=True, dynamic=dynamic)) for name, fn in _ELEMENTWISE.items()}


def _module_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """How the midlayer runs a matmul by default: the module itself (Eagle3Draft.midlayer_linear
    may name another function with this signature for TTT)."""
    return module(x)


# The midlayer's math is written once, in the methods below, and both paths run it: serving with
# the eager `_ELEMENTWISE` and the modules' own matmuls (the defaults), TTT (Eagle3Draft.ttt_step)
# with `ew` = the eager or compiled elementwise functions and `lin` = its midlayer_linear.


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(2 * h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ew: dict = _ELEMENTWISE, lin=_module_linear):
        """x [B, T, 2H]; cos/sin [B or 1, T, D] fp32 -> q [B, Hq, T, D], k/v [B, Hkv, T, D] (RoPE applied)."""
        b, t, _ = x.shape
        q = lin(self.q_proj, x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = lin(self.k_proj, x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = lin(self.v_proj, x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)  # [B, 1, T, D]
        return ew["rope"](q, cos, sin), ew["rope"](k, cos, sin), v

    def out(self, attn: torch.Tensor, lin=_module_linear) -> torch.Tensor:
        """[B, Hq, T, D] -> [B, T, H]."""
        b, _, t, _ = attn.shape
        return lin(self.o_proj, attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ew: dict = _ELEMENTWISE, lin=_module_linear) -> torch.Tensor:
        return lin(self.down_proj, ew["silu_mul"](lin(self.gate_proj, x), lin(self.up_proj, x)))


class Eagle3DecoderLayer(nn.Module):
    """The `midlayer`. Split in two halves around the attention, which TTT and serving do differently."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)
        self.norm_before_residual = config.norm_before_residual

    def qkv(self, embeds, hidden, cos, sin, ew: dict = _ELEMENTWISE, lin=_module_linear):
        """embeds, hidden [B, T, H] -> q, k, v of cat(norm(embeds), norm(hidden)) [B, T, 2H]."""
        x = ew["norm_cat"](embeds, hidden, self.input_layernorm.weight, self.hidden_norm.weight, self.input_layernorm.eps)
        return self.self_attn.qkv(x, cos, sin, ew, lin)

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor, norm: RMSNorm, ew: dict = _ELEMENTWISE, lin=_module_linear):
        """attn [B, Hq, T, D], hidden [B, T, H] (the step's hidden input, as qkv got it) ->
        (un-normed output [B, T, H], that output through `norm`, the draft's final norm: lm_head's
        input). The residual stream starts from hidden, or hidden_norm(hidden) with
        norm_before_residual."""
        residual = ew["rms"](hidden, self.hidden_norm.weight, self.hidden_norm.eps) if self.norm_before_residual else hidden
        h, y = ew["add_norm"](residual, self.self_attn.out(attn, lin), self.post_attention_layernorm.weight,
                              self.post_attention_layernorm.eps)
        return ew["add_norm"](h, self.mlp(y, ew, lin), norm.weight, norm.eps)


@dataclass
class DraftCache:
    """Serving state: step-0 keys/values (RoPE applied) and un-normed step-0 outputs of the rows so far."""

    keys: torch.Tensor  # [B, Hkv, L, D]
    values: torch.Tensor  # [B, Hkv, L, D]
    hidden: torch.Tensor  # [B, L, H], un-normed midlayer output of each row at step 0 (norm_output or not)

    @property
    def length(self) -> int:
        return self.keys.shape[2]


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(config.fc_in_features, config.hidden_size, bias=False)
        # EAGLE-3.1: one RMSNorm [Ht] per aux state, before fc (fc_norm.{i}.weight); None otherwise.
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                     for _ in config.aux_layer_ids) if config.fc_norm else None
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # Identity vocabulary map until set_vocab_map: draft id i is target id i.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # A plain fp32 tensor, not a buffer: module.to(bfloat16) must not round the frequencies.
        self.inv_freq, self.attention_scaling = rope_parameters(config)
        # How ttt_step runs the midlayer's matmuls: None = each nn.Linear itself; else a function
        # (linear module, x) -> y, e.g. one that adds its weight gradient straight into .grad
        # (train/weight_grads.py; serving always runs the modules).
        self.midlayer_linear = None
        self.reset_parameters()

    # ------------------------------------------------------------------ setup

    def reset_parameters(self, std: float = 0.02) -> None:
        """Linear weights ~ N(0, std) (transformers' Llama init), norms 1; embed_tokens untouched."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @classmethod
    def from_pretrained(cls, path, embed_tokens: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "Eagle3Draft":
        """The draft of an export directory (config.json + model.safetensors, docs/export.md), as
        Hugging Face models load; embed_tokens: the target's input embedding (see load_draft)."""
        from eagleforge.draft.io import load_draft

        return load_draft(path, embed_tokens=embed_tokens, dtype=dtype, device=device)

    def save_pretrained(self, path, dtype: torch.dtype = torch.bfloat16):
        """Write the export directory that vLLM and SGLang load unchanged (atomically)."""
        from eagleforge.draft.io import save_draft

        return save_draft(self, path, dtype=dtype)

    def nonfinite_tensors(self) -> list[str]:
        """Names of the trained tensors holding NaN/Inf (the frozen embed_tokens is the target's):
        such a draft proposes garbage that acceptance figures would not flag by themselves."""
        return [name for name, t in self.state_dict().items()
                if name != "embed_tokens.weight" and t.is_floating_point() and not bool(torch.isfinite(t).all())]

    def set_embed_tokens(self, weight: torch.Tensor) -> None:
        """Copy the target's input embedding [V, H] into the frozen embed_tokens."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"embed_tokens: expected shape {tuple(self.embed_tokens.weight.shape)}, got {tuple(weight.shape)}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """d2t int64 [Vd] (target id = i + d2t[i]), t2d bool [V]; checked against each other."""
        cfg = self.config
        if tuple(d2t.shape) != (cfg.draft_vocab_size,) or tuple(t2d.shape) != (cfg.vocab_size,):
            raise ValueError(f"vocab map: expected d2t [{cfg.draft_vocab_size}] and t2d [{cfg.vocab_size}], "
                             f"got {tuple(d2t.shape)} and {tuple(t2d.shape)}")
        target_ids = torch.arange(cfg.draft_vocab_size, device=d2t.device) + d2t.long()
        if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size or not t2d.bool()[target_ids].all() \
                or int(t2d.sum()) != cfg.draft_vocab_size:
            raise ValueError("vocab map: d2t and t2d disagree (d2t must map onto exactly the ids where t2d is true)")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> target vocabulary ids (int64, same shape)."""
        return draft_ids + self.d2t[draft_ids]

    # ------------------------------------------------------------------ math shared by TTT and serving

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B or 1, T] -> cos, sin [B or 1, T, D] in fp32 (non-interleaved halves)."""
        inv_freq = self._inv_freq_on(positions.device)
        freqs = positions.float()[..., None] * inv_freq  # [.., T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """inv_freq on `device`, copied once: a copy per call from the host is a blocking
        transfer (a host sync per TTT step, seen in bench-train's sync list)."""
        cache = self.__dict__.setdefault("_inv_freq_cache", {})
        if cache.get("source") is not self.inv_freq:  # a new table: drop the old copies
            cache.clear()
            cache["source"] = self.inv_freq  # held, so its id cannot be reused by another tensor
        key = str(device)
        if key not in cache:
            cache[key] = self.inv_freq.to(device)
        return cache[key]

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """aux [B, T, k*Ht] -> fc(aux) [B, T, H] in the model's dtype; with fc_norm, aux state i
        (the i-th [B, T, Ht] chunk) goes through fc_norm[i] first. Every path into the midlayer
        (TTT, serving, the benchmarks) starts here."""
        if aux_hidden_states.shape[-1] != self.fc.in_features:
            raise ValueError(f"aux_hidden_states: last dim {aux_hidden_states.shape[-1]}, expected "
                             f"{self.fc.in_features} (= {self.config.num_aux_layers} aux layers x {self.config.target_hidden_size})")
        x = aux_hidden_states.to(self.fc.weight.dtype)  # [B, T, k*Ht]
        if self.fc_norm is not None:
            chunks = x.split(self.config.target_hidden_size, dim=-1)  # k x [B, T, Ht]
            x = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)  # [B, T, k*Ht]
        return self.fc(x)

    def fed_forward(self, out: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """What a step hands the next one as its hidden input, from its un-normed output and that
        output's final norm (both [B, T, H]): the un-normed one, or the normed one with norm_output."""
        return normed if self.config.norm_output else out

    def logits(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] (output of norm) -> draft logits [..., Vd]."""
        return self.lm_head(normed_hidden)

    # ------------------------------------------------------------------ training-time test

    def forward_ttt(self, aux_hidden_states: torch.Tensor, input_ids: torch.Tensor, ttt_steps: int,
                    attention: str = "auto", *, checkpoint: str | Sequence[str] = "none",
                    compile: bool | str = False, embeds: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Unrolled TTT: a list of `ttt_steps` NORMED hidden states [B, T, H] (inputs of lm_head).

        aux_hidden_states [B, T, k*Ht], input_ids [B, T] (row t = position t of the sequence).
        Step j, row t: fed token input_ids[t+1+j] (id 0 past the end) and predicts token t+2+j;
        hidden input fuse(aux[t]) at j = 0, else step j-1's output at row t (fed_forward: un-normed,
        or normed with norm_output); RoPE
        position t+j; attends to step-0 keys at rows <= t and steps 1..j keys at row t only.

        checkpoint: activation checkpointing per TTT step, one of CHECKPOINT_MODES, or a list of
        `ttt_steps` of them (e.g. selective for the first steps and step for the rest, to fit a
        memory budget). Same numbers, less memory, some recompute in the backward. compile: the elementwise work between the
        matmuls (norms, RoPE, SiLU, residuals; the merged attention's diagonal merge) through
        torch.compile; matmuls and attention kernels as they are. True compiles a graph per
        batch shape, "dynamic" one graph for all shapes (batches of varying length).

        embeds: embed_tokens(input_ids padded with ttt_steps zeros) [B, T + K, H], gathered
        elsewhere (the trainer does it on the host, where it keeps the frozen embedding); None:
        looked up here.
        """
        if compile not in COMPILE_MODES:
            raise ValueError(f"forward_ttt: compile must be one of {COMPILE_MODES}, got {compile!r}")
        b, t = input_ids.shape
        if aux_hidden_states.shape[:2] != (b, t):
            raise ValueError(f"forward_ttt: aux_hidden_states {tuple(aux_hidden_states.shape)} and input_ids "
                             f"{tuple(input_ids.shape)} disagree on [B, T]")
        if ttt_steps < 1:
            raise ValueError(f"forward_ttt: ttt_steps must be >= 1, got {ttt_steps}")
        modes = checkpoint_modes(checkpoint, ttt_steps)
        hidden = self.fuse(aux_hidden_states)  # [B, T, H]
        # Embeddings of all steps at once: step j reads rows 1+j .. T+j (ids 0 past the end).
        if embeds is None:
            embeds = self.embed_tokens(ttt_input_ids(input_ids, ttt_steps))  # [B, T + K, H]
        elif tuple(embeds.shape) != (b, t + ttt_steps, self.config.hidden_size):
            raise ValueError(f"forward_ttt: embeds {tuple(embeds.shape)}, expected [B, T + ttt_steps, H] = "
                             f"{(b, t + ttt_steps, self.config.hidden_size)}")
        rows = torch.arange(t, device=input_ids.device)[None]  # [1, T]
        step_fns = {m: self.ttt_step_fn(attention, m, compile) for m in set(modes)}
        keys, values, normed = [], [], []
        for j in range(ttt_steps):
            cos, sin = self.rope(rows + j)
            hidden, normed_j, k, v = step_fns[modes[j]](j, hidden, embeds[:, 1 + j: 1 + j + t], cos, sin, *keys, *values)
            keys.append(k)
            values.append(v)
            normed.append(normed_j)
        return normed

    def ttt_step(self, attention: str, n_prev: int, hidden, embeds, cos, sin, *kv, compile: bool | str = False):
        """One TTT step of the midlayer: midlayer.qkv, the TTT attention, midlayer.finish (the
        serving path's own methods).

        hidden, embeds [B, T, H]; cos/sin [1, T, D] fp32; kv = the n_prev keys then the n_prev
        values [B, Hkv, T, D] of the earlier steps -> (the next step's hidden input [B, T, H]: the
        un-normed output, or the normed one with norm_output; normed output [B, T, H]; k_j, v_j).
        The matmuls are the modules' own or `midlayer_linear`'s (either way aten matmuls a
        selective checkpoint policy sees); the elementwise work between them goes through
        `_ELEMENTWISE` (eager) or its torch.compile'd twin (fused kernels: each norm is one pass,
        no fp32 copies kept)."""
        ew = _compiled_elementwise(compile == "dynamic") if compile else _ELEMENTWISE
        lin = self.midlayer_linear or _module_linear
        q, k, v = self.midlayer.qkv(embeds, hidden, cos, sin, ew, lin)  # [B, Hq, T, D], [B, Hkv, T, D] x 2
        keys, values = list(kv[:n_prev]) + [k], list(kv[n_prev:]) + [v]
        attn = ttt_attention(q, keys, values, self.midlayer.self_attn.scale, mode=attention, compile=compile)
        out, normed = self.midlayer.finish(attn, hidden, self.norm, ew, lin)
        return self.fed_forward(out, normed), normed, k, v

    def ttt_step_fn(self, attention: str = "auto", checkpoint: str = "none", compile: bool | str = False):
        """fn(n_prev, hidden, embeds, cos, sin, *kv) -> ttt_step's outputs, checkpointed as asked
        (one of CHECKPOINT_MODES). forward_ttt runs it per step; trainers may call it directly."""
        step = functools.partial(self.ttt_step, attention, compile=compile)
        return checkpointed(step, checkpoint, self.config.hidden_size)

    # ------------------------------------------------------------------ serving

    def new_cache(self, batch_size: int = 1) -> DraftCache:
        attn = self.midlayer.self_attn
        w = self.fc.weight
        kv = torch.zeros(batch_size, attn.num_kv_heads, 0, attn.head_dim, dtype=w.dtype, device=w.device)
        return DraftCache(keys=kv, values=kv.clone(),
                          hidden=torch.zeros(batch_size, 0, self.config.hidden_size, dtype=w.dtype, device=w.device))

    @torch.no_grad()
    def extend(self, cache: DraftCache, aux_hidden_states: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Append n verified rows: row i is fed fc(aux[i]) and next_tokens[i] (the token after it).

        aux_hidden_states [B, n, k*Ht], next_tokens [B, n]; RoPE positions continue from the
        cache length; each new row attends to all cached rows and the new rows up to itself.
        """
        b, n = next_tokens.shape
        if aux_hidden_states.shape[:2] != (b, n) or cache.keys.shape[0] != b:
            raise ValueError(f"extend: aux_hidden_states {tuple(aux_hidden_states.shape)}, next_tokens "
                             f"{tuple(next_tokens.shape)} and cache batch {cache.keys.shape[0]} disagree")
        start = cache.length
        hidden = self.fuse(aux_hidden_states)  # [B, n, H]
        positions = torch.arange(start, start + n, device=hidden.device)[None]  # [1, n]
        cos, sin = self.rope(positions)
        q, k, v = self.midlayer.qkv(self.embed_tokens(next_tokens), hidden, cos, sin)
        cache.keys = torch.cat([cache.keys, k], dim=2)
        cache.values = torch.cat([cache.values, v], dim=2)
        key_pos = torch.arange(start + n, device=hidden.device)
        mask = key_pos[None, :] <= positions[0, :, None]  # [n, L+n]
        attn = self._attend(q, cache.keys, cache.values, mask)
        out, _ = self.midlayer.finish(attn, hidden, self.norm)
        cache.hidden = torch.cat([cache.hidden, out], dim=1)

    def _attend(self, q, keys, values, mask=None) -> torch.Tensor:
        """Plain attention for serving: q [B, Hq, n, D] over keys/values [B, Hkv, L, D]."""
        n_rep = q.shape[1] // keys.shape[1]
        return F.scaled_dot_product_attention(q, repeat_kv(keys, n_rep), repeat_kv(values, n_rep),
                                              attn_mask=mask, scale=self.midlayer.self_attn.scale)

    def _chain_step(self, cache: DraftCache, chain_kv: list, hidden: torch.Tensor, token: torch.Tensor,
                    step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One chain step j >= 1 from the last cached row: hidden [B, 1, H] (what step j-1 fed
        forward), token [B, 1]; position (L - 1) + j; attends to all cached rows plus the chain's
        own keys of steps 1..j (appended to chain_kv). Returns what it feeds forward and its
        normed output, both [B, 1, H]."""
        positions = torch.full((1, 1), cache.length - 1 + step, device=hidden.device)
        cos, sin = self.rope(positions)
        q, k, v = self.midlayer.qkv(self.embed_tokens(token), hidden, cos, sin)
        chain_kv.append((k, v))
        keys = torch.cat([cache.keys] + [kk for kk, _ in chain_kv], dim=2)
        values = torch.cat([cache.values] + [vv for _, vv in chain_kv], dim=2)
        out, normed = self.midlayer.finish(self._attend(q, keys, values), hidden, self.norm)
        return self.fed_forward(out, normed), normed

    @torch.no_grad()
    def chain(self, cache: DraftCache, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced chain from the last row: step j (1..m) is fed tokens[:, j-1] (TARGET
        ids) and its own step j-1 hidden. Returns the normed hidden states [B, 1 + m, H] of
        steps 0..m (step 0 = the cached row). The cache is left as it was."""
        if cache.length == 0:
            raise ValueError("chain: the cache is empty; extend it with at least one verified row first")
        normed = self.norm(cache.hidden[:, -1:])  # [B, 1, H]
        hidden = self.fed_forward(cache.hidden[:, -1:], normed)
        out, chain_kv = [normed], []
        for j in range(1, tokens.shape[1] + 1):
            hidden, normed = self._chain_step(cache, chain_kv, hidden, tokens[:, j - 1:j], j)
            out.append(normed)
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def propose(self, cache: DraftCache, k: int) -> torch.Tensor:
        """k greedy draft tokens as TARGET ids [B, k], chained from the last cached row.

        Token 1 is the argmax of the last row's step-0 output; token j+1 comes from chain step j,
        fed its own hidden and its own token j at position (L - 1) + j. The cache is unchanged.
        """
        if cache.length == 0:
            raise ValueError("propose: the cache is empty; extend it with at least one verified row first")
        if k < 1:
            raise ValueError(f"propose: k must be >= 1, got {k}")
        normed = self.norm(cache.hidden[:, -1:])  # [B, 1, H]
        hidden = self.fed_forward(cache.hidden[:, -1:], normed)
        token = self.to_target_ids(self.logits(normed).argmax(-1))  # [B, 1]
        proposals, chain_kv = [token], []
        for j in range(1, k):
            hidden, normed = self._chain_step(cache, chain_kv, hidden, token, j)
            token = self.to_target_ids(self.logits(normed).argmax(-1))
            proposals.append(token)
        return torch.cat(proposals, dim=1)

    def rollback(self, cache: DraftCache, n_rows: int) -> None:
        """Drop the last n_rows rows of the cache (e.g. rows extended past a rejected token)."""
        if not 0 <= n_rows <= cache.length:
            raise ValueError(f"rollback: n_rows must be in [0, {cache.length}], got {n_rows}")
        keep = cache.length - n_rows
        cache.keys, cache.values = cache.keys[:, :, :keep], cache.values[:, :, :keep]
        cache.hidden = cache.hidden[:, :keep]
