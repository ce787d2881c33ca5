"""Export and load of the draft in the format vLLM and SGLang load unchanged (docs/export.md).

    out_dir/config.json          Eagle3Config.to_hf_dict()
    out_dir/model.safetensors    export_tensor_specs(config): EXPORT_TENSOR_NAMES, and
                                 fc_norm.{i}.weight with "fc_norm": true (EAGLE-3.1); bf16 unless
                                 noted, metadata {"format": "pt"}

No embed_tokens (both engines use the target's), no "model." prefix, no other keys: vLLM rejects
unknown names. Written atomically: a temporary sibling directory, fsynced, then renamed.

load_draft also reads what other trainers write: their tensor names (FOREIGN_TENSOR_NAMES), an
embed_tokens.weight of the draft's own, and the config forms of Eagle3Config.from_hf_dict.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagleforge.atomic import atomic_dir
from eagleforge.draft.config import Eagle3Config
from eagleforge.draft.model import Eagle3Draft
from eagleforge.errors import bounded_repr, bounded_text
from eagleforge.readers import open_safetensors, read_json_object

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# name -> (shape as a function of the config, dtype or None for the export dtype, required).
EXPORT_TENSOR_NAMES: dict[str, tuple] = {
    "midlayer.self_attn.q_proj.weight": (lambda c: (c.num_attention_heads * c.head_dim, 2 * c.hidden_size), None, True),
    "midlayer.self_attn.k_proj.weight": (lambda c: (c.num_key_value_heads * c.head_dim, 2 * c.hidden_size), None, True),
    "midlayer.self_attn.v_proj.weight": (lambda c: (c.num_key_value_heads * c.head_dim, 2 * c.hidden_size), None, True),
    "midlayer.self_attn.o_proj.weight": (lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim), None, True),
    "midlayer.mlp.gate_proj.weight": (lambda c: (c.intermediate_size, c.hidden_size), None, True),
    "midlayer.mlp.up_proj.weight": (lambda c: (c.intermediate_size, c.hidden_size), None, True),
    "midlayer.mlp.down_proj.weight": (lambda c: (c.hidden_size, c.intermediate_size), None, True),
    "midlayer.input_layernorm.weight": (lambda c: (c.hidden_size,), None, True),
    "midlayer.hidden_norm.weight": (lambda c: (c.hidden_size,), None, True),
    "midlayer.post_attention_layernorm.weight": (lambda c: (c.hidden_size,), None, True),
    "fc.weight": (lambda c: (c.hidden_size, c.fc_in_features), None, True),
    "norm.weight": (lambda c: (c.hidden_size,), None, True),
    "lm_head.weight": (lambda c: (c.draft_vocab_size, c.hidden_size), None, True),
    # Present exactly when the draft vocabulary is smaller than the target's.
    "d2t": (lambda c: (c.draft_vocab_size,), torch.int64, False),
    # Optional (SGLang and vLLM ignore / accept it); written whenever d2t is.
    "t2d": (lambda c: (c.vocab_size,), torch.bool, False),
}

# EAGLE-3.1 (config.fc_norm): one RMSNorm weight [Ht] per aux layer i = 0 .. k-1, named as vLLM
# and SGLang load them; present exactly when config.json has "fc_norm": true.
FC_NORM_TENSOR = "fc_norm.{}.weight"

# Other writers' names of the export's tensors (prefix -> the export's), which both engines or
# SGLang alone load: the decoder layer as vLLM's speculators format names it (layers.0.), SGLang's
# legacy names of the three fc_norm weights (its llama_eagle3.py load_weights; vLLM refuses them).
FOREIGN_TENSOR_NAMES = {"layers.0.": "midlayer.", "aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.",
                        "aux_norm_high.": "fc_norm.2."}
# A draft's own input embedding [V, H] (SpecForge's save_pretrained writes the target's): the
# loader uses it only when no embed_tokens is given.
EMBED_TENSOR = "embed_tokens.weight"


def export_tensor_name(name: str) -> str:
    """The export's name of a tensor stored under `name` (FOREIGN_TENSOR_NAMES)."""
    for prefix, ours in FOREIGN_TENSOR_NAMES.items():
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


def export_tensor_specs(config: Eagle3Config) -> dict[str, tuple]:
    """EXPORT_TENSOR_NAMES's entries for `config`'s draft: those of every draft, and with
    config.fc_norm the fc_norm.{i}.weight entries (required)."""
    specs = dict(EXPORT_TENSOR_NAMES)
    if config.fc_norm:
        for i in range(config.num_aux_layers):
            specs[FC_NORM_TENSOR.format(i)] = (lambda c: (c.target_hidden_size,), None, True)
    return specs


