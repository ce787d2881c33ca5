"""Training-time-test (TTT) attention of the EAGLE-3 draft.

At TTT step j the queries of all rows t (step j) attend to
  - the step-0 keys at rows s <= t (causal), and
  - the keys of steps 1..j at row t only (a diagonal per step).

Shapes: q [B, Hq, T, D]; keys[i], values[i] [B, Hkv, T, D] for steps i = 0..j; Hq a multiple of
Hkv (GQA: query head h uses kv head h // (Hq // Hkv), as transformers' repeat_kv). Output
[B, Hq, T, D] in q's dtype. All softmax arithmetic in fp32.

Five implementations, equal up to rounding (tests/test_draft_attention.py):
- `ttt_attention_reference`: one explicit boolean mask over the concatenated keys of all steps.
- `ttt_attention_sdpa`: causal scaled_dot_product_attention over the step-0 keys, then the j
  diagonal keys merged in by log-sum-exp. Exact, with exact gradients (see `_causal_lse`), but
  the gradient of the causal lse costs a second attention.
- `ttt_attention_merged`: the same merge inside one autograd.Function around the flash kernel's
  own forward (which returns the row lse) and backward. The backward runs the flash backward ONCE
  with the MERGED output and lse: flash computes dS = P (dP - rowsum(dO * O)) with
  P = exp(S - lse), which for the final O and lse is exactly the union softmax's gradient
  restricted to the causal keys (ring attention's trick); the diagonal keys' share is j
  elementwise dot products. No [T, (j+1)T] keys are concatenated. CPU: the CPU flash ops (any
  float dtype); CUDA: FlashAttention-2 (fp16/bf16, head_dim <= 256), else it falls back to sdpa.
- `merged_cudnn`: the same Function around cuDNN's fused attention forward/backward instead of
  FlashAttention-2 (CUDA; cuDNN's backward also derives rowsum(dO * O) from the out and lse it is
  given, so the merged pair works unchanged). Where cuDNN refuses the inputs it warns once and
  runs FlashAttention-2. On the CPU it is `merged`.
- `ttt_attention_flex`: flex_attention with a block mask over the concatenated keys (CUDA,
  compiled; block sparsity skips the masked-out blocks).
`ttt_attention(..., mode="auto")` is merged_cudnn on CUDA and merged elsewhere; "fast" is the
same as "auto": merged_cudnn is the fastest at a fixed length from 8K tokens (equal to merged
at 2K, where launches dominate), and at lengths changing every step cuDNN's plan per new shape
costs little beside flex's block mask and kernels per new length (measured: BENCHMARKS.md,
"TTT attention alone"). flex stays available by name.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from eagleforge.modes import ATTENTION_MODES

log = logging.getLogger(__name__)



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
        if q.device.type == "cpu" and _flash_supported(q):
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
    expected_k = _causal_sdpa(q.detach(), k.detach(), k, scale)
    surrogate = scale * (q.float() * expected_k.float()).sum(dim=-1)  # [B, H, T]
    return value + (surrogate - surrogate.detach())


# The CPU flash backward is trusted from this torch on: torch 2.11's returned a garbage q gradient
# (relative error 9e23) for a one-row causal block on an H200 machine's CPU (through the merged Function and through
# F.scaled_dot_product_attention, which picks the same CPU flash kernel), while 2.13 (the
# version the Makefile installs and the tests run) matches the reference at every tested shape.
CPU_FLASH_MIN_TORCH = (2, 13)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _causal_sdpa(q, k, v, scale: float) -> torch.Tensor:
    """F.scaled_dot_product_attention, causal; on a CPU torch older than CPU_FLASH_MIN_TORCH
    pinned to the math backend (its flash backward is the one that was wrong)."""
    if q.device.type == "cpu" and _torch_version() < CPU_FLASH_MIN_TORCH:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def ttt_attention_sdpa(q, keys, values, scale: float) -> torch.Tensor:
    """Causal SDPA over step-0 keys, merged with the diagonal keys of steps 1..j by log-sum-exp."""
    _check(q, keys, values)
    n_rep = q.shape[1] // keys[0].shape[1]
    k0, v0 = repeat_kv(keys[0], n_rep), repeat_kv(values[0], n_rep)
    out0 = _causal_sdpa(q, k0, v0, scale)  # [B, Hq, T, D]
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


# ----------------------------------------------------------------------------------------------
# Flash forward/backward with the row lse, merged with the diagonal keys (ttt_attention_merged)
# ----------------------------------------------------------------------------------------------


def _flash_supported(q: torch.Tensor) -> bool:
    """The device's flash ops take these inputs: CPU any float dtype (torch >= CPU_FLASH_MIN_TORCH);
    CUDA fp16/bf16, D <= 256, D % 8 == 0."""
    if q.device.type == "cpu":
        return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") and _torch_version() >= CPU_FLASH_MIN_TORCH
    if q.device.type == "cuda":
        d = q.shape[-1]
        return q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0
    return False


CUDA_KERNELS = ("flash", "cudnn")
_cudnn_refused: set[tuple] = set()  # input signatures cuDNN refused once (warned, then flash)


def _cudnn_allowed(q, k, v) -> bool:
    """torch's own checks for its cuDNN attention (switch, version, shapes), as SDPA asks them."""
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    try:
        from torch.backends.cuda import SDPAParams, can_use_cudnn_attention
    except ImportError:  # older torch: the kernel's own refusal is the only check
        return True
    return bool(can_use_cudnn_attention(SDPAParams(q, k, v, None, 0.0, True, False)))


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """t with ref's strides (a copy only when they differ): cuDNN gets O and dO in q's layout,
    the layout its own SDPA path hands it, so the plans it caches per shape serve both."""
    return t if t.stride() == ref.stride() else torch.empty_like(ref).copy_(t)


