"""All K TTT steps of the fused soft cross-entropy in one call, the teacher shared
(docs/training.md): step j's row t has the teacher of position t + shift + j, so the teacher
logits of a chunk of positions are computed ONCE and reused by every step; a TTT step costs three
matmuls, not four, and the teacher lse needs no separate pass. The packed form skips the rows
without a teacher. The row pass is soft_ce.py's; the chunk loops (per step and packed), the checks
and the autograd Function are kernels/rows.py's, shared with the LK loss.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from eagleforge.kernels import rows
from eagleforge.kernels.soft_ce import row_pass


def fused_soft_cross_entropy_ttt(draft_hiddens: Sequence[torch.Tensor], draft_head: torch.Tensor, teacher_hidden: torch.Tensor,
                                 teacher_head: torch.Tensor, weight: torch.Tensor, *, teacher_shift: int = 1,
                                 chunk_tokens: int | None = None, backend: str = "auto", packed: bool = False,
                                 check_weight: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All K TTT steps in one call, the teacher logits computed once per position.

    packed: run the K steps of each teacher chunk as ONE set of matmuls over their packed rows
    (rows.ttt_forward); chunk_tokens then bounds the packed rows per chunk, so the [C, Vd]
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
    forward = functools.partial(rows.ttt_forward, packed=bool(packed), row_pass=row_pass)
    return rows.ttt_loss(forward, draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, teacher_shift,
                         chunk_tokens, backend, check_weight)


def matmul_flops_per_step(n_rows: int, hidden: int, vocab: int, shared_teacher_steps: int = 1) -> float:
    """FLOPs of one step: 3 matmuls (draft logits, grad hidden, grad head) + the teacher logits
    matmul, shared over `shared_teacher_steps` steps. For the benchmark's floors."""
    one = 2.0 * n_rows * hidden * vocab
    return 3 * one + one / max(1, shared_teacher_steps)
