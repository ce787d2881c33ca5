"""AdamW on bf16 weights at fp32 precision: each weight's fp32 master is its bf16 value plus a
16-bit remainder kept beside it, so no update is rounded away.

A bf16 weight near 1.0 moves only in steps of 2^-8 to 2^-7: an AdamW update (about lr in size)
below that is lost when weights and moments live in bf16, so RMSNorm gains never leave 1.0 and,
at lr 5e-5, most N(0, 0.02) weights never move. Keeping an fp32 master per weight fixes it (what
fp32 parameters under autocast, or SpecForge's fp32 copies, do) but costs a second copy. Here the
master's bits are split instead:

    master bits (int32)  = (weight bits << 16) + remainder        weight bf16 [N], remainder int16 [N]
    weight               = master rounded to bf16 (half away from zero), the bf16 matmuls' operand
    remainder            = master bits - (weight bits << 16), in [-2^15, 2^15)

so the pair is the fp32 master exactly, and the weight is what a cast of it to bf16 gives (round
to nearest; ties, one in 2^16, away from zero instead of to even). One step, all in fp32, as
torch.optim.AdamW with fp32 parameters:

    m = b1 m + (1 - b1) g                   v = b2 v + (1 - b2) g^2
    master = master (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Bytes per parameter: weight 2 + remainder 2 + bf16 gradient 2 + fp32 moments 8 = 14, against 16
for fp32 parameters (weight, gradient, moments) and 20 at SpecForge's optimizer step. The Triton
kernel reads weight, remainder, gradient and both moments once and writes them once (26 bytes per
parameter); the CPU path is the same math in torch. A step whose `skip` flag is set (a NaN/Inf
loss or gradient: the trainer's found_inf) leaves everything, the step count included, as it was,
without the host reading the flag on CUDA. The plain-torch reference (torch.optim.AdamW over fp32
masters) is in tests/test_master_adamw.py.
"""

from __future__ import annotations

import os

import torch

from eagleforge.kernels.optional_triton import HAS_TRITON, tl, triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 1024


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N] -> (bf16 weight [N], int16 remainder [N]) whose join is `master` bit for bit."""
    bits = master.contiguous().view(torch.int32)
    high = (bits + 0x8000) >> 16  # rounded half away from zero in magnitude (arithmetic shift keeps the sign)
    low = bits - (high << 16)
    return high.to(torch.int16).view(torch.bfloat16), low.to(torch.int16)


def join_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16 weight, int16 remainder) -> the fp32 master they hold."""
    bits = (weight.contiguous().view(torch.int16).to(torch.int32) << 16) + remainder.to(torch.int32)
    return bits.view(torch.float32)