def _cudnn_forward(q, k, v, scale: float):
    """cuDNN causal attention: (out, lse [B, H, T] fp32, aux) like `_flash_forward`. cuDNN
    returns its softmax stats (the row logsumexp of the scaled scores) as [B, H, T, 1]; aux keeps
    that shape for the backward."""
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    b, h, t, _ = q.shape
    return out, lse.reshape(b, h, t), ("cudnn", tuple(lse.shape), cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_forward(q, k, v, scale: float, kernel: str = "flash"):
    """Causal flash attention. q, k, v [B, H, T, D] -> (out [B, H, T, D], lse [B, H, T] fp32, aux).
    `aux` carries what the CUDA backward needs besides out and lse (the kernel, sequence
    bookkeeping, rng). kernel: "flash" (FlashAttention-2) or "cudnn" on CUDA; the CPU has one."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, None
    if kernel == "cudnn":
        signature = (q.dtype, tuple(q.shape), q.device.index)
        if signature not in _cudnn_refused:
            try:
                if _cudnn_allowed(q, k, v):
                    return _cudnn_forward(q, k, v, scale)
                reason = "torch's checks (torch.backends.cuda.can_use_cudnn_attention) say no"
            except torch.OutOfMemoryError:
                raise  # not a refusal: FA2 would need the same memory
            except RuntimeError as err:  # e.g. a cuDNN without a plan for these shapes
                reason = str(err).splitlines()[0][:200]
            _cudnn_refused.add(signature)
            log.warning("cuDNN attention refused q %s %s (%s); using FlashAttention-2 for these inputs",
                        tuple(q.shape), q.dtype, reason)
    return _fa2_forward(q, k, v, scale)


def _fa2_forward(q, k, v, scale: float):
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False, scale=scale)
    return out, lse, ("flash", cum_q, cum_k, max_q, max_k, rng_state, unused)


def _flash_backward(grad_out, q, k, v, out, lse, aux, scale: float):
    """Causal flash backward given (out, lse [B, H, T] fp32), by the kernel that ran the forward
    (named in aux): -> (dq, dk, dv)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, True, scale=scale)
    if aux[0] == "cudnn":
        _, lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = aux
        try:
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                _like(grad_out, q), q, k, v, _like(out, q), lse.contiguous().reshape(lse_shape), seed, offset, None,
                cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:  # cuDNN took the forward but not the backward: FA2 with the same (out, lse)
            _cudnn_refused.add((q.dtype, tuple(q.shape), q.device.index))
            log.warning("cuDNN attention backward refused q %s (%s); FlashAttention-2's backward instead",
                        tuple(q.shape), str(err).splitlines()[0][:200])
            aux = _fa2_forward(q, k, v, scale)[2]  # its sequence bookkeeping; out and lse stay the merged ones
    _, cum_q, cum_k, max_q, max_k, rng_state, unused = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng_state, unused, scale=scale)


