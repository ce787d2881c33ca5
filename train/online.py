"""Online training (`train.source=online`): the target runs inside the train stage and its captured
hidden states train the draft in memory; nothing but checkpoints and logs is written.

    python -m eagleforge.train run_dir=runs/x train.source=online          # hf backend, one process
    torchrun --nproc-per-node 8 -m eagleforge.train --config configs/kimi_k25_pilot.yaml train.source=online

What stays as offline training (train/loop.py): the samples (RUN/data/samples.jsonl, or the
pre-tokenized data.source for the native backend, checked and cut to data.max_length as extract
does: extract/samples.py), their order (sample index = position in id order, the last
train.holdout_samples held out), the schedule (train/schedule.py), the loss, FSDP2/DDP,
checkpoints and the held-out metrics. Only where a batch's states come from changes: `OnlineSource`
is the trainer's BatchSource (train/sources.py) that runs the target on the batch's samples through
extract's own Target (eagleforge/target/protocol.py: the same forward and capture hooks), so an online run
trains on the same numbers as extract -> vocab -> train on the same samples.

Vocabulary: the token counts are taken from the samples' loss-masked input ids (the training
samples only), which is exactly what the vocab stage counts from the shards; no first pass of the
target is needed (eagleforge/vocab.py `build_vocab_from_samples`).

Parallelism: the job's Layout (eagleforge/layout.py) cuts the world into groups of target.tp ranks
(native backend; the hf backend is tp 1, every rank its own group); the draft trains over the
whole world. For a slot of an optimizer step, a group runs ONE target forward (chunked by
extract.batch_tokens) over the union of its ranks' batches; every rank of the group then holds
the same states (after the tensor-parallel all-reduces) and keeps the rows of its own batch.

Pipeline schedule (target.pp = P > 1): a slot's forwards go through the P stages one after the
other, so a schedule that ran each slot's forwards and then trained on them would leave stage s
idle while the forwards reach it (s forwards' time) and again after its last one (P - 1 - s),
every slot. Instead the forwards of all slots form one stream (load() queues a slot's, the feed
loads pp - 1 slots ahead of the one it waits for, train/prefetch.py), and when stage s waits for
slot n it runs the stream up to slot n's last forward and then `ahead` = P - 1 - s forwards more
(as many as are queued). At each draft step stage s is then P - 1 - s forwards ahead of the last
stage (the forwards of slot n + 1 have started in every stage but the last while the draft
trains on slot n), and its next forward's input is already sent by stage s - 1, one further
ahead: after the step every stage computes at once. The stages' fill and drain happen once per
feed (the run, the held-out evaluation), not once per slot. A rank's rows of a forward it ran ahead
are received only when it waits for that forward's slot (their receive posted then, before the
last stage sends them): during a draft step a rank holds the batch it trains and no rows of
later slots. Every rank of a stage runs the same forwards in the same order, so the stages'
sends and receives pair up; a feed stopped early leaves forwards queued, which close() runs
(`flush`) before the target closes.

In line: the trainer's feed (train/prefetch.py) runs a slot's target forwards on the training
thread, before the step that trains on them (train/loop.py ONLINE_PREFETCH), so the target's
tensor-parallel collectives and FSDP's run from one thread, in turn, and the target's activations
and the draft's step are never in memory at once (the online plan takes the larger).

Cache (`train.cache_gb`, train/state_cache.py): part of the first epoch's states kept as shards in
RUN/hidden, read back by later epochs instead of forwarded.

Resume: the data position saved in a checkpoint is the number of global batches consumed by
finished optimizer steps (as offline); the feed restarts from it, so a killed run neither repeats
nor skips a sample. Forwards the feed ran past the kill are simply redone.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import torch

from eagleforge.config import Config
from eagleforge.extract.samples import batch_by_tokens, read_samples
from eagleforge.layout import Layout
from eagleforge.target.protocol import nonfinite_cause, open_target
from eagleforge.train.batching import Batch, PendingBatch, pad_batch
from eagleforge.train.schedule import Slot, make_batches

log = logging.getLogger(__name__)


class OnlineSource:
    """The trainer's BatchSource with the target in the loop. Rank 0 writes RUN/vocab from the
    samples before the trainer reads it."""

    on_device = True

    def __init__(self, cfg: Config, layout: Layout):
        from eagleforge.vocab import build_vocab_from_samples, training_sample_count

        self.layout, self.device = layout, layout.device
        self.batch_tokens, self.target_dtype = cfg.extract.batch_tokens, cfg.target.dtype
        read: list = []  # (samples in id order: sample index i = samples[i], their file)

        # Building the target draws from the global RNG (module inits before the weights load);
        # the trainer seeded it for the draft's init, so the target is built on a forked RNG.
        # On CUDA the online plan (target + draft, train/online_plan.py) is checked before any weight
        # is read; it also cuts the stages (by memory) and picks the draft's checkpoint mode (auto).
        self.plan = None

        def check_memory(info) -> float | None:
            self.plan = _check_online_memory(cfg, layout)
            return None if self.plan is None else self.plan.total_bytes()

        with torch.random.fork_rng(devices=[layout.device] if layout.device.type == "cuda" else []):
            self.target = open_target(cfg, layout, write_target_argmax=True, check_memory=check_memory,
                                      check_inputs=lambda vocab_size: read.extend(read_samples(cfg, vocab_size)),
                                      stage_ranges=lambda: None if self.plan is None else self.plan.ranges)
        self.samples, source = read
        self.samples_file, self._samples_sha256 = source, None
        self.planned_bytes = self.target.planned_bytes  # the online plan (target + draft) on CUDA
        # train.activation_checkpoint=auto: the mode the online plan fitted beside the target (None: the step plan's own)
        self.planned_checkpoint = None if self.plan is None else self.plan.checkpoint
        # the manifest as the trainer reads it: the target's header and its config (build_draft sizes the draft from it)
        self.manifest = {**self.target.header, "target": {**self.target.header["target"], "config": self.target.hf_config}}
        self.skipped_samples, self.skipped_ids = 0, set()  # samples whose states held NaN/Inf
        header = self.target.header
        self.hidden_size = int(header["target"]["hidden_size"])
        self.aux_width = len(header["aux_layer_ids"]) * self.hidden_size
        from eagleforge.target.loading import torch_dtype

        self.state_dtype = torch_dtype(cfg.target.dtype)
        if layout.is_main:
            build_vocab_from_samples(cfg, self.samples, self.manifest, self.fingerprint()[1])
        layout.barrier()
        self._ids = [torch.tensor(s["input_ids"], dtype=torch.int64) for s in self.samples]
        self._masks = [torch.tensor(s["loss_mask"], dtype=torch.bool) for s in self.samples]
        self.cache = None
        if cfg.train.cache_gb > 0:
            from eagleforge.train.state_cache import StateCache

            n_train = training_sample_count(len(self.samples), cfg.train.holdout_samples, str(cfg.run / "data" / "samples.jsonl"))
            epoch0 = make_batches(self.sample_lengths(), list(range(n_train)), cfg.train.batch_tokens, cfg.train.seed, 0)
            self.cache = StateCache(cfg.run / "hidden", cfg.train.cache_gb, cfg.extract.storage_dtype, layout,
                                    self.target.header, self.samples, epoch0)
        self.target_seconds, self.target_tokens = 0.0, 0  # this process's target forwards (overlap report)
        # Pipeline schedule: the target forwards queued by load() and not run yet, how many were
        # queued and run since the start, and the forwards run ahead whose rows' receives wait
        self._queue: collections.deque[_Forward] = collections.deque()
        self._queued = self._ran = 0
        self._deferred: list[_Forward] = []
        self.ahead = layout.pp - 1 - layout.stage  # forwards this stage runs past the slot it finishes
        if layout.is_main:
            log.info("online: %d samples from %s, %d target group(s) of %d rank(s), %s backend", len(self.samples),
                     source, layout.num_groups, layout.group_size, cfg.target.backend)

    def __len__(self) -> int:
        return len(self.samples)

    def sample_lengths(self) -> list[int]:
        return [len(s["input_ids"]) for s in self.samples]

    def load(self, slot: Slot) -> "Batch | PendingBatch":
        """This rank's Batch of `slot` on the device: the target's forwards of the union of the
        group's batches of that slot (chunked by extract.batch_tokens), this rank's rows kept.
        Training slots (slot.epoch set): from the second epoch on, samples the cache holds are
        read instead of forwarded; in the first, this rank's batch is written to the cache when it
        is one the cache keeps.

        Pipeline stages: the slot's forwards are queued, not run, and a PendingBatch comes back;
        its wait() runs the queue up to this slot's last forward and then `ahead` forwards more
        (module docstring, "Pipeline schedule"), then waits for this rank's rows from the last
        stage and makes the Batch."""
        layout = self.layout
        mine = slot.batch_of(layout.rank, layout.world_size)
        reads = {r: slot.read_of(r, layout.world_size) for r in layout.group_ranks}  # what each rank of the group trains
        union: list[int] = []
        for r in layout.group_ranks:
            union += [i for i in reads[r] if i not in union]
        ids = reads[layout.rank]
        cached: list[int] = []
        if self.cache is not None and slot.epoch is not None and slot.epoch > 0:
            # Which samples skip the target is a function of the schedule, the same on every rank
            # of the group (their collectives stay paired); each rank reads only its own rows,
            # when the batch is made (not while its forwards wait in the queue).
            cached = [i for i in ids if i in self.cache.cached]
            union = [i for i in union if i not in self.cache.cached]
        lengths = [len(self.samples[i]["input_ids"]) for i in union]
        forwards = []
        for positions in batch_by_tokens(lengths, self.batch_tokens):
            chunk = [union[p] for p in positions]
            rows_for = {r: [chunk.index(i) for i in reads[r] if i in chunk] for r in layout.group_ranks}
            rows_for = {r: positions for r, positions in rows_for.items() if positions}
            forwards.append(_Forward(chunk, rows_for, [chunk[p] for p in rows_for.get(layout.rank, [])]))
        self.target_tokens += sum(lengths)  # forwarded by the target (cached rows not counted)
        self._queue.extend(forwards)
        self._queued += len(forwards)
        end = self._queued  # the slot's last forward is the end-th queued since the start

        def finish() -> Batch:
            return self._finish(slot, ids, mine, cached, forwards, end)

        if layout.pp == 1:  # every rank of the group ends with every row: nothing to wait for
            return finish()
        return PendingBatch(finish)

    def _run(self, forward: "_Forward", post_rows: bool) -> None:
        """The target's forward of the next queued `forward` (the one after it given as `then`,
        so a pipeline stage posts that forward's receive ahead)."""
        then = [self.samples[i]["input_ids"] for i in self._queue[0].samples] if self._queue else None
        inputs = [self.samples[i]["input_ids"] for i in forward.samples]
        if self.layout.pp > 1:
            forward.rows = self.target.forward(inputs, then=then, rows_for=forward.rows_for, post_rows=post_rows)
        else:
            forward.rows = self.target.forward(inputs, then=then, rows_for=forward.rows_for)
        self._ran += 1
        if hasattr(forward.rows, "post") and not forward.rows.posted:
            self._deferred.append(forward)

    def _finish(self, slot: Slot, ids: list[int], mine, cached: list[int], forwards: list["_Forward"], end: int) -> Batch:
        """The Batch of a slot load() queued (`end`: the count of forwards queued up to its last):
        its forwards run (with pipeline stages, and `ahead` more), its rows taken, padded."""
        start = time.perf_counter()
        # rows of this slot's forwards that ran ahead in an earlier wait: their receives now, in
        # forward order (before any later forward's), while the last stage runs the forwards
        for forward in forwards:
            if forward in self._deferred:
                forward.rows.post()
                self._deferred.remove(forward)
        # this slot's forwards, then `ahead` more: their rows' receives are left for their own wait
        while self._queue and self._ran < end:
            self._run(self._queue.popleft(), post_rows=True)
        while self._queue and self._ran < end + self.ahead:
            self._run(self._queue.popleft(), post_rows=False)
        if hasattr(self.target, "pause"):  # the draft's step comes next: one pipeline send held through it
            self.target.pause()
        states: dict[int, dict] = {}
        for forward in forwards:
            rows = forward.rows.wait() if hasattr(forward.rows, "wait") else forward.rows
            forward.rows = None
            row = 0
            for i in forward.mine:
                n = len(self.samples[i]["input_ids"])
                states[i] = {key: value[row : row + n] for key, value in rows.items()}
                row += n
        for i in cached:
            states[i] = self.cache.read(i, self.device)
        bad = self._nonfinite(ids, states)
        batch_rows = [{"input_ids": self._ids[i].to(self.device), "loss_mask": self._masks[i].to(self.device), **states[i]}
                      for i in ids]
        if self.cache is not None and slot.epoch == 0 and mine is not None:
            self.cache.write(mine, batch_rows, bad)
        batch = pad_batch(batch_rows)
        for b, i in enumerate(ids):
            if i in bad:  # no loss row, no token counted (the states are zeros)
                batch.lengths[b] = 0
                batch.loss_mask[b] = False
                batch.host_tokens -= len(self.samples[i]["input_ids"])
        self.target_seconds += time.perf_counter() - start
        return batch

    def flush(self) -> None:
        """Run what is still queued and take the rows still on their way (pipeline stages: every
        rank then ran the same forwards, so no send is left unmatched when the target closes).
        Nothing is queued after a feed that ran to its end; a feed stopped early leaves some."""
        while self._queue:
            self._run(self._queue.popleft(), post_rows=True)
        for forward in self._deferred:
            forward.rows.post()
        for forward in self._deferred:
            forward.rows.wait()
        self._deferred = []

    def host_input_ids(self, slot: Slot) -> torch.Tensor:
        """This rank's input ids of `slot` on the host, [B, T] int64 padded with 0 as the Batch's
        are: the frozen embedding's rows are gathered from them there (train.embed_device=host)."""
        rows = [self._ids[i] for i in slot.read_of(self.layout.rank, self.layout.world_size)]
        out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int64)
        for b, r in enumerate(rows):
            out[b, : len(r)] = r
        return out

    def _nonfinite(self, ids: list[int], states: dict[int, dict | None]) -> set[int]:
        """The samples of `ids` whose states hold NaN/Inf (one device read for the batch) or that
        the cache's first epoch skipped (None): skipped and counted, as extraction skips them (the
        trainer's step never sees them), their states replaced by zeros in place."""
        present = [i for i in ids if states[i] is not None]
        finite = torch.stack([torch.isfinite(states[i]["aux_hidden_states"]).all() & torch.isfinite(states[i]["last_hidden_state"]).all()
                              for i in present]).tolist() if present else []  # one device read for the batch
        bad = {i for i in ids if states[i] is None} | {i for i, ok in zip(present, finite) if not ok}
        for i in bad:
            n = len(self.samples[i]["input_ids"])
            states[i] = {"aux_hidden_states": torch.zeros(n, self.aux_width, dtype=self.state_dtype, device=self.device),
                         "last_hidden_state": torch.zeros(n, self.hidden_size, dtype=self.state_dtype, device=self.device),
                         "target_argmax": torch.zeros(n, dtype=torch.int32, device=self.device)}
            if self.samples[i]["id"] not in self.skipped_ids:
                self.skipped_ids.add(self.samples[i]["id"])
                self.skipped_samples = len(self.skipped_ids)
                log.warning("online: sample %d: the target's hidden states held NaN/Inf; skipped (%d so far)",
                            self.samples[i]["id"], self.skipped_samples)
                cause = nonfinite_cause(self.target.nonfinite_weights)
                if cause is not None and self.skipped_samples == 1:  # once: most samples may skip for it
                    log.warning("online: %s", cause)
        return bad

    def begin(self, epoch: int, batch_index: int) -> None:
        """Training starts (or resumes) at this position: the cache keeps what it still can."""
        if self.cache is not None:
            self.cache.settle(epoch, batch_index)

    def shared_embedding(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The target's input embedding [V, H] when this rank holds all of it on its device in
        `dtype` (native tp 1 and pp 1, or an hf target without a device map): the draft's frozen
        embedding is the same tensor, so it takes this one instead of a copy. None elsewhere."""
        weight = self.target.input_embedding()
        if weight is None or weight.dtype != dtype or weight.device != self.device:
            return None
        return weight

    def fingerprint(self) -> tuple[str, str]:
        """The samples trained on (ids, tokens, masks as read and cut), hashed once; not RUN/hidden,
        which the cache fills during the run."""
        if self._samples_sha256 is None:
            from eagleforge.shards import rows_sha256

            self._samples_sha256 = rows_sha256(self.samples)
        return str(self.samples_file), self._samples_sha256

    def nonfinite_error(self, step: int, samples: list[int]) -> str:
        # the states are not kept: the target made them
        return (f"step {step}: the target's hidden states held NaN/Inf (train.source=online); "
                f"check the target in its own dtype (target.dtype={self.target_dtype})")

    def summary(self) -> dict:
        """What train_summary.json records of the online source: this process's tokens forwarded
        by the target and read from the cache during training (the held-out forwards follow)."""
        out = {"source": "online", "target_tokens": self.target_tokens, "target_seconds": self.target_seconds,
               "target_tp": self.layout.tp, "target_pp": self.layout.pp}
        if self.cache is not None:
            out.update(cache_planned_bytes=self.cache.planned_bytes, cache_read_tokens=self.cache.read_tokens)
        return out

    def close(self) -> None:
        self.flush()
        self.target.close()


@dataclass(eq=False)
class _Forward:
    """One target forward of a slot's union: its samples in order, the positions (in `samples`)
    of each rank's rows, this rank's samples in it; after it ran, this rank's rows (a dict, a
    PendingRows from the last stage, or None)."""

    samples: list[int]
    rows_for: dict[int, list[int]]
    mine: list[int]
    rows: object = None


def _check_online_memory(cfg: Config, layout: Layout):
    """On CUDA, refuse before loading: target + draft must fit (train/online_plan.py); the plan
    (its stages' layers, the checkpoint mode, the bytes per GPU), None on the CPU."""
    if layout.device.type != "cuda":
        return None
    from eagleforge.train.online_plan import check_online_fits, format_online_plan

    gpu_bytes = int(cfg.target.gpu_memory_gib * 2**30) or torch.cuda.get_device_properties(layout.device).total_memory
    plan = check_online_fits(cfg, gpu_bytes, layout.world_size)
    if layout.is_main:
        log.info("online memory plan (train/online_plan.py):\n%s", format_online_plan(plan, gpu_bytes))
    return plan
