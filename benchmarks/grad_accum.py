"""A linear layer whose backward adds its weight gradient straight into `weight.grad`.

TTT runs the midlayer's seven matmuls K times per sample (K = 7), so each weight receives K
gradients. Autograd computes each one into a fresh [out, in] tensor and AccumulateGrad then
adds it to `.grad`: per weight and step after the first, one extra write and read of the full
weight (4 bytes per bf16 parameter). `accumulating_linear` instead runs the weight-gradient GEMM
with beta = 1 into `.grad` itself (cuBLAS reads and writes C in its epilogue), as Megatron's
gradient-accumulation fusion does. For the Kimi draft's midlayer (807M parameters) that is about
19 GB of memory traffic per training step, and no [out, in] temporaries at the backward's peak.

Limits (why the trainer does not use it; bench-train measures it as a variant, `fusegrad=1`,
through `fuse_weight_grads(draft)`): autograd never sees these weight gradients, so hooks on
AccumulateGrad (DDP's and FSDP's reducers) do not fire; use it on one process. The weight must
have the activations' dtype (bf16 parameters; under autocast with fp32 masters the cast copy
would have to be kept per step, which costs what the fusion saves).
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
        ctx.save_for_backward(x)
        # The parameter itself, not a saved tensor: under activation checkpointing saved tensors
        # come back as detached aliases, and .grad set on an alias would never reach it.
        ctx.param = weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        grad_x = grad_out.matmul(ctx.param) if ctx.needs_input_grad[0] else None  # [..., in]
        if ctx.needs_input_grad[1]:
            accumulate_weight_grad(ctx.param, grad_out, x)
        return grad_x, None


def accumulating_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T -> [..., out]; weight.grad accumulated in place by the
    backward (see the module docstring). x and weight must share a dtype."""
    if x.dtype != weight.dtype:
        raise ValueError(f"accumulating_linear: input dtype {x.dtype} differs from weight dtype {weight.dtype} "
                         "(the fusion needs parameters in the compute dtype; turn fuse_weight_grads off under autocast)")
    if torch.is_autocast_enabled(x.device.type):
        raise ValueError(f"accumulating_linear: autocast to {torch.get_autocast_dtype(x.device.type)} is on: the "
                         "matmul would run in that dtype and its weight gradient would not match .grad's "
                         f"{weight.dtype}; turn fuse_weight_grads off under autocast")
    return _AccumulatingLinear.apply(x, weight)


def fuse_weight_grads(draft, enabled: bool = True) -> None:
    """Run `draft`'s TTT midlayer matmuls through accumulating_linear (or back through the
    modules themselves), via Eagle3Draft.midlayer_linear."""
    draft.midlayer_linear = (lambda module, x: accumulating_linear(x, module.weight)) if enabled else None
