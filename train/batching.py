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

import functools
import logging
from dataclasses import dataclass
from typing import Sequence

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
    host_tokens: int | None = None  # sum(lengths), known on the host (collate): no device read

    @property
    def num_tokens(self) -> int:
        return self.host_tokens if self.host_tokens is not None else int(self.lengths.sum())


def collate(samples: list[dict], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Batch:
    """Pad a list of shard samples (ARCHITECTURE.md `eagleforge.shards` dicts) into a Batch.

    The padded hidden states are built in the samples' own (storage) dtype and converted to
    `dtype` on the device: half the bytes over PCIe for bf16 shards and no fp32 conversion on the
    host. For a CUDA device they are built in pinned memory, so the copies are asynchronous (a
    copy from pageable memory first waits for the whole stream: a host sync per tensor). torch
    keeps freed pinned blocks for reuse: the pool grows to about the largest batches in flight
    (a few batches' hidden states, not the dataset)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    device = torch.device(device)
    pin = device.type == "cuda"
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    b, t = len(samples), max(lengths)

    def padded(key: str, width: int | None, buffer_dtype: torch.dtype) -> torch.Tensor:
        shape = (b, t) if width is None else (b, t, width)
        out = torch.empty(shape, dtype=buffer_dtype, pin_memory=pin)
        for row, (sample, n) in enumerate(zip(samples, lengths)):
            out[row, :n] = sample[key]  # converted to the buffer's dtype where they differ
            out[row, n:] = 0
        return out

    first = samples[0]
    has_argmax = all(s.get("target_argmax") is not None for s in samples)
    input_ids = padded("input_ids", None, torch.int64)
    loss_mask = padded("loss_mask", None, torch.bool)
    def stored(key: str) -> torch.dtype:  # one dtype holding every sample's exactly
        return functools.reduce(torch.promote_types, (s[key].dtype for s in samples))

    aux = padded("aux_hidden_states", first["aux_hidden_states"].shape[-1], stored("aux_hidden_states"))
    last = padded("last_hidden_state", first["last_hidden_state"].shape[-1], stored("last_hidden_state"))
    argmax = padded("target_argmax", None, torch.int64) if has_argmax else None

    def to(x: torch.Tensor | None, as_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        if x is None:
            return None
        moved = x.to(device, non_blocking=True)
        return moved if as_dtype is None else moved.to(as_dtype)

    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    return Batch(to(input_ids), to(loss_mask), to(aux, dtype), to(last, dtype), to(argmax),
                 to(lengths_t.pin_memory() if pin else lengths_t), host_tokens=sum(lengths))
