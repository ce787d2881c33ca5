"""The target as the extract stage and online training see it: token rows in, captured rows out.

    target = open_target(cfg, layout)        # the hf or the native backend, capture hooks attached
    rows = target.forward(input_ids)         # input_ids: a list of B token lists, right padded here
    # on the group's leader: {"aux_hidden_states": [sum n, k*H], "last_hidden_state": [sum n, H],
    #                         "target_argmax": [sum n] int32 (when asked)}, the samples' rows end
    #                         to end, on the rank's device (no host sync); None on the other ranks
    rows = target.forward(input_ids, then=next_ids, rows_for={rank: [sample positions], ...})
    # each rank named in rows_for gets the rows of its positions, in that order: a dict, or a
    # PendingRows (wait() -> the dict) where they are still on their way from the leader;
    # post_rows=False: its receive is posted only at post() or wait() (no buffer until then)
    target.header                            # the manifest's header (docs/shards.md)
    target.close()

Every rank of a target group calls `forward` with the same ids, in the same order: the group's
collectives (tensor-parallel all-reduces, the vocabulary-parallel argmax, the pipeline's sends
and receives) must pair up. `then` is the next call's input ids when known: a pipeline stage
posts that forward's receive ahead. The hf backend (eagleforge/target/hf.py) is one rank per group; the
native backend (extract/native/target.py) spreads a group over target.tp x target.pp ranks. Both
capture through eagleforge/target/capture.py's hooks and pack rows with `pack_rows`, so the shards, the
manifest and online training see the same rows whichever backend made them.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Protocol, Sequence

import torch

from eagleforge.config import Config
from eagleforge.layout import Layout
from eagleforge.target.capture import HiddenStateCapture

Rows = dict  # {"aux_hidden_states": [N, k*H], "last_hidden_state": [N, H], "target_argmax": [N] int32}


class Target(Protocol):
    header: dict  # the manifest's header: target (path, architecture, sizes), aux layer ids, tokenizer, ...
    hf_config: dict  # the target's config as a dict: the draft is sized from it
    vocab_size: int  # every token id must stay under it
    planned_bytes: float | None  # what the memory plan counted for this rank (None: no plan)
    nonfinite_weights: list[str]  # the group's weights holding NaN/Inf, found at load (nonfinite_weights())

    def forward(self, input_ids: list[list[int]], then: list[list[int]] | None = None,
                rows_for: dict[int, list[int]] | None = None, post_rows: bool = True) -> "Rows | PendingRows | None": ...

    def input_embedding(self) -> torch.Tensor | None:
        """The whole input embedding [V, H] when this rank holds it, else None."""

    def close(self) -> None: ...


class CapturingTarget:
    """What both backends share: the capture hooks on the decoder layers for the target's lifetime."""

    nonfinite_weights: list[str] = []  # each backend sets its own at load

    def __init__(self, layers: Sequence[torch.nn.Module], aux_layers: list[int], final_norm: torch.nn.Module | None):
        self.aux_layers = aux_layers
        self.capture = HiddenStateCapture(layers, aux_layers, final_norm).__enter__()

    def close(self) -> None:
        self.capture.__exit__(None, None, None)


# Elements per isfinite pass when the weights are scanned: the pass's bool copy stays at 16 MB.
SCAN_CHUNK_ELEMENTS = 1 << 24


