"""Batches of whole samples from the shards: deterministic, seeded, padded per row.

A batch is a list of sample indices whose padded size (rows x longest sample) is at most
`batch_tokens`. Samples are never split and never share a row, so attention cannot cross
samples and no packing mask is needed; to keep the padding small, each epoch shuffles the
samples with a seed of (seed, epoch), sorts them by length inside windows of
`SORT_WINDOW` samples, packs greedily, then shuffles the order of the batches. Everything is
a pure function of (lengths, batch_tokens, seed, epoch), so a resumed run rebuilds the same
batches from the epoch number and continues from the saved batch index.

Data parallelism: every rank computes the same global list of an epoch's batches; an optimizer
step takes the next world x grad_accum of them and rank r runs batches r, r + world, ...
(`rank_micro_batches`), so each sample is seen once per epoch, on one rank. The position saved
in a checkpoint is the global batch index, so a run can resume on another number of ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

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


@dataclass
class Batch:
    """Samples padded to the longest one; padding has loss_mask 0 and input id 0."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool
    aux_hidden_states: torch.Tensor  # [B, T, k*Ht] float (storage dtype cast to `dtype`)
    last_hidden_state: torch.Tensor  # [B, T, Ht]
    target_argmax: torch.Tensor | None  # [B, T] int64, None when the shards lack it
    lengths: torch.Tensor  # [B] int64

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


def collate(samples: list[dict], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Batch:
    """Pad a list of shard samples (ARCHITECTURE.md `eagleforge.shards` dicts) into a Batch."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    b, t = len(samples), max(lengths)
    k_h = samples[0]["aux_hidden_states"].shape[-1]
    h = samples[0]["last_hidden_state"].shape[-1]
    has_argmax = all(s.get("target_argmax") is not None for s in samples)
    input_ids = torch.zeros(b, t, dtype=torch.int64)
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    aux = torch.zeros(b, t, k_h, dtype=dtype)
    last = torch.zeros(b, t, h, dtype=dtype)
    argmax = torch.zeros(b, t, dtype=torch.int64) if has_argmax else None
    for row, (sample, n) in enumerate(zip(samples, lengths)):
        input_ids[row, :n] = sample["input_ids"].to(torch.int64)
        loss_mask[row, :n] = sample["loss_mask"].to(torch.bool)
        aux[row, :n] = sample["aux_hidden_states"].to(dtype)
        last[row, :n] = sample["last_hidden_state"].to(dtype)
        if argmax is not None:
            argmax[row, :n] = sample["target_argmax"].to(torch.int64)
    to = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
    return Batch(to(input_ids), to(loss_mask), to(aux), to(last), to(argmax), torch.tensor(lengths, device=device))


def iterate_batches(batches: list[list[int]], get_sample: Callable[[int], dict], device, dtype=torch.float32, start: int = 0):
    """Yield (batch index, Batch) from `start` on; `get_sample(i)` reads sample i from the shards."""
    for index in range(start, len(batches)):
        yield index, collate([get_sample(i) for i in batches[index]], device, dtype)