def _merge_forward(scale: float, q, out0, lse0, *diag):
    """Merge the causal block (out0 [B, H, T, D], lse0 [B, H, T] fp32) with the n diagonal keys
    and values diag = (k_1..k_n, v_1..v_n) [B, H, T, D] -> (out in q's dtype, merged lse fp32)."""
    n = len(diag) // 2
    q32 = q.float()
    scores = [(q32 * k.float()).sum(-1) * scale for k in diag[:n]]  # n x [B, H, T]
    lse = torch.logsumexp(torch.stack([lse0, *scores], dim=-1), dim=-1)  # [B, H, T]
    out = torch.exp(lse0 - lse)[..., None] * out0.float()  # the causal block's share
    for score, v in zip(scores, diag[n:]):
        out = out + torch.exp(score - lse)[..., None] * v.float()
    return out.to(q.dtype), lse


def _merge_backward(scale: float, q, out, lse, grad_out, dq_causal, *diag):
    """The diagonal keys' share of the gradient, given the merged (out, lse) and dq of the causal
    block: -> (dq, dk_1..dk_n, dv_1..dv_n). With P_i = exp(s_i - lse) and D = rowsum(dO * O):
    dv_i = P_i dO, dS_i = P_i (dO . v_i - D), dq += scale dS_i k_i, dk_i = scale dS_i q."""
    n = len(diag) // 2
    q32, do32 = q.float(), grad_out.float()
    delta = (do32 * out.float()).sum(-1)  # [B, H, T], as flash computes it
    dq = dq_causal.float()
    dks, dvs = [], []
    for k, v in zip(diag[:n], diag[n:]):
        k32 = k.float()
        p = torch.exp((q32 * k32).sum(-1) * scale - lse)  # [B, H, T]
        ds = p * ((do32 * v.float()).sum(-1) - delta) * scale
        dq = dq + ds[..., None] * k32
        dks.append((ds[..., None] * q32).to(k.dtype))
        dvs.append((p[..., None] * do32).to(v.dtype))
    return (dq.to(q.dtype), *dks, *dvs)


@functools.lru_cache(maxsize=2)
def _compiled_merge(dynamic: bool = False):
    """torch.compile'd (_merge_forward, _merge_backward): one fused kernel per pass instead of a
    dozen fp32 [B, H, T, D] temporaries. One graph per number of diagonal keys (and per shape
    unless dynamic)."""
    return (torch.compile(_merge_forward, fullgraph=True, dynamic=dynamic),
            torch.compile(_merge_backward, fullgraph=True, dynamic=dynamic))


def many_graphs():
    """Context raising dynamo's per-function graph limit (default 8) for the compiled TTT pieces:
    K - 1 diagonal counts x a few sequence lengths x dtypes exceed it, and past it dynamo would
    silently run the function eagerly."""
    import torch._dynamo

    config = torch._dynamo.config
    if hasattr(config, "recompile_limit"):
        limits = {"recompile_limit": 64, "accumulated_recompile_limit": 1024}
    else:  # older torch names
        limits = {"cache_size_limit": 64, "accumulated_cache_size_limit": 1024}
    return config.patch(**{k: v for k, v in limits.items() if hasattr(config, k)})


