"""Fused linear LK loss: the acceptance-aware draft loss (docs/training.md, "LK loss").

LK losses (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative
Decoding", arXiv 2602.23881) train the draft on the quantity speculative sampling accepts. For a
row n with draft logits z_n [Vd] and the target's distribution p_n over the draft vocabulary
(the soft cross-entropy's teacher, soft_ce.py):

    q_n     = softmax(z_n)
    alpha_n = sum_v min(p_nv, q_nv) = 1 - TV(p_n, q_n)    the chance the draft's token is accepted
    CE_n    = -sum_v p_nv log q_nv                         (soft_ce.py)

Two variants, SpecForge's `lk_loss_type` (the paper's LK^lambda and LK^alpha), for row weights
w_n (the trainer's: 1 / rows of the step on each loss row, times decay^j):

    lambda: abar = sum_n w_n alpha_n / sum_n w_n          the batch's mean acceptance at this step
            lam  = kl_scale * exp(-kl_decay * abar)        no gradient through lam
            loss = lam * sum_n w_n CE_n + (1 - lam) * sum_n w_n (1 - alpha_n)
    alpha:  loss = sum_n w_n * -log(max(alpha_n, ALPHA_FLOOR))

No temperature (the distributions at T = 1, as both SpecForge and speculators).

Gradient (the teacher is a constant). With A_n = sum over {v : q_v < p_v} of q_v (min takes
the draft's branch there; at a tie it takes the target's, which has no gradient):

    dalpha_n/dz_nk = [q_k < p_k] q_k - q_k A_n
    G_n = c_ce,n (q_n S_n - p_n) + c_g,n dalpha_n/dz_n        S_n = sum_v p_nv (soft_ce.py)

with c_ce = lam w, c_g = -(1 - lam) w (lambda) and c_ce = 0, c_g = -w / alpha (alpha; 0 below
the floor, where the loss is the constant -log ALPHA_FLOOR). Each row's (c_ce, c_acc) pair is
its weight [rows, 2]; the row pass reads nothing of other rows, so it runs inside the chunk loops
the soft cross-entropy runs in (kernels/chunk_loops.py: row_loss_forward, ttt_forward per step
or packed):
same chunking, matmuls and buffers, gradients computed in the forward, which the backward only
scales by the upstream gradient. Only lam needs the whole batch: the lambda variant first runs
those loops WITHOUT gradients to get abar per step (one more draft-logits matmul per step, and the
teacher's once more), then the real pass.

How the references differ (this file follows SpecForge, whose LK code comes from the paper's
authors):
- SpecForge (specforge/core/lk_loss.py): as above, per TTT step; its acceptance uses the
  target's FULL-vocabulary probabilities restricted to the draft vocabulary (not renormalized),
  where this trainer, which holds only the draft vocabulary's rows of the target head, uses the
  renormalized p of the cross-entropy. Its abar is all-reduced over data-parallel ranks; here it
  is each rank's batch. Its CE term is averaged over all B x T positions, masked ones included;
  here over the step's loss rows, as the soft cross-entropy. Its log(0) gives 0 (the row drops
  out); here the floor. Its CLI defaulted kl_decay to 3.0 (the paper's best eta), kl_scale 1.0.
- vllm-project/speculators (losses: `lk_hybrid`, `nla`): lam per position, exp(-eta * alpha_n)
  with no scale, and the true KL in place of CE (same gradient); `nla` is the alpha variant with
  a floor of 1e-5. Both normalize by the loss-masked positions.

The Triton row pass makes three passes over Vd (draft lse and argmax; CE, alpha, A; G) where
the soft cross-entropy's makes two.

This file, top to bottom: the row pass (Triton kernel, launcher, CPU path), the variants' row
weights, then each op (`fused_lk_loss`, `fused_lk_loss_ttt`) with its autograd Function.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from eagleforge.kernels import chunk_loops, grads_kept, row_triton, rows
from eagleforge.kernels.optional_triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from eagleforge.kernels.row_triton import row_block, row_operands, row_pass1

VARIANTS = ("lambda", "alpha")  # SpecForge's lk_loss_type: the adaptive mix of CE and 1 - acceptance, -log acceptance
# -log of an acceptance below this is this constant (no gradient): only an exact 0 (every q_v
# under p's support underflowed) needs it; any larger floor would stop rows that can still learn.
ALPHA_FLOOR = 1e-12

# What a row pass computes, from the row's weight pair (c_ce, c_acc):
LINEAR = 0  # loss c_ce CE + c_acc (1 - alpha), G as the module docstring (lambda variant)
LOG = 1  # loss c_ce CE + c_acc (-log alpha) (alpha variant)
ACCEPT = 2  # loss c_acc alpha, no G: the lambda variant's first pass (logits left as they are)


# ----------------------------------------------------------------------------------------------
# Row pass: one chunk of logits -> per-row loss, argmax, and G in place of the logits
# ----------------------------------------------------------------------------------------------


if HAS_TRITON:

    # One program per row r, z = its draft logits, p = exp(t - teacher_lse) its teacher's
    # probabilities (HAS_TIDX / HAS_PSUM as soft_ce._soft_ce_rows_kernel), (c_ce, c_acc) = its
    # weight pair (w_ptr: [rows, 2] fp32), q = softmax(z):
    #     pass 1 (rows.row_pass1): lse = logsumexp(z), the first argmax, S = sum_v p_v
    #     pass 2: CE = sum_v p_v (lse - z_v), alpha = sum_v min(p_v, q_v), A = sum_{q_v < p_v} q_v
    #     KIND ACCEPT: loss_r = c_acc alpha, no G (the logits are left as they are)
    #     KIND LINEAR: loss_r = c_ce CE + c_acc (1 - alpha),  c_g = -c_acc
    #     KIND LOG:    loss_r = c_ce CE + c_acc (-log max(alpha, floor)),
    #                  c_g = -c_acc / alpha (0 below the floor)
    #     pass 3 (LINEAR, LOG): G = dloss_r/dz = c_ce (q S - p) + c_g ([q < p] q - q A), over z in
    #            z's dtype
    # A row whose two weights are 0 stores loss 0 and G = 0 whatever its inputs.
    @triton.jit
    def _lk_rows_kernel(
        z_ptr, t_ptr, tidx_ptr, tlse_ptr, psum_ptr, w_ptr, loss_ptr, argmax_ptr,
        z_stride, t_stride, vocab, floor,
        BLOCK: tl.constexpr, HAS_TIDX: tl.constexpr, HAS_PSUM: tl.constexpr, KIND: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        z_row, trow, t_row, tlse = row_operands(row, z_ptr, t_ptr, tidx_ptr, tlse_ptr, z_stride, t_stride, HAS_TIDX)
        c_ce = tl.load(w_ptr + 2 * row)
        c_acc = tl.load(w_ptr + 2 * row + 1)

        lse, best_idx, p_sum = row_pass1(z_row, t_row, tlse, psum_ptr + trow, vocab, BLOCK, HAS_PSUM)

        ce = 0.0
        alpha = 0.0
        a_sum = 0.0
        for start in range(0, vocab, BLOCK):
            cols, mask, z, p = row_block(z_row, t_row, tlse, start, vocab, BLOCK)  # masked lanes: p = q = 0
            q = tl.where(mask, tl.exp(z - lse), 0.0)
            ce += tl.sum(p * (lse - z), axis=0)
            alpha += tl.sum(tl.minimum(p, q), axis=0)
            a_sum += tl.sum(tl.where(q < p, q, 0.0), axis=0)

        keep = (c_ce != 0.0) | (c_acc != 0.0)
        if KIND == 2:
            tl.store(loss_ptr + row, tl.where(keep, c_acc * alpha, 0.0))
        else:
            if KIND == 0:
                acc_loss = 1.0 - alpha
                c_g = -c_acc
            else:
                ok = alpha >= floor
                acc_loss = -tl.log(tl.maximum(alpha, floor))
                c_g = tl.where(ok, -c_acc / tl.where(ok, alpha, 1.0), 0.0)
            for start in range(0, vocab, BLOCK):
                cols, mask, z, p = row_block(z_row, t_row, tlse, start, vocab, BLOCK)
                q = tl.exp(z - lse)  # masked lanes are not stored
                g = c_ce * (q * p_sum - p) + c_g * (tl.where(q < p, q, 0.0) - q * a_sum)
                g = tl.where(keep, g, 0.0)
                tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=mask)
            loss = tl.where(c_ce != 0.0, c_ce * ce, 0.0) + c_acc * acc_loss
            tl.store(loss_ptr + row, tl.where(keep, loss, 0.0))
        tl.store(argmax_ptr + row, best_idx.to(tl.int64))


def _lk_rows_triton(logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor, weight: torch.Tensor,
                    teacher_index: torch.Tensor | None = None, teacher_psum: torch.Tensor | None = None, *, kind: int):
    """Triton row pass (rows.RowsFn) with weight [c, 2] fp32 = (c_ce, c_acc): logits [c, Vd]
    (overwritten with G unless kind is ACCEPT) -> (loss_rows [c] fp32, argmax [c]).
    row_triton.launch_rows checks the operands (the message names them) before the launch."""
    return row_triton.launch_rows(_lk_rows_kernel, logits, teacher_logits, teacher_lse, weight, teacher_index, teacher_psum,
                            ALPHA_FLOOR, weights_per_row=2, KIND=kind)


def _lk_rows_torch(logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor, weight: torch.Tensor,
                   teacher_index: torch.Tensor | None = None, teacher_psum: torch.Tensor | None = None, *, kind: int):
    """CPU path: the kernel's math in plain torch, fp32, same contract as `_lk_rows_triton`."""
    z, p, lse, argmax, p_sum = rows.torch_row_operands(logits, teacher_logits, teacher_lse, teacher_index, teacher_psum)
    q = torch.exp(z - lse[:, None])  # [c, Vd]
    c_ce, c_acc = weight[:, 0], weight[:, 1]  # [c], [c]
    keep = (c_ce != 0) | (c_acc != 0)  # rows whose two weights are 0: loss 0 and G = 0 (no 0 * inf = nan)
    zero = torch.zeros_like(lse)
    alpha = torch.minimum(p, q).sum(-1)  # [c]
    if kind == ACCEPT:
        return torch.where(keep, c_acc * alpha, zero), argmax
    below = torch.where(q < p, q, torch.zeros_like(q))  # [c, Vd]: min's draft branch
    a_sum = below.sum(-1)  # [c]
    ce = (p * (lse[:, None] - z)).sum(-1)  # [c]
    if kind == LINEAR:
        acc_loss, c_g = 1 - alpha, -c_acc
    else:
        ok = alpha >= ALPHA_FLOOR
        acc_loss = -torch.log(alpha.clamp_min(ALPHA_FLOOR))
        c_g = torch.where(ok, -c_acc / torch.where(ok, alpha, 1.0), zero)
    grad = c_ce[:, None] * (q * p_sum[:, None] - p) + c_g[:, None] * (below - q * a_sum[:, None])  # [c, Vd]
    logits.copy_(torch.where(keep[:, None], grad, torch.zeros_like(grad)))
    loss = torch.where(c_ce != 0, c_ce * ce, zero) + c_acc * acc_loss
    return torch.where(keep, loss, torch.zeros_like(loss)), argmax


