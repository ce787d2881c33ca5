"""Fused linear soft cross-entropy for EAGLE-3 (docs/training.md, ARCHITECTURE "Loss").

For N positions, the draft head W [Vd, H] and the target's head rows of the draft vocabulary
U [Vd, H]:

    z_n = draft_hidden_n @ W.T                     draft logits                     [N, Vd]
    u_n = teacher_hidden_n @ U.T                   target logits, restricted        [N, Vd]
    p_n = exp(u_n - teacher_lse_n)                 target distribution over Vd
    CE_n = -sum_v p_nv * log_softmax(z_n)_v
    loss = sum_n weight_n * CE_n

Gradient (the teacher is a constant), with S_n = sum_v p_nv (1 up to rounding, kept so the
gradient is exactly that of the formula) and q_n = softmax(z_n):

    G_n = dloss/dz_n = weight_n * (q_n * S_n - p_n)                                  [N, Vd]
    dloss/ddraft_hidden = G @ W        dloss/dW = G.T @ draft_hidden

Two implementations, same numbers (the plain-torch formula that materializes [N, Vd] in fp32 is
`eagleforge.train.loss.soft_cross_entropy`, the reference of the tests and benchmarks):
- torch path (CPU default): chunks over tokens; per chunk the logits come from matmuls in the
  input dtype and the softmax / gradient factor is plain torch in fp32.
- Triton path (CUDA default), a HYBRID: the four matmuls per chunk are cuBLAS (torch.mm into
  preallocated [C, Vd] buffers, no copies), and one Triton kernel per chunk does the
  online-softmax pass over Vd blocks (lse, argmax, CE) and writes G in place over the logits.
  Per chunk only two [C, Vd] buffers in the input dtype exist, never [N, Vd] in fp32.

Like Liger-Kernel's fused linear losses, the gradients are computed during the forward and the
backward only scales them by the upstream gradient.

The multi-step form (all K TTT steps in one call, the teacher shared) is in soft_ce_ttt.py; it
runs on the row pass and dispatch defined here.
"""

from __future__ import annotations

import logging
import os

import torch
from torch.autograd.function import once_differentiable

log = logging.getLogger(__name__)

try:  # Triton is optional: the CPU path and CPU machines run without it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False

# Budget for the per-chunk [C, Vd] buffers. GPU: two buffers in the input dtype (logits, then the
# gradient factor in place; teacher logits); 256 MiB in all gives C = 2048 at Vd = 32000 bf16.
GPU_CHUNK_BYTES = 256 * 2**20
# CPU: the torch row pass makes about six fp32 [C, Vd] temporaries; 2^22 elements = 16 MiB each.
CPU_CHUNK_ELEMENTS = 2**22


# ----------------------------------------------------------------------------------------------
# Row pass: given one chunk of logits, lse / argmax / CE and the gradient factor G in place
# ----------------------------------------------------------------------------------------------


def _rows_torch(logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor, weight: torch.Tensor,
                teacher_index: torch.Tensor | None = None, teacher_psum: torch.Tensor | None = None):
    """Torch row pass. logits [c, Vd] (overwritten with G in its dtype), teacher_logits [c', Vd]
    with teacher_lse [c'] fp32 and optionally teacher_psum [c'] fp32 (S per teacher row, from
    `_lse_psum_*`, else summed here), one teacher row per row (c' = c) or the row named by
    teacher_index [c] int32; weight [c] fp32 -> (weight * CE [c] fp32, argmax [c] int64).
    Rows with weight 0 give 0 loss and G = 0 whatever their inputs (no 0 * inf = nan)."""
    if teacher_index is not None:
        rows = teacher_index.long()
        teacher_logits, teacher_lse = teacher_logits[rows], teacher_lse[rows]  # [c, Vd], [c]
        teacher_psum = teacher_psum[rows] if teacher_psum is not None else None
    z = logits.float()  # [c, Vd]; a view when logits are fp32, G is built before it is written
    p = torch.exp(teacher_logits.float() - teacher_lse[:, None])  # [c, Vd]
    lse = torch.logsumexp(z, dim=-1)  # [c]
    p_sum = p.sum(-1) if teacher_psum is None else teacher_psum  # [c]
    ce = -(p * (z - lse[:, None])).sum(-1)  # [c]
    argmax = z.argmax(-1)
    keep = weight != 0
    loss_rows = torch.where(keep, weight * ce, torch.zeros_like(ce))
    grad = (torch.exp(z - lse[:, None]) * p_sum[:, None] - p) * weight[:, None]  # [c, Vd]
    logits.copy_(torch.where(keep[:, None], grad, torch.zeros_like(grad)))
    return loss_rows, argmax


