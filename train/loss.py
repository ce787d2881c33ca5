"""The EAGLE-3 training loss: soft cross-entropy against the target restricted to the draft vocabulary.

For N positions, a draft head W_d [Vd, H] and the target's head rows of the draft vocabulary
W_t [Vd, H] (ARCHITECTURE.md, "Loss"):

    z_n = draft_hidden_n @ W_d.T                    draft logits            [N, Vd]
    u_n = teacher_hidden_n @ W_t.T                  target logits (restricted)
    p_n = softmax(u_n) = exp(u_n - teacher_lse_n)   target distribution, renormalized over Vd
    CE_n = -sum_v p_nv * log_softmax(z_n)_v = lse(z_n) * sum_v p_nv - sum_v p_nv z_nv
    loss = sum_n weight_n * CE_n

Gradient (teacher side is a constant):
    dloss/dz_n = weight_n * (softmax(z_n) * sum_v p_nv - p_n)
    dloss/ddraft_hidden = G @ W_d,  dloss/dW_d = G.T @ draft_hidden   with G = dloss/dz  [N, Vd]

The reference here is plain torch in fp32, chunked over positions so the [N, Vd] logits exist
only one chunk at a time: the autograd.Function computes the gradient during the forward (the
softmax is at hand there) and the backward only scales it by the upstream gradient, the same
structure as Liger-Kernel's fused linear losses. `eagleforge.kernels.fused_soft_cross_entropy`
has the same signature; `get_loss_fn` picks one (cfg.train.loss).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)

# Rows per chunk: [CHUNK, Vd] fp32 is 128 MiB at Vd = 32000, 640 MiB at Kimi's 163840.
CHUNK_ROWS = 1024

LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def teacher_logsumexp(teacher_hidden: torch.Tensor, teacher_head: torch.Tensor, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """logsumexp of the target's restricted logits, [T, H] x [Vd, H] -> [T] fp32 (no gradient).

    Computed once per batch: a position is the teacher of TTT step j for row t - 1 - j, for
    every j, and its distribution does not change with j.
    """
    _check_2d(teacher_hidden, "teacher_hidden")
    _check_2d(teacher_head, "teacher_head")
    if teacher_hidden.shape[1] != teacher_head.shape[1]:
        raise ValueError(f"teacher_hidden {tuple(teacher_hidden.shape)} and teacher_head {tuple(teacher_head.shape)} differ in H")
    head = teacher_head.float()
    out = torch.empty(teacher_hidden.shape[0], dtype=torch.float32, device=teacher_hidden.device)
    for start in range(0, teacher_hidden.shape[0], chunk_rows):
        rows = teacher_hidden[start : start + chunk_rows].float()
        out[start : start + chunk_rows] = torch.logsumexp(rows @ head.T, dim=-1)  # [c, Vd] -> [c]
    return out


def soft_cross_entropy(
    draft_hidden: torch.Tensor,
    draft_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    teacher_lse: torch.Tensor,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_n weight_n * CE_n as a scalar fp32, draft argmax [N] int64). Gradients flow to
    draft_hidden [N, H] and draft_head [Vd, H] only."""
    _check_inputs(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight)
    if torch.is_grad_enabled() and (draft_hidden.requires_grad or draft_head.requires_grad):
        return _SoftCrossEntropy.apply(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight)
    loss, argmax, _, _ = _chunked(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, False)
    return loss, argmax  # evaluation: no gradient work


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight):
        loss, argmax, grad_hidden, grad_head = _chunked(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, True)
        ctx.save_for_backward(grad_hidden, grad_head)
        ctx.input_dtypes = (draft_hidden.dtype, draft_head.dtype)
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss, grad_argmax):
        grad_hidden, grad_head = ctx.saved_tensors
        out_hidden = (grad_hidden * grad_loss).to(ctx.input_dtypes[0]) if ctx.needs_input_grad[0] else None
        out_head = (grad_head * grad_loss).to(ctx.input_dtypes[1]) if ctx.needs_input_grad[1] else None
        return out_hidden, out_head, None, None, None, None