def expected_tensors(config: Eagle3Config, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[tuple, torch.dtype]]:
    """{name: (shape, dtype)} an export of `config` holds (d2t/t2d only when Vd < V, fc_norm.{i}
    only with config.fc_norm)."""
    out = {}
    for name, (shape, tensor_dtype, required) in export_tensor_specs(config).items():
        if required or config.draft_vocab_size < config.vocab_size:
            out[name] = (tuple(shape(config)), tensor_dtype or dtype)
    return out


def export_state_dict(draft: Eagle3Draft, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The export's tensors, contiguous, on the CPU."""
    state = draft.state_dict()
    out = {}
    for name, (_, tensor_dtype) in expected_tensors(draft.config, dtype).items():
        out[name] = state[name].detach().to("cpu", tensor_dtype).contiguous()
    return out


def save_draft(draft: Eagle3Draft, out_dir, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors to out_dir atomically (replacing what is there)."""
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:  # the old export stays whole until the new one is complete
        save_file(export_state_dict(draft, dtype), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(draft.config.to_hf_dict(), indent=2) + "\n")
    log.info("exported the draft to %s", out_dir)
    return out_dir


# safetensors' dtype names as torch names them (what an error line shows)
_TORCH_DTYPE_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                      "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
                      "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                      "F8_E8M0": "float8_e8m0fnu", "C64": "complex64"}


def _check_dtypes(dtypes: dict[str, str], weights: Path) -> None:
    """ValueError naming the file, the tensor and its dtype (`dtypes`: safetensors' names, from
    the header) when the format does not allow it: weights are floating point, d2t holds integer
    offsets, t2d booleans (or 0/1 integers). A cast would turn an int8 fc.weight into a draft of
    other numbers without a word."""
    for name, dtype in sorted(dtypes.items()):
        floating, integer = dtype.startswith(("F", "BF")), dtype.startswith(("I", "U"))
        if name == "d2t":
            allowed, wanted = integer, "an integer dtype"
        elif name == "t2d":
            allowed, wanted = integer or dtype == "BOOL", "bool or an integer dtype"
        else:
            allowed, wanted = floating, "a floating-point dtype"
        if not allowed:
            raise ValueError(f"{weights}: {name} is {_TORCH_DTYPE_NAMES.get(dtype, dtype.lower())}, the format asks for {wanted}")


def read_draft_config(path) -> tuple[dict, Path, Path]:
    """(config.json as a dict, its path, the weights' path) of the draft directory `path`:
    FileNotFoundError for a missing file, a ValueError (UserInputError) naming config.json when it
    is not a JSON object."""
    path = Path(path)
    config_path, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    for file in (config_path, weights):
        if not file.is_file():
            raise FileNotFoundError(f"draft {path}: missing {file.name}")
    return read_json_object(config_path, "a draft's config.json"), config_path, weights


def check_draft_weights(f, config: Eagle3Config, weights: Path, config_path: Path) -> tuple[dict[str, str], torch.Tensor | None]:
    """The draft's weights file, open as `f` (open_safetensors), against its `config`: the
    tensors `config` asks for, each of the shape it implies and a dtype the format allows, no
    other, and the vocabulary map (d2t, t2d: read, the only tensors read here). Returns
    ({the export's name: the name stored}, the checked t2d, derived from d2t when the file has
    none; None without d2t). A ValueError names the file and what differs. load_draft and the
    export check (eagleforge/export.py, which eval runs first) both check a draft so."""
    stored = {export_tensor_name(n): n for n in f.keys()}
    if len(stored) < len(f.keys()):
        twice = sorted(n for n in f.keys() if stored[export_tensor_name(n)] != n)
        raise ValueError(f"{weights}: {bounded_repr(twice)} hold tensors that are also stored under the export's names")
    specs = {**export_tensor_specs(config), EMBED_TENSOR: (lambda c: (c.vocab_size, c.hidden_size), None, False)}
    names = set(stored)
    _check_fc_norm(config, names, weights, config_path)
    unknown, missing = names - set(specs), {n for n, v in specs.items() if v[2]} - names
    if unknown or missing:
        raise ValueError(f"{weights}: unknown tensors {bounded_repr(sorted(unknown))}, missing tensors {sorted(missing)}")
    dtypes = {}
    for name in sorted(names):
        piece = f.get_slice(stored[name])
        shape, implied = tuple(piece.get_shape()), tuple(specs[name][0](config))
        if shape != implied:
            raise ValueError(f"{weights}: {stored[name]} has shape {shape}, config.json implies {implied}")
        dtypes[name] = piece.get_dtype()
    _check_dtypes(dtypes, weights)
    if "d2t" not in names:
        if config.draft_vocab_size < config.vocab_size:
            raise ValueError(f"{weights}: draft_vocab_size {config.draft_vocab_size} < vocab_size {config.vocab_size} but no d2t")
        return stored, None
    d2t = f.get_tensor(stored["d2t"]).long()
    target_ids = torch.arange(config.draft_vocab_size) + d2t
    outside = ((target_ids < 0) | (target_ids >= config.vocab_size)).nonzero().flatten()
    if len(outside):
        i = int(outside[0])
        raise ValueError(f"{weights}: d2t maps draft id {i} to target id {int(target_ids[i])}, outside the vocabulary of "
                         f"{config.vocab_size} (vocab_size of {config_path}){f' (and {len(outside) - 1} more)' if len(outside) > 1 else ''}")
    if "t2d" in names:
        t2d = f.get_tensor(stored["t2d"])
        if (t2d.dtype != torch.bool and not ((t2d == 0) | (t2d == 1)).all()) or not t2d.bool()[target_ids].all() \
                or int(t2d.bool().sum()) != config.draft_vocab_size:
            raise ValueError(f"{weights}: d2t and t2d disagree (d2t must map onto exactly the ids where t2d is true)")
        return stored, t2d.bool()
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    if int(t2d.sum()) != config.draft_vocab_size:
        raise ValueError(f"{weights}: d2t maps two draft ids to one target id")
    return stored, t2d


def load_draft(path, embed_tokens: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", target_num_layers: int = 0) -> Eagle3Draft:
    """An Eagle3Draft from an export directory (or a draft another trainer wrote, docs/export.md).

    embed_tokens: the target's input embedding, a [V, H] tensor or an nn.Embedding; None leaves
    the draft's embed_tokens random (attach it later with draft.set_embed_tokens) unless the
    draft holds its own. target_num_layers: the target's depth, needed only for a config.json
    that names no aux layers (the engines then capture the target's defaults). What does not fit
    is a ValueError naming the file (check_draft_weights).
    """
    path = Path(path)
    hf, config_path, weights = read_draft_config(path)
    config = Eagle3Config.from_hf_dict(hf, source=str(config_path), target_num_layers=target_num_layers)
    with open_safetensors(weights) as f:  # a crafted or cut header: a ValueError naming the file
        stored, t2d = check_draft_weights(f, config, weights, config_path)
        tensors = {name: f.get_tensor(stored[name]) for name in stored if name not in ("d2t", "t2d")}
        d2t = f.get_tensor(stored["d2t"]) if "d2t" in stored else None
    draft = Eagle3Draft(config)
    own_embed = tensors.pop(EMBED_TENSOR, None)
    result = draft.load_state_dict(tensors, strict=False)
    assert set(result.missing_keys) <= {"embed_tokens.weight", "d2t", "t2d"}, f"not loaded: {result.missing_keys}"
    if d2t is not None:
        draft.set_vocab_map(d2t, t2d)
    if embed_tokens is not None:
        weight = getattr(embed_tokens, "weight", embed_tokens)  # nn.Embedding or its weight
        weight = weight.detach().to("cpu", torch.float32)
        if own_embed is not None and not torch.equal(own_embed.float(), weight):
            # vLLM keeps a draft's own embedding where it differs from the target's; SGLang and
            # this loader take the target's.
            log.warning("%s: %s differs from the target's input embedding; loaded with the target's "
                        "(as SGLang runs it; vLLM would run the draft's own)", weights, stored[EMBED_TENSOR])
        draft.set_embed_tokens(weight)
    elif own_embed is not None:
        draft.set_embed_tokens(own_embed.float())
    return draft.to(device=device, dtype=dtype)


def _check_fc_norm(config: Eagle3Config, names: set[str], weights: Path, config_path: Path) -> None:
    """ValueError when the weights' fc_norm tensors and config.json's "fc_norm" disagree: vLLM
    refuses fc_norm weights without the key, SGLang drops them silently (a draft run without the
    norms it was trained with), and with the key both engines need every one of them."""
    present = sorted(n for n in names if n.startswith("fc_norm."))
    if present and not config.fc_norm:
        raise ValueError(f"{weights}: holds {bounded_text(present[0])} but {config_path} does not set \"fc_norm\": true "
                         f"(an EAGLE-3.1 draft's config.json must; without it the norms are refused or ignored)")
    if config.fc_norm:
        lacking = [FC_NORM_TENSOR.format(i) for i in range(config.num_aux_layers) if FC_NORM_TENSOR.format(i) not in names]
        if lacking:
            raise ValueError(f"{weights}: has no {lacking[0]} but {config_path} sets \"fc_norm\": true "
                             f"(one fc_norm.{{i}}.weight per aux layer, i < {config.num_aux_layers})")
