"""Online training (`train.source=online`): the target runs inside the train stage and its captured
hidden states train the draft in memory; nothing but checkpoints and logs is written.

    python -m eagleforge.train run_dir=runs/x train.source=online          # hf backend, one process
    torchrun --nproc-per-node 8 -m eagleforge.train --config configs/kimi_k25_pilot.yaml train.source=online

What stays as offline training (train/loop.py): the samples (RUN/data/samples.jsonl, or the
pre-tokenized data.source for the native backend, checked and cut to data.max_length as extract
does), their order (sample index = position in id order, the last train.holdout_samples held
out), the batches (batching.make_batches), the rank split (batching.rank_micro_batches), the
loss, FSDP2/DDP, checkpoints and the held-out metrics. Only where a batch's states come from
changes: `OnlineSource` stands where the ShardReader stood and runs the target on the batch's
samples with extract's own forward and capture hooks (extract/hf.py `forward_batch`,
extract/native/run.py `forward_batch`, extract/capture.py `HiddenStateCapture`), so an online
run trains on the same numbers as extract -> vocab -> train on the same samples.

Vocabulary: the token counts are taken from the samples' loss-masked input ids (the training
samples only), which is exactly what the vocab stage counts from the shards; no first pass of the
target is needed. RUN/vocab is written the same way (vocab_map + target head rows).

Parallelism: the world is cut into groups of target.tp ranks (native backend; the hf backend is
tp 1, every rank its own group). For micro-batch slot i of an optimizer step, rank r trains
global batch i * world + r, as offline. A group runs ONE target forward (chunked by
extract.batch_tokens) over the union of its ranks' batches; every rank of the group then holds
the same states (after the tensor-parallel all-reduces) and keeps the rows of its own batch. A
rank past the epoch's tail (no batch) takes the step's first batch with weight 0, as offline.

Overlap (`train.prefetch` = N > 0): a producer thread runs the target forwards of the next N
micro-batches ahead of the training thread (on CUDA on a side stream), through a bounded queue;
0 runs them in line. The target's tensor-parallel collectives then run on the group's own
process group from the producer thread while FSDP's run on the world group from the trainer's.

Cache (`train.cache_gb`, StateCache): part of the first epoch's states kept as shards in
RUN/hidden, read back by later epochs instead of forwarded.

Resume: the data position saved in a checkpoint is the number of global batches consumed by
finished optimizer steps (as offline); the producer is restarted from it, so a killed run
neither repeats nor skips a sample. Forwards the producer ran past the kill are simply redone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import queue
import threading
import time

import torch

from eagleforge.config import Config, UserInputError
from eagleforge.train.batching import Batch, make_batches, rank_micro_batches

log = logging.getLogger(__name__)


def check_source(cfg: Config) -> str:
    """train.source, checked against the keys that go with it (the config layer checks each key's
    choices and range)."""
    source = cfg.train.source
    if cfg.train.cache_gb > 0 and source != "online":
        raise UserInputError(f"config key 'train.cache_gb' = {cfg.train.cache_gb}: only train.source=online has a cache "
                             f"(got train.source={source})")
    return source


# ----------------------------------------------------------------------------- targets


class HFTarget:
    """A transformers causal LM with the capture hooks attached for the source's lifetime."""

    def __init__(self, cfg: Config, device: torch.device):
        from eagleforge.data.stage import load_samples
        from eagleforge.extract.capture import HiddenStateCapture
        from eagleforge.extract.hf import check_samples, manifest_header
        from eagleforge.target import decoder_layers, final_norm, load_target, padding_id, resolve_aux_layers, text_config

        self.cfg, self.device = cfg, device
        self.model, tokenizer = load_target(cfg.target, device=device)
        config = text_config(self.model.config)
        self.aux_layers = resolve_aux_layers(cfg.extract.aux_layers, int(config.num_hidden_layers))
        self.pad = padding_id(tokenizer) if tokenizer is not None else 0
        self.header = manifest_header(cfg, self.model, tokenizer, self.aux_layers)
        self.header["has_target_argmax"] = True
        self.header["target"]["config"] = self.model.config.to_dict()  # build_draft reads it (no second load)
        self.samples = check_samples(load_samples(cfg.run), cfg.run / "data" / "samples.jsonl", int(config.vocab_size),
                                     cfg.data.max_length, cfg.data.overlong)
        self.capture = HiddenStateCapture(decoder_layers(self.model), self.aux_layers, final_norm(self.model)).__enter__()

    def forward(self, input_ids: list[list[int]]) -> dict[str, torch.Tensor]:
        """Packed rows of the samples end to end (extract/hf.py forward_batch): aux [sum n, k*H],
        last [sum n, H], target_argmax [sum n] int32, on the device."""
        from eagleforge.extract.hf import forward_batch

        return forward_batch(self.model, self.capture, input_ids, self.pad, self.device, write_target_argmax=True)

    def close(self) -> None:
        self.capture.__exit__(None, None, None)


