"""The teacher's side of a row pass: the lse of the restricted target logits and S = sum_v p_v,
once per teacher row for every TTT step that shares it; in torch (the CPU path) and as one
Triton program per row. -> `teacher_lse_fns(backend)`.
"""

from __future__ import annotations

import torch

from eagleforge.kernels.optional_triton import HAS_TRITON, tl, triton
from eagleforge.kernels.row_triton import launch, need_triton


def _lse_torch(teacher_logits: torch.Tensor) -> torch.Tensor:
    """[c, Vd] -> [c] fp32."""
    return torch.logsumexp(teacher_logits.float(), dim=-1)


def _lse_psum_torch(teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[c, Vd] -> (lse [c] fp32, S = sum_v exp(t_v - lse) [c] fp32): the teacher's side of the row
    pass, once per teacher row for all the TTT steps that share it."""
    t = teacher_logits.float()
    lse = torch.logsumexp(t, dim=-1)
    return lse, torch.exp(t - lse[:, None]).sum(-1)


if HAS_TRITON:

    @triton.jit
    def _row_lse_kernel(t_ptr, out_ptr, psum_ptr, t_stride, vocab, BLOCK: tl.constexpr, WITH_PSUM: tl.constexpr):
        """One program per row: out = logsumexp(t_row) in fp32, online over Vd blocks; WITH_PSUM
        also psum = sum exp(t - lse) (a second pass over the row)."""
        row = tl.program_id(0).to(tl.int64)
        t_row = t_ptr + row * t_stride
        offs = tl.arange(0, BLOCK)
        m = float("-inf")
        l = 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            t = tl.load(t_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(t, axis=0))
            l = l * tl.exp(m - m_new) + tl.sum(tl.exp(t - m_new), axis=0)
            m = m_new
        lse = m + tl.log(l)
        tl.store(out_ptr + row, lse)
        if WITH_PSUM:
            p_sum = 0.0
            for start in range(0, vocab, BLOCK):
                cols = start + offs
                t = tl.load(t_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                p_sum += tl.sum(tl.exp(t - lse), axis=0)
            tl.store(psum_ptr + row, p_sum)


def _lse_triton(teacher_logits: torch.Tensor, with_psum: bool = False):
    """[c, Vd] -> lse [c] fp32, or (lse, psum) with `with_psum` (see `_lse_psum_torch`)."""
    need_triton()
    if teacher_logits.stride(-1) != 1:
        raise ValueError(f"triton lse: Vd must be the contiguous dim, strides {teacher_logits.stride()}")
    rows, vocab = teacher_logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=teacher_logits.device)
    psum = torch.empty(rows, dtype=torch.float32, device=teacher_logits.device) if with_psum else out
    launch(_row_lse_kernel, rows, vocab, teacher_logits, out, psum, teacher_logits.stride(0), vocab, WITH_PSUM=with_psum)
    return (out, psum) if with_psum else out


def _lse_psum_triton(teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _lse_triton(teacher_logits, with_psum=True)


def teacher_lse_fns(backend: str):
    """(teacher lse: [c, Vd] -> [c] fp32, teacher lse and S: [c, Vd] -> ([c], [c]) fp32) of a backend."""
    if backend == "triton":
        return _lse_triton, _lse_psum_triton
    return _lse_torch, _lse_psum_torch