def lk_rows_fn(backend: str, kind: int) -> rows.RowsFn:
    """The LK row pass of one kind on a backend ("torch" or "triton")."""
    return functools.partial(_lk_rows_triton if backend == "triton" else _lk_rows_torch, kind=kind)


# ----------------------------------------------------------------------------------------------
# The variants: each row's weight pair (c_ce, c_acc)
# ----------------------------------------------------------------------------------------------


def check_options(variant: str, kl_scale: float, kl_decay: float) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"LK variant {variant!r}: expected one of {VARIANTS}")
    if not (0.0 <= kl_scale <= 1.0) or not (kl_decay >= 0.0):  # also refuses nan
        raise ValueError(f"LK kl_scale must be in [0, 1] and kl_decay >= 0, got {kl_scale} and {kl_decay}")


def _row_weights(weight: torch.Tensor, mean_acceptance: torch.Tensor | None, variant: str, kl_scale: float,
                 kl_decay: float) -> torch.Tensor:
    """weight [..., N] -> [..., N, 2] (c_ce, c_acc). lambda: lam from mean_acceptance [...]
    (one per step, on the device: no host sync)."""
    if variant == "alpha":
        return torch.stack([torch.zeros_like(weight), weight], -1)
    lam = (kl_scale * torch.exp(-kl_decay * mean_acceptance))[..., None]  # [..., 1]
    return torch.stack([lam * weight, (1 - lam) * weight], -1)


