"""Checkpoint reading for the native backend: config, safetensors index, per-rank slices.

Accepted layouts (docs/kimi-k25.md):
  - Kimi-K2.5: config.json is the `kimi_k25` wrapper with the language model in `text_config`;
    text weights under `language_model.model.*` and `language_model.lm_head.weight`;
    `vision_tower.*` / `mm_projector.*` are never read.
  - plain DeepSeek-V3 and Kimi-K2 style: model_type deepseek_v3 (or kimi_k2), un-prefixed names
    (`model.*`, `lm_head.weight`).
Routed experts are either compressed-tensors "pack-quantized" INT4 (weight_packed / weight_scale /
weight_shape, kept packed) or plain weights; every other weight is read as is and cast to the
compute dtype, except the router's fp32 correction bias, which stays fp32.

Every rank opens the files with `safe_open(...).get_slice(name)` and reads only the rows or
columns it owns (the `shard_spec` of each module, parallel.py); the whole tensor is read only
where it is replicated. `LoadStats.bytes_read` counts what was read, for tests and logs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from eagleforge.extract.native import int4
from eagleforge.extract.native.model import DeepseekV3ForExtraction, ModelArgs, RoutedExperts
from eagleforge.extract.native.parallel import TensorParallel

log = logging.getLogger(__name__)

TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
PREFIXES = ("language_model.", "")  # Kimi-K2.5 wrapper first, then DeepSeek-V3 / K2 names


@dataclass
class CheckpointInfo:
    path: Path
    text_config: dict
    architecture: str
    prefix: str  # prepended to transformers' DeepseekV3ForCausalLM names
    weight_map: dict  # tensor name -> file name (relative to path)
    quantized_experts: bool

    @functools.cached_property
    def args(self) -> ModelArgs:
        return ModelArgs.from_config(self.text_config, str(self.path / "config.json"))


@dataclass
class LoadStats:
    bytes_read: int = 0
    tensors_read: int = 0
    names: list = field(default_factory=list)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"target.path: {path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def text_config_of(config: dict, source: str) -> tuple[dict, str]:
    """(deepseek_v3 text config, architecture name) from a config.json dict."""
    architecture = (config.get("architectures") or [config.get("model_type", "?")])[0]
    text = config.get("text_config") or config
    model_type = text.get("model_type", "deepseek_v3")
    if model_type not in TEXT_MODEL_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} is not a DeepSeek-V3 family language model ({TEXT_MODEL_TYPES})")
    return text, architecture


def check_quantization(config: dict, text: dict, source: str) -> bool:
    """True when a supported INT4 pack-quantized config is present; anything else is refused."""
    quant = config.get("quantization_config") or text.get("quantization_config")
    if not quant:
        return False
    method = quant.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(f"{source}: quantization_config.quant_method = {method!r} is not supported (only compressed-tensors INT4 pack-quantized)")
    for name, group in (quant.get("config_groups") or {}).items():
        fmt = group.get("format") or quant.get("format")
        weights = group.get("weights") or {}
        got = (fmt, weights.get("num_bits"), weights.get("type"), weights.get("symmetric"), weights.get("group_size"))
        want = ("pack-quantized", 4, "int", True, int4.GROUP_SIZE)
        if got != want:
            raise ValueError(
                f"{source}: quantization_config.config_groups.{name} (format, num_bits, type, symmetric, group_size) "
                f"= {got}; only {want} is supported"
            )
        if group.get("input_activations"):
            raise ValueError(f"{source}: quantization_config.config_groups.{name} quantizes activations; not supported")
    return True


def read_checkpoint_info(path: str | Path) -> CheckpointInfo:
    """Config, tensor -> file map and naming prefix of a checkpoint directory."""
    path = Path(path)
    config_path = path / "config.json"
    config = _read_json(config_path)
    text, architecture = text_config_of(config, str(config_path))
    has_quant_config = check_quantization(config, text, str(config_path))
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map") or {}
    elif (path / "model.safetensors").is_file():
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            weight_map = {name: "model.safetensors" for name in f.keys()}
    else:
        raise FileNotFoundError(f"target.path {path}: neither model.safetensors.index.json nor model.safetensors")
    prefix = next((p for p in PREFIXES if f"{p}model.embed_tokens.weight" in weight_map), None)
    if prefix is None:
        raise ValueError(f"{index_path}: no 'model.embed_tokens.weight' under any of the prefixes {PREFIXES}")
    args = ModelArgs.from_config(text, str(config_path))
    first_moe = args.first_k_dense_replace
    probe = f"{prefix}model.layers.{first_moe}.mlp.experts.0.gate_proj"
    quantized = f"{probe}.weight_packed" in weight_map
    if quantized and not has_quant_config:
        raise ValueError(f"{config_path}: {probe}.weight_packed is packed but config.json has no quantization_config")
    if not quantized and f"{probe}.weight" not in weight_map and args.num_hidden_layers > first_moe:
        raise ValueError(f"{index_path}: tensor {probe}.weight (or .weight_packed) not found")
    return CheckpointInfo(path, text, architecture, prefix, weight_map, quantized)


def build_model(info: CheckpointInfo, tp: TensorParallel, layout: str, dtype: torch.dtype,
                device: torch.device, prefill_attention: str = "auto", moe_backend: str = "auto") -> DeepseekV3ForExtraction:
    """This rank's model with uninitialized local weights, allocated on `device` directly; the two
    kernel choices are target.prefill_attention and target.moe_backend."""
    args = dataclasses.replace(info.args, prefill_attention=prefill_attention, moe_backend=moe_backend)
    with torch.device(device):
        model = DeepseekV3ForExtraction(args, tp, layout, dtype, info.quantized_experts)
    return model.eval().requires_grad_(False)


class _Reader:
    """Open safetensors files once; read slices; check full shapes; count bytes."""

    def __init__(self, info: CheckpointInfo, stats: LoadStats):
        self.info, self.stats, self.handles = info, stats, {}

    def slice(self, name: str, full_shape: tuple | None, index: tuple = ()) -> torch.Tensor:
        file = self.info.weight_map.get(name)
        if file is None:
            raise ValueError(f"{self.info.path}: tensor {name} is not in the checkpoint index")
        if file not in self.handles:
            self.handles[file] = safe_open(str(self.info.path / file), framework="pt", device="cpu")
        view = self.handles[file].get_slice(name)
        shape = tuple(view.get_shape())
        if full_shape is not None and shape != tuple(full_shape):
            raise ValueError(f"{self.info.path / file}: tensor {name} has shape {list(shape)}, expected {list(full_shape)}")
        tensor = view[index] if index else view[:]
        self.stats.bytes_read += tensor.numel() * tensor.element_size()
        self.stats.tensors_read += 1
        self.stats.names.append(name)
        return tensor


def _param_slice(module: torch.nn.Module, leaf: str, local_shape: tuple) -> tuple[tuple, tuple]:
    """(full shape, index) of a parameter from its module's shard_spec."""
    spec = getattr(module, "shard_spec", {}).get(leaf)
    if spec is None:
        return local_shape, ()
    dim, start, end, full = spec
    full_shape = tuple(full if d == dim else s for d, s in enumerate(local_shape))
    index = tuple(slice(start, end) if d == dim else slice(None) for d in range(len(local_shape)))
    return full_shape, index


