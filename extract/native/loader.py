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

Every rank first lists the tensors it will read (`plan_reads`: the `shard_spec` of each module,
parallel.py) and checks them against the index and the safetensors headers (`check_reads`:
present, full shape, dtype), reading nothing but the headers; only then does it open the files
with `safe_open(...).get_slice(name)` and read the rows or columns it owns; the whole tensor is
read only where it is replicated. `LoadStats.bytes_read` counts what was read, for tests and logs.
Every refusal is a `UserInputError`: one line naming the file, the tensor or key and the value.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from tqdm import tqdm

from eagleforge.errors import UserInputError
from eagleforge.extract.native import int4
from eagleforge.extract.native.model import DeepseekV3ForExtraction, ModelArgs, RoutedExperts
from eagleforge.extract.native.parallel import TensorParallel
from eagleforge.readers import read_json_object, read_safetensors_header

log = logging.getLogger(__name__)

TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
PREFIXES = ("language_model.", "")  # Kimi-K2.5 wrapper first, then DeepSeek-V3 / K2 names
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("BF16", "F16", "F32")  # safetensors names of the weights' accepted dtypes
INT_DTYPES = ("I32", "I64")


@dataclass
class CheckpointInfo:
    path: Path
    text_config: dict
    architecture: str
    prefix: str  # prepended to transformers' DeepseekV3ForCausalLM names
    weight_map: dict  # tensor name -> file name (relative to path)
    quantized_experts: bool
    index_file: str = INDEX_FILE  # what weight_map was read from (model.safetensors without an index)

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
    return read_json_object(path)


def text_config_of(config: dict, source: str) -> tuple[dict, str]:
    """(deepseek_v3 text config, architecture name) from a config.json dict."""
    architecture = (config.get("architectures") or [config.get("model_type", "?")])[0]
    text = config.get("text_config") or config
    model_type = text.get("model_type", "deepseek_v3")
    if model_type not in TEXT_MODEL_TYPES:
        raise UserInputError(f"{source}: model_type {model_type!r} is not a DeepSeek-V3 family language model ({TEXT_MODEL_TYPES})")
    return text, architecture


def check_quantization(config: dict, text: dict, source: str) -> bool:
    """True when a supported INT4 pack-quantized config is present; anything else is refused."""
    quant = config.get("quantization_config") or text.get("quantization_config")
    if not quant:
        return False
    if not isinstance(quant, dict) or not isinstance(quant.get("config_groups") or {}, dict):
        raise UserInputError(f"{source}: quantization_config is not a mapping with config_groups")
    method = quant.get("quant_method")
    if method != "compressed-tensors":
        raise UserInputError(f"{source}: quantization_config.quant_method = {method!r} is not supported (only compressed-tensors INT4 pack-quantized)")
    for name, group in (quant.get("config_groups") or {}).items():
        group = group if isinstance(group, dict) else {}
        fmt = group.get("format") or quant.get("format")
        weights = group.get("weights") if isinstance(group.get("weights"), dict) else {}
        got = (fmt, weights.get("num_bits"), weights.get("type"), weights.get("symmetric"), weights.get("group_size"))
        want = ("pack-quantized", 4, "int", True, int4.GROUP_SIZE)
        if got != want:
            raise UserInputError(
                f"{source}: quantization_config.config_groups.{name} (format, num_bits, type, symmetric, group_size) "
                f"= {got}; only {want} is supported"
            )
        if group.get("input_activations"):
            raise UserInputError(f"{source}: quantization_config.config_groups.{name} quantizes activations; not supported")
    return True


