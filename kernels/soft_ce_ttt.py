"""All K TTT steps of the fused soft cross-entropy in one call, the teacher shared
(docs/training.md): step j's row t has the teacher of position t + shift + j, so the teacher
logits of a chunk of positions are computed ONCE and reused by every step; a TTT step costs three
matmuls, not four, and the teacher lse needs no separate pass. The packed form skips the rows
without a teacher. The row pass, the dispatch and the chunk sizes are soft_ce.py's.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.autograd.function import once_differentiable

from eagleforge.kernels.soft_ce import check_chunk, check_pair, default_chunk_tokens, one_chunk, resolve_backend, row_fns, scale_grads_


def _ttt_outputs(draft_hiddens, draft_head, n_rows: int, need_grad_h, need_grad_head):
    """(loss_rows [K, N] fp32 zeros, argmax [K, N], grads_h, grad_head) of the TTT forwards. The
    gradients are left EMPTY: every row with a teacher is written by its chunk, `_ttt_tails`
    zeroes the rest, and the first grad-head addmm has beta 0 (zero-filling them cost ~0.9 ms a
    call at T = 8192 on an H200)."""
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


@torch.no_grad()
def _ttt_forward(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, shift,
                 need_grad_h, need_grad_head, chunk, backend, rows_fn=None):
    """-> (step_losses [K] fp32, argmax [K, N], grads_h list of [N, H] | None, grad_head | None).
    rows_fn: another row pass with soft_ce's contract (the LK loss's, kernels/lk.py); weight may
    then carry trailing dims ([K, N, 2]), sliced by step and row here.

    Loop over chunks of teacher positions [s0, s1): teacher logits, their lse and S once, then for
    each step j the draft rows [s0 - d, s1 - d) with d = shift + j (their teachers are exactly
    that chunk): draft logits, row pass, both gradient matmuls. Rows n >= N - d of step j have
    no teacher: they get argmax only, and must have weight 0."""
    default_rows_fn, _, lse_psum_fn = row_fns(backend)
    rows_fn = rows_fn or default_rows_fn
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
    copy of all rows at once was slower: 95 us against ~70 us for the seven copies on an H200)."""
    off = 0
    for j, t0, t1 in spans:
        n = t1 - t0
        if grads_h[j] is not None:
            r0 = t0 + s0 - shift - j
            grads_h[j][r0:r0 + n] = packed[off:off + n]
        off += n


@torch.no_grad()
def _ttt_forward_packed(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, shift,
                        need_grad_h, need_grad_head, chunk, backend, rows_fn=None):
    """Same contract as `_ttt_forward`, with the K steps of a teacher chunk PACKED: the draft rows
    of every step whose teacher lies in the chunk are copied into one [P <= chunk, H] buffer, so
    each chunk runs ONE draft-logits matmul, ONE row pass (teacher rows by index), ONE grad-hidden
    matmul and ONE grad-head addmm instead of K of each. `chunk` bounds P (the [P, Vd] logits,
    as in the unpacked form); the teacher chunk is chunk // K positions.

    Cost of packing: a copy of the rows in (P x H) and of their gradients out, about
    2 x 2 P H bytes per chunk, small beside the 6 P H Vd matmul FLOPs."""
    default_rows_fn, _, lse_psum_fn = row_fns(backend)
    rows_fn = rows_fn or default_rows_fn
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


