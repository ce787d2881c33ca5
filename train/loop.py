"""The EAGLE-3 training loop with training-time test (TTT), held-out evaluation and export.

Per optimizer step: `grad_accum` batches of whole samples (train/batching.py); per batch the
draft runs `ttt_steps` chained steps (Eagle3Draft.forward_ttt) and each step's normed hidden
states are scored against the target with the soft cross-entropy (train/ttt_loss.py, which
also says how the steps align with the target and how the loss is normalized). The batches come
from RUN/hidden's shards, or from the target itself with train.source=online (train/online.py).

An optimizer step averages the batch losses of its n global batches (world x grad_accum, fewer
at an epoch's end), wherever they ran: 1 process with grad_accum 2 and 2 ranks with grad_accum
1 take the same gradient (Trainer.train_step). Logged metrics are sums over all ranks
(train/metrics.py). Under torchrun the model is DraftWithLoss (forward_ttt + this loss in one
forward) wrapped by train/distributed.py (FSDP2 or DDP); checkpoints are
torch.distributed.checkpoint (checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import fields
from pathlib import Path
from typing import Callable

import torch

from eagleforge.atomic import write_json_atomic
from eagleforge.config import Config, UserInputError
from eagleforge.modes import PLAIN_LOSS_MODES
from eagleforge.target import target_path
from eagleforge.train.batching import Batch, BatchPrefetch, collate_host, gather_embeddings, make_batches, rank_micro_batches
from eagleforge.train.checkpoint import (
    check_resume_config,
    checkpoint_dir,
    find_resume_checkpoint,
    load_checkpoint,
    load_draft_from_checkpoint,
    save_checkpoint,
)
from eagleforge.train.distributed import (
    DistEnv,
    DraftWithLoss,
    all_reduce_tensor,
    barrier,
    clip_grad_norm,
    gradient_sync,
    init_distributed,
    parallelize,
    resolve_parallel,
    shutdown,
)
from eagleforge.train.metrics import MetricLogger, TTTStats, reduce_stats
from eagleforge.train.online import check_source
from eagleforge.train.step_plan import plan_step, resolve_embed_device, resolve_param_dtype
from eagleforge.train.ttt_loss import TTTLoss, target_argmax_from_hidden
from eagleforge.train.weight_grads import fuse_weight_grads
from eagleforge.vocab import check_vocab_files, coverage, load_target_head, load_vocab_map, read_target_head, training_sample_count

log = logging.getLogger(__name__)

SUMMARY_NAME = "train_summary.json"


# ----------------------------------------------------------------------------- schedule and model


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


def target_hf_config(cfg: Config, manifest: dict):
    """The target's HF config: stored in the manifest when the extractor put it there, else
    read from the target directory (AutoConfig)."""
    stored = manifest.get("target", {}).get("config")
    if isinstance(stored, dict):
        return stored
    from transformers import AutoConfig

    path = target_path(cfg.target)
    kwargs = {"gguf_file": cfg.target.gguf_file} if cfg.target.gguf_file else {}
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=cfg.target.trust_remote_code, **kwargs)
    except (OSError, ValueError) as err:
        raise UserInputError(f"target.path {path}: cannot read the target's config ({str(err).splitlines()[0]})") from None


def build_draft(cfg: Config, manifest: dict, vocab: dict, head: dict) -> torch.nn.Module:
    """Eagle3Draft sized from the target config (+ cfg.draft overrides), with the frozen target
    embedding and d2t/t2d. lm_head keeps its random init: in a short SmolLM2 trial, starting it
    from the target's head rows gave a ~1.5x higher initial loss, grad norms ~50x larger (so
    clipping dominated) and no accuracy gain."""
    from eagleforge.draft import Eagle3Config, Eagle3Draft
    from eagleforge.draft.config import RopeConflictError

    overrides = {f.name: getattr(cfg.draft, f.name) for f in fields(cfg.draft)}
    try:
        draft_config = Eagle3Config.from_target_config(
            target_hf_config(cfg, manifest), int(vocab["d2t"].shape[0]), manifest["aux_layer_ids"], **overrides
        )
    except RopeConflictError as err:  # the target's own config, not the draft.* keys
        raise UserInputError(f"target.path {cfg.target.path or 'embedded default'}: {err}") from None
    except ValueError as err:  # a draft.* override that does not fit the target or itself
        set_keys = ", ".join(f"draft.{k}={v}" for k, v in overrides.items() if v not in (None, 0, ""))
        raise UserInputError(f"draft config ({set_keys or 'defaults'}) does not fit the target of {cfg.run / 'hidden'}: {err}") from None
    shard_hidden = manifest.get("target", {}).get("hidden_size")
    if shard_hidden is not None and int(shard_hidden) != draft_config.target_hidden_size:
        raise UserInputError(
            f"{cfg.run / 'hidden'}: the shards hold hidden_size {shard_hidden} but the target "
            f"({cfg.target.path or 'embedded default'}) has {draft_config.target_hidden_size}; extract again for this target"
        )
    draft = Eagle3Draft(draft_config)
    try:
        draft.set_embed_tokens(head["embed_tokens"])
        draft.set_vocab_map(vocab["d2t"], vocab["t2d"])
    except ValueError as err:
        raise UserInputError(f"{cfg.run / 'vocab'}: {err} (target changed since the vocab stage? rerun it)") from None
    draft.embed_tokens.weight.requires_grad_(False)
    return draft


def embedding_to_host(draft: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """Take the draft's frozen embedding out of it: returns its weight [V, H] as `dtype` on the
    host and leaves an empty [0, H] one in the draft (moved with it, holding no memory), so
    the batches bring their embedding rows (Batch.input_embeds) instead."""
    weight = draft.embed_tokens.weight.detach().to("cpu", dtype)
    draft.embed_tokens.weight = torch.nn.Parameter(weight.new_empty(0, weight.shape[1]), requires_grad=False)
    return weight


# ----------------------------------------------------------------------------- the trainer


def open_reader(cfg: Config):
    """ShardReader of RUN/hidden; with train.skip_corrupt_shards, shards failing the size or
    sha256 check are left out (logged) instead of stopping the run."""
    from eagleforge.shards import ShardReader

    tc = cfg.train
    reader = ShardReader(cfg.run / "hidden", verify_checksums=tc.verify_checksums, skip_corrupt=tc.skip_corrupt_shards)
    if reader.skipped_shards:
        log.warning("skipped %d corrupt shard(s) holding %d samples: %s", len(reader.skipped_shards),
                    reader.skipped_samples, ", ".join(map(str, reader.skipped_shards)))
    return reader


class Trainer:
    """State of one training run (one rank of it under torchrun); `run()` trains, evaluates on the
    held-out samples and exports. Distributed pieces come from train/distributed.py."""

    def __init__(self, cfg: Config, env: DistEnv | None = None):
        self.cfg = cfg
        tc = cfg.train
        self.env = env or init_distributed(tc.device)
        self.device = self.env.device
        torch.manual_seed(tc.seed)  # the same initial draft on every rank
        online = check_source(cfg) == "online"
        if online:  # the target runs here; its states stand in for the shards
            from eagleforge.train.online import OnlineSource

            self.reader = OnlineSource(cfg, self.env)
        else:
            self.reader = open_reader(cfg)
        manifest = self.reader.manifest
        self.vocab = load_vocab_map(cfg.run)  # both checked: readable, sha256, shapes, finite head
        head = load_target_head(cfg.run)
        check_vocab_files(self.vocab, head, cfg.run / "vocab")
        self.parallel = resolve_parallel(tc.parallel, self.env)
        self.param_dtype = resolve_param_dtype(tc, self.device, self.parallel)
        # float32: fp32 masters under autocast. bfloat16: weights, gradients and AdamW moments in
        # bf16 (the frozen embedding too) and the midlayer's weight gradients accumulated by the
        # GEMMs themselves (train/weight_grads.py).
        draft = build_draft(cfg, manifest, self.vocab, head)
        # [V, H] on the host in the parameters' dtype, or None (on the device inside the draft)
        self.host_embedding = (embedding_to_host(draft, self.param_dtype)
                               if resolve_embed_device(tc, self.device, online) else None)
        self.draft = draft.to(self.device, self.param_dtype)
        fuse_weight_grads(self.draft, self.param_dtype == torch.bfloat16)
        self.prefetch = BatchPrefetch(self._read_host)  # closed by train()
        # [Vd, Ht]; the fused loss runs its matmuls in bf16 under train.bf16: stored so, no cast
        # copy per step (the plain-torch reference loss reads it in fp32)
        head_dtype = torch.bfloat16 if tc.bf16 and tc.loss not in PLAIN_LOSS_MODES else torch.float32
        self.teacher_head = head["lm_head"].to(self.device, head_dtype)
        self.full_head = None
        if not manifest.get("has_target_argmax", False):
            log.info("the shards have no target_argmax: computing it from last_hidden_state and the full target head")
            full, _ = read_target_head(target_path(cfg.target), cfg.target)
            self.full_head = full.to(self.device, torch.float32)
        n_samples = len(self.reader)
        n_train = training_sample_count(n_samples, tc.holdout_samples, str(cfg.run / "hidden" / "manifest.json"))
        self.train_ids = list(range(n_train))
        self.heldout_ids = list(range(n_train, n_samples))
        self.lengths = self.reader.sample_lengths()
        self._epoch_cache: dict[int, list[list[int]]] = {}
        self.total_steps = self._total_steps()
        # train.activation_checkpoint / compile on auto: from the batch size and the GPU's memory
        self.step_plan = plan_step(tc, self.draft, self.param_dtype, self.device,
                                   world=self.env.world_size if self.parallel == "fsdp" else 1)
        step_options = dataclasses.replace(tc, activation_checkpoint=self.step_plan.activation_checkpoint,
                                           compile=self.step_plan.compile)
        loss = TTTLoss(step_options, self.teacher_head, self.device)
        self.model = parallelize(DraftWithLoss(self.draft, loss), self.env, self.parallel, tc.bf16)
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # sharded under FSDP
        # fused: its step reads `found_inf` (a device flag) and then leaves weights, moments and
        # step counts as they were, so a step with a NaN/Inf loss or gradient is skipped on the
        # device, without a host sync (train_step).
        self.optimizer = torch.optim.AdamW(self.params, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, tc.adam_beta2), fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(self.total_steps, tc.warmup_ratio, tc.min_lr_ratio))
        self.step, self.epoch, self.batch_index = 0, 0, 0
        self.train_tokens = 0
        # Skipped (non-finite) steps: counted before this process (state.json) and, per step of
        # the current log window, device flags with the step's global batches (read at log time).
        self.nonfinite_before = 0
        # (step, step skipped, its inputs held NaN/Inf, its global batches): device flags, read at log steps
        self._window_flags: list[tuple[int, torch.Tensor, torch.Tensor, list[list[int]]]] = []
        self.train_seconds, self.session_tokens = 0.0, 0  # this process only (not restored on resume)
        if self.env.is_main:
            log.info(
                "draft: %s parameters trainable, Vd=%d, coverage %.4f; %d training / %d held-out samples; %d optimizer "
                "steps of %d batches (%d ranks x grad_accum %d, parallel=%s)",
                f"{sum(p.numel() for p in self.draft.parameters() if p.requires_grad):,}", self.vocab["d2t"].shape[0],
                coverage(self.vocab["counts"], self.vocab["t2d"]), n_train, len(self.heldout_ids), self.total_steps,
                self.batches_per_step, self.env.world_size, max(1, tc.grad_accum), self.parallel,
            )
            log.info("draft step: parameters %s, activation_checkpoint=%s, compile=%s; memory per rank by the plan:\n%s",
                     str(self.param_dtype).removeprefix("torch."), self.step_plan.activation_checkpoint,
                     self.step_plan.compile, "\n".join(self.step_plan.lines()))

    # -- data

    @property
    def batches_per_step(self) -> int:
        """Global batches per optimizer step: world size x grad_accum."""
        return self.env.world_size * max(1, self.cfg.train.grad_accum)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The epoch's global batch list: a pure function of the seed, identical on every rank."""
        if epoch not in self._epoch_cache:
            self._epoch_cache = {epoch: make_batches(self.lengths, self.train_ids, self.cfg.train.batch_tokens, self.cfg.train.seed, epoch)}
        return self._epoch_cache[epoch]

    def _total_steps(self) -> int:
        tc = self.cfg.train
        if tc.max_steps > 0:
            return tc.max_steps
        if tc.epochs < 1:
            raise UserInputError(f"train.epochs={tc.epochs} and train.max_steps={tc.max_steps}: one must be >= 1")
        return sum(math.ceil(len(self.epoch_batches(e)) / self.batches_per_step) for e in range(tc.epochs))

    def _read_host(self, ids: list[int]) -> Batch:
        """The padded batch of samples `ids` on the host (pinned for a GPU), with its embedding
        rows when the frozen embedding is kept here: the prefetch worker's job."""
        pin = self.device.type == "cuda"
        batch = collate_host([self.reader[i] for i in ids], pin=pin)
        if self.host_embedding is not None:
            batch.input_embeds = gather_embeddings(self.host_embedding, batch.input_ids, self.cfg.train.ttt_steps, pin)
        return batch

    def _load(self, ids: list[int]) -> Batch:
        """The batch on the device, its states in the draft's input dtype (bf16 with bf16
        parameters: half the bytes of fp32 on the GPU; fp32 otherwise, as autocast expects)."""
        return self.prefetch.get(ids).to(self.device, self.param_dtype)

    def _micro_batches(self, step_batches: list[list[int]], own: list | None = None) -> list[list[int]]:
        """The sample ids this rank reads for the step (past the epoch's tail: the first batch);
        own: this rank's rank_micro_batches of them, when already at hand."""
        if own is None:
            own = rank_micro_batches(step_batches, self.env.rank, self.env.world_size)
        return [ids if ids is not None else step_batches[0] for ids in own]

    def _rank_batches(self, step_batches: list[list[int]], training: bool = False):
        """This rank's (ids or None, Batch) of the step's global batches, in slot order; None: past
        the epoch's tail, the step's first batch stands in (weight 0). Online: train/online.py.
        In training the next step's batches are handed to the prefetch worker first, so they are
        read while this step trains."""
        if hasattr(self.reader, "rank_batches"):
            yield from self.reader.rank_batches(self, step_batches, training)
            return
        own = rank_micro_batches(step_batches, self.env.rank, self.env.world_size)
        reads = self._micro_batches(step_batches, own)
        if training:
            self.prefetch.ensure(reads)  # queued a step ago, except at the first step
            if self.step + 1 < getattr(self, "last_step", self.total_steps):
                self.prefetch.ahead(self._micro_batches(self._upcoming_batches(self.batches_per_step)))
        for i, ids in enumerate(own):
            if not training:  # evaluation: one batch ahead (not every held-out batch at once)
                self.prefetch.ensure(reads[i + 1 : i + 2])
            yield ids, self._load(reads[i])

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
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats = TTTStats(tc.ttt_steps)
        step_batches = self._next_batches(self.batches_per_step)
        micro = rank_micro_batches(step_batches, self.env.rank, self.env.world_size)
        share = len(step_batches) / self.env.world_size
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        inputs_bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for i, (ids, batch) in enumerate(self._rank_batches(step_batches, training=True)):
            with gradient_sync(self.model, enabled=i == len(micro) - 1):
                loss, batch_stats = self.batch_loss(batch, training=True)
                (loss / share if ids is not None else loss * 0.0).backward()
            if ids is not None:
                stats.merge(batch_stats)
                loss_sum = loss_sum + loss.detach().float()
                # The states themselves, even in rows the loss masks out: one device reduction per
                # tensor (~0.25 ms for a 16K-token Kimi batch on an H200), no host sync.
                inputs_bad = inputs_bad + (~torch.isfinite(batch.aux_hidden_states)).any() \
                    + (~torch.isfinite(batch.last_hidden_state)).any()
        # the step's tokens over all ranks, from the host's own lengths (every rank knows the global batches)
        global_tokens = sum(self.lengths[i] for ids in step_batches for i in ids)
        stats = reduce_stats(stats, self.env, global_tokens)
        grad_norm = clip_grad_norm(self.params, tc.grad_clip)
        # A NaN/Inf loss or gradient norm (a poisoned input, or divergence): skip the update on
        # the device. The norm is global; the loss is this rank's, so under torchrun the flag is
        # summed over the ranks and every rank skips the same steps.
        flags = torch.stack([(~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm.float()))).float(),
                             (inputs_bad > 0).float()])  # [step bad, inputs bad]
        if self.env.distributed:
            flags = (all_reduce_tensor(flags.to(self.env.device), self.env) > 0).float()
        nonfinite = flags.max()  # non-finite inputs skip the step even where the loss masks them out
        self.optimizer.found_inf = nonfinite.to(self.params[0].device)
        self.optimizer.step()
        self._window_flags.append((self.step + 1, nonfinite, flags[1], step_batches))
        self.scheduler.step()
        self.step += 1
        self.train_tokens += stats.tokens
        self.session_tokens += stats.tokens  # train_seconds: counted by run() between host syncs
        return stats, grad_norm

    def _upcoming_batches(self, count: int) -> list[list[int]]:
        """What _next_batches(count) will return next, without moving the position."""
        epoch, index = self.epoch, self.batch_index
        if index >= len(self.epoch_batches(epoch)):
            epoch, index = epoch + 1, 0
        return self.epoch_batches(epoch)[index : index + count]

    def _next_batches(self, count: int) -> list[list[int]]:
        """The next `count` global batches of the epoch (fewer at its end); moves to the next
        epoch when the current one is exhausted."""
        if self.batch_index >= len(self.epoch_batches(self.epoch)):
            self.epoch, self.batch_index = self.epoch + 1, 0
        batches = self.epoch_batches(self.epoch)[self.batch_index : self.batch_index + count]
        self.batch_index += len(batches)
        return batches

    @torch.no_grad()
    def evaluate(self, ids: list[int]) -> TTTStats:
        """TTT loss and accuracies over the samples `ids` (the held-out ones), no gradient; the
        batches are split over the ranks like training batches and the sums reduced."""
        self.model.eval()
        stats = TTTStats(self.cfg.train.ttt_steps)
        batches = make_batches(self.lengths, ids, self.cfg.train.batch_tokens, self.cfg.train.seed, 0)
        for batch_ids, batch in self._rank_batches(batches):
            batch_stats = self.batch_loss(batch)[1]
            if batch_ids is not None:
                stats.merge(batch_stats)
        return reduce_stats(stats, self.env)

    # -- non-finite steps

    def nonfinite_steps(self) -> int:
        """Steps skipped for a NaN/Inf loss or gradient norm so far in the run (reads the
        current window's device flags: call it where the host waits anyway)."""
        return self.nonfinite_before + sum(1 for _, flag, _, _ in self._window_flags if float(flag) > 0)

    def _check_nonfinite(self) -> None:
        """At a log step: name the cause of the window's skipped steps and stop past
        train.max_nonfinite_steps. A non-finite hidden state in the skipped steps' samples is a
        damaged shard: an error naming it at once (the extractor never writes one)."""
        flags, self._window_flags = self._window_flags, []
        if not flags:
            return
        bad = torch.stack([torch.stack([f, inputs]) for _, f, inputs, _ in flags]).tolist()  # [steps, 2]
        skipped = [(step, batches, inputs > 0) for (step, _, _, batches), (flag, inputs) in zip(flags, bad) if flag > 0]
        if not skipped:
            return
        for step, batches, inputs_bad in skipped:
            if not inputs_bad:
                continue
            if self.cfg.train.source == "online":  # the states are not kept: the target made them
                raise UserInputError(f"step {step}: the target's hidden states held NaN/Inf (train.source=online); "
                                     f"check the target in its own dtype (target.dtype={self.cfg.target.dtype})")
            for i in (i for ids in batches for i in ids):
                problem = self.reader.nonfinite(i)
                if problem is not None:
                    raise UserInputError(f"{problem} (step {step}); the extractor never writes one: re-extract it "
                                         f"or set train.skip_corrupt_shards=true after deleting it from the manifest")
            raise UserInputError(f"step {step}: a batch's hidden states held NaN/Inf after reading "
                                 f"(extract.storage_dtype of the shards: {self.reader.manifest.get('storage_dtype')})")
        self.nonfinite_before += len(skipped)
        limit = self.cfg.train.max_nonfinite_steps
        steps = ", ".join(str(step) for step, _, _ in skipped)
        if self.nonfinite_before > limit:
            raise UserInputError(
                f"training diverged: {self.nonfinite_before} steps had a NaN/Inf loss or gradient norm (skipped; the last: "
                f"{steps}), more than train.max_nonfinite_steps={limit}; the inputs of those steps are finite: lower "
                f"train.lr (now {self.cfg.train.lr}) or train.grad_clip")
        if self.env.is_main:
            log.warning("step(s) %s: NaN/Inf loss or gradient norm, update skipped (%d so far, train.max_nonfinite_steps=%d)",
                        steps, self.nonfinite_before, limit)

    # -- state

    def data_state(self) -> dict:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "train_tokens": self.train_tokens,
                "nonfinite_steps": self.nonfinite_steps()}

    def save(self) -> Path:
        return save_checkpoint(self.cfg, self.step, self.model, self.optimizer, self.scheduler, self.data_state(), self.env)

    def maybe_resume(self) -> None:
        if not self.cfg.train.resume:
            return
        path = find_resume_checkpoint(self.cfg, self.env)
        if path is None:
            return
        check_resume_config(self.cfg, path, self.env.world_size)
        state = load_checkpoint(path, self.model, self.optimizer, self.scheduler, self.env)
        self._check_finite_state(path)
        self.step, self.epoch, self.batch_index = int(state["step"]), int(state["epoch"]), int(state["batch_index"])
        self.train_tokens = int(state.get("train_tokens", 0))
        self.nonfinite_before = int(state.get("nonfinite_steps", 0))
        if self.env.is_main:
            log.info("resumed from %s: step %d, epoch %d, batch %d (written by %s rank(s))", path, self.step,
                     self.epoch, self.batch_index, state.get("world_size", 1))

    def _check_finite_state(self, path: Path) -> None:
        """A checkpoint whose weights or optimizer moments hold NaN/Inf would train (and export)
        a NaN draft: refuse it. One reduction per tensor and one host read, at resume only."""
        tensors = [p for p in self.params] + [v for state in self.optimizer.state.values() for v in state.values()
                                              if isinstance(v, torch.Tensor) and v.is_floating_point()]
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t  # FSDP2: this rank's shard
            bad = bad + (~torch.isfinite(local.detach())).any().float().to(self.device)
        if self.env.distributed:
            bad = all_reduce_tensor(bad, self.env)
        if float(bad) > 0:
            raise UserInputError(f"{path}: the checkpoint holds NaN/Inf weights or optimizer state; delete it to resume "
                                 f"from an earlier one, or delete {path.parent} to start over")

    # -- the run

    def run(self, stop_after_step: int | None = None) -> dict | None:
        """Train to the end, evaluate, export; returns the summary. `stop_after_step` (tests)
        saves a checkpoint after that step and returns None: a kill right after a checkpoint."""
        from tqdm import tqdm

        tc = self.cfg.train
        main = self.env.is_main
        self.maybe_resume()
        self.last_step = min(self.total_steps, stop_after_step or self.total_steps)  # online prefetch stops there
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
                    logger.log(self.step, self.epoch, window, tc.step_weight_decay, self.scheduler.get_last_lr()[0], norm, window.tokens / max(elapsed, 1e-9))
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
        latest = find_resume_checkpoint(self.cfg, self.env)
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
            "steps": self.step, "epochs": self.epoch + (1 if self.batch_index else 0), "ttt_steps": tc.ttt_steps,
            "train_samples": len(self.train_ids), "heldout_samples": len(self.heldout_ids), "train_tokens": self.train_tokens,
            "train_tokens_per_s": self.session_tokens / self.train_seconds if self.train_seconds else None,
            "draft_vocab_size": int(self.vocab["d2t"].shape[0]),
            "vocab_coverage": coverage(self.vocab["counts"], self.vocab["t2d"]),
            "world_size": self.env.world_size, "parallel": self.parallel,
            "skipped_samples": self.reader.skipped_samples,
        }
        summary.update(getattr(self.reader, "summary", dict)())  # online: the target's share
        k = min(self.cfg.eval.k, tc.ttt_steps)
        if self.heldout_ids:
            stats = self.evaluate(self.heldout_ids)
            summary["heldout"] = {
                "tokens": stats.tokens,
                "loss": stats.loss(tc.step_weight_decay),
                "loss_per_step": stats.loss_per_step(),
                "accuracy_per_step": stats.accuracy_per_step(),
                "simulated_acceptance_length_by_k": {str(i): stats.acceptance_length(i) for i in range(1, tc.ttt_steps + 1)},
            }
            summary["simulated_acceptance_length"] = stats.acceptance_length(k)
            summary["simulated_acceptance_length_k"] = k
            if self.env.is_main:
                log.info(
                    "held-out: loss %.4f, accuracy per step %s, simulated acceptance length %.3f at k=%d",
                    summary["heldout"]["loss"], " ".join(f"{a:.3f}" for a in stats.accuracy_per_step()), summary["simulated_acceptance_length"], k,
                )
        else:
            if self.env.is_main:
                log.warning("train.holdout_samples=0: no held-out evaluation, simulated_acceptance_length is null")
            summary["simulated_acceptance_length"] = None
        if self.env.is_main:
            write_json_atomic(self.cfg.run / SUMMARY_NAME, summary, indent=1)
            export_finite(checkpoint_dir(self.cfg.run) / f"step-{self.step:06d}", self.cfg.run / "draft", self.vocab)
        barrier(self.env)
        return summary


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
    caller made it."""
    if cfg.train.source == "online" and cfg.target.backend == "native":
        from eagleforge.extract.native.parallel import use_expandable_segments

        use_expandable_segments()  # before CUDA starts, as the native extraction (its plan's reserve assumes it)
    env = init_distributed(cfg.train.device)
    trainer = None
    try:
        trainer = Trainer(cfg, env)
        return trainer.run(stop_after_step)
    finally:
        if trainer is not None:
            trainer.prefetch.close()
            if hasattr(trainer.reader, "close"):  # online: the producer thread
                trainer.reader.close()
        shutdown(env)
