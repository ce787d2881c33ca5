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

This file is the one plain-torch form of the loss, in fp32 with autograd (it holds the [N, Vd]
logits): the trainer runs it with train.loss=reference, and the kernels' tests and benchmarks
take it as their reference (it is itself checked against the formula in float64). The chunked,
gradient-in-forward versions live in `eagleforge.kernels` (torch path on the CPU, Triton on
GPUs) with the same signature; `get_loss_fn` picks one (cfg.train.loss), and the trainer's
default is the kernels' shared-teacher TTT form. The teacher's logsumexp has one
implementation, `eagleforge.kernels.soft_ce.teacher_logsumexp`.

The LK loss (train.loss=lk / lk_reference; the math, and how SpecForge and speculators differ, in
eagleforge.kernels.lk): `lk_loss` here is its plain-torch form, the same way.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Sequence

import torch

from eagleforge.kernels.lk import ALPHA_FLOOR, check_options
from eagleforge.modes import LK_LOSS_MODES, LOSS_MODES

log = logging.getLogger(__name__)

LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def soft_cross_entropy(draft_hidden: torch.Tensor, draft_head: torch.Tensor, teacher_hidden: torch.Tensor,
                       teacher_head: torch.Tensor, teacher_lse: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_n weight_n * CE_n as a scalar fp32, draft argmax [N] int64). Gradients flow to
    draft_hidden [N, H] and draft_head [Vd, H] only (plain autograd: this is the reference)."""
    z, p, argmax = _logits(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, torch.float32)
    loss = (weight.detach().float() * _cross_entropy(z, p)).sum()
    return loss, argmax


def _logits(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, dtype):
    """(draft logits z [N, Vd] with autograd, target distribution p [N, Vd], draft argmax [N]),
    in `dtype`, after the input checks."""
    _check_inputs(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight)
    keep = weight != 0  # [N]
    # Rows of weight 0 contribute exactly nothing, even when their inputs are garbage (inf * 0):
    # they enter the differentiable path as zeros.
    hidden = torch.where(keep[:, None], draft_hidden, 0).to(dtype)  # [N, H]
    teacher = torch.where(keep[:, None], teacher_hidden.detach(), 0).to(dtype)
    lse_t = torch.where(keep, teacher_lse.detach(), 0).to(dtype)  # [N]
    z = hidden @ draft_head.to(dtype).T  # draft logits [N, Vd]
    p = torch.exp(teacher @ teacher_head.detach().to(dtype).T - lse_t[:, None])  # target distribution
    argmax = z.detach().argmax(-1)
    if not bool(keep.all()):  # the accuracy still counts masked rows: their argmax from real inputs
        argmax[~keep] = (draft_hidden[~keep].detach().to(dtype) @ draft_head.detach().to(dtype).T).argmax(-1)
    return z, p, argmax


def _cross_entropy(z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """CE_n = -sum_v p_nv log_softmax(z_n)_v = lse(z_n) sum_v p_nv - sum_v p_nv z_nv, [N]."""
    return torch.logsumexp(z, dim=-1) * p.sum(-1) - (p * z).sum(-1)


def lk_loss(draft_hidden: torch.Tensor, draft_head: torch.Tensor, teacher_hidden: torch.Tensor, teacher_head: torch.Tensor,
            teacher_lse: torch.Tensor, weight: torch.Tensor, *, variant: str = "lambda", kl_scale: float = 1.0,
            kl_decay: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The LK loss of eagleforge.kernels.lk over these rows, plain autograd (the reference of
    fused_lk_loss; same signature as `soft_cross_entropy` plus the variant's options):

        alpha_n = sum_v min(p_nv, q_nv)       q = softmax(z), p the target over the draft vocabulary
        lambda: lam = kl_scale * exp(-kl_decay * abar), abar = sum w alpha / sum w, lam detached;
                loss = lam * sum_n w_n CE_n + (1 - lam) * sum_n w_n (1 - alpha_n)
        alpha:  loss = sum_n w_n * -log(max(alpha_n, ALPHA_FLOOR))

    -> (loss scalar, fp32, or fp64 for fp64 inputs (gradcheck); draft argmax [N] int64)."""
    check_options(variant, kl_scale, kl_decay)
    dtype = torch.float64 if draft_hidden.dtype == torch.float64 else torch.float32
    z, p, argmax = _logits(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight, dtype)
    q = torch.softmax(z, dim=-1)  # [N, Vd]
    # min(p, q), its gradient on the draft's branch only where q < p (the target's at a tie): the
    # fused kernel's choice, so the two agree even there
    alpha = torch.where(q < p, q, p).sum(-1)  # [N]
    w = weight.detach().to(dtype)
    if variant == "alpha":
        return (w * -torch.log(alpha.clamp_min(ALPHA_FLOOR))).sum(), argmax
    ce = _cross_entropy(z, p)  # [N]
    mean_alpha = (w * alpha.detach()).sum() / w.sum().clamp_min(torch.finfo(torch.float32).tiny)
    lam = kl_scale * torch.exp(-kl_decay * mean_alpha)  # a constant of the gradient
    return lam * (w * ce).sum() + (1 - lam) * (w * (1 - alpha)).sum(), argmax