def read_checkpoint_info(path: str | Path) -> CheckpointInfo:
    """Config, tensor -> file map and naming prefix of a checkpoint directory."""
    path = Path(path)
    config_path = path / "config.json"
    config = _read_json(config_path)
    text, architecture = text_config_of(config, str(config_path))
    has_quant_config = check_quantization(config, text, str(config_path))
    index_path = path / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        _check_weight_map(weight_map, index_path)
    elif (path / "model.safetensors").is_file():
        index_path = path / "model.safetensors"
        weight_map = {name: index_path.name for name in read_safetensors_header(index_path)}
    else:
        raise FileNotFoundError(f"target.path {path}: neither {INDEX_FILE} nor model.safetensors")
    prefix = next((p for p in PREFIXES if f"{p}model.embed_tokens.weight" in weight_map), None)
    if prefix is None:
        raise UserInputError(f"{index_path}: no 'model.embed_tokens.weight' under any of the prefixes {PREFIXES}")
    args = ModelArgs.from_config(text, str(config_path))
    _check_layers_held(args, prefix, weight_map, config_path, index_path)
    _check_embedding_shape(args, path, prefix, weight_map, config_path)
    first_moe = args.first_k_dense_replace
    probe = f"{prefix}model.layers.{first_moe}.mlp.experts.0.gate_proj"
    quantized = f"{probe}.weight_packed" in weight_map
    if quantized and not has_quant_config:
        raise UserInputError(f"{config_path}: {probe}.weight_packed is packed but config.json has no quantization_config")
    if not quantized and f"{probe}.weight" not in weight_map and args.num_hidden_layers > first_moe:
        raise UserInputError(f"{index_path}: tensor {probe}.weight (or .weight_packed) not found")
    return CheckpointInfo(path, text, architecture, prefix, weight_map, quantized, index_path.name)


def _check_layers_held(args: ModelArgs, prefix: str, weight_map: dict, config_path: Path, index_path: Path) -> None:
    """config.json's num_hidden_layers against the layers the index names tensors of: a config
    claiming more is refused here, before the pipeline cut, the memory plan or the model loop
    over its layers (a million claimed layers made the cut search run for hours)."""
    pattern = re.compile(rf"{re.escape(prefix)}model\.layers\.(\d+)\.")
    held = {int(m.group(1)) for name in weight_map if (m := pattern.match(name))}
    missing = [i for i in range(min(args.num_hidden_layers, len(held) + 1)) if i not in held]
    if missing:
        have = f"layers {min(held)}-{max(held)} ({len(held)} in all)" if held else "no layer"
        raise UserInputError(f"{config_path}: num_hidden_layers = {args.num_hidden_layers} but {index_path} names tensors of "
                             f"{have}, none of layer {missing[0]}; the config does not belong to these weights")


def _check_embedding_shape(args: ModelArgs, path: Path, prefix: str, weight_map: dict, config_path: Path) -> None:
    """config.json's vocab_size and hidden_size against the embedding's shape in its file's
    safetensors header (no tensor read): every tensor the model builds is sized by them."""
    name = f"{prefix}model.embed_tokens.weight"
    file = path / weight_map[name]
    try:
        entry = read_safetensors_header(file).get(name) if file.is_file() else None
    except UserInputError:  # a damaged or cut file: check_reads names it with the rest of this rank's problems
        return
    wanted = [args.vocab_size, args.hidden_size]
    if entry is not None and entry["shape"] != wanted:
        raise UserInputError(f"{file}: tensor {name} has shape {entry['shape']} but {config_path} gives vocab_size x "
                             f"hidden_size = {wanted}; the config does not belong to these weights")


def _check_weight_map(weight_map, index_path: Path) -> None:
    """The index's weight_map: tensor name -> a file name inside the checkpoint directory (a path
    elsewhere, such as ../x or /x, is refused: the loader opens what the index names)."""
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserInputError(f"{index_path}: no 'weight_map' of tensor names to file names")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).is_absolute() or ".." in Path(file).parts or "\\" in file:
            raise UserInputError(f"{index_path}: tensor {name} is mapped to {str(file)[:80]!r}, not a file name inside the checkpoint")