def _coefficients(step: torch.Tensor, lr: float, beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(lr / (1 - b1^t), sqrt(1 - b2^t)) as fp32 0-dim tensors on the step's device, t = step
    (computed in fp64, as torch's AdamW does in Python floats)."""
    t = step.to(torch.float64)
    return (lr / (1 - beta1 ** t)).float(), (1 - beta2 ** t).sqrt().float()


def _step_torch(weight, remainder, grad, exp_avg, exp_avg_sq, step_size, bias2_sqrt, lr, beta1, beta2, eps, weight_decay):
    """The step in torch ops, in place (the CPU path)."""
    master = join_master(weight, remainder)
    g = grad.float()
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    master.mul_(1 - lr * weight_decay)
    master.sub_(step_size * (exp_avg / (exp_avg_sq.sqrt() / bias2_sqrt + eps)))
    new_weight, new_remainder = split_master(master)
    weight.copy_(new_weight)
    remainder.copy_(new_remainder)


if HAS_TRITON:

    @triton.jit
    def _master_adamw_kernel(w_ptr, r_ptr, g_ptr, m_ptr, v_ptr, coef_ptr, skip_ptr, n, keep, beta1, beta2, one_minus_beta1,
                             one_minus_beta2, eps, BLOCK: tl.constexpr):
        """One block of elements: join the master, AdamW in fp32, split it back (see the docstring)."""
        if tl.load(skip_ptr) != 0:
            return
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        step_size = tl.load(coef_ptr)
        bias2_sqrt = tl.load(coef_ptr + 1)
        high = tl.load(w_ptr + offs, mask=mask, other=0).to(tl.int32)  # the bf16 weight's bits, sign-extended
        bits = (high << 16) + tl.load(r_ptr + offs, mask=mask, other=0).to(tl.int32)
        master = bits.to(tl.float32, bitcast=True)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # 1 - beta from the host in fp64: 1 - 0.999 taken in fp32 from fp32's 0.999 is 1.3e-5 off
        m = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0) + one_minus_beta1 * g
        v = beta2 * tl.load(v_ptr + offs, mask=mask, other=0.0) + one_minus_beta2 * g * g
        master = master * keep  # 1 - lr wd, computed in fp64 on the host as torch does
        # IEEE-rounded sqrt and divisions, as torch's AdamW computes them (tl.sqrt and / are approximate)
        denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
        master = master - step_size * tl.div_rn(m, denom)
        bits = master.to(tl.int32, bitcast=True)
        high = (bits + 0x8000) >> 16
        tl.store(w_ptr + offs, high.to(tl.int16), mask=mask)
        tl.store(r_ptr + offs, (bits - (high << 16)).to(tl.int16), mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def _use_triton(weight: torch.Tensor) -> bool:
    return HAS_TRITON and (weight.is_cuda or INTERPRET)


@torch.no_grad()
def master_adamw_step_(weight: torch.Tensor, remainder: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                       exp_avg_sq: torch.Tensor, step: torch.Tensor, skip: torch.Tensor | None, *, lr: float, beta1: float,
                       beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step of `weight` (bf16) with its `remainder` (int16) and fp32 moments, in place;
    `step` (fp32 0-dim, on the weight's device) counts the steps taken and is advanced here
    unless `skip` (0-dim, nonzero = skip) is set. All tensors contiguous and of one shape."""
    if weight.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise ValueError(f"master_adamw_step_: weight must be bfloat16 and remainder int16, got {weight.dtype} and {remainder.dtype}")
    if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
        raise ValueError(f"master_adamw_step_: the moments must be float32, got {exp_avg.dtype} and {exp_avg_sq.dtype}")
    shapes = {tuple(t.shape) for t in (weight, remainder, grad, exp_avg, exp_avg_sq)}
    if len(shapes) != 1:
        raise ValueError(f"master_adamw_step_: weight, remainder, grad and moments differ in shape: {sorted(shapes)}")
    if not all(t.is_contiguous() for t in (weight, remainder, grad, exp_avg, exp_avg_sq)):
        raise ValueError("master_adamw_step_: weight, remainder, grad and moments must be contiguous")
    if _use_triton(weight):
        if skip is None:
            skip = torch.zeros((), device=weight.device)
        step.add_(1 - (skip != 0).float())
        n = weight.numel()
        if n == 0:  # a rank's empty shard of a small tensor
            return
        coef = torch.stack(_coefficients(step, lr, beta1, beta2))  # [2] fp32: lr / bias1, sqrt(bias2)
        _master_adamw_kernel[(triton.cdiv(n, BLOCK),)](weight.view(torch.int16), remainder, grad, exp_avg, exp_avg_sq, coef, skip, n,
                                                       1 - lr * weight_decay, beta1, beta2, 1 - beta1, 1 - beta2, eps,
                                                       BLOCK=BLOCK)
        return
    if skip is not None and bool(skip):  # the CPU: reading the flag costs nothing
        return
    step.add_(1)
    step_size, bias2_sqrt = _coefficients(step, lr, beta1, beta2)
    _step_torch(weight, remainder, grad, exp_avg, exp_avg_sq, step_size, bias2_sqrt, lr, beta1, beta2, eps, weight_decay)