def soft_cross_entropy_ttt(draft_hiddens: Sequence[torch.Tensor], draft_head: torch.Tensor, teacher_hidden: torch.Tensor,
                           teacher_head: torch.Tensor, weight: torch.Tensor,
                           teacher_shift: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K steps of `soft_cross_entropy`, the teacher shared: step j's row n has the teacher row
    n + shift + j (rows past the end have none and must carry weight 0); weight [K, N].
    -> (loss, step_losses [K], argmax [K, N]), the signature of fused_soft_cross_entropy_ttt."""
    return _ttt_reference(soft_cross_entropy, draft_hiddens, draft_head, teacher_hidden, teacher_head, weight,
                          teacher_shift)


def lk_loss_ttt(draft_hiddens: Sequence[torch.Tensor], draft_head: torch.Tensor, teacher_hidden: torch.Tensor,
                teacher_head: torch.Tensor, weight: torch.Tensor, teacher_shift: int = 1,
                **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K steps of `lk_loss` (options: variant, kl_scale, kl_decay), the teacher shared as in
    `soft_cross_entropy_ttt`: the reference of fused_lk_loss_ttt. Each step has its own lam."""
    return _ttt_reference(functools.partial(lk_loss, **options), draft_hiddens, draft_head, teacher_hidden,
                          teacher_head, weight, teacher_shift)


def _ttt_reference(step_fn, draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, teacher_shift):
    n_rows = teacher_hidden.shape[0]
    with torch.no_grad():
        dtype = torch.float64 if teacher_hidden.dtype == torch.float64 else torch.float32
        lse = torch.logsumexp(teacher_hidden.to(dtype) @ teacher_head.to(dtype).T, dim=-1)  # [N]
    losses, argmaxes = [], []
    for j, hidden in enumerate(draft_hiddens):
        idx = (torch.arange(n_rows, device=hidden.device) + teacher_shift + j).clamp(max=n_rows - 1)
        loss, argmax = step_fn(hidden, draft_head, teacher_hidden[idx], teacher_head, lse[idx], weight[j])
        losses.append(loss)
        argmaxes.append(argmax)
    step_losses = torch.stack(losses)
    return step_losses.sum(), step_losses.detach(), torch.stack(argmaxes)


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


# The LK loss the trainer runs (train.loss=lk | lk_reference): the lambda variant with scale 1.0
# and decay 3.0, SpecForge's and the paper's; the alpha variant stays the functions' `variant="alpha"`.
LK_OPTIONS = dict(variant="lambda", kl_scale=1.0, kl_decay=3.0)


def get_loss_fn(name: str, device: torch.device | str, lk: dict | None = None) -> LossFn:
    """The per-step loss to use: the soft cross-entropy "reference" (this file), "fused"
    (eagleforge.kernels), or "auto" = fused on CUDA when importable, else reference; the LK loss
    "lk" (eagleforge.kernels.lk) or "lk_reference" (this file), with the options `lk`
    (the trainer's: LK_OPTIONS; the defaults of `lk_loss` without)."""
    device = torch.device(device)
    if name in LK_LOSS_MODES:
        if name == "lk_reference":
            return functools.partial(lk_loss, **(lk or {}))
        from eagleforge.kernels.lk import fused_lk_loss

        return functools.partial(fused_lk_loss, **(lk or {}))
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
    raise ValueError(f"train.loss must be one of {list(LOSS_MODES)}, got {name!r}")
