"""Which samples each rank trains on, and when: epochs, optimizer steps, micro-batch slots.

A batch is a list of sample indices whose padded size (rows x longest sample) is at most
`batch_tokens`. Samples are never split and never share a row, so attention cannot cross
samples and no packing mask is needed; to keep the padding small, each epoch shuffles the
samples with a seed of (seed, epoch), sorts them by length inside windows of `SORT_WINDOW`
samples, packs greedily, then shuffles the order of the batches (`make_batches`).

An optimizer step takes the next world x grad_accum of the epoch's batches (fewer at its end,
never across epochs); rank r runs batches r, r + world, ... of them (`rank_micro_batches`): its
micro-batch *slots*, the same count on every rank. A rank whose slot lies past the end of the
list gets None (the epoch's tail): it still runs the step's first batch, with weight 0, so the
collectives stay matched. Each sample is seen once per epoch, on one rank.

Everything here is a pure function of (lengths, batch_tokens, seed, epoch, world, grad_accum):
every rank computes the same schedule without talking, and a resumed run rebuilds it from the
position a checkpoint saved: (epoch, global batch index), which is independent of the world
size, so a run can resume on another number of ranks.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from eagleforge.errors import UserInputError

log = logging.getLogger(__name__)

SORT_WINDOW = 64  # samples sorted by length together: less padding, still well mixed


def make_batches(lengths: Sequence[int], sample_ids: Sequence[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Greedy batches of `sample_ids` (indices into `lengths`) for one epoch, each at most
    `batch_tokens` padded tokens (a sample longer than that is a batch of its own)."""
    if batch_tokens < 1:
        raise ValueError(f"train.batch_tokens must be >= 1, got {batch_tokens}")
    gen = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
    order = [sample_ids[i] for i in torch.randperm(len(sample_ids), generator=gen).tolist()]
    windows = [sorted(order[i : i + SORT_WINDOW], key=lambda s: (lengths[s], s)) for i in range(0, len(order), SORT_WINDOW)]
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for sample in (s for window in windows for s in window):
        n = int(lengths[sample])
        if current and max(longest, n) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        if n > batch_tokens:
            log.warning("sample %d has %d tokens > train.batch_tokens=%d: it forms a batch of its own", sample, n, batch_tokens)
        current.append(sample)
        longest = max(longest, n)
    if current:
        batches.append(current)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def rank_micro_batches(step_batches: Sequence[list[int]], rank: int, world_size: int) -> list[list[int] | None]:
    """Rank `rank`'s micro-batches of one optimizer step: step_batches[i * world + rank] for
    i < ceil(len / world). Every rank gets the same count (collectives stay matched); a rank
    whose slot lies past the end of the list gets None (the epoch's tail): it must still run
    a forward and backward, with weight 0."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    slots = -(-len(step_batches) // world_size)
    picks = [i * world_size + rank for i in range(slots)]
    return [step_batches[i] if i < len(step_batches) else None for i in picks]


def _epoch_seed(seed: int, epoch: int) -> int:
    return (int(seed) * 1_000_003 + int(epoch) * 7919 + 17) % (2**63 - 1)


@dataclass(frozen=True)
class Slot:
    """Micro-batch slot `index` of one optimizer step, as every rank sees it: the step's global
    batches (lists of sample indices) and the epoch they come from (None: held-out evaluation)."""

    step_batches: tuple[tuple[int, ...], ...]
    index: int
    epoch: int | None = None

    def batch_of(self, rank: int, world_size: int) -> list[int] | None:
        """The samples `rank` trains in this slot; None past the epoch's tail (weight 0)."""
        batch = rank_micro_batches(self.step_batches, rank, world_size)[self.index]
        return None if batch is None else list(batch)

    def read_of(self, rank: int, world_size: int) -> list[int]:
        """The samples `rank` runs in this slot: its batch, or the step's first standing in."""
        batch = self.batch_of(rank, world_size)
        return batch if batch is not None else list(self.step_batches[0])


def step_slots(step_batches: Sequence[Sequence[int]], world_size: int, epoch: int | None = None) -> list[Slot]:
    """The slots of one step's global batches: ceil(len / world) of them, on every rank."""
    frozen = tuple(tuple(b) for b in step_batches)
    return [Slot(frozen, i, epoch) for i in range(-(-len(frozen) // world_size))]


@dataclass(frozen=True)
class Position:
    """Where training stands: the epoch and the global batches of it consumed by finished steps."""

    epoch: int = 0
    batch_index: int = 0


@dataclass(frozen=True)
class Step:
    """One optimizer step: its global batches and the position before and after it."""

    number: int  # 1-based: the step count once it is done
    epoch: int
    batches: list[list[int]]
    after: Position


class Schedule:
    """The whole run's steps for one world: epochs of batches, optimizer steps, and each rank's
    slots. Pure: built from the lengths and keys alone, the same on every rank and every resume."""

    def __init__(self, lengths: Sequence[int], train_ids: Sequence[int], batch_tokens: int, seed: int,
                 world_size: int = 1, grad_accum: int = 1, epochs: int = 1, max_steps: int = 0):
        self.lengths, self.train_ids = list(lengths), list(train_ids)
        self.batch_tokens, self.seed, self.world_size = batch_tokens, seed, world_size
        self.batches_per_step = world_size * max(1, grad_accum)  # global batches per optimizer step
        # this instance's epochs, the one being trained and the next (a reading thread may be a step ahead)
        self.epoch_batches = functools.lru_cache(maxsize=2)(self._epoch_batches)
        if max_steps > 0:
            self.total_steps = max_steps
        elif epochs < 1:
            raise UserInputError(f"train.epochs={epochs} and train.max_steps={max_steps}: one must be >= 1")
        else:
            self.total_steps = sum(math.ceil(len(self.epoch_batches(e)) / self.batches_per_step) for e in range(epochs))

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """The epoch's global batch list: a pure function of the seed, identical on every rank."""
        return make_batches(self.lengths, self.train_ids, self.batch_tokens, self.seed, epoch)

    def step_at(self, position: Position, number: int) -> Step:
        """The step taken from `position` (moving to the next epoch when this one is used up)."""
        epoch, index = position.epoch, position.batch_index
        if index >= len(self.epoch_batches(epoch)):
            epoch, index = epoch + 1, 0
        batches = self.epoch_batches(epoch)[index : index + self.batches_per_step]
        return Step(number, epoch, batches, Position(epoch, index + len(batches)))

    def steps(self, position: Position, done: int, last: int) -> Iterator[Step]:
        """The steps done + 1 .. last, from `position` (the position after step `done`)."""
        for number in range(done + 1, last + 1):
            step = self.step_at(position, number)
            yield step
            position = step.after

    def slots(self, position: Position, done: int, last: int) -> Iterator[Slot]:
        """Every slot of the steps done + 1 .. last, in the order each rank trains them."""
        for step in self.steps(position, done, last):
            yield from step_slots(step.batches, self.world_size, step.epoch)
