"""The hf backend: any transformers causal LM as a Target (eagleforge/target/protocol.py), one rank per group.

    python -m eagleforge.extract run_dir=runs/x                       # one process
    torchrun --nproc-per-node 8 -m eagleforge.extract run_dir=runs/x  # 8 data-parallel groups

The base model (`model.model`) runs under HiddenStateCapture, right padded with an attention
mask, so neither the full logits nor all L + 1 hidden states are ever materialized.
`target_argmax` comes from the captured final state through the lm_head, a few rows at a time.
The chunks, their batches, resume and the writer are the extract stage's (extract/driver.py).
"""

from __future__ import annotations

import logging

import torch

from eagleforge.config import Config
from eagleforge.errors import UserInputError
from eagleforge.layout import Layout
from eagleforge.target.capture import HiddenStateCapture
from eagleforge.target.loading import decoder_layers, final_norm, load_target, padding_id, resolve_aux_layers, target_path, text_config
from eagleforge.target.protocol import CapturingTarget, forward_packed, nonfinite_weights, select_rows

log = logging.getLogger(__name__)

# Rows of last_hidden_state per lm_head matmul for target_argmax: keeps the transient logits
# chunk at about 2**24 elements (64 MiB fp32) whatever the vocabulary (341 rows for SmolLM2's
# 49152, 102 for Kimi's 163840: still large matmuls).
ARGMAX_CHUNK_ELEMENTS = 1 << 24


class HFTarget(CapturingTarget):
    """A transformers causal LM on this rank's device (or spread by target.device_map), hooks attached."""

    def __init__(self, cfg: Config, layout: Layout, write_target_argmax: bool):
        self.device, self.rank = layout.device, layout.rank
        self.planned_bytes = None  # no memory plan for the hf backend
        self.model, tokenizer = load_target(cfg.target, device=self.device)
        config = text_config(self.model.config)
        self.vocab_size = int(config.vocab_size)
        aux_layers = resolve_aux_layers(cfg.extract.aux_layers, int(config.num_hidden_layers))
        self.pad = padding_id(tokenizer) if tokenizer is not None else 0
        self.write_target_argmax = write_target_argmax
        self.header = manifest_header(cfg, self.model, tokenizer, aux_layers)
        self.header["has_target_argmax"] = bool(write_target_argmax)
        self.hf_config = self.model.config.to_dict()
        self.nonfinite_weights = nonfinite_weights(self.model)  # named when samples are skipped for them
        super().__init__(decoder_layers(self.model), aux_layers, final_norm(self.model))

    def input_embedding(self) -> torch.Tensor | None:
        """The model's input embedding [V, H] (None when a device map may have it elsewhere)."""
        embed = self.model.get_input_embeddings()
        return None if embed is None or getattr(self.model, "hf_device_map", None) else embed.weight

    def forward(self, input_ids: list[list[int]], then: list[list[int]] | None = None,
                rows_for: dict[int, list[int]] | None = None, post_rows: bool = True) -> dict[str, torch.Tensor] | None:
        """The packed rows of the samples (forward_batch); every rank is its own group's leader
        (its rows are never in flight: post_rows changes nothing)."""
        packed = forward_batch(self.model, self.capture, input_ids, self.pad, self.device, self.write_target_argmax)
        if rows_for is None:
            return packed
        mine = rows_for.get(self.rank)
        return None if mine is None else select_rows(packed, [len(ids) for ids in input_ids], mine)


def forward_batch(model, capture: HiddenStateCapture, input_ids: list[list[int]], pad_id: int,
                  device: torch.device, write_target_argmax: bool) -> dict[str, torch.Tensor]:
    """One right-padded forward of the base model (target.forward_packed): aux_hidden_states
    [sum n, k*H], last_hidden_state [sum n, H] (compute dtype) and target_argmax [sum n] int32
    when asked, on `device`."""
    # The base model (model.model for Llama): the decoder stack without the lm_head, so no
    # [B, T, V] logits are computed.
    base = getattr(model, "base_model", model)

    def run(tokens: torch.Tensor, mask: torch.Tensor) -> None:
        base(input_ids=tokens, attention_mask=mask, use_cache=False)

    greedy = (lambda last: _target_argmax(model, last)) if write_target_argmax else None
    return forward_packed(run, capture, input_ids, pad_id, device, greedy)


def _target_argmax(model, last_hidden: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary greedy next token, [N, H] -> [N] int32, in row chunks of the lm_head."""
    head = model.get_output_embeddings()
    if head is None:
        raise UserInputError(f"{type(model).__name__} has no output embeddings: set extract.write_target_argmax=false")
    rows = max(1, ARGMAX_CHUNK_ELEMENTS // head.weight.shape[0])
    # Logit scaling or soft-capping some models apply after the head is monotonic: same argmax.
    # Under target.device_map the head may sit on another device (its hook moves the rows there).
    parts = [head(last_hidden[i : i + rows]).argmax(-1).to(last_hidden.device) for i in range(0, last_hidden.shape[0], rows)]
    if not parts:
        return torch.zeros(0, dtype=torch.int32, device=last_hidden.device)
    return torch.cat(parts).to(torch.int32)


def manifest_header(cfg: Config, model, tokenizer, aux_layers: list[int]) -> dict:
    config = text_config(model.config)
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    return {
        "target": {
            "path": str(target_path(cfg.target)),
            "architecture": architectures[0],
            "num_layers": int(config.num_hidden_layers),
            "hidden_size": int(config.hidden_size),
            "vocab_size": int(config.vocab_size),
        },
        "aux_layer_ids": aux_layers,
        "tokenizer": getattr(tokenizer, "name_or_path", "") if tokenizer is not None else "",
        "chat_template": getattr(tokenizer, "chat_template", None) if tokenizer is not None else None,
        "max_length": cfg.data.max_length,
        "has_target_argmax": bool(cfg.extract.write_target_argmax),
    }
