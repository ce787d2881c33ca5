"""The TTT loss assembled from a batch: which rows each training-time-test step scores, their
weights, the teacher's logsumexp, and the loss (eagleforge.train.loss or the fused kernels).

Alignment (ARCHITECTURE.md, forward_ttt): at TTT step j, row t of a sample predicts token
t+2+j. Its teacher is the target's last hidden state at position t+1+j (whose next token is
t+2+j), the target's greedy choice is target_argmax[t+1+j], and the loss mask is
loss_mask[t+2+j] (0 past the end of the sample). The teacher's logsumexp over the draft
vocabulary is computed once per batch for every position and indexed by each step.

Normalization (the choice): step j's loss is the MEAN soft cross-entropy over its positions
with loss_mask[t+2+j] = 1 whose target argmax lies in the draft vocabulary; the batch loss is
sum_j step_weight_decay^j * loss_j. Each step has equal say whatever its number of positions
(later steps have fewer), and the gradient scale does not depend on the batch size.
Accuracy at step j counts every position with loss_mask[t+2+j] = 1, including those whose
target token is outside the draft vocabulary (the draft can never propose those, so the
simulated acceptance length stays honest).

train.loss=lk / lk_reference: the LK loss (eagleforge.kernels.lk) in place of the soft
cross-entropy, over the same rows with the same weights (the step's mean over its loss rows, times
decay^j); the lambda variant's mean acceptance and weight lam are per step. The stats' "loss"
sums are then the LK values.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
import torch.nn.functional as F

from eagleforge.kernels.soft_ce import teacher_logsumexp
from eagleforge.modes import LK_LOSS_MODES, PLAIN_LOSS_MODES, checkpoint_modes
from eagleforge.train.loss import LK_OPTIONS, get_loss_fn
from eagleforge.train.metrics import TTTStats

log = logging.getLogger(__name__)

# The trainer's TTT loss (TTTLoss):
STEP_WEIGHT_DECAY = 0.8  # TTT step j's loss weighted 0.8^j: EAGLE-3's recipe, which SpecForge keeps
LOSS_CHUNK_TOKENS = None  # rows per chunk of the fused loss: None = kernels/rows.py default_chunk_tokens, sized to Vd and dtype
LOSS_PACKED = False  # each step's rows in their own matmuls; packed is the same math, kept for its tests and bench-loss


def ttt_step_rows(loss_mask: torch.Tensor, step: int) -> torch.Tensor:
    """Flat indices (b * T + t) [M] of the rows that carry a loss at TTT step `step`: those
    with loss_mask[b, t + 2 + step] set. Their teacher rows are the returned indices + 1 + step
    (same sample row, since t + 1 + step < T). step = -1 gives the teacher positions s (those
    with loss_mask[s + 1] set)."""
    batch, length = loss_mask.shape
    shift = 2 + step
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    if shift < length:
        valid[:, : length - shift] = loss_mask[:, shift:].to(torch.bool)
    return valid.reshape(-1).nonzero().squeeze(1)


def ttt_loss(
    normed_hiddens: list[torch.Tensor],
    draft_head: torch.Tensor,
    last_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    teacher_lse: torch.Tensor,
    loss_mask: torch.Tensor,
    target_argmax: torch.Tensor,
    t2d: torch.Tensor,
    d2t: torch.Tensor,
    step_weight_decay: float,
    loss_fn: Callable,
) -> tuple[torch.Tensor, TTTStats]:
    """(sum_j decay^j * mean soft-CE of step j, per-step stats) for one batch; loss_fn is a
    per-step loss of train/loss.py's signature (soft_cross_entropy, lk_loss, or their fused forms).

    normed_hiddens: ttt_steps x [B, T, H] (forward_ttt); draft_head [Vd, H]; last_hidden
    [B, T, Ht]; teacher_head [Vd, Ht]; teacher_lse [B*T]; loss_mask [B, T]; target_argmax
    [B, T] target ids; t2d [V] bool; d2t [Vd] int64.
    """
    batch, length, h_target = last_hidden.shape
    teacher_flat = last_hidden.reshape(-1, h_target)  # [B*T, Ht]
    argmax_flat = target_argmax.reshape(-1)
    stats = TTTStats(len(normed_hiddens))
    total = torch.zeros((), dtype=torch.float32, device=last_hidden.device)
    for j, hidden in enumerate(normed_hiddens):
        rows = ttt_step_rows(loss_mask, j)  # [M] flat rows predicting token t+2+j
        if rows.numel() == 0:
            continue
        teacher_rows = rows + 1 + j
        target_ids = argmax_flat[teacher_rows]  # target's greedy token t+2+j
        in_vocab = t2d[target_ids]
        n_in = int(in_vocab.sum())
        weight = in_vocab.float() / max(n_in, 1)
        draft_hidden = hidden.reshape(-1, hidden.shape[-1])[rows]  # [M, H]
        ce_mean, draft_argmax = loss_fn(draft_hidden, draft_head, teacher_flat[teacher_rows], teacher_head, teacher_lse[teacher_rows], weight)
        total = total + step_weight_decay**j * ce_mean
        correct = (draft_argmax + d2t[draft_argmax]) == target_ids
        stats.ce_sum[j] += float(ce_mean.detach()) * n_in
        stats.n_loss[j] += n_in
        stats.n_correct[j] += int(correct.sum())
        stats.n_valid[j] += int(rows.numel())
    return total, stats


def ttt_loss_weights(loss_mask: torch.Tensor, target_argmax: torch.Tensor, t2d: torch.Tensor, steps: int,
                     step_weight_decay: float) -> tuple[torch.Tensor, ...]:
    """The TTT loss weights of a batch as masks on the device (no host sync), for
    fused_soft_cross_entropy_ttt with teacher_shift 1. loss_mask, target_argmax [B, T]; t2d [V].

    Step j, row t of sample b is a loss row when loss_mask[b, t + 2 + j]; its teacher is row
    t + 1 + j, whose target argmax is the token it predicts. Returns, over the flat rows N = B*T:
    weight [K, N] fp32 = loss row x (that token in the draft vocabulary) x decay^j / (such rows
    of step j), zero on rows without a teacher; valid [K, N] bool (the loss rows); teacher_ids
    [K, N] int64; n_in [K] (in-vocabulary rows per step); decay [K] fp32."""
    batch, length = loss_mask.shape
    dev = loss_mask.device
    mask = loss_mask.to(torch.bool)
    argmax = F.pad(target_argmax.reshape(batch, length).long(), (0, steps + 1))  # [B, T + K + 1]: no read past a row
    valid = torch.zeros(steps, batch, length, dtype=torch.bool, device=dev)
    teacher_ids = torch.zeros(steps, batch, length, dtype=torch.long, device=dev)
    for j in range(steps):
        if 2 + j < length:
            valid[j, :, : length - 2 - j] = mask[:, 2 + j:]
        teacher_ids[j] = argmax[:, 1 + j: 1 + j + length]  # the target's greedy token t + 2 + j
    valid, teacher_ids = valid.reshape(steps, -1), teacher_ids.reshape(steps, -1)
    in_vocab = valid & t2d[teacher_ids]  # [K, N]
    n_in = in_vocab.sum(1)  # [K], on the device
    decay = step_weight_decay ** torch.arange(steps, device=dev, dtype=torch.float32)
    weight = in_vocab.float() * (decay / n_in.clamp_min(1))[:, None]
    return weight, valid, teacher_ids, n_in, decay


def ttt_loss_shared(
    normed_hiddens: list[torch.Tensor],
    draft_head: torch.Tensor,
    last_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    loss_mask: torch.Tensor,
    target_argmax: torch.Tensor,
    t2d: torch.Tensor,
    d2t: torch.Tensor,
    step_weight_decay: float,
    compute_dtype: torch.dtype,
    chunk_tokens: int | None = None,
    packed: bool = False,
    lk: dict | None = None,
) -> tuple[torch.Tensor, TTTStats]:
    """The same loss and stats as `ttt_loss`, through the TTT form of the fused kernel: the
    teacher logits are computed once per position for all steps (3 + 1/K matmuls per step
    instead of 4) and the matmuls run in `compute_dtype` (bf16 on GPUs and on CPUs with
    bf16 units). Shapes as in `ttt_loss`. lk: the LK loss's options (train.loss.LK_OPTIONS)
    for fused_lk_loss_ttt instead of the soft cross-entropy (the lambda variant: one more
    forward-only matmul per step, for its mean acceptance).

    No host sync: the rows of each step are masks, not index lists (no nonzero), the per-step
    counts stay on the device (the weights divide by them there), and the stats are device sums
    (TTTStats.add_device_sums) read back once when the step's numbers are logged (what host syncs
    cost a step: BENCHMARKS.md, "Smaller measurements the code's choices rest on")."""
    from eagleforge.kernels import fused_lk_loss_ttt, fused_soft_cross_entropy_ttt

    fused_ttt = fused_soft_cross_entropy_ttt if lk is None else functools.partial(fused_lk_loss_ttt, **lk)
    steps = len(normed_hiddens)
    batch, length, h_target = last_hidden.shape
    n_rows = batch * length
    weight, valid, teacher_ids, n_in, decay = ttt_loss_weights(loss_mask, target_argmax, t2d, steps, step_weight_decay)
    hiddens = [h.reshape(n_rows, -1).to(compute_dtype) for h in normed_hiddens]
    loss, step_losses, draft_argmax = fused_ttt(
        hiddens, draft_head.to(compute_dtype), last_hidden.reshape(n_rows, h_target).to(compute_dtype),
        teacher_head.to(compute_dtype), weight, teacher_shift=1, chunk_tokens=chunk_tokens, packed=packed,
        check_weight=False,  # zero there by construction (valid above); the check would sync
    )
    correct = valid & ((draft_argmax + d2t[draft_argmax]) == teacher_ids)  # [K, N]
    stats = TTTStats(steps)
    sums = torch.stack([step_losses.detach().double() / decay.double() * n_in.double(), n_in.double(),
                        correct.sum(1).double(), valid.sum(1).double()])  # [4, K]
    stats.add_device_sums(sums)
    return loss, stats


def batch_teacher_lse(last_hidden: torch.Tensor, loss_mask: torch.Tensor, teacher_head: torch.Tensor) -> torch.Tensor:
    """teacher_lse [B*T] for one batch, computed once for all TTT steps. Position s is a teacher
    (of step j for row s-1-j) only when loss_mask[s+1] is set, so only those rows are computed;
    the others stay 0 and are never read."""
    h_target = last_hidden.shape[-1]
    flat = last_hidden.reshape(-1, h_target)
    teachers = ttt_step_rows(loss_mask, -1)  # shift 1: rows s with loss_mask[s+1]
    lse = torch.zeros(flat.shape[0], dtype=torch.float32, device=flat.device)
    lse[teachers] = teacher_logsumexp(flat[teachers].float(), teacher_head.float())  # fp32 logits, as the loss's own
    return lse


@torch.no_grad()
def target_argmax_from_hidden(last_hidden: torch.Tensor, full_head: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """The target's full-vocabulary greedy token [B, T] from last_hidden [B, T, Ht] and its
    whole head [V, Ht]: the fallback when the shards carry no target_argmax."""
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])
    head = full_head.to(flat.device, torch.float32)
    out = torch.empty(flat.shape[0], dtype=torch.int64, device=flat.device)
    for start in range(0, flat.shape[0], chunk_rows):
        out[start : start + chunk_rows] = (flat[start : start + chunk_rows].float() @ head.T).argmax(-1)
    return out.reshape(last_hidden.shape[:-1])


class TTTLoss:
    """forward_ttt and the TTT loss of one batch: what DraftWithLoss runs inside its forward, so
    FSDP has lm_head gathered when the loss reads it. Returns (loss, TTTStats) as ttt_loss.

    teacher_head [Vd, Ht]; the rest are the train.* keys of the same names (docs/training.md):
    loss (a LOSS_MODES name; the LK modes with LK_OPTIONS), checkpoint (one of CHECKPOINT_MODES
    or a list per step) and compile as the step plan resolved them; chunk_tokens: the fused loss's
    rows per chunk (a benchmark's fixed size; the trainer's is LOSS_CHUNK_TOKENS). The steps'
    weights and the fused loss's per-step path are this module's constants."""

    def __init__(self, teacher_head: torch.Tensor, device: torch.device, *, ttt_steps: int, loss: str = "auto",
                 bf16: bool = True, attention: str = "auto", checkpoint="none", compile: bool = False,
                 chunk_tokens: int | None = LOSS_CHUNK_TOKENS):
        self.teacher_head, self.device_type = teacher_head, device.type
        self.ttt_steps, self.step_weight_decay, self.loss, self.bf16 = ttt_steps, STEP_WEIGHT_DECAY, loss, bf16
        self.attention, self.checkpoint, self.compile = attention, checkpoint, compile
        self.chunk_tokens, self.packed = chunk_tokens, LOSS_PACKED
        self.lk = LK_OPTIONS if loss in LK_LOSS_MODES else None
        # the per-step loss of the plain path (the LK loss with its options)
        self.loss_fn = get_loss_fn(loss, device, self.lk)
        # Autocast caches each weight's bf16 copy for the whole region, so with fp32 masters only
        # TTT step 0 casts; a selectively checkpointed step j > 0 recomputes its casts, and the
        # checkpoint refuses a recompute whose casts differ from the forward's: no cache there.
        # (bf16 parameters are not cast at all.)
        self.autocast_cache = not any(mode.startswith("selective") for mode in checkpoint_modes(checkpoint, ttt_steps))

    def __call__(self, draft, aux_hidden_states, input_ids, last_hidden, loss_mask, target_argmax, input_embeds=None):
        """input_embeds: [B, T + K, H] gathered on the host (train.embed_device=host), else None."""
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16, cache_enabled=self.autocast_cache):
            hiddens = draft.forward_ttt(aux_hidden_states, input_ids, self.ttt_steps, attention=self.attention,
                                        checkpoint=self.checkpoint, embeds=input_embeds,
                                        compile="dynamic" if self.compile else False)  # batches vary in length
        if self.loss not in PLAIN_LOSS_MODES:  # the TTT form: teacher shared over steps
            return ttt_loss_shared(
                hiddens, draft.lm_head.weight, last_hidden, self.teacher_head, loss_mask, target_argmax, draft.t2d,
                draft.d2t, self.step_weight_decay, torch.bfloat16 if self.bf16 else torch.float32, self.chunk_tokens,
                packed=self.packed, lk=self.lk,
            )
        lse = batch_teacher_lse(last_hidden, loss_mask, self.teacher_head)
        return ttt_loss(hiddens, draft.lm_head.weight, last_hidden, self.teacher_head, lse, loss_mask, target_argmax,
                        draft.t2d, draft.d2t, self.step_weight_decay, self.loss_fn)