def build_model(info: CheckpointInfo, tp: TensorParallel, layout: str, dtype: torch.dtype,
                device: torch.device, prefill_attention: str = "auto", moe_backend: str = "auto",
                layers: range | None = None, first: bool = True, last: bool = True) -> DeepseekV3ForExtraction:
    """This rank's model (one pipeline stage's `layers`, `first`, `last`; default all) with
    uninitialized local weights, allocated on `device` directly; the two kernel choices are
    target.prefill_attention and target.moe_backend."""
    args = dataclasses.replace(info.args, prefill_attention=prefill_attention, moe_backend=moe_backend)
    with torch.device(device):
        model = DeepseekV3ForExtraction(args, tp, layout, dtype, info.quantized_experts, layers, first, last)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------- what this rank reads


@dataclass(frozen=True)
class TensorRead:
    """One tensor this rank reads: its checkpoint name, the full shape it must have (None: any),
    the slice of it this rank owns (() = all of it), the safetensors dtypes accepted, and
    `store`, which takes the slice (a copy into a parameter, or a check of the values)."""

    name: str
    full_shape: tuple | None
    index: tuple
    dtypes: tuple[str, ...]
    store: Callable[[torch.Tensor], object]


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


def _param_reads(model: DeepseekV3ForExtraction, info: CheckpointInfo, prefix: str, module: torch.nn.Module) -> list[TensorRead]:
    """The module's parameters; each is cast to its own dtype on copy (compute dtype, the fp32
    correction bias stays fp32)."""
    reads = []
    for name, param in module.named_parameters(prefix=prefix):
        owner_name, _, leaf = name.rpartition(".")
        full_shape, index = _param_slice(model.get_submodule(owner_name), leaf, tuple(param.shape))
        reads.append(TensorRead(_checkpoint_name(info, name), full_shape, index, FLOAT_DTYPES, param.data.copy_))
    return reads


