"""The fused losses' backward: each op's forward computes its input gradients with the loss
(chunk_loops.py) and keeps them (`keep_grads`); `GradsKeptFunction.backward`, one for all ops,
scales them by the upstream gradient in place (`scale_grads_`).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from eagleforge.kernels.optional_triton import HAS_TRITON, tl, triton

# fp32 temporaries of `scale_grads_` stay within this many elements (64 MiB).
_SCALE_CHUNK_ELEMENTS = 2**24
_SCALE_BLOCK = 4096  # elements per program of _scale_kernel (16 per thread at 8 warps)


if HAS_TRITON:

    @triton.jit
    def _scale_kernel(g_ptr, up_ptr, n, BLOCK: tl.constexpr):
        """g *= up in place, in fp32 (up: one fp32 value on the device, read by the kernel)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        up = tl.load(up_ptr)
        g = tl.load(g_ptr + offs, mask=mask)
        # round to nearest even as torch does (the interpreter would truncate by default)
        tl.store(g_ptr + offs, (g.to(tl.float32) * up).to(g_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def keep_grads(ctx, backend: str, grads, non_differentiable, lead: int) -> None:
    """The end of an op's autograd forward: the input gradients it computed are kept for
    `GradsKeptFunction.backward`, `lead` of them for the first inputs and the rest for the last."""
    ctx.save_for_backward(*grads)
    ctx.mark_non_differentiable(*non_differentiable)
    ctx.backend, ctx.lead = backend, lead


class GradsKeptFunction(torch.autograd.Function):
    """The ops' autograd Functions: the forward computes the loss and its input gradients in one
    pass and keeps them (`keep_grads`); the backward, this one for all, scales them by the upstream
    gradient. The inputs between the first `lead` and the last ones are constants (None)."""

    @staticmethod
    @once_differentiable  # the saved gradients are constants: a create_graph backward must fail, not drop terms
    def backward(ctx, grad_loss, *_):
        grads = ctx.saved_tensors
        scale_grads_(grads, grad_loss, ctx.backend)
        constants = len(ctx.needs_input_grad) - len(grads)
        return (*grads[:ctx.lead], *[None] * constants, *grads[ctx.lead:])


def scale_grads_(grads, upstream: torch.Tensor, backend: str) -> None:
    """grad *= upstream in place for each saved gradient, in fp32 (the upstream is not rounded to
    bf16). No host sync: testing for the usual upstream of 1 would read a device value back and
    stall the launch queue at the start of every backward, so the pass is always made: on the
    Triton backend one kernel per gradient reading the upstream on the device (one read and one
    write, where the chunked fp32 torch version makes three kernels per 2^24 elements; both
    measured: BENCHMARKS.md, "Fused EAGLE-3 loss"); on the torch backend in chunks of bounded
    fp32 temporaries.
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
