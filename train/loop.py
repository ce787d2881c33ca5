"""The EAGLE-3 training loop with training-time test (TTT), held-out evaluation and export.

Per optimizer step: `grad_accum` batches of whole samples per rank (train/schedule.py); per batch
the draft runs `ttt_steps` chained steps (Eagle3Draft.forward_ttt) and each step's normed hidden
states are scored against the target with the soft cross-entropy (train/ttt_loss.py, which
also says how the steps align with the target and how the loss is normalized). The batches come
from one BatchSource (train/sources.py): RUN/hidden's shards, or the target itself with
train.source=online (train/online.py), made ahead of the step by one worker (train/prefetch.py).

An optimizer step averages the batch losses of its n global batches (world x grad_accum, fewer
at an epoch's end), wherever they ran: 1 process with grad_accum 2 and 2 ranks with grad_accum
1 take the same gradient (Trainer.train_step). Logged metrics are sums over all ranks
(train/metrics.py). Under torchrun the model is DraftWithLoss (forward_ttt + this loss in one
forward) wrapped by train/distributed.py (FSDP2 or DDP); checkpoints are
torch.distributed.checkpoint (checkpoint.py).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Callable

import torch

from eagleforge.atomic import write_json_atomic
from eagleforge.config import Config
from eagleforge.errors import UserInputError
from eagleforge.failures import out_of_memory
from eagleforge.layout import Layout, init_layout
from eagleforge.modes import PLAIN_LOSS_MODES
from eagleforge.target.loading import target_path
from eagleforge.train.batching import Batch, PendingBatch, gather_embeddings
from eagleforge.train.build import build_draft, embedding_to_host
from eagleforge.train.checkpoint import (
    INPUTS_KEY,
    RUN_ID_KEY,
    check_resume_config,
    check_resume_inputs,
    checkpoint_dir,
    find_resume_checkpoint,
    load_checkpoint,
    load_draft_from_checkpoint,
    new_run_id,
    prune_checkpoints,
    refuse_a_fresh_run_over,
    save_checkpoint,
    tidy_checkpoints,
)
from eagleforge.train.distributed import DraftWithLoss, clip_grad_norm, gradient_sync, parallelize, reduce_dtype_of, resolve_parallel
from eagleforge.train.metrics import MetricLogger, TTTStats, reduce_stats
from eagleforge.train.optimizer import build_optimizer
from eagleforge.train.prefetch import Prefetcher
from eagleforge.train.schedule import Position, Schedule, Slot, make_batches, step_slots
from eagleforge.train.sources import BatchSource, check_source, open_source
from eagleforge.train.step_plan import plan_step, resolve_embed_device, resolve_param_dtype
from eagleforge.train.ttt_loss import STEP_WEIGHT_DECAY, TTTLoss, target_argmax_from_hidden
from eagleforge.train.weight_grads import fuse_weight_grads
from eagleforge.vocab import (
    check_vocab_files,
    coverage,
    load_target_head,
    load_vocab_map,
    read_target_head,
    training_sample_count,
    vocab_fingerprint,
)

log = logging.getLogger(__name__)

SUMMARY_NAME = "train_summary.json"
MIN_LR_RATIO = 0.1  # the cosine ends at 0.1 x train.lr: every measured run's schedule (BENCHMARKS.md); the last steps still learn
WEIGHT_DECAY = 0.0  # AdamW without weight decay: EAGLE-3's and SpecForge's recipe for the draft
MAX_NONFINITE_STEPS = 3  # skipped NaN/Inf steps a run survives: a rare spike is skipped, a diverging run stops soon
# online target forwards run in line, before the step that trains on them: on one GPU a producer
# thread gained nothing and two forwards ahead cost 9% (BENCHMARKS.md, bench-online)
ONLINE_PREFETCH = 0


def lr_lambda(total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak lr after `step` optimizer steps: linear warmup over
    round(warmup_ratio * total) steps (at least 1 when the ratio > 0), cosine down to min_lr_ratio."""
    warmup = max(1, round(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def training_layout(cfg: Config) -> Layout:
    """The job's Layout for training: the draft over the whole world; online, the target's groups
    of target.tp ranks inside it (eagleforge/target/groups.py target_layout)."""
    if check_source(cfg.train.source, cfg.train.cache_gb) == "online":
        from eagleforge.target.groups import target_layout

        return target_layout(cfg, cfg.train.device)
    return init_layout(cfg.train.device)


def ttt_loss_of(cfg: Config, teacher_head: torch.Tensor, device: torch.device, activation_checkpoint, compile: bool) -> TTTLoss:
    """The TTT loss with the run's train.* keys, its checkpointing and compile as the step plan
    resolved them (train/step_plan.py)."""
    tc = cfg.train
    return TTTLoss(teacher_head, device, ttt_steps=tc.ttt_steps, loss=tc.loss, bf16=tc.bf16, attention=tc.attention,
                   checkpoint=activation_checkpoint, compile=compile)


class Trainer:
    """State of one training run (one rank of it under torchrun); `run()` trains, evaluates on the
    held-out samples and exports. Distributed pieces come from train/distributed.py."""

    def __init__(self, cfg: Config, layout: Layout | None = None):
        self.cfg = cfg
        tc = cfg.train
        self.layout = layout or training_layout(cfg)
        self.device = self.layout.device
        torch.manual_seed(tc.seed)  # the same initial draft on every rank
        self.source: BatchSource = open_source(cfg, self.layout)
        self.vocab, head = self._read_vocab()
        self.parallel = resolve_parallel(tc.parallel, self.layout)
        # float32: fp32 weights under autocast. bfloat16: bf16 weights and gradients (the frozen
        # embedding too), the midlayer's weight gradients accumulated by the GEMMs themselves
        # (train/weight_grads.py), exact fp32 masters and moments in the optimizer (train/optimizer.py).
        self.param_dtype = resolve_param_dtype(tc, self.device, self.parallel)
        self.draft, self.host_embedding = self._build_draft(head)
        self.teacher_head, self.full_head = self._teacher_heads(head)
        self.schedule, self.train_ids, self.heldout_ids = self._schedule()
        self.lengths = self.schedule.lengths
        # train.activation_checkpoint / compile on auto: from the batch size and the GPU's memory
        self.step_plan = plan_step(tc, self.draft, self.param_dtype, self.device,
                                   world=self.layout.world_size if self.parallel == "fsdp" else 1, embedding=self.embedding_place,
                                   planned_mode=getattr(self.source, "planned_checkpoint", None))
        loss = ttt_loss_of(cfg, self.teacher_head, self.device, self.step_plan.activation_checkpoint, self.step_plan.compile)
        self.model = parallelize(DraftWithLoss(self.draft, loss), self.layout, self.parallel, tc.bf16,
                                 reduce_dtype_of(self.param_dtype))
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # sharded under FSDP
        self.optimizer, self.scheduler = self._optimizer()
        self.step, self.position, self.train_tokens = 0, Position(), 0
        self.run_id: str | None = None  # the run's identity: set by maybe_resume (new, or the resumed run's)
        self._inputs: dict | None = None  # rank 0: the fingerprints of the data and RUN/vocab (input_fingerprints)
        self.last_step = self.schedule.total_steps  # run() may stop earlier; the feed reads up to it
        # Skipped (non-finite) steps: counted before this process (state.json) and, per step of
        # the current log window, device flags with the step's global batches (read at log time).
        self.nonfinite_before = 0
        # (step, step skipped, its inputs held NaN/Inf, its global batches): device flags, read at log steps
        self._window_flags: list[tuple[int, torch.Tensor, torch.Tensor, list[list[int]]]] = []
        self.train_seconds, self.session_tokens = 0.0, 0  # this process only (not restored on resume)
        # the training feed: made at the first step, from the position then (after a resume)
        self.feed: Prefetcher | None = None
        # what the feed's worker makes of a slot (a benchmark may swap in a fixed batch)
        self.read: Callable[[Slot], Batch] = self._read
        self._log_setup()

    # -- construction steps

    def _read_vocab(self) -> tuple[dict, dict]:
        """RUN/vocab's map and target head, both checked: readable, sha256, shapes, finite head."""
        vocab = load_vocab_map(self.cfg.run)
        head = load_target_head(self.cfg.run)
        check_vocab_files(vocab, head, self.cfg.run / "vocab")
        return vocab, head

    def _build_draft(self, head: dict) -> tuple[torch.nn.Module, torch.Tensor | None]:
        """(the draft on the device in the parameters' dtype, the frozen embedding [V, H] on the
        host when the step plan keeps it there, else None: inside the draft)."""
        tc = self.cfg.train
        draft = build_draft(self.cfg, self.source.manifest, self.vocab, head)
        shared = self.source.shared_embedding(self.param_dtype)
        host_embedding = (embedding_to_host(draft, self.param_dtype)
                          if resolve_embed_device(tc, self.device, shared=shared is not None) else None)
        if shared is not None and host_embedding is None:  # online: the target's own tensor, no second copy
            if tuple(shared.shape) != tuple(draft.embed_tokens.weight.shape):
                raise UserInputError(f"the target's input embedding is {tuple(shared.shape)}, the draft's "
                                     f"{tuple(draft.embed_tokens.weight.shape)}: rebuild {self.cfg.run / 'vocab'}")
            draft.embed_tokens.weight = torch.nn.Parameter(shared, requires_grad=False)
        self.embedding_place = "host" if host_embedding is not None else "shared" if shared is not None else "device"
        draft = draft.to(self.device, self.param_dtype)
        fuse_weight_grads(draft, self.param_dtype == torch.bfloat16)
        return draft, host_embedding

    def _teacher_heads(self, head: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the teacher head [Vd, Ht], the full target head [V, Ht] when the source has no
        target_argmax). The fused loss runs its matmuls in bf16 under train.bf16: stored so, no
        cast copy per step (the plain-torch reference loss reads it in fp32)."""
        tc = self.cfg.train
        head_dtype = torch.bfloat16 if tc.bf16 and tc.loss not in PLAIN_LOSS_MODES else torch.float32
        teacher_head = head["lm_head"].to(self.device, head_dtype)
        full_head = None
        if not self.source.manifest.get("has_target_argmax", False):
            log.info("the shards have no target_argmax: computing it from last_hidden_state and the full target head")
            full, _ = read_target_head(target_path(self.cfg.target), self.cfg.target)
            full_head = full.to(self.device, torch.float32)
        return teacher_head, full_head

    def _schedule(self) -> tuple[Schedule, list[int], list[int]]:
        """The run's schedule over the training samples, and the training and held-out sample indices."""
        tc = self.cfg.train
        n_samples = len(self.source)
        n_train = training_sample_count(n_samples, tc.holdout_samples, str(self.cfg.run / "hidden" / "manifest.json"))
        train_ids, heldout_ids = list(range(n_train)), list(range(n_train, n_samples))
        schedule = Schedule(self.source.sample_lengths(), train_ids, tc.batch_tokens, tc.seed, self.layout.world_size,
                            tc.grad_accum, tc.epochs, tc.max_steps)
        return schedule, train_ids, heldout_ids

    def _optimizer(self):
        """AdamW over the trainable parameters at fp32 precision in either parameter dtype
        (train/optimizer.py): its step reads `found_inf` (a device flag) and then leaves weights,
        moments and step counts as they were, so a step with a NaN/Inf loss or gradient is skipped
        on the device, without a host sync (train_step); the lr schedule."""
        tc = self.cfg.train
        optimizer = build_optimizer(self.params, self.param_dtype, tc.lr, (0.9, tc.adam_beta2), WEIGHT_DECAY)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.schedule.total_steps, tc.warmup_ratio, MIN_LR_RATIO))
        return optimizer, scheduler

    def _log_setup(self) -> None:
        if not self.layout.is_main:
            return
        tc = self.cfg.train
        log.info(
            "draft: %s parameters trainable, Vd=%d, coverage %.4f; %d training / %d held-out samples; %d optimizer "
            "steps of %d batches (%d ranks x grad_accum %d, parallel=%s)",
            f"{sum(p.numel() for p in self.draft.parameters() if p.requires_grad):,}", self.vocab["d2t"].shape[0],
            coverage(self.vocab["counts"], self.vocab["t2d"]), len(self.train_ids), len(self.heldout_ids), self.total_steps,
            self.schedule.batches_per_step, self.layout.world_size, max(1, tc.grad_accum), self.parallel,
        )
        log.info("draft step: parameters %s, activation_checkpoint=%s, compile=%s; memory per rank by the plan:\n%s",
                 str(self.param_dtype).removeprefix("torch."), self.step_plan.activation_checkpoint,
                 self.step_plan.compile, "\n".join(self.step_plan.lines()))

    @property
    def total_steps(self) -> int:
        return self.schedule.total_steps

    @property
    def epoch(self) -> int:
        return self.position.epoch

    # -- batches

    def _read(self, slot: Slot) -> "Batch | PendingBatch":
        """This rank's batch of `slot` from the source, with its embedding rows when the frozen
        embedding is kept on the host: the feed worker's job (off the training thread). An online
        batch still on its way (pipeline stages) gets them once it has come."""
        batch = self.source.load(slot)
        if self.host_embedding is None:
            return batch
        if isinstance(batch, PendingBatch):
            pending = batch
            return PendingBatch(lambda: self._with_embeddings(pending.wait(), slot))
        return self._with_embeddings(batch, slot)

    def _with_embeddings(self, batch: Batch, slot: Slot) -> Batch:
        """`batch` with the frozen embedding's rows [B, T + K, H] gathered on the host (pinned on
        CUDA: copied with the batch), from the host's own input ids (an online batch's are on
        the device already; the source gives them from its samples, no copy back)."""
        ids = batch.input_ids if batch.input_ids.device.type == "cpu" else self.source.host_input_ids(slot)
        batch.input_embeds = gather_embeddings(self.host_embedding, ids, self.cfg.train.ttt_steps, pin=self.device.type == "cuda")
        return batch

    def _feed(self, slots) -> Prefetcher:
        """A worker making this rank's batches of `slots` ahead of the consumer: online, the
        target's forwards in line (ONLINE_PREFETCH); from shards, a step's worth of reads (its
        grad_accum slots) while the current step trains."""
        tc = self.cfg.train
        depth = ONLINE_PREFETCH if self.source.on_device else max(1, tc.grad_accum)
        what = "the online target forward" if self.source.on_device else "reading a batch"
        # pipeline stages: forwards started pp - 1 slots ahead of the one whose rows are awaited
        lookahead = self.layout.pp - 1 if self.source.on_device else 0
        return Prefetcher(self.read, slots, depth, self.device, side_stream=self.source.on_device, what=what, lookahead=lookahead)

    def _rank_batches(self, slots: list[Slot], feed: Prefetcher):
        """This rank's (ids or None, Batch on the device) of `slots`, in order; None: past the
        epoch's tail, the step's first batch stands in (weight 0). The states stay in the dtype
        the source made them (the target's, or the shards' storage dtype: bf16 for Kimi-K2.5), half
        the bytes of fp32 on the GPU: every reader casts them where it computes (the draft's fc to
        its weights' dtype, the losses to their matmul dtype, the teacher's logsumexp to fp32), and
        a cast of bf16 (or fp16) up to fp32 is exact, so fp32 parameters train on the same numbers
        as when the batch was converted here."""
        rank, world = self.layout.rank, self.layout.world_size
        for expected in slots:
            try:
                slot, batch = feed.get()
            except torch.OutOfMemoryError:  # online: the target's forward, chunked by extract.batch_tokens
                raise out_of_memory("train (the online target's forward)", "extract.batch_tokens", self.cfg.extract.batch_tokens,
                                    self.source.planned_bytes, self.device) from None
            if slot != expected:  # the feed follows the trainer's schedule; a mismatch is a bug
                raise RuntimeError(f"batch feed out of order: got slot {slot}, the trainer expects {expected}")
            yield slot.batch_of(rank, world), batch.to(self.device, None)

    def load_batch(self, ids: list[int]) -> Batch:
        """The batch of samples `ids` on the device, as the trainer would train it (tests, benchmarks)."""
        return self.read(step_slots([ids], 1)[0]).to(self.device, None)

    # -- one batch

    def batch_loss(self, batch: Batch, training: bool = False) -> tuple[torch.Tensor, TTTStats]:
        """(loss, stats) of one batch through the (wrapped) model: forward_ttt + the TTT loss.
        training with train.loss_positions=all: every real (unpadded) position is a loss row."""
        target_argmax = batch.target_argmax
        if target_argmax is None:
            target_argmax = target_argmax_from_hidden(batch.last_hidden_state, self.full_head)
        loss_mask = batch.loss_mask
        if training and self.cfg.train.loss_positions == "all":
            loss_mask = torch.arange(loss_mask.shape[1], device=loss_mask.device)[None] < batch.lengths[:, None]  # [B, T]
        loss, stats = self.model(batch.aux_hidden_states, batch.input_ids, batch.last_hidden_state, loss_mask, target_argmax,
                                 batch.input_embeds)
        stats.tokens = batch.num_tokens
        return loss, stats

    def train_step(self) -> tuple[TTTStats, torch.Tensor]:
        """One optimizer step over the next world x grad_accum global batches (this rank runs
        its share); returns (stats summed over all ranks, global grad norm as a 0-dim device tensor).

        Normalization: the step's loss is the mean over its n real global batches of each
        batch's loss (sum_j decay^j x per-step mean). Each rank divides a batch's loss by
        n / world and DDP/FSDP average gradients over the world, so the gradient equals the
        single-process gradient over the same n batches. A rank past the epoch's tail runs a
        batch with weight 0: every rank does the same forwards and backwards (no hang)."""
        tc = self.cfg.train
        if self.feed is None:  # from here to the last step this process will take
            self.feed = self._feed(self.schedule.slots(self.position, self.step, self.last_step))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats = TTTStats(tc.ttt_steps)
        step = self.schedule.step_at(self.position, self.step + 1)
        slots = step_slots(step.batches, self.layout.world_size, step.epoch)
        share = len(step.batches) / self.layout.world_size
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        inputs_bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for i, (ids, batch) in enumerate(self._rank_batches(slots, self.feed)):
            with gradient_sync(self.model, enabled=i == len(slots) - 1):
                loss, batch_stats = self.batch_loss(batch, training=True)
                (loss / share if ids is not None else loss * 0.0).backward()
            if ids is not None:
                stats.merge(batch_stats)
                loss_sum = loss_sum + loss.detach().float()
                # The states themselves, even in rows the loss masks out: one device reduction per
                # tensor (its cost: BENCHMARKS.md, "Smaller measurements"), no host sync.
                inputs_bad = inputs_bad + (~torch.isfinite(batch.aux_hidden_states)).any() \
                    + (~torch.isfinite(batch.last_hidden_state)).any()
        # the step's tokens over all ranks, from the host's own lengths (every rank knows the global batches)
        global_tokens = sum(self.lengths[i] for ids in step.batches for i in ids)
        stats = reduce_stats(stats, self.layout, global_tokens)
        grad_norm = clip_grad_norm(self.params, tc.grad_clip)
        # A NaN/Inf loss or gradient norm (a poisoned input, or divergence): skip the update on
        # the device. The norm is global; the loss is this rank's, so under torchrun the flag is
        # summed over the ranks and every rank skips the same steps.
        flags = torch.stack([(~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm.float()))).float(),
                             (inputs_bad > 0).float()])  # [step bad, inputs bad]
        if self.layout.distributed:
            flags = (self.layout.all_reduce_tensor(flags.to(self.device)) > 0).float()
        nonfinite = flags.max()  # non-finite inputs skip the step even where the loss masks them out
        self.optimizer.found_inf = nonfinite.to(self.params[0].device)
        self.optimizer.step()
        self._window_flags.append((step.number, nonfinite, flags[1], step.batches))
        self.scheduler.step()
        self.step, self.position = step.number, step.after
        self.train_tokens += stats.tokens
        self.session_tokens += stats.tokens  # train_seconds: counted by run() between host syncs
        return stats, grad_norm

    @torch.no_grad()
    def evaluate(self, ids: list[int]) -> TTTStats:
        """TTT loss and accuracies over the samples `ids` (the held-out ones), no gradient; the
        batches are split over the ranks like one step's batches and the sums reduced."""
        self.model.eval()
        stats = TTTStats(self.cfg.train.ttt_steps)
        batches = make_batches(self.lengths, ids, self.cfg.train.batch_tokens, self.cfg.train.seed, 0)
        slots = step_slots(batches, self.layout.world_size)
        feed = self._feed(slots)
        try:
            for batch_ids, batch in self._rank_batches(slots, feed):
                batch_stats = self.batch_loss(batch)[1]
                if batch_ids is not None:
                    stats.merge(batch_stats)
        finally:
            feed.close()
        return reduce_stats(stats, self.layout)

    # -- non-finite steps

    def nonfinite_steps(self) -> int:
        """Steps skipped for a NaN/Inf loss or gradient norm so far in the run (reads the
        current window's device flags: call it where the host waits anyway)."""
        return self.nonfinite_before + sum(1 for _, flag, _, _ in self._window_flags if float(flag) > 0)

    def _check_nonfinite(self) -> None:
        """At a log step: name the cause of the window's skipped steps and stop past
        MAX_NONFINITE_STEPS. A non-finite hidden state in the skipped steps' samples is a
        damaged input (the source names it): an error at once."""
        flags, self._window_flags = self._window_flags, []
        if not flags:
            return
        bad = torch.stack([torch.stack([f, inputs]) for _, f, inputs, _ in flags]).tolist()  # [steps, 2]
        skipped = [(step, batches, inputs > 0) for (step, _, _, batches), (flag, inputs) in zip(flags, bad) if flag > 0]
        if not skipped:
            return
        for step, batches, inputs_bad in skipped:
            if inputs_bad:
                raise UserInputError(self.source.nonfinite_error(step, [i for ids in batches for i in ids]))
        self.nonfinite_before += len(skipped)
        limit = MAX_NONFINITE_STEPS
        steps = ", ".join(str(step) for step, _, _ in skipped)
        if self.nonfinite_before > limit:
            raise UserInputError(
                f"training diverged: {self.nonfinite_before} steps had a NaN/Inf loss or gradient norm (skipped; the last: "
                f"{steps}), more than {limit}; the inputs of those steps are finite: lower "
                f"train.lr (now {self.cfg.train.lr}) or train.grad_clip")
        if self.layout.is_main:
            log.warning("step(s) %s: NaN/Inf loss or gradient norm, update skipped (%d so far; more than %d stop the run)",
                        steps, self.nonfinite_before, limit)

    # -- state

    def data_state(self) -> dict:
        """What state.json records besides the optimizer's and the scheduler's state (rank 0 writes it)."""
        return {"epoch": self.position.epoch, "batch_index": self.position.batch_index, "train_tokens": self.train_tokens,
                "nonfinite_steps": self.nonfinite_steps(), RUN_ID_KEY: self.run_id,
                INPUTS_KEY: self.input_fingerprints() if self.layout.is_main else None}

    def input_fingerprints(self) -> dict:
        """{"data" | "vocab": {"source", "sha256"}} of what this run trains on (rank 0; computed once)."""
        if self._inputs is None:
            data_file, data_sha = self.source.fingerprint()
            self._inputs = {"data": {"source": data_file, "sha256": data_sha},
                            "vocab": {"source": str(self.cfg.run / "vocab"), "sha256": vocab_fingerprint(self.cfg.run)}}
        return self._inputs

    def save(self) -> Path:
        return save_checkpoint(self.cfg, self.step, self.model, self.optimizer, self.scheduler, self.data_state(), self.layout)

    def maybe_resume(self) -> None:
        """Resume from the newest checkpoint, or start a new run where there is none. A run that
        starts afresh (train.resume=false) where an earlier run's checkpoints are is refused: it
        would prune them and mix its log with theirs."""
        if self.layout.is_main:
            tidy_checkpoints(self.cfg.run)  # the others wait in the broadcast below
        path = find_resume_checkpoint(self.cfg, self.layout)
        if path is not None and not self.cfg.train.resume:
            refuse_a_fresh_run_over(path)
        if path is None:
            self.run_id = self.layout.broadcast_object(new_run_id())
            return
        check_resume_config(self.cfg, path, self.layout.world_size)
        state = load_checkpoint(path, self.model, self.optimizer, self.scheduler, self.layout)
        check_resume_inputs(path, state, self.input_fingerprints() if self.layout.is_main else None, self.layout)
        self._check_finite_state(path)
        self.run_id = state.get(RUN_ID_KEY)  # None: written before runs recorded one; its run goes on as such
        if self.layout.is_main:  # the prune a kill cut short, once the checkpoint is known to be good
            prune_checkpoints(self.cfg.run, self.cfg.train.keep_last, self.run_id)
        self.step, self.position = int(state["step"]), Position(int(state["epoch"]), int(state["batch_index"]))
        self.train_tokens = int(state.get("train_tokens", 0))
        self.nonfinite_before = int(state.get("nonfinite_steps", 0))
        if self.layout.is_main:
            log.info("resumed from %s: step %d, epoch %d, batch %d (written by %s rank(s))", path, self.step,
                     self.position.epoch, self.position.batch_index, state.get("world_size", 1))

    def _check_finite_state(self, path: Path) -> None:
        """A checkpoint whose weights or optimizer moments hold NaN/Inf would train (and export)
        a NaN draft: refuse it. One reduction per tensor and one host read, at resume only."""
        tensors = [p for p in self.params] + [v for state in self.optimizer.state.values() for v in state.values()
                                              if isinstance(v, torch.Tensor) and v.is_floating_point()]
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t  # FSDP2: this rank's shard
            bad = bad + (~torch.isfinite(local.detach())).any().float().to(self.device)
        if self.layout.distributed:
            bad = self.layout.all_reduce_tensor(bad)
        if float(bad) > 0:
            raise UserInputError(f"{path}: the checkpoint holds NaN/Inf weights or optimizer state; delete it to resume "
                                 f"from an earlier one, or delete {path.parent} to start over")

    # -- the run

    def run(self, stop_after_step: int | None = None) -> dict | None:
        """Train to the end, evaluate, export; returns the summary. `stop_after_step` (tests)
        saves a checkpoint after that step and returns None: a kill right after a checkpoint."""
        try:
            return self._run(stop_after_step)
        except torch.OutOfMemoryError:  # the draft's step or the held-out evaluation
            planned = self.source.planned_bytes or (self.step_plan.total_bytes if self.device.type == "cuda" else None)
            raise out_of_memory("train", "train.batch_tokens", self.cfg.train.batch_tokens, planned, self.device) from None

    def _run(self, stop_after_step: int | None) -> dict | None:
        from tqdm import tqdm

        tc = self.cfg.train
        main = self.layout.is_main
        self.maybe_resume()
        self.source.begin(self.position.epoch, self.position.batch_index)
        self.last_step = min(self.total_steps, stop_after_step or self.total_steps)  # the feed stops there
        logger = MetricLogger(self.cfg.run, tc.ttt_steps, resumed_step=self.step) if main else None
        window = TTTStats(tc.ttt_steps)
        window_start, grad_norm = time.perf_counter(), 0.0
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", mininterval=5, disable=None if main else True)
        while self.step < self.total_steps:
            stats, grad_norm = self.train_step()
            window.merge(stats)
            bar.update(1)
            if self.step % tc.log_every == 0 or self.step == self.total_steps:
                norm = float(grad_norm)  # waits for the GPU: the window's time below includes its work
                window.ce_sum  # noqa: B018 - reads the window's device sums back (the same wait)
                self._check_nonfinite()  # the window's skipped-step flags (the same wait)
                elapsed = time.perf_counter() - window_start
                self.train_seconds += elapsed
                if logger is not None:
                    logger.log(self.step, self.epoch, window, STEP_WEIGHT_DECAY, self.scheduler.get_last_lr()[0], norm, window.tokens / max(elapsed, 1e-9))
                window, window_start = TTTStats(tc.ttt_steps), time.perf_counter()
            if self.step == stop_after_step:
                self.save()
                bar.close()
                return None
            if tc.save_every > 0 and self.step % tc.save_every == 0 and self.step < self.total_steps:
                saving = time.perf_counter()
                self.save()
                window_start += time.perf_counter() - saving  # a checkpoint is not training time
        bar.close()
        latest = find_resume_checkpoint(self.cfg, self.layout)
        if latest is None or latest.name != f"step-{self.step:06d}":
            self.save()
        if logger is not None:
            logger.close()
        return self.finish()

    def finish(self) -> dict:
        """Evaluate on the held-out samples (all ranks), write RUN/train_summary.json and export
        RUN/draft from the final checkpoint (rank 0)."""
        tc = self.cfg.train
        summary = {
            "steps": self.step, "epochs": self.position.epoch + (1 if self.position.batch_index else 0), "ttt_steps": tc.ttt_steps,
            "train_samples": len(self.train_ids), "heldout_samples": len(self.heldout_ids), "train_tokens": self.train_tokens,
            "train_tokens_per_s": self.session_tokens / self.train_seconds if self.train_seconds else None,
            "draft_vocab_size": int(self.vocab["d2t"].shape[0]),
            "vocab_coverage": coverage(self.vocab["counts"], self.vocab["t2d"]),
            "world_size": self.layout.world_size, "parallel": self.parallel,
            "skipped_samples": self.source.skipped_samples,
        }
        summary.update(self.source.summary())  # online: the target's share
        k = min(self.cfg.eval.k, tc.ttt_steps)
        if self.heldout_ids:
            stats = self.evaluate(self.heldout_ids)
            summary["heldout"] = {
                "tokens": stats.tokens,
                "loss": stats.loss(STEP_WEIGHT_DECAY),
                "loss_per_step": stats.loss_per_step(),
                "accuracy_per_step": stats.accuracy_per_step(),
                "simulated_acceptance_length_by_k": {str(i): stats.acceptance_length(i) for i in range(1, tc.ttt_steps + 1)},
            }
            summary["simulated_acceptance_length"] = stats.acceptance_length(k)
            summary["simulated_acceptance_length_k"] = k
            if self.layout.is_main:
                log.info(
                    "held-out: loss %.4f, accuracy per step %s, simulated acceptance length %.3f at k=%d",
                    summary["heldout"]["loss"], " ".join(f"{a:.3f}" for a in stats.accuracy_per_step()), summary["simulated_acceptance_length"], k,
                )
        else:
            if self.layout.is_main:
                log.warning("train.holdout_samples=0: no held-out evaluation, simulated_acceptance_length is null")
            summary["simulated_acceptance_length"] = None
        if self.layout.is_main:
            write_json_atomic(self.cfg.run / SUMMARY_NAME, summary, indent=1)
            export_finite(checkpoint_dir(self.cfg.run) / f"step-{self.step:06d}", self.cfg.run / "draft", self.vocab)
        self.layout.barrier()
        return summary

    def close(self) -> None:
        """Stop the feed's worker and release the source (online: the target's hooks)."""
        if self.feed is not None:
            self.feed.close()
            self.feed = None
        self.source.close()


