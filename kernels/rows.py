"""What the fused per-row losses (soft_ce.py, soft_ce_ttt.py, lk.py) share: helpers, not a
framework. Each op file holds its own math (a Triton kernel, its launcher, the CPU path), its
autograd Function and its entry point; this module holds what they would otherwise repeat:
- backends, chunk sizes and the input checks (`prepare_row_loss`, `prepare_ttt_loss`);
- the Triton row kernels' common pieces (`row_operands`, `row_pass1`, `row_block`) and their one
  launcher (`launch_rows`, which checks the operands);
- the teacher's side of a row pass, lse and S once per teacher row (`teacher_lse_fns`);
- the chunk loops that run the matmuls around an op's row pass and compute the gradients in the
  forward: one step (`row_loss_forward`), all TTT steps with the teacher shared (`ttt_forward`,
  per step or packed);
- the ops' autograd backward, those gradients scaled by the upstream (`GradsKeptFunction`,
  `keep_grads`, `scale_grads_`).

A row pass (`RowsFn`) is one op's math on one chunk of logits:

    rows_fn(logits [c, Vd], teacher_logits [c', Vd], teacher_lse [c'] fp32, weight [c] or [c, k] fp32,
            teacher_index [c] int32 | None = None, teacher_psum [c'] fp32 | None = None)
        -> (loss_rows [c] fp32, argmax [c] int64), logits overwritten in place with G = dloss/dlogits

(one teacher row per row, c' = c, or the row named by teacher_index; teacher_psum: S = sum_v p_v
per teacher row, summed by the row pass when not given; rows whose weights are all 0 give 0 loss
and G = 0 whatever their inputs).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch.autograd.function import once_differentiable

from eagleforge.kernels.optional_triton import HAS_TRITON, tl, triton

RowsFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# Budget for the per-chunk [C, Vd] buffers. GPU: two buffers in the input dtype (logits, then the
# gradient factor in place; teacher logits); 256 MiB in all gives C = 2048 at Vd = 32000 bf16.
GPU_CHUNK_BYTES = 256 * 2**20
# CPU: the torch row pass makes about six fp32 [C, Vd] temporaries; 2^22 elements = 16 MiB each.
CPU_CHUNK_ELEMENTS = 2**22


# ----------------------------------------------------------------------------------------------
# Backends, chunk sizes, input checks
# ----------------------------------------------------------------------------------------------

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA when triton imports, else 'torch'."""
    if backend not in BACKENDS:
        raise ValueError(f"fused loss backend {backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        return "triton" if (device.type == "cuda" and HAS_TRITON) else "torch"
    return backend


def default_chunk_tokens(vocab: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per chunk so the [C, Vd] buffers stay inside the budget (multiple of 128 on GPU)."""
    if device.type == "cuda":
        per_row = 2 * vocab * torch.empty((), dtype=dtype).element_size()
        return max(128, GPU_CHUNK_BYTES // per_row // 128 * 128)
    return max(16, CPU_CHUNK_ELEMENTS // vocab)


def check_pair(hidden: torch.Tensor, head: torch.Tensor, hname: str, wname: str) -> None:
    if hidden.dim() != 2 or head.dim() != 2:
        raise ValueError(f"{hname} must be [N, H] and {wname} [Vd, H], got {tuple(hidden.shape)} and {tuple(head.shape)}")
    if hidden.shape[1] != head.shape[1]:
        raise ValueError(f"{hname} {tuple(hidden.shape)} and {wname} {tuple(head.shape)} differ in H")
    if hidden.dtype != head.dtype:
        raise ValueError(f"{hname} is {hidden.dtype} but {wname} is {head.dtype}: cast one (matmuls run in the input dtype)")
    if hidden.device != head.device:
        raise ValueError(f"{hname} on {hidden.device} but {wname} on {head.device}")


def _check_vector(t: torch.Tensor, name: str, rows: int, device: torch.device) -> None:
    if t.shape != (rows,) or t.dtype != torch.float32:
        raise ValueError(f"{name} must be fp32 [{rows}], got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} on {t.device}, inputs on {device}")


def check_chunk(chunk_tokens: int) -> None:
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")


def prepare_row_loss(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight,
                     chunk_tokens: int | None, backend: str) -> tuple[tuple, int, str]:
    """The checks and the argument tuple of a single-step op (shapes, devices, the [N] vectors,
    the backend and the chunk size). -> ((draft_hidden, draft_head, teacher_hidden, teacher_head,
    teacher_lse, weight) with the constants detached, chunk rows, backend)."""
    check_pair(draft_hidden, draft_head, "draft_hidden", "draft_head")
    check_pair(teacher_hidden, teacher_head, "teacher_hidden", "teacher_head")
    n_rows, vocab = draft_hidden.shape[0], draft_head.shape[0]
    if teacher_hidden.shape[0] != n_rows or teacher_head.shape[0] != vocab:
        raise ValueError(f"teacher_hidden {tuple(teacher_hidden.shape)} / teacher_head {tuple(teacher_head.shape)} "
                         f"do not match draft_hidden {tuple(draft_hidden.shape)} / draft_head {tuple(draft_head.shape)}")
    if teacher_hidden.device != draft_hidden.device:
        raise ValueError(f"teacher on {teacher_hidden.device}, draft on {draft_hidden.device}")
    _check_vector(teacher_lse, "teacher_lse", n_rows, draft_hidden.device)
    _check_vector(weight, "weight", n_rows, draft_hidden.device)
    backend = resolve_backend(backend, draft_hidden.device)
    chunk = chunk_tokens or default_chunk_tokens(vocab, draft_head.dtype, draft_hidden.device)
    check_chunk(chunk)
    args = (draft_hidden, draft_head, teacher_hidden.detach(), teacher_head.detach(),
            teacher_lse.detach().contiguous(), weight.detach().contiguous())
    return args, chunk, backend


def _check_no_teacher_weight(weight: torch.Tensor, shift: int) -> None:
    """Rows without a teacher (n + shift + j >= N) must carry weight 0: one host sync for all steps."""
    k_steps, n_rows = weight.shape
    no_teacher = torch.arange(n_rows, device=weight.device)[None, :] + shift \
        + torch.arange(k_steps, device=weight.device)[:, None] >= n_rows  # [K, N]
    bad = (weight != 0) & no_teacher
    if bool(bad.any()):
        j = int(bad.any(1).nonzero()[0])
        tail = max(0, n_rows - shift - j)
        raise ValueError(f"weight[{j}, {tail}:] must be 0: those rows' teacher (row n + {shift} + {j}) "
                         f"lies past the last of {n_rows} rows")


def prepare_ttt_loss(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, teacher_shift: int,
                     chunk_tokens: int | None, backend: str, check_weight: bool) -> tuple[tuple, int, str]:
    """The checks and the argument tuple of an all-steps op (shapes, dtypes, devices; see
    soft_ce_ttt.fused_soft_cross_entropy_ttt). -> ((draft_head, teacher_hidden, teacher_head,
    weight) with the constants detached, chunk rows, backend)."""
    if len(draft_hiddens) == 0:
        raise ValueError("draft_hiddens is empty: need one [N, H] tensor per TTT step")
    check_pair(teacher_hidden, teacher_head, "teacher_hidden", "teacher_head")
    n_rows, vocab = teacher_hidden.shape[0], draft_head.shape[0] if draft_head.dim() == 2 else -1
    for j, hidden in enumerate(draft_hiddens):
        check_pair(hidden, draft_head, f"draft_hiddens[{j}]", "draft_head")
        if hidden.shape[0] != n_rows or hidden.device != teacher_hidden.device:
            raise ValueError(f"draft_hiddens[{j}] {tuple(hidden.shape)} on {hidden.device} does not match "
                             f"teacher_hidden {tuple(teacher_hidden.shape)} on {teacher_hidden.device}")
    if teacher_head.shape[0] != vocab:
        raise ValueError(f"teacher_head {tuple(teacher_head.shape)} and draft_head {tuple(draft_head.shape)} differ in Vd")
    k_steps = len(draft_hiddens)
    if weight.shape != (k_steps, n_rows) or weight.dtype != torch.float32 or weight.device != teacher_hidden.device:
        raise ValueError(f"weight must be fp32 [{k_steps}, {n_rows}] on {teacher_hidden.device}, "
                         f"got {weight.dtype} {tuple(weight.shape)} on {weight.device}")
    if teacher_shift < 0:
        raise ValueError(f"teacher_shift must be >= 0, got {teacher_shift}")
    if check_weight:
        _check_no_teacher_weight(weight, teacher_shift)
    backend = resolve_backend(backend, teacher_hidden.device)
    chunk = chunk_tokens or default_chunk_tokens(vocab, draft_head.dtype, teacher_hidden.device)
    check_chunk(chunk)
    return (draft_head, teacher_hidden.detach(), teacher_head.detach(), weight.detach()), chunk, backend


def torch_row_operands(logits, teacher_logits, teacher_lse, teacher_index, teacher_psum):
    """The opening of a CPU row pass (what `row_operands` and `row_pass1` are to a kernel): each
    row's teacher, teacher_index's row or its own -> (z: the logits in fp32 [c, Vd], p: the
    teacher's probabilities [c, Vd], the draft's lse [c] and argmax [c], S = sum_v p_v [c])."""
    if teacher_index is not None:  # row r's teacher is teacher row teacher_index[r]
        index = teacher_index.long()
        teacher_logits, teacher_lse = teacher_logits[index], teacher_lse[index]  # [c, Vd], [c]
        teacher_psum = teacher_psum[index] if teacher_psum is not None else None
    z = logits.float()  # a view when the logits are fp32: everything is read before G is written
    p = torch.exp(teacher_logits.float() - teacher_lse[:, None])  # [c, Vd]
    lse, argmax = torch.logsumexp(z, dim=-1), z.argmax(-1)  # [c], [c]
    p_sum = p.sum(-1) if teacher_psum is None else teacher_psum  # S [c]
    return z, p, lse, argmax, p_sum


def wants_grad(*tensors: torch.Tensor) -> bool:
    """Whether an op runs through its autograd Function (else its forward alone, no gradient work)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------------------------
# The Triton row kernels: their common pieces and their launcher
# ----------------------------------------------------------------------------------------------


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


def _need_triton() -> None:
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
    _need_triton()
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


# ----------------------------------------------------------------------------------------------
# The teacher's side of a row pass: lse and S, once per teacher row
# ----------------------------------------------------------------------------------------------


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
    _need_triton()
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


# ----------------------------------------------------------------------------------------------
# The chunk loops: one step, and all TTT steps with the teacher shared (per step or packed)
# ----------------------------------------------------------------------------------------------


def one_chunk(h, draft_head, teacher_logits, teacher_lse, weight, zbuf, rows_fn, grad_h_out, grad_head, first,
              teacher_psum=None):
    """Draft logits, row pass `rows_fn`, both gradient matmuls for one chunk of rows h [c, H].
    -> (loss_rows [c], argmax [c]); grad_head accumulated in place (beta 0 on the first chunk)."""
    zb = zbuf[: h.shape[0]]
    torch.mm(h, draft_head.T, out=zb)  # [c, Vd] draft logits
    loss_rows, argmax = rows_fn(zb, teacher_logits, teacher_lse, weight, teacher_psum=teacher_psum)  # zb := G [c, Vd]
    if grad_h_out is not None:
        torch.mm(zb, draft_head, out=grad_h_out)  # [c, Vd] x [Vd, H]
    if grad_head is not None:
        grad_head.addmm_(zb.T, h, beta=0.0 if first else 1.0)  # [Vd, c] x [c, H]
    return loss_rows, argmax


@torch.no_grad()
def row_loss_forward(draft_hidden, draft_head, teacher_hidden, teacher_head, teacher_lse, weight,
                     need_grad_h, need_grad_head, chunk, rows_fn: RowsFn):
    """One step over chunks of rows, the row pass `rows_fn` -> (loss fp32 scalar, argmax [N],
    grad_hidden [N, H] | None, grad_head [Vd, H] | None). weight may carry trailing dims ([N, 2]
    for the LK row pass), sliced by row here."""
    n_rows, vocab = draft_hidden.shape[0], draft_head.shape[0]
    dev = draft_hidden.device
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=dev)
    argmax = torch.empty(n_rows, dtype=torch.int64, device=dev)
    # contiguous whatever the inputs' layout: `scale_grads_` scales them in place through a flat view
    grad_h = torch.empty_like(draft_hidden, memory_format=torch.contiguous_format) if need_grad_h else None
    # empty: the first chunk's addmm has beta 0; zeros only when there is no chunk (N = 0)
    make_grad_head = torch.empty_like if n_rows else torch.zeros_like
    grad_head = make_grad_head(draft_head, memory_format=torch.contiguous_format) \
        if need_grad_head else None
    c_max = max(1, min(chunk, n_rows))
    zbuf = torch.empty(c_max, vocab, dtype=draft_head.dtype, device=dev)
    tbuf = torch.empty(c_max, vocab, dtype=teacher_head.dtype, device=dev)
    for i, s in enumerate(range(0, n_rows, chunk)):
        e = min(n_rows, s + chunk)
        tb = tbuf[: e - s]
        torch.mm(teacher_hidden[s:e], teacher_head.T, out=tb)  # [c, Vd] teacher logits
        loss_rows[s:e], argmax[s:e] = one_chunk(
            draft_hidden[s:e], draft_head, tb, teacher_lse[s:e], weight[s:e], zbuf, rows_fn,
            grad_h[s:e] if grad_h is not None else None, grad_head, i == 0,
        )
    return loss_rows.sum(), argmax, grad_h, grad_head


def _ttt_outputs(draft_hiddens, draft_head, n_rows: int, need_grad_h, need_grad_head):
    """(loss_rows [K, N] fp32 zeros, argmax [K, N], grads_h, grad_head) of the TTT forwards. The
    gradients are left EMPTY: every row with a teacher is written by its chunk, `_ttt_tails`
    zeroes the rest, and the first grad-head addmm has beta 0 (what zero-filling them cost:
    BENCHMARKS.md, "Fused EAGLE-3 loss")."""
    k_steps, dev = len(draft_hiddens), draft_head.device
    loss_rows = torch.zeros(k_steps, n_rows, dtype=torch.float32, device=dev)
    argmax = torch.empty(k_steps, n_rows, dtype=torch.int64, device=dev)
    grads_h = [torch.empty_like(h, memory_format=torch.contiguous_format) if need_grad_h[j] else None
               for j, h in enumerate(draft_hiddens)]
    grad_head = torch.empty_like(draft_head, memory_format=torch.contiguous_format) if need_grad_head else None
    return loss_rows, argmax, grads_h, grad_head


def _ttt_tails(draft_hiddens, draft_head, shift: int, argmax, grads_h, grad_head, head_written: bool) -> None:
    """Rows n >= N - shift - j of step j have no teacher: zero gradient, and their argmax, from ONE
    matmul for all steps (one pass over the head, not K)."""
    n_rows = draft_hiddens[0].shape[0]
    tails = [max(0, n_rows - shift - j) for j in range(len(draft_hiddens))]
    for grad, tail in zip(grads_h, tails):
        if grad is not None:
            grad[tail:].zero_()
    if grad_head is not None and not head_written:
        grad_head.zero_()
    rows = [hidden[tail:] for hidden, tail in zip(draft_hiddens, tails)]
    if sum(r.shape[0] for r in rows):
        best = (torch.cat(rows) @ draft_head.T).argmax(-1)  # [sum of tails]
        for j, part in enumerate(best.split([r.shape[0] for r in rows])):
            argmax[j, tails[j]:] = part


def ttt_forward(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, shift, need_grad_h, need_grad_head,
                chunk, backend, rows_fn: RowsFn, packed: bool):
    """All K TTT steps over chunks of teacher positions, the row pass `rows_fn` (of `backend`, whose
    teacher lse and S it uses), per step or `packed` -> (step_losses [K] fp32, argmax [K, N],
    grads_h list of [N, H] | None, grad_head | None). Step j's row n has teacher row n + shift + j;
    rows without one get argmax only (and must have weight 0). weight [K, N] may carry trailing
    dims ([K, N, 2] for the LK row pass)."""
    forward = _ttt_forward_packed if packed else _ttt_forward_per_step
    return forward(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, shift, need_grad_h, need_grad_head,
                   chunk, backend, rows_fn)


@torch.no_grad()
def _ttt_forward_per_step(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, shift,
                          need_grad_h, need_grad_head, chunk, backend, rows_fn):
    """Loop over chunks of teacher positions [s0, s1): teacher logits, their lse and S once, then for
    each step j the draft rows [s0 - d, s1 - d) with d = shift + j (their teachers are exactly
    that chunk): draft logits, row pass, both gradient matmuls."""
    _, lse_psum_fn = teacher_lse_fns(backend)
    n_rows, vocab = teacher_hidden.shape[0], draft_head.shape[0]
    dev = teacher_hidden.device
    loss_rows, argmax, grads_h, grad_head = _ttt_outputs(draft_hiddens, draft_head, n_rows, need_grad_h, need_grad_head)
    c_max = max(1, min(chunk, n_rows))
    zbuf = torch.empty(c_max, vocab, dtype=draft_head.dtype, device=dev)
    tbuf = torch.empty(c_max, vocab, dtype=teacher_head.dtype, device=dev)
    first = True
    for s0 in range(0, n_rows, chunk):
        s1 = min(n_rows, s0 + chunk)
        tb = tbuf[: s1 - s0]
        torch.mm(teacher_hidden[s0:s1], teacher_head.T, out=tb)  # [c, Vd], once for all steps
        lse, psum = lse_psum_fn(tb)  # [c], [c]
        for j, hidden in enumerate(draft_hiddens):
            d = shift + j
            r0, r1 = max(0, s0 - d), s1 - d  # draft rows whose teacher lies in [s0, s1)
            if r1 <= r0:
                continue
            t0, t1 = r0 + d - s0, r1 + d - s0
            gh = grads_h[j][r0:r1] if grads_h[j] is not None else None
            loss_rows[j, r0:r1], argmax[j, r0:r1] = one_chunk(
                hidden[r0:r1], draft_head, tb[t0:t1], lse[t0:t1], weight[j, r0:r1].contiguous(), zbuf, rows_fn,
                gh, grad_head, first, teacher_psum=psum[t0:t1],
            )
            first = False
    _ttt_tails(draft_hiddens, draft_head, shift, argmax, grads_h, grad_head, head_written=not first)
    return loss_rows.sum(-1), argmax, grads_h, grad_head


def _packed_index(spans, n_rows: int, shift: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """For a chunk's spans (step j, teacher rows [t0, t1)): each packed row's teacher row (int32)
    and its place in the [K*N] flattened step-major outputs less the chunk start s0 (int64):
    row t of step j is draft row t + s0 - (shift + j)."""
    tidx = torch.cat([torch.arange(t0, t1, device=dev, dtype=torch.int32) for _, t0, t1 in spans])
    flat = torch.cat([torch.arange(t0, t1, device=dev) + (j * n_rows - shift - j) for j, t0, t1 in spans])
    return tidx, flat


def _scatter_grads(grads_h, packed: torch.Tensor, spans, s0: int, shift: int) -> None:
    """Packed hidden-state gradients [P, H] to their steps, one contiguous copy per step (an index
    copy of all rows at once was slower: BENCHMARKS.md, "Fused EAGLE-3 loss")."""
    off = 0
    for j, t0, t1 in spans:
        n = t1 - t0
        if grads_h[j] is not None:
            r0 = t0 + s0 - shift - j
            grads_h[j][r0:r0 + n] = packed[off:off + n]
        off += n


@torch.no_grad()
def _ttt_forward_packed(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, shift,
                        need_grad_h, need_grad_head, chunk, backend, rows_fn):
    """Same contract as `_ttt_forward_per_step`, with the K steps of a teacher chunk PACKED: the
    draft rows of every step whose teacher lies in the chunk are copied into one [P <= chunk, H]
    buffer, so each chunk runs ONE draft-logits matmul, ONE row pass (teacher rows by index), ONE
    grad-hidden matmul and ONE grad-head addmm instead of K of each. `chunk` bounds P (the [P, Vd]
    logits, as in the unpacked form); the teacher chunk is chunk // K positions.

    Cost of packing: a copy of the rows in (P x H) and of their gradients out, about
    2 x 2 P H bytes per chunk, small beside the 6 P H Vd matmul FLOPs."""
    _, lse_psum_fn = teacher_lse_fns(backend)
    k_steps, n_rows, vocab = len(draft_hiddens), teacher_hidden.shape[0], draft_head.shape[0]
    hid, dev = draft_head.shape[1], teacher_hidden.device
    loss_rows, argmax, grads_h, grad_head = _ttt_outputs(draft_hiddens, draft_head, n_rows, need_grad_h, need_grad_head)
    t_chunk = max(1, chunk // k_steps)  # teacher positions per chunk
    p_max = max(1, min(t_chunk, n_rows) * k_steps)  # packed draft rows per chunk
    zbuf = torch.empty(p_max, vocab, dtype=draft_head.dtype, device=dev)  # logits, then G in place
    tbuf = torch.empty(max(1, min(t_chunk, n_rows)), vocab, dtype=teacher_head.dtype, device=dev)
    hbuf = torch.empty(p_max, hid, dtype=draft_head.dtype, device=dev)  # packed draft rows
    gbuf = torch.empty(p_max, hid, dtype=draft_head.dtype, device=dev) if any(need_grad_h) else None
    first = True
    index_of = {}  # the packed rows' teacher rows and places, by the chunk's spans
    for s0 in range(0, n_rows, t_chunk):
        s1 = min(n_rows, s0 + t_chunk)
        tb = tbuf[: s1 - s0]
        torch.mm(teacher_hidden[s0:s1], teacher_head.T, out=tb)  # [c, Vd], once for all steps
        lse, psum = lse_psum_fn(tb)  # [c], [c]: the teacher's side of the row pass, once for K steps
        # Step j's rows [r0, r1) have their teachers at [r0 + d, r1 + d) within [s0, s1), d = shift + j.
        spans = []  # (step, teacher rows [t0, t1) within the chunk); step j's draft rows are t + s0 - d
        parts, weights = [], []
        for j, hidden in enumerate(draft_hiddens):
            d = shift + j
            r0, r1 = max(0, s0 - d), s1 - d
            if r1 <= r0:
                continue
            spans.append((j, r0 + d - s0, r1 + d - s0))
            parts.append(hidden[r0:r1])
            weights.append(weight[j, r0:r1])
        if not spans:
            continue
        p = sum(t1 - t0 for _, t0, t1 in spans)
        hb, zb = hbuf[:p], zbuf[:p]
        torch.cat(parts, out=hb)  # [P, H]
        key = tuple(spans)
        if key not in index_of:  # every chunk away from the ends has the same spans: made once
            index_of[key] = _packed_index(spans, n_rows, shift, dev)
        tidx, flat = index_of[key]  # [P] int32 teacher row in the chunk; [P] int64 row in [K*N] minus s0
        flat = flat + s0
        torch.mm(hb, draft_head.T, out=zb)  # [P, Vd] draft logits of all steps
        packed_loss, packed_argmax = rows_fn(zb, tb, lse, torch.cat(weights), tidx, teacher_psum=psum)
        if gbuf is not None:
            torch.mm(zb, draft_head, out=gbuf[:p])  # [P, Vd] x [Vd, H]
        if grad_head is not None:
            grad_head.addmm_(zb.T, hb, beta=0.0 if first else 1.0)  # [Vd, P] x [P, H]
        first = False
        # the packed rows' loss and argmax back to their steps in one index copy each (not one
        # copy per step: 14 fewer small kernels per chunk)
        loss_rows.view(-1).index_copy_(0, flat, packed_loss)
        argmax.view(-1).index_copy_(0, flat, packed_argmax)
        if gbuf is not None:
            _scatter_grads(grads_h, gbuf[:p], spans, s0, shift)
    _ttt_tails(draft_hiddens, draft_head, shift, argmax, grads_h, grad_head, head_written=not first)
    return loss_rows.sum(-1), argmax, grads_h, grad_head


# ----------------------------------------------------------------------------------------------
# The backward: the gradients computed in the forward, scaled by the upstream
# ----------------------------------------------------------------------------------------------


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
