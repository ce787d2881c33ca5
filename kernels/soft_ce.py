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

As in Liger-Kernel's fused linear losses, the gradients are computed during the forward and the
backward only scales them by the upstream gradient. Per chunk of rows (kernels/chunk_loops.py's
loop) the four matmuls are cuBLAS / torch.mm in the input dtype into preallocated [C, Vd]
buffers, and the row pass below computes lse, argmax, CE and writes G over the logits: the
Triton kernel (CUDA default) in one program per row over Vd blocks, or the same math in plain
torch in fp32 (CPU default). Never [N, Vd] in fp32. The all-steps TTT form is soft_ce_ttt.py, on
the same row pass.

This file, top to bottom: the row pass (Triton kernel, launcher, CPU path), teacher_logsumexp,
the autograd Function and the op `fused_soft_cross_entropy`.
"""

from __future__ import annotations

import torch

from eagleforge.kernels import chunk_loops, grads_kept, row_triton, rows
from eagleforge.kernels.optional_triton import HAS_TRITON, tl, triton
from eagleforge.kernels.teacher_lse import teacher_lse_fns

if HAS_TRITON:
    from eagleforge.kernels.row_triton import row_block, row_operands, row_pass1


# ----------------------------------------------------------------------------------------------
# Row pass: one chunk of logits -> weight * CE per row, argmax, and G in place of the logits
# ----------------------------------------------------------------------------------------------


if HAS_TRITON:

    # One program per row r, z = its draft logits, p = exp(t - teacher_lse) its teacher's
    # probabilities (t: the teacher logits of row r, or of teacher row tidx[r] with HAS_TIDX, as
    # the packed TTT form shares one teacher row among steps):
    #     pass 1 (rows.row_pass1): lse = logsumexp(z), the first argmax, S = sum_v p_v (read per
    #            teacher row with HAS_PSUM, when no teacher logit is read in this pass)
    #     pass 2: CE = sum_v p_v (lse - z_v),  loss_r = w CE,
    #             G = dloss_r/dz = w (exp(z - lse) S - p), stored over z in z's dtype
    # A row of weight 0 stores loss 0 and G = 0 whatever its inputs.
    @triton.jit
    def _soft_ce_rows_kernel(
        z_ptr, t_ptr, tidx_ptr, tlse_ptr, psum_ptr, w_ptr, loss_ptr, argmax_ptr,
        z_stride, t_stride, vocab,
        BLOCK: tl.constexpr, HAS_TIDX: tl.constexpr, HAS_PSUM: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        z_row, trow, t_row, tlse = row_operands(row, z_ptr, t_ptr, tidx_ptr, tlse_ptr, z_stride, t_stride, HAS_TIDX)
        w = tl.load(w_ptr + row)

        lse, best_idx, p_sum = row_pass1(z_row, t_row, tlse, psum_ptr + trow, vocab, BLOCK, HAS_PSUM)

        keep = w != 0.0
        ce = 0.0
        for start in range(0, vocab, BLOCK):
            cols, mask, z, p = row_block(z_row, t_row, tlse, start, vocab, BLOCK)
            ce += tl.sum(tl.where(mask, p * (lse - z), 0.0), axis=0)
            g = (tl.exp(z - lse) * p_sum - p) * w
            g = tl.where(keep, g, 0.0)
            tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=mask)
        tl.store(loss_ptr + row, tl.where(keep, w * ce, 0.0))
        tl.store(argmax_ptr + row, best_idx.to(tl.int64))


def _rows_triton(logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor, weight: torch.Tensor,
                 teacher_index: torch.Tensor | None = None, teacher_psum: torch.Tensor | None = None):
    """Triton row pass (rows.RowsFn): logits [c, Vd] (overwritten with G in its dtype), weight [c]
    fp32 -> (weight * CE [c] fp32, argmax [c] int64). row_triton.launch_rows checks the operands
    (devices, shapes, dtypes, strides; the message names them) before the launch."""
    return row_triton.launch_rows(_soft_ce_rows_kernel, logits, teacher_logits, teacher_lse, weight, teacher_index, teacher_psum)


def _rows_torch(logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor, weight: torch.Tensor,
                teacher_index: torch.Tensor | None = None, teacher_psum: torch.Tensor | None = None):
    """CPU path: the kernel's math in plain torch, fp32, same contract as `_rows_triton`."""
    z, p, lse, argmax, p_sum = rows.torch_row_operands(logits, teacher_logits, teacher_lse, teacher_index, teacher_psum)
    ce = -(p * (z - lse[:, None])).sum(-1)  # [c]
    grad = (torch.exp(z - lse[:, None]) * p_sum[:, None] - p) * weight[:, None]  # [c, Vd]
    keep = weight != 0  # rows of weight 0: loss 0 and G = 0 (no 0 * inf = nan)
    logits.copy_(torch.where(keep[:, None], grad, torch.zeros_like(grad)))
    loss = weight * ce
    return torch.where(keep, loss, torch.zeros_like(loss)), argmax