def _mean(weighted_sum: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_n w_n alpha_n / sum_n w_n, 0 where no row has weight."""
    return weighted_sum / weight.sum(-1).clamp_min(torch.finfo(torch.float32).tiny)


# ----------------------------------------------------------------------------------------------
# Single step: fused_lk_loss, gradients computed in the forward, the backward scales them
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def _lk_forward(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, need_grad_h,
                need_grad_head, chunk, backend, variant, kl_scale, kl_decay):
    """(loss fp32 scalar, argmax [N], grad_hidden | None, grad_head | None) through chunk_loops.py's
    loop with the LK row pass; lambda: a first pass without gradients for abar."""
    args = (draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse)
    mean_acc = None
    if variant == "lambda":
        accept = torch.stack([torch.zeros_like(weight), weight], -1)
        acc_sum, _, _, _ = chunk_loops.row_loss_forward(*args, accept, False, False, chunk, lk_rows_fn(backend, ACCEPT))
        mean_acc = _mean(acc_sum, weight)
    pairs = _row_weights(weight, mean_acc, variant, kl_scale, kl_decay)
    return chunk_loops.row_loss_forward(*args, pairs, need_grad_h, need_grad_head, chunk,
                                 lk_rows_fn(backend, LINEAR if variant == "lambda" else LOG))


class LKLossFunction(grads_kept.GradsKeptFunction):
    """fused_lk_loss with a gradient: d loss / d draft_hidden and d loss / d draft_head."""

    @staticmethod
    def forward(ctx, draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, chunk, backend,
                variant, kl_scale, kl_decay):
        loss, argmax, grad_hidden, grad_head = _lk_forward(
            draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, ctx.needs_input_grad[0],
            ctx.needs_input_grad[1], chunk, backend, variant, kl_scale, kl_decay,
        )
        grads_kept.keep_grads(ctx, backend, (grad_hidden, grad_head), (argmax,), lead=2)
        return loss, argmax


def fused_lk_loss(draft_hidden: torch.Tensor, draft_head: torch.Tensor, teacher_hidden: torch.Tensor,
                  teacher_head: torch.Tensor, teacher_lse: torch.Tensor, weight: torch.Tensor, *, variant: str = "lambda",
                  kl_scale: float = 1.0, kl_decay: float = 3.0, chunk_tokens: int | None = None,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(LK loss of the module docstring, fp32 scalar; draft argmax [N] int64): the interface of
    soft_ce.fused_soft_cross_entropy (shapes, dtypes, chunking, zero-weight rows) plus the
    variant and its weights; the lambda variant's abar is over this call's rows."""
    check_options(variant, kl_scale, kl_decay)
    args, chunk, backend = rows.prepare_row_loss(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse,
                                                 weight, chunk_tokens, backend)
    options = (variant, float(kl_scale), float(kl_decay))
    if rows.wants_grad(draft_hidden, draft_head):
        return LKLossFunction.apply(*args, chunk, backend, *options)
    loss, argmax, _, _ = _lk_forward(*args, False, False, chunk, backend, *options)
    return loss, argmax


# ----------------------------------------------------------------------------------------------
# All TTT steps, the teacher shared: fused_lk_loss_ttt
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def _lk_ttt_forward(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, shift, need_grad_h,
                    need_grad_head, chunk, backend, packed, variant, kl_scale, kl_decay):
    """chunk_loops.py's TTT loops (per step or packed) with the LK row pass; lambda: a first pass
    without gradients for each step's abar. -> (step_losses [K], argmax [K, N], grads_h, grad_head)."""
    k_steps, n_rows = weight.shape
    # Rows without a teacher are never scored: their weight must not count in abar's denominator
    # either (a caller with check_weight=False may leave weight there).
    has_teacher = (torch.arange(n_rows, device=weight.device)[None, :] + shift
                   + torch.arange(k_steps, device=weight.device)[:, None]) < n_rows  # [K, N]
    weight = weight * has_teacher
    args = (draft_hiddens, draft_head, teacher_hidden, teacher_head)
    mean_acc = None
    if variant == "lambda":
        accept = torch.stack([torch.zeros_like(weight), weight], -1)  # [K, N, 2]
        acc_sums, _, _, _ = chunk_loops.ttt_forward(*args, accept, shift, [False] * k_steps, False, chunk, backend,
                                             lk_rows_fn(backend, ACCEPT), packed)
        mean_acc = _mean(acc_sums, weight)  # [K]
    pairs = _row_weights(weight, mean_acc, variant, kl_scale, kl_decay)  # [K, N, 2]
    return chunk_loops.ttt_forward(*args, pairs, shift, need_grad_h, need_grad_head, chunk, backend,
                            lk_rows_fn(backend, LINEAR if variant == "lambda" else LOG), packed)


class LKLossTTTFunction(grads_kept.GradsKeptFunction):
    """fused_lk_loss_ttt with a gradient: the gradients of the head and of each step's hidden
    states. -> (loss = sum of the steps, step_losses [K], argmax [K, N])."""

    @staticmethod
    def forward(ctx, draft_head, teacher_hidden, teacher_head, weight, shift, chunk, backend, packed, variant, kl_scale,
                kl_decay, *draft_hiddens):
        step_losses, argmax, grads_hidden, grad_head = _lk_ttt_forward(
            draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, shift, ctx.needs_input_grad[11:],
            ctx.needs_input_grad[0], chunk, backend, packed, variant, kl_scale, kl_decay,
        )
        grads_kept.keep_grads(ctx, backend, (grad_head, *grads_hidden), (step_losses, argmax), lead=1)
        return step_losses.sum(), step_losses, argmax


def fused_lk_loss_ttt(draft_hiddens: Sequence[torch.Tensor], draft_head: torch.Tensor, teacher_hidden: torch.Tensor,
                      teacher_head: torch.Tensor, weight: torch.Tensor, *, variant: str = "lambda", kl_scale: float = 1.0,
                      kl_decay: float = 3.0, teacher_shift: int = 1, chunk_tokens: int | None = None, backend: str = "auto",
                      packed: bool = False, check_weight: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All K TTT steps of the LK loss, the teacher logits computed once per position: the
    interface of soft_ce_ttt.fused_soft_cross_entropy_ttt (step j's row n against teacher row
    n + teacher_shift + j; weight [K, N] fp32; packed; check_weight) plus the variant and its
    weights. Returns (loss = sum over steps, differentiable; step_losses [K] fp32, detached;
    draft argmax [K, N] int64). The lambda variant's abar and lam are per step, over that step's
    weighted rows."""
    check_options(variant, kl_scale, kl_decay)
    args, chunk, backend = rows.prepare_ttt_loss(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight,
                                                 teacher_shift, chunk_tokens, backend, check_weight)
    options = (bool(packed), variant, float(kl_scale), float(kl_decay))
    if rows.wants_grad(draft_head, *draft_hiddens):
        return LKLossTTTFunction.apply(*args, teacher_shift, chunk, backend, *options, *draft_hiddens)
    step_losses, argmax, _, _ = _lk_ttt_forward(draft_hiddens, *args, teacher_shift, [False] * len(draft_hiddens), False,
                                                chunk, backend, *options)
    return step_losses.sum(), step_losses, argmax
