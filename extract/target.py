"""The target as the extract stage and online training see it: token rows in, captured rows out.

    target = open_target(cfg, layout)        # the hf or the native backend, capture hooks attached
    rows = target.forward(input_ids)         # input_ids: a list of B token lists, right padded here
    # on the group's leader: {"aux_hidden_states": [sum n, k*H], "last_hidden_state": [sum n, H],
    #                         "target_argmax": [sum n] int32 (when asked)}, the samples' rows end
    #                         to end, on the rank's device (no host sync); None on the other ranks
    target.header                            # the manifest's header (docs/shards.md)
    target.close()

Every rank of a target group calls `forward` with the same ids, in the same order: the group's
collectives (tensor-parallel all-reduces, the vocabulary-parallel argmax) must pair up. The hf
backend (extract/hf.py) is one rank per group; the native backend (extract/native/target.py)
spreads a group over target.tp ranks. Both capture through extract/capture.py's hooks and pack
rows with `forward_packed`, so the shards, the manifest and online training see the same rows
whichever backend made them.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from eagleforge.config import Config
from eagleforge.extract.capture import HiddenStateCapture
from eagleforge.layout import Layout


class Target(Protocol):
    header: dict  # the manifest's header: target (path, architecture, sizes), aux layer ids, tokenizer, ...
    hf_config: dict  # the target's config as a dict: the draft is sized from it
    vocab_size: int  # every token id must stay under it

    def forward(self, input_ids: list[list[int]]) -> dict[str, torch.Tensor] | None: ...

    def close(self) -> None: ...


class CapturingTarget:
    """What both backends share: the capture hooks on the decoder layers for the target's lifetime."""

    def __init__(self, layers: Sequence[torch.nn.Module], aux_layers: list[int], final_norm: torch.nn.Module | None):
        self.aux_layers = aux_layers
        self.capture = HiddenStateCapture(layers, aux_layers, final_norm).__enter__()

    def close(self) -> None:
        self.capture.__exit__(None, None, None)


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
    aux, last = capture.aux_hidden_states.to(device), capture.last_hidden_state.to(device)  # [B, T, k*H], [B, T, H]
    capture.clear()
    # Unpadded rows by slicing (lengths are known on the host): unlike a boolean mask, no sync.
    packed = {"aux_hidden_states": torch.cat([aux[b, :n] for b, n in enumerate(lengths)]),  # [sum n, k*H]
              "last_hidden_state": torch.cat([last[b, :n] for b, n in enumerate(lengths)])}  # [sum n, H]
    del aux, last  # the padded copies are not needed by the argmax: its logits take their place
    if greedy_tokens is not None:
        packed["target_argmax"] = greedy_tokens(packed["last_hidden_state"])  # [sum n] int32
    return packed


def open_target(cfg: Config, layout: Layout, *, write_target_argmax: bool | None = None, rows_to: str = "leader",
                check_memory: Callable | None = None, check_inputs: Callable[[int], None] | None = None) -> Target:
    """The configured backend's target on this rank, hooks attached. write_target_argmax: default
    extract.write_target_argmax. rows_to: which ranks of a group `forward` returns the rows on,
    "leader" (the one that writes shards) or "group" (every rank: online training, where each
    rank trains on its own rows). check_memory(info): the native backend's refusal of a layout
    that does not fit (default: the extraction plan's). check_inputs(vocab_size): the caller's
    check of its samples against the target's vocabulary, run as soon as the vocabulary is
    known: before any weight is read with the native backend (a Kimi-K2.5 load takes minutes),
    once the model is loaded with the hf backend (whose errors about the target come first)."""
    if rows_to not in ("leader", "group"):
        raise ValueError(f"open_target: rows_to must be 'leader' or 'group', got {rows_to!r}")
    argmax = cfg.extract.write_target_argmax if write_target_argmax is None else write_target_argmax
    if cfg.target.backend == "native":
        from eagleforge.extract.native.target import load_native_target  # imported lazily: heavy, and only for that backend

        return load_native_target(cfg, layout, argmax, rows_to, check_memory, check_inputs)
    from eagleforge.extract.hf import HFTarget

    target = HFTarget(cfg, layout, argmax)
    if check_inputs is not None:
        check_inputs(target.vocab_size)
    return target