def row_pass(backend: str) -> rows.RowsFn:
    """The soft cross-entropy's row pass on a backend ("torch" or "triton")."""
    return _rows_triton if backend == "triton" else _rows_torch


# ----------------------------------------------------------------------------------------------
# teacher_logsumexp
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def teacher_logsumexp(teacher_hidden: torch.Tensor, teacher_head: torch.Tensor, *, chunk_tokens: int | None = None,
                      backend: str = "auto") -> torch.Tensor:
    """logsumexp of the restricted target logits, [T, H] x [Vd, H] -> [T] fp32, no gradient.

    Once per sequence: every TTT step reuses it (the teacher of step j, row t is position t+1+j).
    The logits are a matmul in the input dtype, the lse is fp32."""
    rows.check_pair(teacher_hidden, teacher_head, "teacher_hidden", "teacher_head")
    backend = rows.resolve_backend(backend, teacher_hidden.device)
    lse_fn = teacher_lse_fns(backend)[0]
    n_rows, vocab = teacher_hidden.shape[0], teacher_head.shape[0]
    chunk = chunk_tokens or rows.default_chunk_tokens(vocab, teacher_head.dtype, teacher_hidden.device)
    rows.check_chunk(chunk)
    out = torch.empty(n_rows, dtype=torch.float32, device=teacher_hidden.device)
    buf = torch.empty(min(chunk, n_rows), vocab, dtype=teacher_head.dtype, device=teacher_hidden.device)
    for s in range(0, n_rows, chunk):
        e = min(n_rows, s + chunk)
        tb = buf[: e - s]
        torch.mm(teacher_hidden[s:e], teacher_head.T, out=tb)  # [c, Vd]
        out[s:e] = lse_fn(tb)
    return out


# ----------------------------------------------------------------------------------------------
# The op: gradients computed in the forward, the backward scales them
# ----------------------------------------------------------------------------------------------


def _forward(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, need_grad_hidden,
             need_grad_head, chunk, backend):
    """-> (loss fp32 scalar, argmax [N], grad_hidden | None, grad_head | None): chunk_loops.py's
    loop (draft and teacher logits, the row pass, the gradient matmuls) with this file's row pass."""
    return chunk_loops.row_loss_forward(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight,
                                 need_grad_hidden, need_grad_head, chunk, row_pass(backend))


class SoftCrossEntropyFunction(grads_kept.GradsKeptFunction):
    """fused_soft_cross_entropy with a gradient: d loss / d draft_hidden and d loss / d draft_head."""

    @staticmethod
    def forward(ctx, draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, chunk, backend):
        loss, argmax, grad_hidden, grad_head = _forward(draft_hidden, draft_head, teacher_hidden, teacher_head,
                                                        teacher_lse, weight, ctx.needs_input_grad[0],
                                                        ctx.needs_input_grad[1], chunk, backend)
        grads_kept.keep_grads(ctx, backend, (grad_hidden, grad_head), (argmax,), lead=2)
        return loss, argmax


def fused_soft_cross_entropy(draft_hidden: torch.Tensor, draft_head: torch.Tensor, teacher_hidden: torch.Tensor,
                             teacher_head: torch.Tensor, teacher_lse: torch.Tensor, weight: torch.Tensor, *,
                             chunk_tokens: int | None = None, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(loss = sum_n weight_n * CE_n, fp32 scalar; draft argmax [N] int64).

    draft_hidden [N, H] and draft_head [Vd, H] get gradients; teacher_hidden [N, H],
    teacher_head [Vd, H], teacher_lse [N] fp32 (from `teacher_logsumexp`) and weight [N] fp32
    are constants. Never holds more than `chunk_tokens` x Vd logits. Rows with weight 0 give 0
    loss and 0 gradient even if their teacher is not finite. backend: auto | torch | triton.
    Without a gradient to compute, the forward runs alone (no gradient matmuls)."""
    args, chunk, backend = rows.prepare_row_loss(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse,
                                                 weight, chunk_tokens, backend)
    if rows.wants_grad(draft_hidden, draft_head):
        return SoftCrossEntropyFunction.apply(*args, chunk, backend)
    loss, argmax, _, _ = _forward(*args, False, False, chunk, backend)
    return loss, argmax
