"""A linear layer whose backward adds its weight gradient straight into `weight.grad`.

TTT runs the midlayer's seven matmuls K times per sample (K = 7), so each weight receives K
gradients. Autograd computes each one into a fresh [out, in] tensor and AccumulateGrad then
adds it to `.grad`: per weight and step after the first, one extra write and read of the full
weight. `accumulating_linear` instead runs the weight-gradient GEMM with beta = 1 into `.grad`
itself (cuBLAS reads and writes C in its epilogue), as Megatron's gradient-accumulation fusion
does: for the Kimi draft's midlayer (807M parameters) about 19 GB less memory traffic per
training step, and no [out, in] temporaries at the backward's peak.

The trainer turns it on with bf16 parameters (train.param_dtype; Trainer in train/loop.py). It
needs the weight in the compute dtype: with fp32 master weights under autocast the matmul runs
on a bf16 cast copy, whose gradient autograd must convert and accumulate itself.

Under FSDP2 the weights the forward reads are the unsharded parameters FSDP2 registered for the
forward; `.grad` set here is what its post-backward reduce-scatters (it reads the unsharded
parameters' `.grad`, it does not hook AccumulateGrad). DDP's reducer does hook AccumulateGrad:
never combine this with DDP (Trainer refuses it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def accumulate_weight_grad(weight: torch.Tensor, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
    """weight.grad [out, in] += grad_out^T @ inputs, grad_out [..., out], inputs [..., in]."""
    dy = grad_out.reshape(-1, grad_out.shape[-1])  # [N, out]
    x = inputs.reshape(-1, inputs.shape[-1])  # [N, in]
    if weight.grad is None:
        weight.grad = dy.t().mm(x)  # [out, in], contiguous
    else:
        weight.grad.addmm_(dy.t(), x)  # one GEMM, C read and written in place


class _AccumulatingLinear(torch.autograd.Function):
    """y = x @ W^T (no bias). Backward: dx = dy @ W returned; dW added into W.grad, None returned."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x.to(weight.dtype)  # under autocast to the weight's dtype: the cast autocast would make
        ctx.save_for_backward(x)
        # The parameter itself, not a saved tensor: under activation checkpointing saved tensors
        # come back as detached aliases, and .grad set on an alias would never reach it.
        ctx.param = weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        grad_out = grad_out.to(x.dtype)
        grad_x = grad_out.matmul(ctx.param) if ctx.needs_input_grad[0] else None  # [..., in]
        if ctx.needs_input_grad[1]:
            accumulate_weight_grad(ctx.param, grad_out, x)
        return grad_x, None  # autograd casts grad_x to the input's dtype


def accumulating_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T -> [..., out]; weight.grad accumulated in place by the
    backward (see the module docstring). The matmul runs in the weight's dtype, which must be
    the input's or, under autocast, autocast's."""
    compute = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    if weight.dtype != compute:
        how = f"autocast to {compute}" if torch.is_autocast_enabled(x.device.type) else f"input dtype {x.dtype}"
        raise ValueError(f"accumulating_linear: weight dtype {weight.dtype} differs from the compute dtype ({how}): "
                         "the fusion needs parameters in the compute dtype (train.param_dtype=bfloat16)")
    return _AccumulatingLinear.apply(x, weight)


def fuse_weight_grads(draft, enabled: bool = True) -> None:
    """Run `draft`'s TTT midlayer matmuls through accumulating_linear (or back through the
    modules themselves), via Eagle3Draft.midlayer_linear."""
    draft.midlayer_linear = (lambda module, x: accumulating_linear(x, module.weight)) if enabled else None
