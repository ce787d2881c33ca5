"""A training batch: whole samples padded per row, their target states beside them.

Batches are built from rows of samples (eagleforge/shards.py dicts: input_ids [n], loss_mask [n],
aux_hidden_states [n, k*H], last_hidden_state [n, H], optional target_argmax [n]), read from the
shards on the host or captured from the target on the device (train/sources.py); which samples
form a batch is the schedule's (train/schedule.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


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

    def to(self, device: torch.device | str, dtype: torch.dtype | None = torch.float32) -> "Batch":
        """This batch on `device` (non-blocking copies: from pinned memory they do not wait for
        the GPU), the hidden states converted to `dtype` there (None: kept in their own dtype)."""
        def move(x: torch.Tensor | None, as_dtype: torch.dtype | None = None) -> torch.Tensor | None:
            if x is None:
                return None
            moved = x.to(device, non_blocking=True)
            return moved if as_dtype is None else moved.to(as_dtype)

        return Batch(move(self.input_ids), move(self.loss_mask), move(self.aux_hidden_states, dtype),
                     move(self.last_hidden_state, dtype), move(self.target_argmax), move(self.lengths), self.host_tokens,
                     move(self.input_embeds, dtype))


class PendingBatch:
    """A batch still being made (online training: rows on their way from the pipeline's last
    stage): wait() -> Batch."""

    def __init__(self, finish):
        self.wait = finish


def collate(samples: list[dict], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Batch:
    """Pad a list of shard samples (ARCHITECTURE.md `eagleforge.shards` dicts) into a Batch on
    `device`, the hidden states as `dtype` (pad_batch, then Batch.to)."""
    device = torch.device(device)
    return pad_batch(samples, pin=device.type == "cuda").to(device, dtype)


def pad_batch(samples: list[dict], pin: bool = False) -> Batch:
    """The padded Batch where the samples' tensors are (the host for shards, the GPU for online
    rows), the hidden states in the samples' own (storage or target) dtype: half the bytes over
    PCIe for bf16 shards and no fp32 conversion on the host. With `pin` (host samples) it is
    built in pinned memory, so the copies to the GPU are asynchronous (a copy from pageable
    memory first waits for the whole stream: a host sync per tensor). torch keeps freed pinned
    blocks for reuse: the pool grows to about the largest batches in flight, not the dataset."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    b, t = len(samples), max(lengths)
    device = samples[0]["input_ids"].device
    pin = pin and device.type == "cpu"

    def padded(key: str, width: int | None, buffer_dtype: torch.dtype) -> torch.Tensor:
        shape = (b, t) if width is None else (b, t, width)
        out = torch.empty(shape, dtype=buffer_dtype, device=device, pin_memory=pin)
        for row, (sample, n) in enumerate(zip(samples, lengths)):
            out[row, :n] = sample[key]  # converted to the buffer's dtype where they differ
            out[row, n:] = 0
        return out

    def stored(key: str) -> torch.dtype:  # one dtype holding every sample's exactly
        return functools.reduce(torch.promote_types, (s[key].dtype for s in samples))

    first = samples[0]
    has_argmax = all(s.get("target_argmax") is not None for s in samples)
    lengths_t = torch.tensor(lengths, dtype=torch.int64, device=device)
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
