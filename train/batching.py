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

import collections
import functools
import logging
from concurrent.futures import Future
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
    host_tokens: int | None = None  # sum(lengths), known on the host (collate): no device read
    # embed_tokens(input_ids padded with K zeros) [B, T + K, H], gathered on the host from the frozen
    # embedding when the trainer keeps it there (train.embed_device=host); None: the draft looks up
    input_embeds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.host_tokens if self.host_tokens is not None else int(self.lengths.sum())

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> "Batch":
        """This batch on `device` (non-blocking copies: from pinned memory they do not wait for
        the GPU), the hidden states converted to `dtype` there."""
        def move(x: torch.Tensor | None, as_dtype: torch.dtype | None = None) -> torch.Tensor | None:
            if x is None:
                return None
            moved = x.to(device, non_blocking=True)
            return moved if as_dtype is None else moved.to(as_dtype)

        return Batch(move(self.input_ids), move(self.loss_mask), move(self.aux_hidden_states, dtype),
                     move(self.last_hidden_state, dtype), move(self.target_argmax), move(self.lengths), self.host_tokens,
                     move(self.input_embeds, dtype))


def collate(samples: list[dict], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Batch:
    """Pad a list of shard samples (ARCHITECTURE.md `eagleforge.shards` dicts) into a Batch on
    `device`, the hidden states as `dtype` (collate_host, then Batch.to)."""
    device = torch.device(device)
    return collate_host(samples, pin=device.type == "cuda").to(device, dtype)


def collate_host(samples: list[dict], pin: bool = False) -> Batch:
    """The padded Batch on the host, the hidden states in the samples' own (storage) dtype: half
    the bytes over PCIe for bf16 shards and no fp32 conversion on the host. With `pin` it is
    built in pinned memory, so the copies to the GPU are asynchronous (a copy from pageable
    memory first waits for the whole stream: a host sync per tensor). torch keeps freed pinned
    blocks for reuse: the pool grows to about the largest batches in flight, not the dataset."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    b, t = len(samples), max(lengths)

    def padded(key: str, width: int | None, buffer_dtype: torch.dtype) -> torch.Tensor:
        shape = (b, t) if width is None else (b, t, width)
        out = torch.empty(shape, dtype=buffer_dtype, pin_memory=pin)
        for row, (sample, n) in enumerate(zip(samples, lengths)):
            out[row, :n] = sample[key]  # converted to the buffer's dtype where they differ
            out[row, n:] = 0
        return out

    def stored(key: str) -> torch.dtype:  # one dtype holding every sample's exactly
        return functools.reduce(torch.promote_types, (s[key].dtype for s in samples))

    first = samples[0]
    has_argmax = all(s.get("target_argmax") is not None for s in samples)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    return Batch(
        input_ids=padded("input_ids", None, torch.int64),
        loss_mask=padded("loss_mask", None, torch.bool),
        aux_hidden_states=padded("aux_hidden_states", first["aux_hidden_states"].shape[-1], stored("aux_hidden_states")),
        last_hidden_state=padded("last_hidden_state", first["last_hidden_state"].shape[-1], stored("last_hidden_state")),
        target_argmax=padded("target_argmax", None, torch.int64) if has_argmax else None,
        lengths=lengths_t.pin_memory() if pin else lengths_t,
        host_tokens=sum(lengths),
    )


def gather_embeddings(weight: torch.Tensor, input_ids: torch.Tensor, ttt_steps: int, pin: bool = False) -> torch.Tensor:
    """weight [V, H] (on the host), input_ids [B, T] -> the rows the K TTT steps read
    [B, T + K, H] (id 0 past the end, as forward_ttt), in weight's dtype; pinned with `pin`."""
    from eagleforge.draft.model import ttt_input_ids

    ids = ttt_input_ids(input_ids, ttt_steps)  # [B, T + K]
    out = torch.empty((*ids.shape, weight.shape[1]), dtype=weight.dtype, pin_memory=pin)
    torch.index_select(weight, 0, ids.reshape(-1), out=out.view(-1, weight.shape[1]))
    return out


class BatchPrefetch:
    """Reads and pads micro-batches (collate_host) on one worker thread, ahead of the step that
    trains on them: the trainer hands over the next optimizer step's batches before it runs the
    current one, so reading the shards (mmap page faults, fp8 dequantization) and padding overlap
    the GPU's work. One worker: in training the shard reader is used by one thread at a time, and
    the batches come back in the order they were asked for."""

    def __init__(self, load: Callable[[list[int]], Batch]):
        from concurrent.futures import ThreadPoolExecutor

        self._load = load
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batch-prefetch")
        # sample ids -> reads queued for them, oldest first (consecutive steps may hold the same batch)
        self._pending: dict[tuple[int, ...], collections.deque[Future]] = {}

    def ahead(self, batches: list[list[int]]) -> None:
        """Queue a read of each of `batches` (lists of sample ids), in this order."""
        for ids in batches:
            self._pending.setdefault(tuple(ids), collections.deque()).append(self._pool.submit(self._load, list(ids)))

    def ensure(self, batches: list[list[int]]) -> None:
        """Queue reads for those of `batches` that are not queued yet (counting repeats)."""
        counts = collections.Counter(tuple(ids) for ids in batches)
        for key, needed in counts.items():
            self.ahead([list(key)] * (needed - len(self._pending.get(key, ()))))

    def get(self, ids: list[int]) -> Batch:
        """The host Batch of `ids`: the oldest read queued for them, else one read now (on the
        worker all the same)."""
        queued = self._pending.get(tuple(ids))
        future = queued.popleft() if queued else self._pool.submit(self._load, list(ids))
        if queued is not None and not queued:
            del self._pending[tuple(ids)]
        return future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