def _chunked(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, need_grad: bool):
    """(loss, argmax, grad_hidden [N, H] | None, grad_head [Vd, H] | None), fp32, CHUNK_ROWS rows at a time."""
    n_rows = draft_hidden.shape[0]
    device = draft_hidden.device
    d_head = draft_head.detach().float()  # [Vd, H]
    t_head = teacher_head.detach().float()
    lse_t = teacher_lse.detach().float()
    w = weight.detach().float()
    grad_hidden = torch.zeros(draft_hidden.shape, dtype=torch.float32, device=device) if need_grad else None
    grad_head = torch.zeros(d_head.shape, dtype=torch.float32, device=device) if need_grad else None
    argmax = torch.empty(n_rows, dtype=torch.int64, device=device)
    loss = torch.zeros((), dtype=torch.float32, device=device)
    for start in range(0, n_rows, CHUNK_ROWS):
        sl = slice(start, start + CHUNK_ROWS)
        h = draft_hidden[sl].detach().float()  # [c, H]
        z = h @ d_head.T  # draft logits [c, Vd]
        # p = exp(u - lse_t), in place on the teacher logits u [c, Vd]
        p = (teacher_hidden[sl].detach().float() @ t_head.T).sub_(lse_t[sl, None]).exp_()
        p_sum = p.sum(-1)  # [c], 1 up to rounding; kept so the gradient is exactly that of the formula
        lse_z = torch.logsumexp(z, dim=-1)  # [c]
        ce = lse_z * p_sum - torch.linalg.vecdot(p, z)  # [c]
        # Rows of weight 0 contribute exactly nothing, even when their inputs are garbage (inf * 0).
        keep = w[sl] != 0
        loss += torch.where(keep, w[sl] * ce, 0.0).sum()
        argmax[sl] = z.argmax(-1)
        if need_grad:
            # dloss/dz = w * (softmax(z) * p_sum - p), built in place in z's storage
            g = z.sub_(lse_z[:, None]).exp_().mul_(p_sum[:, None]).sub_(p).mul_(w[sl, None])
            g.masked_fill_(~keep[:, None], 0.0)
            grad_hidden[sl] = g @ d_head
            grad_head.addmm_(g.T, h)
    return loss, argmax, grad_hidden, grad_head


def _check_2d(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def _check_inputs(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight) -> None:
    for t, name in ((draft_hidden, "draft_hidden"), (draft_head, "draft_head"), (teacher_hidden, "teacher_hidden"), (teacher_head, "teacher_head")):
        _check_2d(t, name)
    n, h = draft_hidden.shape
    if draft_head.shape[1] != h:
        raise ValueError(f"draft_head {tuple(draft_head.shape)} does not match draft_hidden {tuple(draft_hidden.shape)} in H")
    if teacher_hidden.shape[0] != n or teacher_head.shape[1] != teacher_hidden.shape[1]:
        raise ValueError(f"teacher_hidden {tuple(teacher_hidden.shape)} / teacher_head {tuple(teacher_head.shape)} do not match N={n}")
    if teacher_head.shape[0] != draft_head.shape[0]:
        raise ValueError(f"teacher_head has {teacher_head.shape[0]} rows, draft_head {draft_head.shape[0]}: both must be the draft vocabulary")
    if teacher_lse.shape != (n,) or weight.shape != (n,):
        raise ValueError(f"teacher_lse {tuple(teacher_lse.shape)} and weight {tuple(weight.shape)} must both be [{n}]")


def fused_available() -> bool:
    try:
        from eagleforge.kernels import fused_soft_cross_entropy  # noqa: F401
    except ImportError:
        return False
    return True


def get_loss_fn(name: str, device: torch.device | str) -> LossFn:
    """The soft cross-entropy to use: "reference" (this file), "fused" (eagleforge.kernels), or
    "auto" = fused on CUDA when importable, else reference."""
    device = torch.device(device)
    if name == "reference":
        return soft_cross_entropy
    if name == "fused":
        try:
            from eagleforge.kernels import fused_soft_cross_entropy
        except ImportError as err:
            raise ValueError(f"train.loss='fused' but eagleforge.kernels.fused_soft_cross_entropy cannot be imported ({err})") from None
        return fused_soft_cross_entropy
    if name == "auto":
        if device.type == "cuda" and fused_available():
            from eagleforge.kernels import fused_soft_cross_entropy

            return fused_soft_cross_entropy
        return soft_cross_entropy
    raise ValueError(f"train.loss must be one of ['auto', 'reference', 'fused'], got {name!r}")