def _checkpoint_name(info: CheckpointInfo, name: str) -> str:
    if name == "lm_head.weight" and info.args.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    return info.prefix + name


def _load_params(model: DeepseekV3ForExtraction, info: CheckpointInfo, reader: _Reader, prefix: str, module: torch.nn.Module) -> None:
    for name, param in module.named_parameters(prefix=prefix):
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        full_shape, index = _param_slice(owner, leaf, tuple(param.shape))
        tensor = reader.slice(_checkpoint_name(info, name), full_shape, index)
        if not tensor.is_floating_point():
            raise ValueError(f"{info.path}: tensor {_checkpoint_name(info, name)} is {tensor.dtype}; expected a float weight")
        param.data.copy_(tensor)  # cast to the compute dtype; the fp32 correction bias stays fp32


def _load_experts(experts: RoutedExperts, info: CheckpointInfo, reader: _Reader, prefix: str) -> None:
    """Stack this rank's experts: ids [start, end), intermediate columns/rows [i0, i1)."""
    args = info.args
    H, I = args.hidden_size, args.moe_intermediate_size
    full = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    for local, e in enumerate(range(experts.start, experts.end)):
        for proj, (rows, cols) in full.items():
            base = f"{info.prefix}{prefix}.{e}.{proj}"
            cut_rows = proj != "down_proj"  # gate/up: intermediate = rows; down: columns
            if experts.quantized:
                packed = _packed_slice(reader, base, rows, cols, experts.i0, experts.i1, cut_rows)
                getattr(experts, f"{proj}_packed")[local].copy_(packed)
                getattr(experts, f"{proj}_scale")[local].copy_(
                    _scale_slice(reader, base, rows, cols, experts.i0, experts.i1, cut_rows))
            else:
                index = (slice(experts.i0, experts.i1), slice(None)) if cut_rows else (slice(None), slice(experts.i0, experts.i1))
                getattr(experts, f"{proj}_weight")[local].copy_(reader.slice(f"{base}.weight", (rows, cols), index))


