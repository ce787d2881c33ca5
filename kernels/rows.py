"""The helpers the fused per-row losses (soft_ce.py, soft_ce_ttt.py, lk.py) share before and
around their math: backends, chunk sizes, the input checks (`prepare_row_loss`,
`prepare_ttt_loss`), the opening of a CPU row pass (`torch_row_operands`) and `wants_grad`.
Each op file holds its own row pass (a Triton kernel and the CPU path in torch), its autograd
Function and its entry point. Beside this file, one idea each:
- row_triton.py: the Triton row kernels' common pieces and their one launcher;
- teacher_lse.py: the teacher's side of a row pass (lse and S, once per teacher row);
- chunk_loops.py: the matmuls around an op's row pass, one step or all TTT steps;
- grads_kept.py: the ops' backward (the gradients computed in the forward, scaled).

A row pass (`RowsFn`) is one op's math on one chunk of logits:

    rows_fn(logits [c, Vd], teacher_logits [c', Vd], teacher_lse [c'] fp32, weight [c] or [c, k] fp32,
            teacher_index [c] int32 | None = None, teacher_psum [c'] fp32 | None = None)
        -> (loss_rows [c] fp32, argmax [c] int64), logits overwritten in place with G = dloss/dlogits

(one teacher row per row, c' = c, or the row named by teacher_index; teacher_psum: S = sum_v p_v
per teacher row, summed by the row pass when not given; rows whose weights are all 0 give 0 loss
and G = 0 whatever their inputs).
"""

from __future__ import annotations

from typing import Callable

import torch

from eagleforge.kernels.optional_triton import HAS_TRITON

RowsFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# Budget for the per-chunk [C, Vd] buffers. GPU: two buffers in the input dtype (logits, then the
# gradient factor in place; teacher logits); 256 MiB in all gives C = 2048 at Vd = 32000 bf16.
GPU_CHUNK_BYTES = 256 * 2**20
# CPU: the torch row pass makes about six fp32 [C, Vd] temporaries; 2^22 elements = 16 MiB each.
CPU_CHUNK_ELEMENTS = 2**22


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