class FusedTTTLoss(torch.autograd.Function):
    """All TTT steps of a chunked loss whose gradients its forward computes (soft CE here, LK in
    kernels/lk.py): `forward_fn(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight,
    shift, need_grad_hiddens, need_grad_head, chunk, backend) -> (step_losses [K], argmax [K, N],
    grads_hidden, grad_head)`; returns (loss = sum of the steps, step_losses, argmax)."""

    @staticmethod
    def forward(ctx, forward_fn, draft_head, teacher_hidden, teacher_head, weight, shift, chunk, backend, *draft_hiddens):
        step_losses, argmax, grads_h, grad_head = forward_fn(
            draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, shift,
            ctx.needs_input_grad[8:], ctx.needs_input_grad[1], chunk, backend,
        )
        ctx.save_for_backward(grad_head, *grads_h)
        ctx.mark_non_differentiable(step_losses, argmax)
        ctx.backend = backend
        return step_losses.sum(), step_losses, argmax

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_steps, grad_argmax):
        grad_head, *grads_h = ctx.saved_tensors
        scale_grads_((grad_head, *grads_h), grad_loss, ctx.backend)
        return (None, grad_head, None, None, None, None, None, None, *grads_h)


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


def check_ttt_inputs(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, teacher_shift: int,
                     chunk_tokens: int | None, backend: str, check_weight: bool) -> tuple[str, int]:
    """The preconditions of a TTT-form call (shapes, dtypes, devices; see
    `fused_soft_cross_entropy_ttt`) -> (resolved backend, rows per chunk)."""
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
    return backend, chunk


def fused_soft_cross_entropy_ttt(
    draft_hiddens: Sequence[torch.Tensor],
    draft_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    weight: torch.Tensor,
    *,
    teacher_shift: int = 1,
    chunk_tokens: int | None = None,
    backend: str = "auto",
    packed: bool = False,
    check_weight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All K TTT steps in one call, the teacher logits computed once per position.

    packed: run the K steps of each teacher chunk as ONE set of matmuls over their packed rows
    (`_ttt_forward_packed`); chunk_tokens then bounds the packed rows per chunk, so the [C, Vd]
    buffers are the same size either way. Same numbers up to the order of the grad-head sum.

    draft_hiddens: K tensors [N, H] (step j's normed draft states, rows = flat positions);
    teacher_hidden [N, H]: the target's final hidden state at each flat position;
    weight [K, N] fp32. Step j's row n is scored against teacher row n + teacher_shift + j
    (ARCHITECTURE: shift 1); rows with n + shift + j >= N have no teacher and must have weight 0.
    Returns (loss = sum over steps of sum_n weight_jn CE_jn, differentiable; step_losses [K]
    fp32, detached; draft argmax [K, N] int64). Same numbers as K calls of
    `fused_soft_cross_entropy` with shifted teacher rows, at 3 matmuls per step instead of 4.

    check_weight: raise if a row without a teacher carries weight. The check reads a device
    value back (a host sync, which empties the launch queue); callers whose weights are zero
    there by construction (the trainer's, bench-train's) may pass False. Such rows are never
    scored either way: no teacher row past the end is read."""
    k_steps = len(draft_hiddens)
    backend, chunk = check_ttt_inputs(draft_hiddens, draft_head, teacher_hidden, teacher_head, weight, teacher_shift,
                                      chunk_tokens, backend, check_weight)
    args = (draft_head, teacher_hidden.detach(), teacher_head.detach(), weight.detach(), teacher_shift, chunk, backend)
    forward = _ttt_forward_packed if packed else _ttt_forward
    if torch.is_grad_enabled() and (draft_head.requires_grad or any(h.requires_grad for h in draft_hiddens)):
        return FusedTTTLoss.apply(forward, *args, *draft_hiddens)
    step_losses, argmax, _, _ = forward(draft_hiddens, *args[:5], [False] * k_steps, False, chunk, backend)
    return step_losses.sum(), step_losses, argmax


def matmul_flops_per_step(n_rows: int, hidden: int, vocab: int, shared_teacher_steps: int = 1) -> float:
    """FLOPs of one step: 3 matmuls (draft logits, grad hidden, grad head) + the teacher logits
    matmul, shared over `shared_teacher_steps` steps. For the benchmark's floors."""
    one = 2.0 * n_rows * hidden * vocab
    return 3 * one + one / max(1, shared_teacher_steps)
