"""The chunk loops of the fused losses: the matmuls around an op's row pass (kernels/rows.py's
RowsFn), the gradients computed in the forward. One step over chunks of rows
(`row_loss_forward`), and all TTT steps over chunks of teacher positions, the teacher logits
computed once per chunk and shared by the steps (`ttt_forward`, per step or packed). Never more
than a chunk x Vd of logits.
"""

from __future__ import annotations

import torch

from eagleforge.kernels.rows import RowsFn
from eagleforge.kernels.teacher_lse import teacher_lse_fns


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
