"""Training-time-test (TTT) attention of the EAGLE-3 draft.

At TTT step j the queries of all rows t (step j) attend to
  - the step-0 keys at rows s <= t (causal), and
  - the keys of steps 1..j at row t only (a diagonal per step).

Shapes: q [B, Hq, T, D]; keys[i], values[i] [B, Hkv, T, D] for steps i = 0..j; Hq a multiple of
Hkv (GQA: query head h uses kv head h // (Hq // Hkv), as transformers' repeat_kv). Output
[B, Hq, T, D] in q's dtype. All softmax arithmetic in fp32.

Three implementations, equal up to rounding (tests/test_draft_attention.py):
- `ttt_attention_reference`: one explicit boolean mask over the concatenated keys of all steps.
- `ttt_attention_sdpa`: causal scaled_dot_product_attention over the step-0 keys, then the j
  diagonal keys merged in by log-sum-exp. Exact, with exact gradients (see `_causal_lse`).
- `ttt_attention_flex`: flex_attention with a block mask over the concatenated keys (CUDA,
  compiled; block sparsity skips the masked-out blocks).
`ttt_attention(..., mode="auto")` picks flex on CUDA when it is available, else sdpa.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ATTENTION_MODES = ("auto", "reference", "fast", "sdpa", "flex")


def _check(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    if len(keys) != len(values) or not keys:
        raise ValueError(f"ttt attention: need as many key as value tensors (>= 1), got {len(keys)} and {len(values)}")
    for k, v in zip(keys, values):
        if k.shape != keys[0].shape or v.shape != keys[0].shape:
            raise ValueError(f"ttt attention: key/value shapes differ: {tuple(k.shape)} {tuple(v.shape)} {tuple(keys[0].shape)}")
    b, hq, t, d = q.shape
    bk, hkv, tk, dk = keys[0].shape
    if (b, t, d) != (bk, tk, dk) or hq % hkv:
        raise ValueError(f"ttt attention: q {tuple(q.shape)} does not match keys {tuple(keys[0].shape)}")


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * n_rep, T, D], kv head g serving query heads g*n_rep .. g*n_rep+n_rep-1."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def ttt_mask(seq_len: int, num_steps: int, device=None) -> torch.Tensor:
    """Boolean mask [T, num_steps * T] (True = attend) over the keys of steps 0..num_steps-1."""
    rows = torch.arange(seq_len, device=device)
    causal = rows[None, :] <= rows[:, None]  # [T, T]
    diag = rows[None, :] == rows[:, None]
    return torch.cat([causal] + [diag] * (num_steps - 1), dim=1)


def ttt_attention_reference(q, keys, values, scale: float) -> torch.Tensor:
    """Explicit mask over cat(keys) [B, Hkv, (j+1)T, D]; the definition the others must match."""
    _check(q, keys, values)
    n_rep = q.shape[1] // keys[0].shape[1]
    k = repeat_kv(torch.cat(keys, dim=2), n_rep).float()  # [B, Hq, (j+1)T, D]
    v = repeat_kv(torch.cat(values, dim=2), n_rep).float()
    scores = (q.float() @ k.transpose(-1, -2)) * scale  # [B, Hq, T, (j+1)T]
    mask = ttt_mask(q.shape[2], len(keys), device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v).to(q.dtype)


def causal_lse_chunked(q: torch.Tensor, k: torch.Tensor, scale: float, chunk: int = 256) -> torch.Tensor:
    """logsumexp_{s <= t} scale * q_t . k_s, [B, H, T] fp32, over [B, H, chunk, T] score blocks."""
    t = q.shape[2]
    cols = torch.arange(t, device=q.device)
    out = []
    for start in range(0, t, chunk):
        rows = torch.arange(start, min(start + chunk, t), device=q.device)
        scores = (q[:, :, start:start + len(rows)].float() @ k.float().transpose(-1, -2)) * scale
        scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        out.append(scores.logsumexp(dim=-1))
    return torch.cat(out, dim=-1)


def _causal_lse_value(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal row logsumexp [B, H, T] fp32, no gradient. q, k [B, H, T, D]."""
    with torch.no_grad():
        if q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            # The CPU flash kernel returns the row logsumexp next to its output.
            _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, k, 0.0, True, scale=scale)
            return lse.float()
        return causal_lse_chunked(q, k, scale)


