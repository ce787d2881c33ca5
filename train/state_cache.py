"""The bounded cache of online training (`train.cache_gb`): part of the first epoch's target
states kept as shards in RUN/hidden, read back by later epochs instead of forwarded again."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from eagleforge.errors import UserInputError
from eagleforge.layout import Layout
from eagleforge.train.sources import VERIFY_CHECKSUMS

log = logging.getLogger(__name__)


class StateCache:
    """`train.cache_gb` = N > 0: the first epoch's states of up to N GB (1e9 bytes, in
    extract.storage_dtype, counted as the shards store them) kept as checksummed shards in the
    existing format (eagleforge/shards.py) under RUN/hidden; later epochs read those samples back and
    run the target only for the rest.

    Which samples are cached is a pure function of the schedule: the batches of epoch 0 in order,
    while their running total of bytes stays within N GB. So every rank of a target group agrees
    on which rows it must forward without talking. Each rank writes its own batches' rows (one
    shard per epoch-0 batch, index = its position in the epoch, group = the rank under torchrun);
    a shard already complete on disk is not rewritten. Samples whose states held NaN/Inf are not
    written: the shard lists them as skipped, and later epochs skip them again.

    A resumed run (`settle`) keeps of that plan the batches it will still write (from its position
    in epoch 0 on) and those whose shards are on disk: every rank reads the same manifests before
    it trains, so the ranks still agree, also when train.cache_gb changed since the run that
    wrote them (a smaller cache after a full disk, or 0 for none).

    Each cached row is bound to its sample's tokens: a shard records the sha256 of its batch's
    samples (ids, tokens, masks: `content_sha256`), so a cache made from other samples under the
    same ids is refused before a shard of it is kept; and every row read back must hold exactly
    its sample's input_ids, so a shard swapped for another (checksums rewritten to match) is
    refused by name. Neither is ever trained on."""

    def __init__(self, hidden_dir: Path, cache_gb: float, storage_dtype: str, layout: Layout, header: dict,
                 samples: list[dict], epoch0_batches: list[list[int]]):
        from eagleforge.shards import STORAGE_DTYPES, ShardWriter

        self.hidden_dir, self.layout, self.samples = hidden_dir, layout, samples
        hidden = int(header["target"]["hidden_size"])
        k = len(header["aux_layer_ids"])
        width = STORAGE_DTYPES[storage_dtype].itemsize
        scales = 4 * (k + 1) if storage_dtype.startswith("float8") else 0
        self.bytes_per_token = (k + 1) * hidden * width + scales + 4 + 1 + 4  # states, ids int32, mask uint8, argmax int32
        budget = cache_gb * 1e9
        self.batch_index: dict[tuple, int] = {}  # epoch-0 batch (its sample positions) -> shard index
        self.cached: set[int] = set()  # sample positions whose states are cached
        lengths = [len(s["input_ids"]) for s in samples]
        used = 0
        for index, batch in enumerate(epoch0_batches):
            size = sum(lengths[i] for i in batch) * self.bytes_per_token
            if used + size > budget:
                break
            used += size
            self.batch_index[tuple(batch)] = index
            self.cached.update(batch)
        self.planned_bytes = used
        self.writer = ShardWriter(hidden_dir, header, storage_dtype, group=layout.rank if layout.world_size > 1 else None)
        self._reader, self._reader_index, self._skipped_ids = None, {}, set()
        self.read_tokens = 0
        log.info("train.cache_gb=%g: %d of %d training samples (%.3f GB) cached in %s during the first epoch",
                 cache_gb, len(self.cached), sum(len(b) for b in epoch0_batches), used / 1e9, hidden_dir)

    def settle(self, epoch: int, batch_index: int) -> None:
        """A run resumed at (epoch, global batch index): keep the batches of the plan it will still
        write (epoch 0, from batch_index on) and those whose shards are on disk (a corrupt one is
        refused by name, as the trainer refuses a corrupt shard)."""
        from eagleforge.shards import ShardReader

        if (epoch, batch_index) == (0, 0):
            return
        on_disk: set[int] = set()
        if self.hidden_dir.is_dir() and any(self.hidden_dir.glob("manifest*.json")):
            reader = ShardReader(self.hidden_dir, verify_checksums=VERIFY_CHECKSUMS)
            on_disk = {int(entry["index"]) for entry in reader.shards}
        first_unwritten = batch_index if epoch == 0 else float("inf")
        kept = {batch: index for batch, index in self.batch_index.items() if index >= first_unwritten or index in on_disk}
        if len(kept) < len(self.batch_index):
            log.info("train.cache_gb: resumed at epoch %d, batch %d: %d of the %d planned cached batches are on disk or "
                     "still to write; the rest are forwarded", epoch, batch_index, len(kept), len(self.batch_index))
        self.batch_index = kept
        self.cached = {i for batch in kept for i in batch}

    def write(self, batch: list[int], rows: list[dict], skipped: set[int] = frozenset()) -> None:
        """Write this rank's epoch-0 batch `batch` (sample positions) with its rows, if it is one
        the cache keeps and not already on disk; the positions in `skipped` (NaN/Inf states) are
        listed as skipped instead of written."""
        index = self.batch_index.get(tuple(batch))
        if index is None:
            return
        from eagleforge.shards import rows_sha256

        samples = [self.samples[i] for i in batch]
        if self.writer.is_complete(index, [s["id"] for s in samples], samples):  # made from these very samples, or refused
            return
        host = [{"input_ids": r["input_ids"].to("cpu", torch.int32), "loss_mask": r["loss_mask"].to("cpu", torch.uint8),
                 "aux_hidden_states": r["aux_hidden_states"].cpu(), "last_hidden_state": r["last_hidden_state"].cpu(),
                 "target_argmax": r["target_argmax"].to("cpu", torch.int32)} for i, r in zip(batch, rows) if i not in skipped]
        self.writer.write_shard(index, host, [self.samples[i]["id"] for i in batch if i not in skipped],
                                skipped_ids=[self.samples[i]["id"] for i in batch if i in skipped],
                                content_sha256=rows_sha256(samples))

    def read(self, position: int, device: torch.device, wait_s: float = 600.0) -> dict | None:
        """The cached states of sample `position` (on `device`), None for a sample the first epoch
        skipped (NaN/Inf states). Another rank may still be writing the shard (the producer runs
        ahead): the manifests are read again until it is listed."""
        from eagleforge.shards import ShardReader

        sample_id = self.samples[position]["id"]
        deadline = time.monotonic() + wait_s
        while sample_id not in self._reader_index and sample_id not in self._skipped_ids:
            if self.hidden_dir.is_dir() and any(self.hidden_dir.glob("manifest*.json")):
                self._reader = ShardReader(self.hidden_dir, verify_checksums=VERIFY_CHECKSUMS)
                self._reader_index = {sid: i for i, sid in enumerate(self._reader.sample_ids())}
                self._skipped_ids = {int(i) for entry in self._reader.shards for i in entry.get("skipped_ids", [])}
            if sample_id in self._reader_index or sample_id in self._skipped_ids:
                break
            if time.monotonic() > deadline:
                raise UserInputError(f"{self.hidden_dir}: cached sample {sample_id} was never written "
                                     f"(a rank of the first epoch failed?); rerun with train.cache_gb=0")
            time.sleep(0.5)
        if sample_id not in self._reader_index:
            return None
        row = self._reader[self._reader_index[sample_id]]
        self._check_tokens(position, row["input_ids"])
        self.read_tokens += int(row["input_ids"].shape[0])
        return {key: row[key].to(device) for key in ("aux_hidden_states", "last_hidden_state", "target_argmax")}

    def _check_tokens(self, position: int, cached: torch.Tensor) -> None:
        """The cached row of sample `position` holds its input_ids, or a UserInputError names the
        shard: its states belong to other tokens (a shard swapped for another, a cache of other
        samples under the same ids)."""
        tokens = self.samples[position]["input_ids"]
        if cached.shape[0] == len(tokens) and cached.tolist() == list(tokens):
            return
        shard, _ = self._reader.locate(self._reader_index[self.samples[position]["id"]])
        raise UserInputError(f"{self.hidden_dir / self._reader.shards[shard]['file']}: the cached states of sample "
                             f"{self.samples[position]['id']} are of other tokens than the sample's (a shard swapped for "
                             f"another, or a cache of other samples); delete {self.hidden_dir} (the cache) or set "
                             "train.cache_gb=0")