def _packed_slice(reader: _Reader, base: str, rows: int, cols: int, i0: int, i1: int, cut_rows: bool) -> torch.Tensor:
    shape_name = f"{base}.weight_shape"
    if shape_name in reader.info.weight_map:
        stored = [int(v) for v in reader.slice(shape_name, None).tolist()]
        if stored != [rows, cols]:
            raise ValueError(f"{reader.info.path}: tensor {shape_name} = {stored}, expected {[rows, cols]}")
    p = int4.PACK_FACTOR
    index = (slice(i0, i1), slice(None)) if cut_rows else (slice(None), slice(i0 // p, i1 // p))
    packed = reader.slice(f"{base}.weight_packed", (rows, cols // p), index)
    if packed.dtype != torch.int32:
        raise ValueError(f"{reader.info.path}: tensor {base}.weight_packed is {packed.dtype}; pack-quantized needs int32")
    return packed


def _scale_slice(reader: _Reader, base: str, rows: int, cols: int, i0: int, i1: int, cut_rows: bool) -> torch.Tensor:
    g = int4.GROUP_SIZE
    index = (slice(i0, i1), slice(None)) if cut_rows else (slice(None), slice(i0 // g, i1 // g))
    return reader.slice(f"{base}.weight_scale", (rows, cols // g), index)


def load_weights(model: DeepseekV3ForExtraction, info: CheckpointInfo, show_progress: bool = True) -> LoadStats:
    """Fill this rank's model from the checkpoint, reading only its slices; a progress bar per layer."""
    stats = LoadStats()
    reader = _Reader(info, stats)
    text = model.model
    _load_params(model, info, reader, "model.embed_tokens", text.embed_tokens)
    _load_params(model, info, reader, "model.norm", text.norm)
    _load_params(model, info, reader, "lm_head", model.lm_head)
    layers = tqdm(enumerate(text.layers), total=len(text.layers), desc="load weights", unit="layer", disable=not show_progress)
    for i, layer in layers:
        _load_params(model, info, reader, f"model.layers.{i}", layer)
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            _load_experts(experts, info, reader, f"model.layers.{i}.mlp.experts")
        layers.set_postfix(GiB=f"{stats.bytes_read / 2**30:.1f}")
    reader.handles.clear()
    return stats
