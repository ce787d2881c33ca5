"""Forward hooks that capture the aux-layer hidden states and the final normed state.

Model-agnostic: it needs only the decoder layer modules and the final norm module, so the hf
backend, the native DeepSeek backend and eval share it. Only the k aux layers and the final norm
are kept (not the L + 1 states of `output_hidden_states=True`):

    with HiddenStateCapture(decoder_layers(model), [1, 14, 26], final_norm(model)) as capture:
        model.model(input_ids, attention_mask=mask)
        aux = capture.aux_hidden_states    # [B, T, 3*H], layers ascending
        last = capture.last_hidden_state   # [B, T, H], output of the final norm

Aux layer ids follow the project convention (docs/aux-layers.md): the OUTPUT of 0-indexed decoder
layer i, which is transformers' `hidden_states[i + 1]`. The captured tensors are the modules'
own outputs (no copy); models must not modify a layer's output in place afterwards (transformers
and the native backend build a new residual tensor per layer).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


def _first(output):
    """A decoder layer returns a tensor or a tuple whose first element is the hidden state."""
    return output[0] if isinstance(output, (tuple, list)) else output


class HiddenStateCapture:
    """`layers`: the decoder layers in order (layer i = layers[i]), or a mapping {layer id: layer}
    for a model that holds some of them (the native backend's LayerStack, keyed by global id; a
    pipeline stage captures the aux layers it holds, none at all for some stages)."""

    def __init__(self, layers: Sequence[torch.nn.Module] | Mapping, aux_layer_ids: Sequence[int],
                 final_norm: torch.nn.Module | None):
        ids = sorted(int(i) for i in aux_layer_ids)
        if len(set(ids)) != len(ids) or not (ids or final_norm is not None):
            raise ValueError(f"aux_layer_ids must be distinct and non-empty (or a final norm given), got {list(aux_layer_ids)}")
        by_id = {int(i): layer for i, layer in layers.items()} if hasattr(layers, "items") else dict(enumerate(layers))
        if any(i not in by_id for i in ids):
            raise ValueError(f"aux_layer_ids {ids} out of range for a model with {len(layers)} decoder layers"
                             + ("" if sorted(by_id) == list(range(len(by_id))) else f" (ids {min(by_id)}..{max(by_id)})"))
        self.layers = by_id
        self.aux_layer_ids = ids
        self.final_norm = final_norm
        self._aux: dict[int, torch.Tensor] = {}
        self._last: torch.Tensor | None = None
        self._handles: list = []

    def _layer_hook(self, layer_id: int):
        def hook(module, args, output):
            self._aux[layer_id] = _first(output).detach()
        return hook

    def _norm_hook(self, module, args, output):
        self._last = _first(output).detach()

    def __enter__(self) -> "HiddenStateCapture":
        if self._handles:
            raise RuntimeError("HiddenStateCapture is already active")
        for i in self.aux_layer_ids:
            self._handles.append(self.layers[i].register_forward_hook(self._layer_hook(i)))
        if self.final_norm is not None:
            self._handles.append(self.final_norm.register_forward_hook(self._norm_hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def aux_hidden_states(self) -> torch.Tensor:
        """[B, T, k*H]: the aux layers' outputs concatenated in ascending layer order."""
        missing = [i for i in self.aux_layer_ids if i not in self._aux]
        if missing or not self.aux_layer_ids:
            raise RuntimeError(f"no output captured for decoder layers {missing}: run a forward inside the context")
        # Under a device_map (target.device_map) the layers sit on several devices: gathered on
        # the first aux layer's (a no-op when they share one).
        first = self._aux[self.aux_layer_ids[0]].device
        return torch.cat([self._aux[i].to(first) for i in self.aux_layer_ids], dim=-1)

    @property
    def last_hidden_state(self) -> torch.Tensor:
        """[B, T, H]: the final norm's output."""
        if self._last is None:
            raise RuntimeError("no final-norm output captured: run a forward inside the context (final_norm given?)")
        return self._last

    def clear(self) -> None:
        """Drop the captured tensors (frees their memory between forwards)."""
        self._aux.clear()
        self._last = None