def _expert_reads(experts: RoutedExperts, info: CheckpointInfo, prefix: str) -> list[TensorRead]:
    """This rank's experts, stacked: ids [start, end), intermediate rows (gate/up) or columns
    (down) [i0, i1). INT4: weight_packed int32 [out, in/8], weight_scale [out, in/32] and the
    optional weight_shape int [2], whose values must be [out, in]."""
    H, I = info.args.hidden_size, info.args.moe_intermediate_size
    full = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    p, g = int4.PACK_FACTOR, int4.GROUP_SIZE
    reads = []
    for local, e in enumerate(range(experts.start, experts.end)):
        for proj, (rows, cols) in full.items():
            base = f"{info.prefix}{prefix}.{e}.{proj}"

            def cut(per: int, proj=proj) -> tuple:  # the intermediate slice; down_proj's in columns of `per` values
                if proj != "down_proj":
                    return (slice(experts.i0, experts.i1), slice(None))
                return (slice(None), slice(experts.i0 // per, experts.i1 // per))

            if not experts.quantized:
                reads.append(TensorRead(f"{base}.weight", (rows, cols), cut(1), FLOAT_DTYPES,
                                        getattr(experts, f"{proj}_weight")[local].copy_))
                continue
            if f"{base}.weight_shape" in info.weight_map:
                reads.append(TensorRead(f"{base}.weight_shape", (2,), (), INT_DTYPES,
                                        functools.partial(_expect_values, info, f"{base}.weight_shape", [rows, cols])))
            reads.append(TensorRead(f"{base}.weight_packed", (rows, cols // p), cut(p), ("I32",),
                                    getattr(experts, f"{proj}_packed")[local].copy_))
            reads.append(TensorRead(f"{base}.weight_scale", (rows, cols // g), cut(g), FLOAT_DTYPES,
                                    getattr(experts, f"{proj}_scale")[local].copy_))
    return reads


def _expect_values(info: CheckpointInfo, name: str, expected: list, tensor: torch.Tensor) -> None:
    stored = [int(v) for v in tensor.tolist()]
    if stored != expected:
        raise UserInputError(f"{info.path / info.weight_map[name]}: tensor {name} = {stored}, expected {expected}")


def plan_reads(model: DeepseekV3ForExtraction, info: CheckpointInfo) -> list[tuple[str, list[TensorRead]]]:
    """Every tensor this rank reads, in steps (the embedding, norm and head, then one per layer)."""
    text = model.model
    ends = [(name, module) for name, module in (("model.embed_tokens", text.embed_tokens), ("model.norm", text.norm),
                                                  ("lm_head", model.lm_head)) if module is not None]  # a stage holds some
    steps = [("embed, norm, head", [read for name, module in ends for read in _param_reads(model, info, name, module)])]
    for i, layer in text.layers.items():
        reads = _param_reads(model, info, f"model.layers.{i}", layer)
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            reads += _expert_reads(experts, info, f"model.layers.{i}.mlp.experts")
        steps.append((f"layer {i}", reads))
    return steps


# ---------------------------------------------------------------------------- headers first (eagleforge.readers)


def check_reads(info: CheckpointInfo, reads: list[TensorRead]) -> None:
    """Each tensor of `reads` against the index and the safetensors headers of its file: present,
    of the full shape the config gives, of an accepted dtype. Only headers are read, so a
    missing or mismatched tensor is found in seconds, before any weight is read; the error is
    one line naming the tensor and the file (and how many more problems this rank has)."""
    headers: dict[str, dict | None] = {}
    problems = []
    for read in reads:
        file = info.weight_map.get(read.name)
        if file is None:
            problems.append(f"{info.path / info.index_file}: tensor {read.name} is not in the index")
            continue
        where = info.path / file
        if file not in headers:
            headers[file] = read_safetensors_header(where) if where.is_file() else None
        if headers[file] is None:
            problems.append(f"{where}: no such file ({info.index_file} names it for tensor {read.name})")
            continue
        entry = headers[file].get(read.name)
        if entry is None:
            problems.append(f"{where}: tensor {read.name} is missing ({info.index_file} names this file for it)")
        elif read.full_shape is not None and tuple(entry["shape"]) != tuple(read.full_shape):
            problems.append(f"{where}: tensor {read.name} has shape {entry['shape']}, "
                            f"expected {list(read.full_shape)} from {info.path / 'config.json'}")
        elif entry["dtype"] not in read.dtypes:
            problems.append(f"{where}: tensor {read.name} is {entry['dtype']}, expected {' or '.join(read.dtypes)}")
    if problems:
        more = f" (and {len(problems) - 1} more problems in the tensors this rank reads)" if len(problems) > 1 else ""
        raise UserInputError(problems[0] + more)


# ---------------------------------------------------------------------------- reading


class _Reader:
    """Open safetensors files once; read slices; count bytes."""

    def __init__(self, info: CheckpointInfo, stats: LoadStats):
        self.info, self.stats, self.handles = info, stats, {}

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        file = self.info.weight_map[name]
        if file not in self.handles:
            self.handles[file] = safe_open(str(self.info.path / file), framework="pt", device="cpu")
        view = self.handles[file].get_slice(name)
        tensor = view[index] if index else view[:]
        self.stats.bytes_read += tensor.numel() * tensor.element_size()
        self.stats.tensors_read += 1
        self.stats.names.append(name)
        return tensor


def load_weights(model: DeepseekV3ForExtraction, info: CheckpointInfo, show_progress: bool = True) -> LoadStats:
    """Fill this rank's model from the checkpoint, reading only its slices, after checking every
    one of them against the headers (check_reads); a progress bar per layer."""
    steps = plan_reads(model, info)
    check_reads(info, [read for _, reads in steps for read in reads])
    stats = LoadStats()
    reader = _Reader(info, stats)
    bar = tqdm(steps, desc="load weights", unit="step", disable=not show_progress)
    for _, reads in bar:
        for read in reads:
            read.store(reader.read(read.name, read.index))
        bar.set_postfix(GiB=f"{stats.bytes_read / 2**30:.1f}")
    reader.handles.clear()
    return stats