def export_finite(checkpoint: Path, out_dir: Path, vocab: dict | None = None) -> Path:
    """RUN/draft from `checkpoint`, refused (nothing written) when a weight is NaN/Inf (such a
    draft proposes garbage that eval would not flag by itself) or, given RUN/vocab's map, when the
    checkpoint's d2t/t2d differ from it (serving engines map draft ids through d2t: a wrong one
    makes every proposal another token, silently)."""
    from eagleforge.draft import save_draft

    draft = load_draft_from_checkpoint(checkpoint)
    bad = draft.nonfinite_tensors()
    if bad:
        raise UserInputError(f"{checkpoint}: NaN/Inf in the draft's {', '.join(bad[:4])}; not exported to {out_dir}")
    if vocab is not None:
        for name in ("d2t", "t2d"):
            ours, theirs = getattr(draft, name).cpu(), vocab[name].cpu()
            if ours.shape != theirs.shape or not torch.equal(ours.to(theirs.dtype), theirs):
                raise UserInputError(f"{checkpoint}: its {name} differs from RUN/vocab's (a checkpoint of another "
                                     f"vocabulary?); not exported to {out_dir}")
    return save_draft(draft, out_dir)


def train(cfg: Config, stop_after_step: int | None = None) -> dict | None:
    """Train (resuming when RUN holds a checkpoint), evaluate held-out, export; the summary dict.
    Under torchrun every rank calls it; the process group is created and ended here unless the
    caller made it. Online with target.layout=auto, the target's split of its group's GPUs is the
    one the online plan fits and projects fastest (online_plan.choose_online_layout)."""
    if check_source(cfg.train.source, cfg.train.cache_gb) == "online":
        from eagleforge.layout import world_size_from_env
        from eagleforge.target.groups import with_chosen_layout
        from eagleforge.train.online_plan import choose_online_layout

        cfg = with_chosen_layout(cfg, cfg.train.device, lambda c, gpu: choose_online_layout(c, gpu, world_size_from_env()))
    layout = training_layout(cfg)
    trainer = None
    try:
        trainer = Trainer(cfg, layout)
        return trainer.run(stop_after_step)
    finally:
        if trainer is not None:
            trainer.close()
        layout.shutdown()