class NativeTarget:
    """The native DeepSeek-V3 / Kimi-K2.5 backend, one tensor-parallel group of target.tp ranks."""

    def __init__(self, cfg: Config, device: torch.device, tp):
        from eagleforge.extract.capture import HiddenStateCapture
        from eagleforge.extract.hf import check_samples
        from eagleforge.extract.native.loader import build_model, load_weights, read_checkpoint_info
        from eagleforge.extract.native.run import load_samples_native, manifest_header, samples_source
        from eagleforge.target import resolve_aux_layers, target_path, torch_dtype

        self.cfg, self.device = cfg, device
        info = read_checkpoint_info(target_path(cfg.target))
        self.aux_layers = resolve_aux_layers(cfg.extract.aux_layers, info.args.num_hidden_layers)
        self.header = manifest_header(cfg, info, self.aux_layers)
        self.header["has_target_argmax"] = True
        # the raw config.json (text_config inside for Kimi): build_draft sizes the draft from it
        self.header["target"]["config"] = json.loads((info.path / "config.json").read_text(encoding="utf-8"))
        self.samples = check_samples(load_samples_native(cfg), samples_source(cfg), info.args.vocab_size,
                                     cfg.data.max_length, cfg.data.overlong)
        if device.type == "cuda":  # refuse before loading: target + draft must fit (train/online_plan.py)
            from eagleforge.train.online_plan import check_online_fits

            gpu_bytes = int(cfg.target.gpu_memory_gib * 2**30) or torch.cuda.get_device_properties(device).total_memory
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            plan = check_online_fits(cfg, gpu_bytes, world)
            log.info("online memory plan: %.1f GiB of %.1f GiB per GPU", plan.total_bytes() / 2**30, gpu_bytes / 2**30)
        self.model = build_model(info, tp, cfg.target.expert_layout, torch_dtype(cfg.target.dtype), device,
                                 cfg.target.prefill_attention, cfg.target.moe_backend)
        load_weights(self.model, info, show_progress=tp.rank == 0 and _is_main())
        self.capture = HiddenStateCapture(self.model.model.layers, self.aux_layers, self.model.model.norm).__enter__()

    def forward(self, input_ids: list[list[int]]) -> dict[str, torch.Tensor]:
        """As HFTarget.forward; every rank of the group calls it with the same ids (collectives)."""
        from eagleforge.extract.native.run import forward_batch

        return forward_batch(self.model, self.capture, input_ids, self.device, write_target_argmax=True, keep=True)

    def close(self) -> None:
        self.capture.__exit__(None, None, None)


def _is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def target_group(cfg: Config, env) -> tuple[list[int], object]:
    """(the world ranks of this rank's target group, the native TensorParallel view or None)."""
    if cfg.target.backend != "native":
        return [env.rank], None
    from eagleforge.extract.native.parallel import TensorParallel, state_from_world

    tp = int(cfg.target.tp)
    if tp < 1 or env.world_size % tp:
        raise UserInputError(f"target.tp = {tp} does not divide the world size {env.world_size} (torchrun --nproc-per-node x --nnodes)")
    if env.world_size == 1:
        view = TensorParallel()
        ranks = [0]
    else:
        state = state_from_world(tp, env.device, initialized_here=False)  # every rank creates every group
        ranks, view = list(range(state.group_index * tp, state.group_index * tp + tp)), state.tp
    view.split_rows_min_tokens, view.overlap_min_rows = cfg.target.split_rows_min_tokens, cfg.target.overlap_min_rows
    return ranks, view


