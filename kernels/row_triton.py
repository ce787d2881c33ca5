"""The Triton row kernels' common pieces (`row_operands`, `row_pass1`, `row_block`: where a
program reads, the first pass over Vd, one block of columns) and their one launcher
(`launch_rows`, which checks the operands first). The kernels themselves are the ops' own
(soft_ce.py, lk.py); kernels/rows.py states the row-pass contract they implement.
"""

from __future__ import annotations

import os

import torch

from eagleforge.kernels.optional_triton import HAS_TRITON, tl, triton

if HAS_TRITON:

    @triton.jit
    def row_operands(row, z_ptr, t_ptr, tidx_ptr, tlse_ptr, z_stride, t_stride, HAS_TIDX: tl.constexpr):
        """Where a row kernel's program `row` reads -> (its draft logits' row, its teacher row
        index, the teacher logits' row, the teacher lse). HAS_TIDX: the teacher row is tidx[row]
        (the packed TTT form shares one teacher row among steps), else `row`."""
        if HAS_TIDX:
            trow = tl.load(tidx_ptr + row).to(tl.int64)
        else:
            trow = row
        return z_ptr + row * z_stride, trow, t_ptr + trow * t_stride, tl.load(tlse_ptr + trow)

    @triton.jit
    def row_pass1(z_row, t_row, tlse, psum_at, vocab, BLOCK: tl.constexpr, HAS_PSUM: tl.constexpr):
        """The first pass of a row kernel over its Vd blocks: online max / sum-exp of the draft
        logits z -> their lse, the first argmax, and S = sum of the teacher's p (read at psum_at
        with HAS_PSUM: then no teacher logit is read). -> (lse, argmax, S)."""
        offs = tl.arange(0, BLOCK)
        m = float("-inf")  # running max of z
        l = 0.0  # running sum of exp(z - m)
        p_sum = 0.0
        if HAS_PSUM:
            p_sum = tl.load(psum_at)
        best = float("-inf")
        best_idx = 0
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            mask = cols < vocab
            z = tl.load(z_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            if not HAS_PSUM:
                t = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
                p_sum += tl.sum(tl.exp(t - tlse), axis=0)  # masked lanes: exp(-inf) = 0
            blk_max = tl.max(z, axis=0)
            blk_arg = tl.argmax(z, axis=0)
            best_idx = tl.where(blk_max > best, start + blk_arg, best_idx)  # strict: first max wins
            best = tl.maximum(best, blk_max)
            m_new = tl.maximum(m, blk_max)
            l = l * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        return m + tl.log(l), best_idx, p_sum

    @triton.jit
    def row_block(z_row, t_row, tlse, start, vocab, BLOCK: tl.constexpr):
        """A row kernel's block of Vd columns from `start` -> (cols, mask, the draft logits z in
        fp32 (0 past Vd), the teacher's p = exp(t - tlse) in fp32 (0 past Vd))."""
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(t_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        return cols, mask, z, tl.exp(t - tlse)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def need_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' needs the triton package (pip install 'eagleforge[gpu]')")


def launch_config(vocab: int) -> tuple[int, int]:
    """(BLOCK, num_warps): Vd blocks of up to 4096 lanes, 16 fp32 values per thread at 8 warps."""
    block = min(4096, triton.next_power_of_2(vocab))
    return block, (8 if block >= 2048 else 4)


def launch(kernel, rows: int, vocab: int, *args, **constexprs) -> None:
    """The one launcher of the row kernels (the losses' row passes and the teacher lse): one
    program per row, Vd in blocks of `launch_config(vocab)`."""
    if rows:
        block, warps = launch_config(vocab)
        kernel[(rows,)](*args, BLOCK=block, num_warps=warps, **constexprs)


def _check_triton_rows(logits, teacher_logits, teacher_lse, weight, teacher_index, teacher_psum, weights_per_row) -> None:
    need_triton()
    if not (logits.is_cuda or interpreting()):
        raise ValueError(f"triton row pass: logits on {logits.device}, need CUDA (or TRITON_INTERPRET=1 on the CPU)")
    if teacher_index is None and logits.shape != teacher_logits.shape:
        raise ValueError(f"triton row pass: logits {tuple(logits.shape)} != teacher logits {tuple(teacher_logits.shape)}")
    if teacher_index is not None and (logits.shape[1] != teacher_logits.shape[1] or teacher_index.shape != (logits.shape[0],)
                                      or teacher_index.dtype != torch.int32 or not teacher_index.is_contiguous()):
        raise ValueError(f"triton row pass: logits {tuple(logits.shape)}, teacher logits {tuple(teacher_logits.shape)} and "
                         f"teacher_index {teacher_index.dtype} {tuple(teacher_index.shape)} (contiguous int32 [rows]) disagree")
    if logits.stride(-1) != 1 or teacher_logits.stride(-1) != 1:
        raise ValueError(f"triton row pass: Vd must be the contiguous dim, strides {logits.stride()} / {teacher_logits.stride()}")
    rows, teacher_rows = logits.shape[0], teacher_logits.shape[0]
    for name, t, shape in (("teacher_lse", teacher_lse, (teacher_rows,)), ("teacher_psum", teacher_psum, (teacher_rows,)),
                           ("weight", weight, (rows,) if weights_per_row == 1 else (rows, weights_per_row))):
        if t is None:
            continue
        if t.shape != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"triton row pass: {name} must be contiguous fp32 {list(shape)}, got {t.dtype} {tuple(t.shape)}")


def launch_rows(kernel, logits: torch.Tensor, teacher_logits: torch.Tensor, teacher_lse: torch.Tensor, weight: torch.Tensor,
                teacher_index: torch.Tensor | None = None, teacher_psum: torch.Tensor | None = None, *scalars,
                weights_per_row: int = 1, **constexprs) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss's Triton row pass (the RowsFn contract, weight [c] or [c, weights_per_row]): the
    checks, the outputs, and `kernel` launched with the row kernels' parameters

        (z_ptr, t_ptr, tidx_ptr, tlse_ptr, psum_ptr, w_ptr, loss_ptr, argmax_ptr, z_stride, t_stride,
         vocab, *scalars, BLOCK, HAS_TIDX, HAS_PSUM, **constexprs)

    (tidx_ptr / psum_ptr point at teacher_lse when there is no index / no S: never read)."""
    _check_triton_rows(logits, teacher_logits, teacher_lse, weight, teacher_index, teacher_psum, weights_per_row)
    rows, vocab = logits.shape
    loss_rows = torch.empty(rows, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device)
    launch(kernel, rows, vocab, logits, teacher_logits, teacher_index if teacher_index is not None else teacher_lse,
           teacher_lse, teacher_psum if teacher_psum is not None else teacher_lse, weight, loss_rows, argmax,
           logits.stride(0), teacher_logits.stride(0), vocab, *scalars,
           HAS_TIDX=teacher_index is not None, HAS_PSUM=teacher_psum is not None, **constexprs)
    return loss_rows, argmax