def _causal_lse(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Differentiable causal row logsumexp [B, H, T] fp32 without materializing [T, T] scores.

    The value comes from `_causal_lse_value`. The gradient of lse_t is that of
    scale * q_t . E_{P_t}[k] with the probabilities P held constant: d/dq_t = scale * E_P[k],
    d/dk_s = scale * sum_t P_ts q_t. A causal SDPA with values = k (queries and keys detached)
    gives E_P[k] with exactly the gradient to k we need, so `surrogate` below carries the exact
    gradient at the cost of one more flash-style attention.
    """
    value = _causal_lse_value(q, k, scale)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        return value
    expected_k = F.scaled_dot_product_attention(q.detach(), k.detach(), k, is_causal=True, scale=scale)
    surrogate = scale * (q.float() * expected_k.float()).sum(dim=-1)  # [B, H, T]
    return value + (surrogate - surrogate.detach())


def ttt_attention_sdpa(q, keys, values, scale: float) -> torch.Tensor:
    """Causal SDPA over step-0 keys, merged with the diagonal keys of steps 1..j by log-sum-exp."""
    _check(q, keys, values)
    n_rep = q.shape[1] // keys[0].shape[1]
    k0, v0 = repeat_kv(keys[0], n_rep), repeat_kv(values[0], n_rep)
    out0 = F.scaled_dot_product_attention(q, k0, v0, is_causal=True, scale=scale)  # [B, Hq, T, D]
    if len(keys) == 1:
        return out0
    lse0 = _causal_lse(q, k0, scale)  # [B, Hq, T]
    k_diag = torch.stack([repeat_kv(k, n_rep) for k in keys[1:]], dim=-2).float()  # [B, Hq, T, j, D]
    v_diag = torch.stack([repeat_kv(v, n_rep) for v in values[1:]], dim=-2).float()
    s_diag = (q.float()[..., None, :] * k_diag).sum(-1) * scale  # [B, Hq, T, j]
    lse = torch.logsumexp(torch.cat([lse0[..., None], s_diag], dim=-1), dim=-1, keepdim=True)  # [B, Hq, T, 1]
    w0 = torch.exp(lse0[..., None] - lse)  # [B, Hq, T, 1]: share of the causal block
    w_diag = torch.exp(s_diag - lse)  # [B, Hq, T, j]
    out = w0 * out0.float() + (w_diag[..., None] * v_diag).sum(dim=-2)
    return out.to(q.dtype)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=64)
def _ttt_block_mask(seq_len: int, num_steps: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        step = kv_idx // seq_len
        pos = kv_idx % seq_len
        return ((step == 0) & (pos <= q_idx)) | ((step > 0) & (pos == q_idx))

    # Compiled on CUDA: the eager call materializes the whole [T, K*T] boolean mask first
    # (7.5 GB at T = 32768, 7 steps) before reducing it to blocks.
    return create_block_mask(
        mask_mod, None, None, seq_len, num_steps * seq_len, device=device, _compile=device.startswith("cuda")
    )


def ttt_attention_flex(q, keys, values, scale: float, compiled: bool = True) -> torch.Tensor:
    """flex_attention over cat(keys) with the TTT block mask (the mask of the reference)."""
    from torch.nn.attention.flex_attention import flex_attention

    _check(q, keys, values)
    n_rep = q.shape[1] // keys[0].shape[1]
    k = torch.cat(keys, dim=2)  # [B, Hkv, (j+1)T, D]
    v = torch.cat(values, dim=2)
    block_mask = _ttt_block_mask(q.shape[2], len(keys), str(q.device))
    fn = _compiled_flex() if compiled else flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=n_rep > 1)


def ttt_attention(q, keys, values, scale: float, mode: str = "auto") -> torch.Tensor:
    """Dispatch: "reference", "sdpa", "flex", "fast" (= flex on CUDA, else sdpa), "auto" (= fast)."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode {mode!r} is not one of {ATTENTION_MODES}")
    if mode == "reference":
        return ttt_attention_reference(q, keys, values, scale)
    if mode == "flex" or (mode in ("auto", "fast") and flex_available(q.device)):
        return ttt_attention_flex(q, keys, values, scale)
    return ttt_attention_sdpa(q, keys, values, scale)