def _lse_torch(teacher_logits: torch.Tensor) -> torch.Tensor:
    """[c, Vd] -> [c] fp32."""
    return torch.logsumexp(teacher_logits.float(), dim=-1)


def _lse_psum_torch(teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[c, Vd] -> (lse [c] fp32, S = sum_v exp(t_v - lse) [c] fp32): the teacher's side of the row
    pass, once per teacher row for all the TTT steps that share it."""
    t = teacher_logits.float()
    lse = torch.logsumexp(t, dim=-1)
    return lse, torch.exp(t - lse[:, None]).sum(-1)


if HAS_TRITON:

    @triton.jit
    def _row_operands(row, z_ptr, t_ptr, tidx_ptr, tlse_ptr, z_stride, t_stride, HAS_TIDX: tl.constexpr):
        """Where a row kernel's program `row` reads (the soft CE's here, the LK's in kernels/lk.py):
        -> (its draft logits' row, its teacher row index, the teacher logits' row, the teacher lse).
        HAS_TIDX: the teacher row is tidx[row] (the packed TTT form shares one teacher row among
        steps), else `row`."""
        if HAS_TIDX:
            trow = tl.load(tidx_ptr + row).to(tl.int64)
        else:
            trow = row
        return z_ptr + row * z_stride, trow, t_ptr + trow * t_stride, tl.load(tlse_ptr + trow)

    @triton.jit
    def _row_pass1(z_row, t_row, tlse, psum_at, vocab, BLOCK: tl.constexpr, HAS_PSUM: tl.constexpr):
        """The first pass of a row kernel over its Vd blocks (the soft CE's here, the LK's in
        kernels/lk.py): online max / sum-exp of the draft logits z -> their lse, the first
        argmax, and S = sum of the teacher's p (read at psum_at with HAS_PSUM: then no teacher
        logit is read). -> (lse, argmax, S)."""
        offs = tl.arange(0, BLOCK)
        m = float("-inf")  # running max of z
        l = 0.0  # running sum of exp(z - m)
        p_sum = 0.0
        if HAS_PSUM:
            p_sum = tl.load(psum_at)
        best = float("-inf")
        best_idx = 0
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            mask = cols < vocab
            z = tl.load(z_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            if not HAS_PSUM:
                t = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
                p_sum += tl.sum(tl.exp(t - tlse), axis=0)  # masked lanes: exp(-inf) = 0
            blk_max = tl.max(z, axis=0)
            blk_arg = tl.argmax(z, axis=0)
            best_idx = tl.where(blk_max > best, start + blk_arg, best_idx)  # strict: first max wins
            best = tl.maximum(best, blk_max)
            m_new = tl.maximum(m, blk_max)
            l = l * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        return m + tl.log(l), best_idx, p_sum

    @triton.jit
    def _soft_ce_rows_kernel(
        z_ptr, t_ptr, tidx_ptr, tlse_ptr, psum_ptr, w_ptr, loss_ptr, argmax_ptr,
        z_stride, t_stride, vocab,
        BLOCK: tl.constexpr, HAS_TIDX: tl.constexpr, HAS_PSUM: tl.constexpr,
    ):
        """One program per row. Pass 1 over Vd blocks: online max / sum-exp of z (draft lse),
        the first argmax, and (unless HAS_PSUM gives it per row) the sum of p, S. Pass 2:
        CE = -sum p (z - lse) and G = w (exp(z - lse) S - p), written over z in z's dtype.
        HAS_TIDX: row r's teacher (logits, lse, S) is teacher row tidx[r] (the packed TTT form
        shares one teacher row among steps). With HAS_PSUM pass 1 reads no teacher logits at all."""
        row = tl.program_id(0).to(tl.int64)
        z_row, trow, t_row, tlse = _row_operands(row, z_ptr, t_ptr, tidx_ptr, tlse_ptr, z_stride, t_stride, HAS_TIDX)
        w = tl.load(w_ptr + row)
        offs = tl.arange(0, BLOCK)

        lse, best_idx, p_sum = _row_pass1(z_row, t_row, tlse, psum_ptr + trow, vocab, BLOCK, HAS_PSUM)

        keep = w != 0.0
        ce = 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            mask = cols < vocab
            z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
            t = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            p = tl.exp(t - tlse)
            ce += tl.sum(tl.where(mask, p * (lse - z), 0.0), axis=0)
            g = (tl.exp(z - lse) * p_sum - p) * w
            g = tl.where(keep, g, 0.0)
            tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=mask)
        tl.store(loss_ptr + row, tl.where(keep, w * ce, 0.0))
        tl.store(argmax_ptr + row, best_idx.to(tl.int64))

    @triton.jit
    def _row_lse_kernel(t_ptr, out_ptr, psum_ptr, t_stride, vocab, BLOCK: tl.constexpr, WITH_PSUM: tl.constexpr):
        """One program per row: out = logsumexp(t_row) in fp32, online over Vd blocks; WITH_PSUM
        also psum = sum exp(t - lse) (a second pass over the row)."""
        row = tl.program_id(0).to(tl.int64)
        t_row = t_ptr + row * t_stride
        offs = tl.arange(0, BLOCK)
        m = float("-inf")
        l = 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            t = tl.load(t_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(t, axis=0))
            l = l * tl.exp(m - m_new) + tl.sum(tl.exp(t - m_new), axis=0)
            m = m_new
        lse = m + tl.log(l)
        tl.store(out_ptr + row, lse)
        if WITH_PSUM:
            p_sum = 0.0
            for start in range(0, vocab, BLOCK):
                cols = start + offs
                t = tl.load(t_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                p_sum += tl.sum(tl.exp(t - lse), axis=0)
            tl.store(psum_ptr + row, p_sum)

    @triton.jit
    def _scale_kernel(g_ptr, up_ptr, n, BLOCK: tl.constexpr):
        """g *= up in place, in fp32 (up: one fp32 value on the device, read by the kernel)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        up = tl.load(up_ptr)
        g = tl.load(g_ptr + offs, mask=mask)
        # round to nearest even as torch does (the interpreter would truncate by default)
        tl.store(g_ptr + offs, (g.to(tl.float32) * up).to(g_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch_config(vocab: int) -> tuple[int, int]:
    """(BLOCK, num_warps): Vd blocks of up to 4096 lanes, 16 fp32 values per thread at 8 warps."""
    block = min(4096, triton.next_power_of_2(vocab))
    return block, (8 if block >= 2048 else 4)


def _check_triton_rows(logits, teacher_logits, teacher_lse, weight, teacher_index=None, teacher_psum=None) -> None:
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' needs the triton package (pip install 'eagleforge[gpu]')")
    if not (logits.is_cuda or _interpreting()):
        raise ValueError(f"triton soft-CE: logits on {logits.device}, need CUDA (or TRITON_INTERPRET=1 on the CPU)")
    if teacher_index is None and logits.shape != teacher_logits.shape:
        raise ValueError(f"triton soft-CE: logits {tuple(logits.shape)} != teacher logits {tuple(teacher_logits.shape)}")
    if teacher_index is not None and (logits.shape[1] != teacher_logits.shape[1] or teacher_index.shape != (logits.shape[0],)
                                      or teacher_index.dtype != torch.int32 or not teacher_index.is_contiguous()):
        raise ValueError(f"triton soft-CE: logits {tuple(logits.shape)}, teacher logits {tuple(teacher_logits.shape)} and "
                         f"teacher_index {teacher_index.dtype} {tuple(teacher_index.shape)} (contiguous int32 [rows]) disagree")
    if logits.stride(-1) != 1 or teacher_logits.stride(-1) != 1:
        raise ValueError(f"triton soft-CE: Vd must be the contiguous dim, strides {logits.stride()} / {teacher_logits.stride()}")
    rows, teacher_rows = logits.shape[0], teacher_logits.shape[0]
    for name, t, n in (("teacher_lse", teacher_lse, teacher_rows), ("weight", weight, rows),
                       ("teacher_psum", teacher_psum, teacher_rows)):
        if t is None:
            continue
        if t.shape != (n,) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"triton soft-CE: {name} must be contiguous fp32 [{n}], got {t.dtype} {tuple(t.shape)}")


def _rows_triton(logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor, weight: torch.Tensor,
                 teacher_index: torch.Tensor | None = None, teacher_psum: torch.Tensor | None = None):
    """Triton row pass, same contract as `_rows_torch`."""
    _check_triton_rows(logits, teacher_logits, teacher_lse, weight, teacher_index, teacher_psum)
    rows, vocab = logits.shape
    loss_rows = torch.empty(rows, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return loss_rows, argmax
    block, warps = _launch_config(vocab)
    _soft_ce_rows_kernel[(rows,)](
        logits, teacher_logits, teacher_index if teacher_index is not None else teacher_lse, teacher_lse,
        teacher_psum if teacher_psum is not None else teacher_lse, weight,
        loss_rows, argmax, logits.stride(0), teacher_logits.stride(0), vocab,
        BLOCK=block, HAS_TIDX=teacher_index is not None, HAS_PSUM=teacher_psum is not None, num_warps=warps,
    )
    return loss_rows, argmax


def _lse_triton(teacher_logits: torch.Tensor, with_psum: bool = False):
    """[c, Vd] -> lse [c] fp32, or (lse, psum) with `with_psum` (see `_lse_psum_torch`)."""
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' needs the triton package (pip install 'eagleforge[gpu]')")
    if teacher_logits.stride(-1) != 1:
        raise ValueError(f"triton lse: Vd must be the contiguous dim, strides {teacher_logits.stride()}")
    rows, vocab = teacher_logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=teacher_logits.device)
    psum = torch.empty(rows, dtype=torch.float32, device=teacher_logits.device) if with_psum else out
    if rows:
        block, warps = _launch_config(vocab)
        _row_lse_kernel[(rows,)](teacher_logits, out, psum, teacher_logits.stride(0), vocab, BLOCK=block,
                                 WITH_PSUM=with_psum, num_warps=warps)
    return (out, psum) if with_psum else out


def _lse_psum_triton(teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _lse_triton(teacher_logits, with_psum=True)


# ----------------------------------------------------------------------------------------------
# Dispatch, preconditions, chunk sizes
# ----------------------------------------------------------------------------------------------

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA when triton imports, else 'torch'."""
    if backend not in BACKENDS:
        raise ValueError(f"soft-CE backend {backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        return "triton" if (device.type == "cuda" and HAS_TRITON) else "torch"
    return backend


def row_fns(backend: str):
    """(row pass, teacher lse, teacher lse and S) of a backend."""
    if backend == "triton":
        return _rows_triton, _lse_triton, _lse_psum_triton
    return _rows_torch, _lse_torch, _lse_psum_torch


def default_chunk_tokens(vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per chunk so the [C, Vd] buffers stay inside the budget (multiple of 128 on GPU)."""
    if device.type == "cuda":
        per_row = 2 * vocab * torch.empty((), dtype=dtype).element_size()
        return max(128, GPU_CHUNK_BYTES // per_row // 128 * 128)
    return max(16, CPU_CHUNK_ELEMENTS // vocab)


def check_pair(hidden: torch.Tensor, head: torch.Tensor, hname: str, wname: str) -> None:
    if hidden.dim() != 2 or head.dim() != 2:
        raise ValueError(f"{hname} must be [N, H] and {wname} [Vd, H], got {tuple(hidden.shape)} and {tuple(head.shape)}")
    if hidden.shape[1] != head.shape[1]:
        raise ValueError(f"{hname} {tuple(hidden.shape)} and {wname} {tuple(head.shape)} differ in H")
    if hidden.dtype != head.dtype:
        raise ValueError(f"{hname} is {hidden.dtype} but {wname} is {head.dtype}: cast one (matmuls run in the input dtype)")
    if hidden.device != head.device:
        raise ValueError(f"{hname} on {hidden.device} but {wname} on {head.device}")


def _check_vector(t: torch.Tensor, name: str, rows: int, device: torch.device) -> None:
    if t.shape != (rows,) or t.dtype != torch.float32:
        raise ValueError(f"{name} must be fp32 [{rows}], got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} on {t.device}, inputs on {device}")


def check_chunk(chunk_tokens: int) -> None:
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")


# ----------------------------------------------------------------------------------------------
# teacher_logsumexp
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def teacher_logsumexp(
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """logsumexp of the restricted target logits, [T, H] x [Vd, H] -> [T] fp32, no gradient.

    Once per sequence: every TTT step reuses it (the teacher of step j, row t is position t+1+j).
    The logits are a matmul in the input dtype, the lse is fp32."""
    check_pair(teacher_hidden, teacher_head, "teacher_hidden", "teacher_head")
    backend = resolve_backend(backend, teacher_hidden.device)
    lse_fn = row_fns(backend)[1]
    n_rows, vocab = teacher_hidden.shape[0], teacher_head.shape[0]
    chunk = chunk_tokens or default_chunk_tokens(vocab, teacher_head.dtype, teacher_hidden.device)
    check_chunk(chunk)
    out = torch.empty(n_rows, dtype=torch.float32, device=teacher_hidden.device)
    buf = torch.empty(min(chunk, n_rows), vocab, dtype=teacher_head.dtype, device=teacher_hidden.device)
    for s in range(0, n_rows, chunk):
        e = min(n_rows, s + chunk)
        tb = buf[: e - s]
        torch.mm(teacher_hidden[s:e], teacher_head.T, out=tb)  # [c, Vd]
        out[s:e] = lse_fn(tb)
    return out


# ----------------------------------------------------------------------------------------------
# Single step: fused_soft_cross_entropy
# ----------------------------------------------------------------------------------------------


def one_chunk(h, draft_head, teacher_logits, teacher_lse, weight, zbuf, rows_fn, grad_h_out, grad_head, first,
               teacher_psum=None):
    """Draft logits, row pass, both gradient matmuls for one chunk of rows h [c, H].
    -> (loss_rows [c], argmax [c]); grad_head accumulated in place (beta 0 on the first chunk)."""
    zb = zbuf[: h.shape[0]]
    torch.mm(h, draft_head.T, out=zb)  # [c, Vd] draft logits
    loss_rows, argmax = rows_fn(zb, teacher_logits, teacher_lse, weight, teacher_psum=teacher_psum)  # zb := G [c, Vd]
    if grad_h_out is not None:
        torch.mm(zb, draft_head, out=grad_h_out)  # [c, Vd] x [Vd, H]
    if grad_head is not None:
        grad_head.addmm_(zb.T, h, beta=0.0 if first else 1.0)  # [Vd, c] x [c, H]
    return loss_rows, argmax


@torch.no_grad()
def _soft_ce_forward(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight,
                     need_grad_h, need_grad_head, chunk, backend, rows_fn=None):
    """(loss fp32 scalar, argmax [N], grad_hidden [N, H] | None, grad_head [Vd, H] | None).
    rows_fn: another row pass with `_rows_torch`'s contract (the LK loss's, kernels/lk.py); its
    weight may carry trailing dims ([N, 2]), sliced by row here."""
    rows_fn = rows_fn or row_fns(backend)[0]
    n_rows, vocab = draft_hidden.shape[0], draft_head.shape[0]
    dev = draft_hidden.device
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=dev)
    argmax = torch.empty(n_rows, dtype=torch.int64, device=dev)
    # contiguous whatever the inputs' layout: `scale_grads_` scales them in place through a flat view
    grad_h = torch.empty_like(draft_hidden, memory_format=torch.contiguous_format) if need_grad_h else None
    # empty: the first chunk's addmm has beta 0; zeros only when there is no chunk (N = 0)
    make_grad_head = torch.empty_like if n_rows else torch.zeros_like
    grad_head = make_grad_head(draft_head, memory_format=torch.contiguous_format) \
        if need_grad_head else None
    c_max = max(1, min(chunk, n_rows))
    zbuf = torch.empty(c_max, vocab, dtype=draft_head.dtype, device=dev)
    tbuf = torch.empty(c_max, vocab, dtype=teacher_head.dtype, device=dev)
    for i, s in enumerate(range(0, n_rows, chunk)):
        e = min(n_rows, s + chunk)
        tb = tbuf[: e - s]
        torch.mm(teacher_hidden[s:e], teacher_head.T, out=tb)  # [c, Vd] teacher logits
        loss_rows[s:e], argmax[s:e] = one_chunk(
            draft_hidden[s:e], draft_head, tb, teacher_lse[s:e], weight[s:e], zbuf, rows_fn,
            grad_h[s:e] if grad_h is not None else None, grad_head, i == 0,
        )
    return loss_rows.sum(), argmax, grad_h, grad_head


# fp32 temporaries of `scale_grads_` stay within this many elements (64 MiB).
_SCALE_CHUNK_ELEMENTS = 2**24


def scale_grads_(grads, upstream: torch.Tensor, backend: str) -> None:
    """grad *= upstream in place for each saved gradient, in fp32 (the upstream is not rounded to
    bf16). No host sync: testing for the usual upstream of 1 would read a device value back and
    stall the launch queue at the start of every backward, so the pass is always made: on the
    Triton backend one kernel per gradient reading the upstream on the device (one read and one
    write: ~0.6 ms for the 7 TTT steps' gradients at T = 8192; the chunked fp32 torch version,
    three kernels per 2^24 elements, took 5.2 ms on an H200); on the torch backend in chunks
    of bounded fp32 temporaries.
    In place: a second backward through the same graph (retain_graph) is refused by autograd's
    own version check on the saved tensors ("modified by an inplace operation"), not scaled twice."""
    upstream = upstream.detach().reshape(1)
    up32 = upstream.to(torch.float32)
    for grad in grads:
        if grad is None or grad.numel() == 0:
            continue
        flat = grad.view(-1)
        if grad.dtype == torch.float64:  # wider than the fp32 the scaling runs in elsewhere
            flat.mul_(upstream.to(torch.float64))
            continue
        if backend == "triton":
            _scale_kernel[(triton.cdiv(flat.numel(), _SCALE_BLOCK),)](flat, up32, flat.numel(), BLOCK=_SCALE_BLOCK,
                                                                       num_warps=8)
            torch.autograd.graph.increment_version(grad)  # a kernel's write is not seen by autograd's check
            continue
        for part in flat.split(_SCALE_CHUNK_ELEMENTS):
            part.copy_(part.float().mul_(up32))


_SCALE_BLOCK = 4096  # elements per program of _scale_kernel (16 per thread at 8 warps)


class FusedRowLoss(torch.autograd.Function):
    """A chunked per-row loss whose gradients its forward computes (soft CE here, LK in
    kernels/lk.py): `forward_fn(draft_hidden, draft_head, teacher_hidden, teacher_head,
    teacher_lse, weight, need_grad_hidden, need_grad_head, chunk, backend) -> (loss, argmax,
    grad_hidden, grad_head)`; the backward scales the saved gradients by the upstream one."""

    @staticmethod
    def forward(ctx, forward_fn, draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, chunk,
                backend):
        loss, argmax, grad_h, grad_head = forward_fn(
            draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight,
            ctx.needs_input_grad[1], ctx.needs_input_grad[2], chunk, backend,
        )
        ctx.save_for_backward(grad_h, grad_head)
        ctx.mark_non_differentiable(argmax)
        ctx.backend = backend
        return loss, argmax

    @staticmethod
    @once_differentiable  # the saved gradients are constants: a create_graph backward must fail, not drop terms
    def backward(ctx, grad_loss, grad_argmax):
        grad_h, grad_head = ctx.saved_tensors
        scale_grads_((grad_h, grad_head), grad_loss, ctx.backend)
        return None, grad_h, grad_head, None, None, None, None, None, None


def prepare_row_loss(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight,
                     chunk_tokens: int | None, backend: str) -> tuple[tuple, int, str]:
    """The checks and the argument tuple every per-row fused loss shares (this module's soft CE,
    kernels/lk.py's LK): shapes, devices, the [N] vectors, the backend and the chunk size.
    -> ((draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight) with the
    constants detached, chunk rows, backend)."""
    check_pair(draft_hidden, draft_head, "draft_hidden", "draft_head")
    check_pair(teacher_hidden, teacher_head, "teacher_hidden", "teacher_head")
    n_rows, vocab = draft_hidden.shape[0], draft_head.shape[0]
    if teacher_hidden.shape[0] != n_rows or teacher_head.shape[0] != vocab:
        raise ValueError(f"teacher_hidden {tuple(teacher_hidden.shape)} / teacher_head {tuple(teacher_head.shape)} "
                         f"do not match draft_hidden {tuple(draft_hidden.shape)} / draft_head {tuple(draft_head.shape)}")
    if teacher_hidden.device != draft_hidden.device:
        raise ValueError(f"teacher on {teacher_hidden.device}, draft on {draft_hidden.device}")
    _check_vector(teacher_lse, "teacher_lse", n_rows, draft_hidden.device)
    _check_vector(weight, "weight", n_rows, draft_hidden.device)
    backend = resolve_backend(backend, draft_hidden.device)
    chunk = chunk_tokens or default_chunk_tokens(vocab, draft_head.dtype, draft_hidden.device)
    check_chunk(chunk)
    args = (draft_hidden, draft_head, teacher_hidden.detach(), teacher_head.detach(),
            teacher_lse.detach().contiguous(), weight.detach().contiguous())
    return args, chunk, backend


def fused_soft_cross_entropy(
    draft_hidden: torch.Tensor,
    draft_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    teacher_lse: torch.Tensor,
    weight: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss = sum_n weight_n * CE_n, fp32 scalar; draft argmax [N] int64).

    draft_hidden [N, H] and draft_head [Vd, H] get gradients; teacher_hidden [N, H],
    teacher_head [Vd, H], teacher_lse [N] fp32 (from `teacher_logsumexp`) and weight [N] fp32
    are constants. Never holds more than `chunk_tokens` x Vd logits. Rows with weight 0 give 0
    loss and 0 gradient even if their teacher is not finite. backend: auto | torch | triton."""
    args, chunk, backend = prepare_row_loss(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight,
                                            chunk_tokens, backend)
    if torch.is_grad_enabled() and (draft_hidden.requires_grad or draft_head.requires_grad):
        return FusedRowLoss.apply(_soft_ce_forward, *args, chunk, backend)
    loss, argmax, _, _ = _soft_ce_forward(*args, False, False, chunk, backend)  # no gradient work
    return loss, argmax
