"""All K TTT steps of the fused soft cross-entropy in one call, the teacher shared
(docs/training.md): step j's row t has the teacher of position t + shift + j, so the teacher
logits of a chunk of positions are computed ONCE and reused by every step; a TTT step costs three
matmuls, not four, and the teacher lse needs no separate pass. The packed form skips the rows
without a teacher.

The math, its gradient and the row pass (Triton kernel and CPU path) are soft_ce.py's; the chunk
loops over teacher positions (per step or packed) are kernels/chunk_loops.py's `ttt_forward`, shared
with the LK loss. This file holds the autograd Function and the op.
"""

from __future__ import annotations

from typing import Sequence

import torch

from eagleforge.kernels import chunk_loops, grads_kept, rows
from eagleforge.kernels.soft_ce import row_pass


class SoftCrossEntropyTTTFunction(grads_kept.GradsKeptFunction):
    """fused_soft_cross_entropy_ttt with a gradient: the gradients of the head and of each step's
    hidden states. -> (loss = sum of the steps, step_losses [K], argmax [K, N])."""

    @staticmethod
    def forward(ctx, draft_head, teacher_hidden, teacher_head, weight, shift, chunk, backend, packed, *draft_hiddens):
        step_losses, argmax, grads_hidden, grad_head = chunk_loops.ttt_forward(
            draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, shift, ctx.needs_input_grad[8:],
            ctx.needs_input_grad[0], chunk, backend, row_pass(backend), packed,
        )
        grads_kept.keep_grads(ctx, backend, (grad_head, *grads_hidden), (step_losses, argmax), lead=1)
        return step_losses.sum(), step_losses, argmax


def fused_soft_cross_entropy_ttt(draft_hiddens: Sequence[torch.Tensor], draft_head: torch.Tensor, teacher_hidden: torch.Tensor,
                                 teacher_head: torch.Tensor, weight: torch.Tensor, *, teacher_shift: int = 1,
                                 chunk_tokens: int | None = None, backend: str = "auto", packed: bool = False,
                                 check_weight: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All K TTT steps in one call, the teacher logits computed once per position.

    packed: run the K steps of each teacher chunk as ONE set of matmuls over their packed rows
    (chunk_loops.ttt_forward); chunk_tokens then bounds the packed rows per chunk, so the [C, Vd]
    buffers are the same size either way. Same numbers up to the order of the grad-head sum.

    draft_hiddens: K tensors [N, H] (step j's normed draft states, rows = flat positions);
    teacher_hidden [N, H]: the target's final hidden state at each flat position;
    weight [K, N] fp32. Step j's row n is scored against teacher row n + teacher_shift + j
    (ARCHITECTURE: shift 1); rows with n + shift + j >= N have no teacher and must have weight 0.
    Returns (loss = sum over steps of sum_n weight_jn CE_jn, differentiable; step_losses [K]
    fp32, detached; draft argmax [K, N] int64). Same numbers as K calls of
    `fused_soft_cross_entropy` with shifted teacher rows, at 3 matmuls per step instead of 4.

    check_weight: raise if a row without a teacher carries weight. The check reads a device
    value back (a host sync, which empties the launch queue); callers whose weights are zero
    there by construction (the trainer's, bench-train's) may pass False. Such rows are never
    scored either way: no teacher row past the end is read."""
    args, chunk, backend = rows.prepare_ttt_loss(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight,
                                                 teacher_shift, chunk_tokens, backend, check_weight)
    packed = bool(packed)
    if rows.wants_grad(draft_head, *draft_hiddens):
        return SoftCrossEntropyTTTFunction.apply(*args, teacher_shift, chunk, backend, packed, *draft_hiddens)
    step_losses, argmax, _, _ = chunk_loops.ttt_forward(draft_hiddens, *args, teacher_shift, [False] * len(draft_hiddens),
                                                 False, chunk, backend, row_pass(backend), packed)
    return step_losses.sum(), step_losses, argmax


def matmul_flops_per_step(n_rows: int, hidden: int, vocab: int, shared_teacher_steps: int = 1) -> float:
    """FLOPs of one step: 3 matmuls (draft logits, grad hidden, grad head) + the teacher logits
    matmul, shared over `shared_teacher_steps` steps. For the benchmark's floors."""
    one = 2.0 * n_rows * hidden * vocab
    return 3 * one + one / max(1, shared_teacher_steps)
