"""RMSNorm in one pass for the native extraction (DeepseekV3RMSNorm's math, bit for bit in intent).

    y = weight * round_to_x_dtype(x * rsqrt(mean(x^2) + eps))      mean and rsqrt in fp32

`rms_norm_reference` is transformers' DeepseekV3RMSNorm verbatim in torch: an fp32 copy of x, a
square, a mean, a multiply, a cast back and a multiply by the weight, each a pass over [N, H].
At Kimi-K2.5's shapes that is a visible share of a layer (measured: BENCHMARKS.md, "Smaller
measurements the code's choices rest on") and, under tensor parallelism, the same on every rank
(the norms are replicated work, as a MoE layer's kernel profile showed).
`rms_norm` is one Triton program per row: one read, one write, fp32 inside, the same two
roundings as the reference (the normalized row to x's dtype, then the product with the weight).
The sum of squares is a tree (Triton's reduction) instead of torch's order: the mean differs in
its last fp32 bits, which after the rounding to bf16 flips an element by one ulp now and then.
"""

from __future__ import annotations

import os

import torch

from eagleforge.kernels.optional_triton import HAS_TRITON, tl, triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The row lives in registers: beyond this width the reference runs (no model here comes close).
MAX_TRITON_WIDTH = 16384


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., H] -> [..., H] in weight * x's dtype: the plain-torch formula (the ground truth)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_out, eps, BLOCK: tl.constexpr):
        """One program per row: out = w * to_x_dtype(x * rsqrt(mean(x^2) + eps))."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        normed = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)  # the reference's cast back
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _use_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel's cases: a float dtype up to fp32 shared with a contiguous [H] weight, no
    autograd (it has no backward: extraction runs under inference_mode)."""
    return (HAS_TRITON and (x.is_cuda or INTERPRET) and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weight.dtype == x.dtype and weight.device == x.device and x.shape[-1] <= MAX_TRITON_WIDTH
            and weight.is_contiguous() and weight.numel() == x.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference` in one pass on CUDA (or the CPU under TRITON_INTERPRET=1) when x and
    weight share a float dtype up to fp32; the reference elsewhere (float64 tests, mixed dtypes)."""
    if not _use_triton(x, weight):
        return rms_norm_reference(x, weight, eps)
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(hidden)
        warps = 8 if block >= 4096 else 4
        extra = {} if INTERPRET else {"num_warps": warps}
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, hidden, rows.stride(0), out.stride(0), float(eps),
                                           BLOCK=block, **extra)
    return out.view(x.shape)


__all__ = ["HAS_TRITON", "rms_norm", "rms_norm_reference"]
