"""Where the trainer's batches come from: one protocol, two sources.

    source = open_source(cfg, layout)        # ShardSource (RUN/hidden) or OnlineSource (the target)
    source.manifest                          # target header: sizes, aux layer ids, has_target_argmax
    len(source), source.sample_lengths()     # the samples in id order: sample index i
    batch = source.load(slot)                # this rank's Batch of one schedule slot (train/schedule.py)

The trainer asks for slots in its schedule's order on one worker thread (train/prefetch.py);
`load` makes this rank's batch of the slot: its samples (or the step's first batch standing in
past the epoch's tail). A shard source pads host rows (pinned for a GPU); an online source runs
the target and returns rows on the device (`on_device`: the worker then works on a side stream).
Both return the states in their own dtype; the trainer moves and casts them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Protocol

import torch

from eagleforge.config import Config
from eagleforge.errors import UserInputError
from eagleforge.layout import Layout
from eagleforge.train.batching import Batch, pad_batch
from eagleforge.train.schedule import Slot

log = logging.getLogger(__name__)

VERIFY_CHECKSUMS = True  # sha256 of every shard when training opens it: a flipped bit is an error naming the file, not a different draft


class BatchSource(Protocol):
    manifest: dict  # the target's header (docs/shards.md), the draft is sized from it
    skipped_samples: int  # samples left out (corrupt shards), recorded in train_summary.json
    on_device: bool  # load() returns tensors on the device (made on the worker's side stream)
    planned_bytes: float | None  # what a memory plan counted per GPU for the source's own work (online: target + draft)

    def __len__(self) -> int: ...

    def sample_lengths(self) -> list[int]: ...

    def load(self, slot: Slot) -> Batch: ...

    def begin(self, epoch: int, batch_index: int) -> None:
        """Training starts (or resumes) at this position of its schedule."""

    def nonfinite_error(self, step: int, samples: list[int]) -> str:
        """The one-line error for a step whose input states held NaN/Inf."""

    def shared_embedding(self, dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor on this rank equal to the draft's frozen embedding [V, H] in `dtype` (the
        online target's own), which the draft then holds instead of a copy; else None."""

    def fingerprint(self) -> tuple[str, str]:
        """(the data's file, a sha256 of what the run trains on): recorded in each checkpoint, so
        a resume on other data is refused at its start (rank 0 calls it)."""

    def summary(self) -> dict: ...

    def close(self) -> None: ...


def check_source(source: str, cache_gb: float) -> str:
    """train.source, checked against the keys that go with it (the config layer checks each key's
    choices and range)."""
    if cache_gb > 0 and source != "online":
        raise UserInputError(f"config key 'train.cache_gb' = {cache_gb}: only train.source=online has a cache "
                             f"(got train.source={source})")
    return source


class ShardSource:
    """RUN/hidden's shards (ShardReader, memory-mapped); with skip_corrupt, shards failing the
    size or sha256 check are left out (logged) instead of stopping the run."""

    on_device = False
    planned_bytes = None

    def __init__(self, hidden_dir: Path, layout: Layout, skip_corrupt: bool = False):
        from eagleforge.shards import ShardReader

        self.layout = layout
        self.reader = ShardReader(hidden_dir, verify_checksums=VERIFY_CHECKSUMS, skip_corrupt=skip_corrupt)
        if self.reader.skipped_shards:
            log.warning("skipped %d corrupt shard(s) holding %d samples: %s", len(self.reader.skipped_shards),
                        self.reader.skipped_samples, ", ".join(map(str, self.reader.skipped_shards)))
        self.manifest = self.reader.manifest
        self.skipped_samples = self.reader.skipped_samples
        self.pin = layout.device.type == "cuda"

    def __len__(self) -> int:
        return len(self.reader)

    def sample_lengths(self) -> list[int]:
        return self.reader.sample_lengths()

    def load(self, slot: Slot) -> Batch:
        """The padded host batch of this rank's samples of `slot` (pinned for a GPU)."""
        ids = slot.read_of(self.layout.rank, self.layout.world_size)
        return pad_batch([self.reader[i] for i in ids], pin=self.pin)

    def nonfinite_error(self, step: int, samples: list[int]) -> str:
        for i in samples:
            problem = self.reader.nonfinite(i)
            if problem is not None:
                return (f"{problem} (step {step}); the extractor never writes one: re-extract it "
                        f"or set train.skip_corrupt_shards=true after deleting it from the manifest")
        return (f"step {step}: a batch's hidden states held NaN/Inf after reading "
                f"(extract.storage_dtype of the shards: {self.manifest.get('storage_dtype')})")

    def begin(self, epoch: int, batch_index: int) -> None:
        pass

    def shared_embedding(self, dtype: torch.dtype) -> None:
        return None

    def fingerprint(self) -> tuple[str, str]:
        """The shards trained on, as the manifest records them (names, sha256, sample ids): the
        same after a byte-identical re-extraction, another one for other samples or states."""
        shards = [[e["file"], e["sha256"], e["sample_ids"], e.get("skipped_ids", [])] for e in self.reader.shards]
        digest = hashlib.sha256(json.dumps(shards, separators=(",", ":")).encode()).hexdigest()
        return str(self.reader.hidden_dir / "manifest.json"), digest

    def summary(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def open_source(cfg: Config, layout: Layout) -> BatchSource:
    """The configured train.source on this rank."""
    tc = cfg.train
    if check_source(tc.source, tc.cache_gb) == "online":  # the target runs here; its states stand in for the shards
        from eagleforge.train.online import OnlineSource

        return OnlineSource(cfg, layout)
    return ShardSource(cfg.run / "hidden", layout, tc.skip_corrupt_shards)