# ----------------------------------------------------------------------------- vocabulary


def build_vocab_from_samples(cfg: Config, samples: list[dict], header: dict) -> None:
    """RUN/vocab from the samples' loss-masked ids of the training samples (the vocab stage counts
    the same tokens from the shards); reused when the samples, holdout, Vd and target are unchanged."""
    from eagleforge.shards import rows_sha256
    from eagleforge.vocab import TARGET_HEAD, VOCAB_MAP, count_tokens, training_sample_count, vocab_up_to_date, write_vocab_files

    out = cfg.run / "vocab"
    files = [out / VOCAB_MAP, out / TARGET_HEAD]
    key = {"samples": rows_sha256(samples),
           "holdout_samples": cfg.train.holdout_samples, "draft_vocab_size": cfg.vocab.draft_vocab_size,
           "target_path": cfg.target.path, "source": "online"}
    identity = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    if vocab_up_to_date(files, identity):
        log.info("%s is up to date with the samples", out)
        return
    vocab_size = int(header["target"]["vocab_size"])
    n_train = training_sample_count(len(samples), cfg.train.holdout_samples, str(cfg.run / "data" / "samples.jsonl"))
    counts = count_tokens(((torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"])) for s in samples[:n_train]), vocab_size)
    d2t, _, cov = write_vocab_files(cfg, counts, identity)
    log.info("draft vocabulary from the samples: Vd=%d of V=%d, coverage %.4f -> %s", d2t.shape[0], vocab_size, cov, out)


# ----------------------------------------------------------------------------- batches on the device


def collate_rows(rows: list[dict], device: torch.device, dtype: torch.dtype = torch.float32) -> Batch:
    """batching.collate for rows already on the device: padded on the device (no host round
    trip). Each row: input_ids [n], loss_mask [n], aux_hidden_states [n, k*H],
    last_hidden_state [n, H], target_argmax [n]."""
    lengths = [int(r["input_ids"].shape[0]) for r in rows]
    b, t = len(rows), max(lengths)

    def padded(key: str, out_dtype: torch.dtype) -> torch.Tensor:
        first = rows[0][key]
        out = torch.zeros((b, t) + tuple(first.shape[1:]), dtype=out_dtype, device=device)
        for i, (r, n) in enumerate(zip(rows, lengths)):
            out[i, :n] = r[key]
        return out

    return Batch(padded("input_ids", torch.int64), padded("loss_mask", torch.bool), padded("aux_hidden_states", dtype),
                 padded("last_hidden_state", dtype), padded("target_argmax", torch.int64),
                 torch.tensor(lengths, dtype=torch.int64, device=device), host_tokens=sum(lengths))


# ----------------------------------------------------------------------------- the bounded cache


class StateCache:
    """`train.cache_gb` = N > 0: the first epoch's states of up to N GB (1e9 bytes, in
    extract.storage_dtype, counted as the shards store them) kept as checksummed shards in the
    existing format (eagleforge/shards.py) under RUN/hidden; later epochs read those samples back and
    run the target only for the rest.

    Which samples are cached is a pure function of the schedule: the batches of epoch 0 in order,
    while their running total of bytes stays within N GB. So every rank of a target group agrees
    on which rows it must forward without talking, and a resumed run caches the same ones. Each
    rank writes its own batches' rows (one shard per epoch-0 batch, index = its position in the
    epoch, group = the rank under torchrun); a shard already complete on disk is not rewritten."""

    def __init__(self, cfg: Config, env, header: dict, samples: list[dict], lengths: list[int], train_ids: list[int]):
        from eagleforge.shards import STORAGE_DTYPES, ShardWriter

        self.cfg, self.env, self.samples = cfg, env, samples
        hidden = int(header["target"]["hidden_size"])
        k = len(header["aux_layer_ids"])
        storage = cfg.extract.storage_dtype
        width = STORAGE_DTYPES[storage].itemsize
        scales = 4 * (k + 1) if storage.startswith("float8") else 0
        self.bytes_per_token = (k + 1) * hidden * width + scales + 4 + 1 + 4  # states, ids int32, mask uint8, argmax int32
        budget = cfg.train.cache_gb * 1e9
        self.batch_index: dict[tuple, int] = {}  # epoch-0 batch (its sample positions) -> shard index
        self.cached: set[int] = set()  # sample positions whose states are cached
        used = 0
        for index, batch in enumerate(make_batches(lengths, train_ids, cfg.train.batch_tokens, cfg.train.seed, 0)):
            size = sum(lengths[i] for i in batch) * self.bytes_per_token
            if used + size > budget:
                break
            used += size
            self.batch_index[tuple(batch)] = index
            self.cached.update(batch)
        self.planned_bytes = used
        header = {key: value for key, value in header.items()}
        header["target"] = {key: value for key, value in header["target"].items() if key != "config"}
        self.writer = ShardWriter(cfg.run / "hidden", header, storage, group=env.rank if env.world_size > 1 else None)
        self._reader, self._reader_index = None, {}
        self.read_tokens = 0
        log.info("train.cache_gb=%g: %d of %d training samples (%.3f GB) cached in %s during the first epoch",
                 cfg.train.cache_gb, len(self.cached), len(train_ids), used / 1e9, cfg.run / "hidden")

    def write(self, batch: list[int], rows: list[dict]) -> None:
        """Write this rank's epoch-0 batch `batch` (sample positions) with its rows, if it is one
        the cache keeps and not already on disk."""
        index = self.batch_index.get(tuple(batch))
        if index is None:
            return
        ids = [self.samples[i]["id"] for i in batch]
        if self.writer.is_complete(index, ids):
            return
        host = [{"input_ids": r["input_ids"].to("cpu", torch.int32), "loss_mask": r["loss_mask"].to("cpu", torch.uint8),
                 "aux_hidden_states": r["aux_hidden_states"].cpu(), "last_hidden_state": r["last_hidden_state"].cpu(),
                 "target_argmax": r["target_argmax"].to("cpu", torch.int32)} for r in rows]
        self.writer.write_shard(index, host, ids)

    def read(self, position: int, device: torch.device, wait_s: float = 600.0) -> dict:
        """The cached states of sample `position` (on `device`). Another rank may still be writing
        the shard (the producer runs ahead): the manifests are read again until it is listed."""
        from eagleforge.shards import ShardReader

        sample_id = self.samples[position]["id"]
        deadline = time.monotonic() + wait_s
        while sample_id not in self._reader_index:
            if (self.cfg.run / "hidden").is_dir() and any((self.cfg.run / "hidden").glob("manifest*.json")):
                self._reader = ShardReader(self.cfg.run / "hidden", verify_checksums=self.cfg.train.verify_checksums)
                self._reader_index = {sid: i for i, sid in enumerate(self._reader.sample_ids())}
            if sample_id in self._reader_index:
                break
            if time.monotonic() > deadline:
                raise UserInputError(f"{self.cfg.run / 'hidden'}: cached sample {sample_id} was never written "
                                     f"(a rank of the first epoch failed?); rerun with train.cache_gb=0")
            time.sleep(0.5)
        row = self._reader[self._reader_index[sample_id]]
        self.read_tokens += int(row["input_ids"].shape[0])
        return {key: row[key].to(device) for key in ("aux_hidden_states", "last_hidden_state", "target_argmax")}


# ----------------------------------------------------------------------------- the source


class OnlineSource:
    """Stands where the trainer's ShardReader stood (`manifest`, `len`, `sample_lengths`,
    `skipped_samples`) and gives each rank its micro-batches with the target's states
    (`rank_batches`). Rank 0 writes RUN/vocab from the samples before the trainer reads it."""

    def __init__(self, cfg: Config, env):
        from eagleforge.train.distributed import barrier

        self.cfg, self.env = cfg, env
        self.group, tp = target_group(cfg, env)
        # Building the target draws from the global RNG (module inits before the weights load);
        # the trainer seeded it for the draft's init, so the target is built on a forked RNG.
        with torch.random.fork_rng(devices=[env.device] if env.device.type == "cuda" else []):
            self.target = NativeTarget(cfg, env.device, tp) if cfg.target.backend == "native" else HFTarget(cfg, env.device)
        self.samples = self.target.samples  # id order: sample index i = samples[i]
        self.manifest = self.target.header
        self.skipped_shards: list[str] = []
        self.skipped_samples = 0
        if env.is_main:
            build_vocab_from_samples(cfg, self.samples, self.manifest)
        barrier(env)
        self._ids = [torch.tensor(s["input_ids"], dtype=torch.int64) for s in self.samples]
        self._masks = [torch.tensor(s["loss_mask"], dtype=torch.bool) for s in self.samples]
        self._producer: Prefetcher | None = None
        self.cache = None
        if cfg.train.cache_gb > 0:
            from eagleforge.vocab import training_sample_count

            n_train = training_sample_count(len(self.samples), cfg.train.holdout_samples, str(cfg.run / "data" / "samples.jsonl"))
            self.cache = StateCache(cfg, env, self.manifest, self.samples, self.sample_lengths(), list(range(n_train)))
        self.target_seconds, self.target_tokens = 0.0, 0  # this process's target forwards (overlap report)
        if env.is_main:
            log.info("online: %d samples from %s, target group of %d rank(s), %s backend, prefetch %d", len(self.samples),
                     cfg.run / "data" / "samples.jsonl", len(self.group), cfg.target.backend, cfg.train.prefetch)

    def __len__(self) -> int:
        return len(self.samples)

    def sample_lengths(self) -> list[int]:
        return [len(s["input_ids"]) for s in self.samples]

    # -- the forwards

    def _group_slot(self, step_batches: list[list[int]], slot: int, epoch: int | None = None) -> tuple[list[int] | None, Batch]:
        """This rank's (ids or None, Batch) of micro-batch `slot`: one target forward of the union
        of the group's batches of that slot, this rank's rows kept. `epoch` (training batches):
        from the second epoch on, samples the cache holds are read instead of forwarded; in the
        first, this rank's batch is written to the cache when it is one the cache keeps."""
        from eagleforge.extract.hf import batch_by_tokens

        world = self.env.world_size
        mine = None
        union: list[int] = []
        for r in self.group:
            share = rank_micro_batches(step_batches, r, world)[slot]
            if r == self.env.rank:
                mine = share
            union += [i for i in (share if share is not None else step_batches[0]) if i not in union]
        ids = mine if mine is not None else step_batches[0]
        start = time.perf_counter()
        states: dict[int, dict] = {}
        if self.cache is not None and epoch is not None and epoch > 0:
            # Which samples skip the target is a function of the schedule, the same on every rank
            # of the group (their collectives stay paired); each rank reads only its own rows.
            states = {i: self.cache.read(i, self.env.device) for i in ids if i in self.cache.cached}
            union = [i for i in union if i not in self.cache.cached]
        lengths = [len(self.samples[i]["input_ids"]) for i in union]
        for positions in batch_by_tokens(lengths, self.cfg.extract.batch_tokens):
            chunk = [union[p] for p in positions]
            packed = self.target.forward([self.samples[i]["input_ids"] for i in chunk])
            row = 0
            for i in chunk:
                n = len(self.samples[i]["input_ids"])
                states[i] = {key: value[row : row + n] for key, value in packed.items()}
                row += n
        rows = [{"input_ids": self._ids[i].to(self.env.device), "loss_mask": self._masks[i].to(self.env.device), **states[i]}
                for i in ids]
        if self.cache is not None and epoch == 0 and mine is not None:
            self.cache.write(mine, rows)
        batch = collate_rows(rows, self.env.device)
        self.target_seconds += time.perf_counter() - start
        self.target_tokens += sum(lengths)  # forwarded by the target (cached rows not counted)
        return mine, batch

    def rank_batches(self, trainer, step_batches: list[list[int]], training: bool = False):
        """Yield this rank's (ids or None, Batch) for the step's global batches, in slot order
        (the trainer's `_rank_batches`). Training steps come from the producer when prefetching."""
        slots = -(-len(step_batches) // self.env.world_size)
        if not training or self.cfg.train.prefetch == 0:
            for slot in range(slots):
                yield self._group_slot(step_batches, slot, trainer.epoch if training else None)
            return
        if self._producer is None:  # from the trainer's position on, to the last step it will take
            world = self.env.world_size
            items = [(sb, slot, epoch) for epoch, sb in upcoming_steps(trainer, step_batches)
                     for slot in range(-(-len(sb) // world))]
            self._producer = Prefetcher(lambda item: self._group_slot(*item), items, self.cfg.train.prefetch, self.env.device)
        for slot in range(slots):
            expected = rank_micro_batches(step_batches, self.env.rank, self.env.world_size)[slot]
            ids, batch = self._producer.get()
            if ids != expected:  # the producer follows the trainer's schedule; a mismatch is a bug
                raise RuntimeError(f"online prefetch out of order: got batch {ids}, the trainer expects {expected}")
            yield ids, batch

    def summary(self) -> dict:
        """What train_summary.json records of the online source: this process's tokens forwarded
        by the target and read from the cache during training (the held-out forwards follow)."""
        out = {"source": "online", "target_tokens": self.target_tokens, "target_seconds": self.target_seconds}
        if self.cache is not None:
            out.update(cache_planned_bytes=self.cache.planned_bytes, cache_read_tokens=self.cache.read_tokens)
        return out

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        self.target.close()


def upcoming_steps(trainer, first_step_batches: list[list[int]]):
    """(epoch, step_batches) of every optimizer step from the current one (whose batches the trainer
    just took: `first_step_batches`) to trainer.last_step, as Trainer._next_batches gives them.
    The epochs' batch lists are rebuilt here (make_batches is a pure function) so the producer
    thread never shares the trainer's cache."""
    tc = trainer.cfg.train
    cache: dict[int, list[list[int]]] = {}

    def batches(epoch: int) -> list[list[int]]:
        if epoch not in cache:
            cache.clear()
            cache[epoch] = make_batches(trainer.lengths, trainer.train_ids, tc.batch_tokens, tc.seed, epoch)
        return cache[epoch]

    epoch, index = trainer.epoch, trainer.batch_index - len(first_step_batches)
    step, last = trainer.step, getattr(trainer, "last_step", trainer.total_steps)
    while step < last:
        if index >= len(batches(epoch)):
            epoch, index = epoch + 1, 0
        step_batches = batches(epoch)[index : index + trainer.batches_per_step]
        index += len(step_batches)
        step += 1
        yield epoch, step_batches


class Prefetcher:
    """A thread running `produce(item)` for each of `items` ahead of the consumer, through a
    bounded queue of `depth` results (the target's forwards of the coming micro-batches, while
    the training thread trains on the current one). On CUDA it works on its own stream; each
    result carries an event the consumer's stream waits on before reading it, and its tensors
    are recorded on that stream (their memory is not reused before the consumer is done)."""

    _DONE = object()

    def __init__(self, produce, items: list, depth: int, device: torch.device):
        self.produce, self.items = produce, items
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.thread = threading.Thread(target=self._run, name="online-target", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                for item in self.items:
                    if self.stop.is_set():
                        return
                    ids, batch = self.produce(item)
                    event = None
                    if self.stream is not None:
                        event = torch.cuda.Event()
                        event.record(self.stream)
                    self._put((ids, batch, event))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(err)
        else:
            self._put(self._DONE)

    def _put(self, item) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def get(self) -> tuple[list[int] | None, Batch]:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise RuntimeError("the online target forward failed") from item
        if item is self._DONE:
            raise RuntimeError("online prefetch ran out of batches before the trainer did")
        ids, batch, event = item
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in (batch.input_ids, batch.loss_mask, batch.aux_hidden_states, batch.last_hidden_state,
                      batch.target_argmax, batch.lengths):
                t.record_stream(current)
        return ids, batch

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def overlap_report(target_tokens: int, target_seconds: float, train_tokens: int, train_seconds: float,
                   online_tokens: int, online_seconds: float) -> dict:
    """Rates in tokens/s and the online rate over the serial ideal 1 / (1/extract + 1/train):
    above 1 when the target's forwards overlap the draft's training."""
    extract = target_tokens / target_seconds if target_seconds else float("nan")
    train = train_tokens / train_seconds if train_seconds else float("nan")
    online = online_tokens / online_seconds if online_seconds else float("nan")
    serial = 1.0 / (1.0 / extract + 1.0 / train)
    return {"extract_tokens_per_s": extract, "train_tokens_per_s": train, "online_tokens_per_s": online,
            "serial_ideal_tokens_per_s": serial, "ratio_to_serial": online / serial}