def nonfinite_weights(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s floating-point parameters and buffers that hold a NaN or an Inf, in
    the model's order: a damaged checkpoint tensor turns the states of every sample whose forward
    reads it into NaN, and the samples skipped for it should name it. Scanned once, at load, in
    chunks (one host read each); tensors a device map left on the meta device are not."""
    return [name for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())
            if tensor.is_floating_point() and tensor.device.type != "meta" and not _all_finite(tensor)]


def _all_finite(tensor: torch.Tensor) -> bool:
    flat = tensor.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + SCAN_CHUNK_ELEMENTS]).all()) for i in range(0, flat.numel(), SCAN_CHUNK_ELEMENTS))


def nonfinite_cause(names: list[str]) -> str | None:
    """The line that names the target's first weight holding NaN/Inf (and how many more), for
    the samples skipped because of it; None when every weight is finite."""
    if not names:
        return None
    more = f" (and {len(names) - 1} more tensors)" if len(names) > 1 else ""
    return (f"the target's {names[0]}{more} holds NaN/Inf: every sample whose forward reads it has NaN/Inf states and "
            "is skipped; the checkpoint is damaged (check that tensor in target.path)")


def select_rows(packed: Rows, lengths: list[int], positions: list[int]) -> Rows:
    """The rows of the samples at `positions` (indices into the forward's samples, whose row
    counts are `lengths`), end to end in that order."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    if positions == list(range(len(lengths))):
        return packed
    return {key: torch.cat([value[starts[p]:starts[p + 1]] for p in positions]) for key, value in packed.items()}


def rows_to_bytes(rows: Rows) -> torch.Tensor:
    """The rows as one contiguous [N, bytes per row] uint8 tensor (one message to send)."""
    parts = [rows[key].reshape(rows[key].shape[0], -1).contiguous().view(torch.uint8) for key in sorted(rows)]
    return torch.cat(parts, dim=1)


def rows_from_bytes(buffer: torch.Tensor, like: dict[str, tuple[tuple, torch.dtype]]) -> Rows:
    """rows_to_bytes inverted: like = {key: (a row's shape, dtype)} of the rows sent, e.g.
    {"last_hidden_state": ((H,), bf16), "target_argmax": ((), int32)}."""
    out, col = {}, 0
    for key in sorted(like):
        row_shape, dtype = like[key]
        width = math.prod(row_shape) * dtype.itemsize
        out[key] = buffer[:, col:col + width].contiguous().view(dtype).reshape(buffer.shape[0], *row_shape)
        col += width
    return out


class PendingRows:
    """Rows on their way from the group's leader to this rank: `receive()` allocates the buffer
    ([N, bytes per row] uint8) and posts its receive, returning (buffer, work); post() calls it
    (once), wait() posts if it was not yet and -> the rows. Posting late keeps the buffer out of
    memory until then; the leader's send of the same rows waits for it (messages between two
    ranks pair up in the order they were posted, so the receives are posted in forward order)."""

    def __init__(self, receive: Callable[[], tuple], like: dict[str, tuple[tuple, torch.dtype]]):
        self.receive, self.like = receive, like
        self.buffer = self.work = None

    @property
    def posted(self) -> bool:
        return self.work is not None

    def post(self) -> None:
        if self.work is None:
            self.buffer, self.work = self.receive()

    def wait(self) -> Rows:
        self.post()
        self.work.wait()
        return rows_from_bytes(self.buffer, self.like)


def pad_right(input_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B token lists -> (tokens [B, T] int64 padded with pad_id, attention mask [B, T] int64), T the longest."""
    lengths = [len(ids) for ids in input_ids]
    tokens = torch.full((len(input_ids), max(lengths)), pad_id, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for b, ids in enumerate(input_ids):
        tokens[b, : lengths[b]] = torch.tensor(ids, dtype=torch.long)
        mask[b, : lengths[b]] = 1
    return tokens, mask


@torch.inference_mode()
def forward_packed(run: Callable[[torch.Tensor, torch.Tensor], object], capture: HiddenStateCapture,
                   input_ids: list[list[int]], pad_id: int, device: torch.device,
                   greedy_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One right-padded forward, `run(tokens [B, T], attention_mask [B, T])` on `device`, under
    `capture`; the samples' unpadded rows packed end to end: aux_hidden_states [sum n, k*H],
    last_hidden_state [sum n, H] and, given `greedy_tokens` ([N, H] normed -> [N] int32),
    target_argmax [sum n]. Sample b is rows sum(n[:b]) : sum(n[:b+1]) (`extract.writer.split_rows`).
    Nothing waits for the device: the copy to the host is the writer's, overlapped."""
    lengths = [len(ids) for ids in input_ids]
    tokens, mask = pad_right(input_ids, pad_id)
    capture.clear()
    run(tokens.to(device), mask.to(device))
    # Under target.device_map the aux layers and the final norm may sit on other devices than
    # `device` (other GPUs, or the CPU for offloaded ones): the rows are gathered on `device`.
    padded = {"aux": capture.aux_hidden_states.to(device), "last": capture.last_hidden_state.to(device)}  # [B, T, k*H], [B, T, H]
    capture.clear()
    return pack_rows(padded, lengths, greedy_tokens)


def pack_rows(padded: dict[str, torch.Tensor], lengths: list[int],
              greedy_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """padded {"aux": [B, T, k*H], "last": [B, T, H]} -> the samples' unpadded rows end to end
    (+ target_argmax [sum n] int32 from `greedy_tokens`). The padded tensors are taken out of
    the dict, so once packed they are freed before the argmax's logits take their place (the
    memory planner counts them apart)."""
    aux, last = padded.pop("aux"), padded.pop("last")
    # Unpadded rows by slicing (lengths are known on the host): unlike a boolean mask, no sync.
    packed = {"aux_hidden_states": torch.cat([aux[b, :n] for b, n in enumerate(lengths)]),  # [sum n, k*H]
              "last_hidden_state": torch.cat([last[b, :n] for b, n in enumerate(lengths)])}  # [sum n, H]
    del aux, last
    if greedy_tokens is not None:
        packed["target_argmax"] = greedy_tokens(packed["last_hidden_state"])  # [sum n] int32
    return packed


def open_target(cfg: Config, layout: Layout, *, write_target_argmax: bool | None = None,
                check_memory: Callable | None = None, check_inputs: Callable[[int], None] | None = None,
                stage_ranges: Callable[[], list[range] | None] | None = None) -> Target:
    """The configured backend's target on this rank, hooks attached. write_target_argmax: default
    extract.write_target_argmax. check_memory(info) -> planned bytes or None: the native backend's
    refusal of a layout that does not fit (default: the extraction plan's). check_inputs(vocab_size): the caller's
    check of its samples against the target's vocabulary, run as soon as the vocabulary is
    known: before any weight is read with the native backend (a Kimi-K2.5 load takes minutes),
    once the model is loaded with the hf backend (whose errors about the target come first).
    stage_ranges(): the native backend's pipeline stages as the memory check cut them (after it)."""
    argmax = cfg.extract.write_target_argmax if write_target_argmax is None else write_target_argmax
    if cfg.target.backend == "native":
        from eagleforge.extract.native.target import load_native_target  # imported lazily: heavy, and only for that backend

        return load_native_target(cfg, layout, argmax, check_memory, check_inputs, stage_ranges)
    from eagleforge.target.hf import HFTarget

    target = HFTarget(cfg, layout, argmax)
    if check_inputs is not None:
        check_inputs(target.vocab_size)
    return target