def _run_merge(which: int, compile: bool | str, *args):
    if not compile:
        return (_merge_forward, _merge_backward)[which](*args)
    with many_graphs():
        return _compiled_merge(compile == "dynamic")[which](*args)


class _MergedTTTAttention(torch.autograd.Function):
    """out = softmax over (causal step-0 keys, diagonal keys of steps 1..j) of the scores, times
    the values. Inputs (kv heads already repeated to Hq): q, k0, v0 [B, H, T, D], then the j
    diagonal keys and the j diagonal values [B, H, T, D]. Saves q, k0, v0, out, lse (and the
    diagonal inputs, which the caller keeps anyway): no probabilities, no concatenation."""

    @staticmethod
    def forward(ctx, scale, compile, kernel, q, k0, v0, *diag):
        out0, lse0, aux = _flash_forward(q, k0, v0, scale, kernel)  # [B, H, T, D], [B, H, T] fp32
        if diag:
            out, lse = _run_merge(0, compile, scale, q, out0, lse0, *diag)
        else:
            out, lse = out0, lse0
        ctx.scale, ctx.aux, ctx.compile, ctx.n = scale, aux, compile, len(diag) // 2
        ctx.save_for_backward(q, k0, v0, out, lse, *diag)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, out, lse, *diag = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        # Causal block with the merged (out, lse): the exact share of the union softmax's gradient.
        dq, dk0, dv0 = _flash_backward(grad_out, q, k0, v0, out, lse, ctx.aux, ctx.scale)
        if not diag:
            return None, None, None, dq, dk0, dv0
        dq, *diag_grads = _run_merge(1, ctx.compile, ctx.scale, q, out, lse, grad_out, dq, *diag)
        return (None, None, None, dq, dk0, dv0, *diag_grads)


def ttt_attention_merged(q, keys, values, scale: float, compile: bool | str = False, kernel: str = "flash") -> torch.Tensor:
    """Flash causal attention over the step-0 keys merged with the diagonal keys of steps 1..j,
    forward and backward in one autograd.Function (see the module docstring). compile: the
    merge's elementwise passes through torch.compile. kernel: the CUDA causal kernel, "flash"
    (FlashAttention-2) or "cudnn". Falls back to `ttt_attention_sdpa` where the device's flash
    kernel does not take the inputs."""
    _check(q, keys, values)
    if kernel not in CUDA_KERNELS:
        raise ValueError(f"merged attention kernel {kernel!r} is not one of {CUDA_KERNELS}")
    if not _flash_supported(q):
        return ttt_attention_sdpa(q, keys, values, scale)
    n_rep = q.shape[1] // keys[0].shape[1]
    ks = [repeat_kv(k, n_rep) for k in keys]  # GQA: autograd sums the repeated heads' gradients
    vs = [repeat_kv(v, n_rep) for v in values]
    compile = compile if compile == "dynamic" else bool(compile)
    return _MergedTTTAttention.apply(float(scale), compile, kernel, q, ks[0], vs[0], *ks[1:], *vs[1:])


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


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


def ttt_attention(q, keys, values, scale: float, mode: str = "auto", compile: bool | str = False) -> torch.Tensor:
    """Dispatch: "reference", "sdpa", "merged", "merged_cudnn", "flex", "fast" (= merged_cudnn on
    CUDA, else merged), "auto" (= fast).
    compile: fuse the merged mode's elementwise work (the other modes ignore it)."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode {mode!r} is not one of {ATTENTION_MODES}")
    if mode == "reference":
        return ttt_attention_reference(q, keys, values, scale)
    if mode in ("auto", "fast"):
        mode = "merged_cudnn" if q.is_cuda else "merged"
    if mode == "flex":
        return ttt_attention_flex(q, keys, values, scale)
    if mode == "sdpa":
        return ttt_attention_sdpa(q, keys, values, scale)
    return ttt_attention_merged(q, keys, values, scale, compile=compile,
                                kernel="cudnn" if mode == "merged_cudnn" else "flash")
