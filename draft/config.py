"""Eagle3Config: the sizes of the EAGLE-3 draft and its export config.json (docs/export.md).

The draft is one Llama decoder layer whatever the target is. Its sizes default to the target's
(hidden, heads, kv heads, head_dim, intermediate, norm eps, RoPE, max positions, vocabulary), read
from the target's HF config:

- Llama-like configs: the plain fields.
- DeepSeek-V3 / Kimi-K2.5 (MLA, `text_config` wrapper for Kimi): MLA has no plain kv heads, so
  the draft gets as many kv heads as query heads and head_dim = v_head_dim (Kimi: hidden 7168,
  64 heads, 64 kv heads, head_dim 128, intermediate 18432 = the dense layer's MLP).

Aux layer ids are kept in the project's convention (0-indexed decoder layers whose OUTPUT is
captured). config.json stores them twice, where each engine reads them (draft/engines.py): at top
level in vLLM's convention (input of layer i + 1), i.e. ids + 1, and in `eagle_config` in the
numbering SGLang applies to the target (the project's ids for most targets).

from_hf_dict also reads the forms other trainers write (docs/export.md "Loading"): ids only in
eagle_config (SpecForge), none at all (the engines' defaults for the target's depth), vLLM's
speculators format, SGLang's legacy `use_aux_norm`.

Variants of the standard draft, each a top-level boolean of config.json written only when true
(docs/export.md), read as vLLM reads them:
    fc_norm               EAGLE-3.1: an RMSNorm per aux state before fc (weights fc_norm.{i}.weight)
    norm_before_residual  the midlayer's residual stream starts from hidden_norm(h) instead of h
    norm_output           the next step is fed the final norm's output instead of its input
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from eagleforge.draft import engines

DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3"
# vLLM's own name of the same draft class (its registry maps both; its speculators configs become it).
DRAFT_ARCHITECTURES = (DRAFT_ARCHITECTURE, "Eagle3LlamaForCausalLM")

# What both engines take for an optional key config.json lacks: transformers' LlamaConfig defaults
# (they load a draft's config.json as a LlamaConfig).
LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048}

# The draft's variant switches: Eagle3Config booleans, config.json keys of the same name (top
# level, present only when true).
VARIANT_KEYS = ("fc_norm", "norm_before_residual", "norm_output")

# Keys of the RoPE dict that transformers >= 5 folds into rope_parameters but that config.json
# carries at top level (rope_theta) or that are redundant (type is the old name of rope_type).
_ROPE_TOP_LEVEL_KEYS = ("rope_theta",)


class RopeConflictError(ValueError):
    """A target config that gives the RoPE base (rope_theta) twice, with different values."""


def rope_theta_conflict(get) -> str | None:
    """One line naming every place a config gives rope_theta, when they disagree; else None.

    `get(key)` reads the config (a dict's .get or getattr on a PretrainedConfig). config.json may
    carry rope_theta at the top level and inside the RoPE dict (rope_parameters, as transformers 5
    writes it, or rope_scaling); transformers 5 reads the dict's value, older readers and other
    engines the top level's, so two different values leave the model's positions undefined.
    """
    values = {}
    if get("rope_theta") is not None:
        values["rope_theta"] = get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        rope = get(key)
        if isinstance(rope, dict) and rope.get("rope_theta") is not None:
            values[f"{key}.rope_theta"] = rope["rope_theta"]
    try:
        distinct = {float(v) for v in values.values()}
    except (TypeError, ValueError):
        distinct = {repr(v) for v in values.values()}
    if len(distinct) < 2:
        return None
    shown = " but ".join(f"{key} = {value!r}" for key, value in values.items())
    return (f"{shown}: the RoPE base is given twice with different values (transformers 5 reads the rope dict's, "
            f"older readers the top level's); set both to the model's value")


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (embed_tokens rows, t2d length)
    draft_vocab_size: int  # lm_head rows, d2t length
    target_hidden_size: int  # width of ONE aux state; fc maps k * target_hidden_size -> hidden_size
    aux_layer_ids: list[int] = field(default_factory=list)  # project convention (output of layer i)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF style, with "rope_type"; None = plain RoPE
    max_position_embeddings: int = 4096
    target_num_layers: int = 0  # 0 = unknown (config.json does not carry it)
    # The target's config.json architectures[0] ("" = unknown; config.json does not carry it): the
    # numbering SGLang gives eagle_config's ids depends on it (draft/engines.py SGLANG_RULES).
    target_architecture: str = ""
    fc_norm: bool = False  # EAGLE-3.1: aux state i [.., Ht] through RMSNorm fc_norm.{i} before fc
    norm_before_residual: bool = False  # residual = hidden_norm(h) instead of h (vLLM's meaning)
    norm_output: bool = False  # step j + 1 is fed norm(h) instead of h (vLLM's meaning, not SpecForge 0.2.0's)

    def __post_init__(self):
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        self.rope_scaling = copy.deepcopy(self.rope_scaling)  # never share a dict that others mutate
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "draft_vocab_size", "target_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Eagle3Config.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.target_architecture, str):
            raise ValueError(f"Eagle3Config.target_architecture must be a string, got {self.target_architecture!r}")
        for name in VARIANT_KEYS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Eagle3Config.{name} must be true or false, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Eagle3Config: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"Eagle3Config: draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.vocab_size}"
            )
        if not self.aux_layer_ids:
            raise ValueError("Eagle3Config.aux_layer_ids is empty: the draft needs at least one aux layer")
        if self.aux_layer_ids != sorted(set(self.aux_layer_ids)) or self.aux_layer_ids[0] < 0:
            raise ValueError(f"Eagle3Config.aux_layer_ids must be distinct, ascending and >= 0, got {self.aux_layer_ids}")
        if self.target_num_layers and self.aux_layer_ids[-1] >= self.target_num_layers:
            raise ValueError(
                f"Eagle3Config.aux_layer_ids {self.aux_layer_ids} exceed the target's {self.target_num_layers} layers"
            )

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def fc_in_features(self) -> int:
        return self.num_aux_layers * self.target_hidden_size

    # ------------------------------------------------------------------ from the target

    @classmethod
    def from_target_config(cls, target_config, draft_vocab_size: int, aux_layer_ids, **overrides) -> "Eagle3Config":
        """Draft sizes derived from the target's HF config (a PretrainedConfig or its dict).

        `overrides` are Eagle3Config fields; a value of 0 or None means "derive from the target"
        (so DraftConfig's 0 defaults pass straight through).
        """
        text = _text_config(target_config)
        get = (lambda key, default=None: text.get(key, default)) if isinstance(text, dict) else (
            lambda key, default=None: getattr(text, key, default))
        hidden = _required(get, "hidden_size")
        heads = _required(get, "num_attention_heads")
        is_mla = get("kv_lora_rank") is not None
        if is_mla:
            # MLA: every query head has its own (decompressed) key/value head; the draft is plain
            # multi-head attention at the target's value head width.
            kv_heads = heads
            head_dim = get("v_head_dim") or get("qk_nope_head_dim") or hidden // heads
        else:
            kv_heads = get("num_key_value_heads") or heads
            head_dim = get("head_dim") or hidden // heads
        rope_theta, rope_scaling = _rope_from_target(get)
        derived = dict(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_required(get, "intermediate_size"),
            vocab_size=_required(get, "vocab_size"),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=hidden,
            aux_layer_ids=list(aux_layer_ids),
            rms_norm_eps=float(get("rms_norm_eps", 1e-5) or 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("max_position_embeddings", 4096) or 4096),
            target_num_layers=int(get("num_hidden_layers", 0) or 0),
            target_architecture=_architecture(target_config),
        )
        known = {f.name for f in fields(cls)}
        for key, value in overrides.items():
            if key not in known:
                raise ValueError(f"Eagle3Config.from_target_config: unknown override {key!r} (fields: {sorted(known)})")
            if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0):
                continue
            derived[key] = value
        return cls(**derived)

    # ------------------------------------------------------------------ config.json

    def sglang_aux_ids(self) -> list[int]:
        """eagle_config's ids: what SGLang reads as this draft's aux layers on its target; a
        ValueError naming the ids where none can (draft/engines.py sglang_eagle_config_ids)."""
        try:
            return engines.sglang_eagle_config_ids(self.aux_layer_ids, self.target_architecture)
        except ValueError as err:
            raise ValueError(f"Eagle3Config: {err}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The export's config.json (docs/export.md): aux ids at top level in vLLM's convention
        (ids + 1) and in eagle_config in SGLang's for the target (sglang_aux_ids)."""
        out: dict[str, Any] = {
            "architectures": [DRAFT_ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": copy.deepcopy(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": "bfloat16",
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.aux_layer_ids],
            # SGLang reads the ids only here (and vLLM sizes fc by their number).
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.sglang_aux_ids(), "use_aux_hidden_state": True},
        }
        if self.target_hidden_size != self.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        for key in VARIANT_KEYS:  # absent = false for vLLM and SGLang alike
            if getattr(self, key):
                out[key] = True
        return out

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], source: str = "config.json", target_num_layers: int = 0) -> "Eagle3Config":
        """Inverse of to_hf_dict, and the forms other trainers write (read_aux_layer_ids,
        flatten_speculators). `source` names the file in error messages; `target_num_layers`
        (0 = unknown) is the target's depth, needed only by a config that names no aux layers."""
        config = flatten_speculators(config, source)
        arch = config.get("architectures") or []
        if not set(DRAFT_ARCHITECTURES) & set(arch):
            raise ValueError(f"{source}: architectures is {arch!r}, expected [{DRAFT_ARCHITECTURE!r}]")
        if config.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{source}: num_hidden_layers is {config['num_hidden_layers']!r}, an EAGLE-3 draft has 1")
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in config]
        if missing:
            raise ValueError(f"{source}: missing keys {missing}")
        eagle_config = config.get("eagle_config") or {}
        if not isinstance(eagle_config, dict):
            raise ValueError(f"{source}: eagle_config is {eagle_config!r}, expected an object")
        if eagle_config.get("use_aux_hidden_state", True) is not True:
            raise ValueError(f"{source}: eagle_config.use_aux_hidden_state is {eagle_config['use_aux_hidden_state']!r}: "
                             "a draft that reads no aux layers (EAGLE-1 style) is not an EAGLE-3 draft")
        for where, holder in (("", config), ("eagle_config.", eagle_config)):
            if holder.get("norm_before_fc"):  # vLLM and SGLang: one RMSNorm over the concatenated aux states
                raise ValueError(f"{source}: {where}norm_before_fc is {holder['norm_before_fc']!r}: this draft has no "
                                 "norm before fc (input_norm); EAGLE-3.1's per-state norms are \"fc_norm\": true")
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        aux = read_aux_layer_ids(config, source, target_num_layers)
        count = config.get("num_aux_hidden_states")
        if count is not None and count != len(aux):
            raise ValueError(f"{source}: num_aux_hidden_states is {count!r} but the config names {len(aux)} aux layers "
                             "(both engines size fc by num_aux_hidden_states)")
        rope_theta, rope_scaling = config.get("rope_theta"), config.get("rope_scaling")
        if isinstance(config.get("rope_parameters"), dict):
            # Saved by transformers >= 5: theta and scaling live in rope_parameters (written beside the
            # legacy keys by some trainers: those win where present).
            theta, scaling = _split_rope_parameters(config["rope_parameters"])
            rope_theta = theta if rope_theta is None else rope_theta
            rope_scaling = scaling if rope_scaling is None else rope_scaling
        if rope_scaling:
            rope_scaling = dict(rope_scaling)
            if "rope_type" not in rope_scaling and "type" in rope_scaling:  # the legacy name
                rope_scaling["rope_type"] = rope_scaling.pop("type")
            rope_scaling.pop("rope_theta", None)
            if rope_scaling.get("rope_type", "default") == "default" and set(rope_scaling) <= {"rope_type", "partial_rotary_factor"}:
                rope_scaling = None
        variants = {}
        for key in VARIANT_KEYS:
            value = config.get(key, False)
            if value is None:
                value = False
            if not isinstance(value, bool):
                raise ValueError(f"{source}: {key} is {value!r}, expected true or false")
            variants[key] = value
        # SGLang's legacy name of fc_norm (its llama_eagle3.py reads either; vLLM reads only fc_norm).
        if config.get("use_aux_norm") not in (None, False, True):
            raise ValueError(f"{source}: use_aux_norm is {config['use_aux_norm']!r}, expected true or false")
        variants["fc_norm"] = variants["fc_norm"] or bool(config.get("use_aux_norm"))
        try:
            return cls(
                hidden_size=hidden,
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                # Absent: the engines take the target's vocabulary (no d2t).
                draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
                target_hidden_size=int(config.get("target_hidden_size") or hidden),
                aux_layer_ids=aux,
                rms_norm_eps=float(config.get("rms_norm_eps", LLAMA_DEFAULTS["rms_norm_eps"])),
                rope_theta=float(rope_theta if rope_theta is not None else LLAMA_DEFAULTS["rope_theta"]),
                rope_scaling=copy.deepcopy(rope_scaling),
                max_position_embeddings=int(config.get("max_position_embeddings", LLAMA_DEFAULTS["max_position_embeddings"])),
                target_num_layers=int(target_num_layers or 0),
                **variants,
            )
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


def _id_list(value, where: str) -> list[int] | None:
    """A list of ints from config.json, None where absent or empty (both engines treat [] as absent)."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise ValueError(f"{where} is {value!r}, expected a list of integers")
    return list(value)


def read_aux_layer_ids(config: dict[str, Any], source: str = "config.json", target_num_layers: int = 0) -> list[int]:
    """The project's aux layer ids (outputs of layer i) of a draft's config.json, read as the
    engines read it (draft/engines.py):

    - top-level eagle_aux_hidden_state_layer_ids (vLLM's: inputs of layer j): i = j - 1. An
      eagle_config list beside them must say the same layers to SGLang: the project's ids (what
      most targets read), or the same list when its first id is not 1 (what the DeepSeek-V2 family
      reads as layer inputs). Otherwise a ValueError naming both.
    - only eagle_config's (SpecForge writes them there, in SGLang's numbering): a first id of 1 is
      read alike by every SGLang target, as layer outputs; another first id is refused: SGLang
      reads it as an output on most targets and as an input on DeepSeek-V2-family ones.
    - none: the engines capture the target's defaults, inputs of (2, L//2, L-3); known only with
      `target_num_layers`, else a ValueError.
    """
    eagle_config = config.get("eagle_config") or {}
    top = _id_list(config.get("eagle_aux_hidden_state_layer_ids"), f"{source}: eagle_aux_hidden_state_layer_ids")
    inner = _id_list(eagle_config.get("eagle_aux_hidden_state_layer_ids"), f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids")
    if top is not None:
        if min(top) < 1:
            raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids is {top}: vLLM's id j is the input of layer j, "
                             "so 0 is the embedding output, which no aux layer is")
        ids = [j - 1 for j in top]
        if inner is not None and inner != ids and not (inner == top and inner[0] != 1):
            raise ValueError(
                f"{source}: eagle_aux_hidden_state_layer_ids {top} and eagle_config.eagle_aux_hidden_state_layer_ids "
                f"{inner} name different layers: vLLM captures the inputs of layers {top} (the outputs of {ids}), "
                f"SGLang {engines.SGLANG_VERSION} the outputs of {inner} on most targets and the inputs of "
                f"{inner if inner[0] != 1 else [i + 1 for i in inner]} on DeepSeek-V2-family targets; "
                f"write the project's ids {ids} in eagle_config")
        return ids
    if inner is not None:
        if inner[0] != 1:
            raise ValueError(
                f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids is {inner} and there are no top-level "
                f"eagle_aux_hidden_state_layer_ids: SGLang {engines.SGLANG_VERSION} reads a list whose first id is not 1 as "
                f"layer outputs on most targets ({engines.rule_source(engines.PLUS_ONE)}) but as layer inputs on "
                f"DeepSeek-V2/V3 and Kimi-K2.5 targets ({engines.rule_source(engines.PLUS_ONE_IF_FIRST_IS_ONE)}), and vLLM "
                "as layer inputs; add top-level eagle_aux_hidden_state_layer_ids (vLLM's numbering: j = the input of "
                "layer j) naming the layers the draft was trained on")
        return inner
    if target_num_layers:
        return [j - 1 for j in engines.default_capture(target_num_layers)]
    raise ValueError(f"{source}: names no aux layers (neither eagle_aux_hidden_state_layer_ids nor "
                     "eagle_config.eagle_aux_hidden_state_layer_ids): vLLM and SGLang capture the target's defaults, the "
                     "inputs of layers (2, L//2, L-3) of its L layers; give the target's depth to read them")


def flatten_speculators(config: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """vLLM's speculators format (`speculators_model_type: eagle3`, the decoder layer's Llama
    config in transformer_layer_config) as the plain config vLLM builds from it
    (vllm/transformers_utils/configs/speculators/algos.py update_eagle3, 0.32.0 and 0.34.0):
    transformer_layer_config's keys, the top-level switches, and norm_before_residual true unless
    set. Any other config is returned as it is."""
    kind = config.get("speculators_model_type")
    if kind is None:
        return config
    if kind != "eagle3":
        raise ValueError(f"{source}: speculators_model_type is {kind!r}; this loader reads EAGLE-3 drafts (\"eagle3\")")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{source}: speculators format without a transformer_layer_config object")
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"{source}: transformer_layer_config.model_type is {layer['model_type']!r}; this draft is the Llama one")
    out = {**layer, "architectures": [DRAFT_ARCHITECTURE]}
    out["draft_vocab_size"] = config.get("draft_vocab_size")
    out["norm_before_residual"] = config.get("norm_before_residual", True)
    for key in ("target_hidden_size", "norm_before_fc", "fc_norm", "norm_output", "eagle_aux_hidden_state_layer_ids"):
        if config.get(key) is not None:
            out[key] = config[key]
    return out


def _architecture(target_config) -> str:
    """architectures[0] of a target's config (the outer one: Kimi-K2.5's, not its text_config's)."""
    arch = target_config.get("architectures") if isinstance(target_config, dict) else getattr(target_config, "architectures", None)
    return str(arch[0]) if arch else ""


def _text_config(target_config):
    """The language model's config: Kimi-K2.5 wraps it as text_config."""
    if isinstance(target_config, dict):
        return target_config.get("text_config") or target_config
    return getattr(target_config, "text_config", None) or target_config


def _required(get, key: str) -> int:
    value = get(key)
    if value is None:
        raise ValueError(f"target config has no {key!r}: cannot derive the draft's size (set it as an override)")
    return int(value)


def _split_rope_parameters(params: dict) -> tuple[float, dict | None]:
    """transformers >= 5 rope_parameters -> (rope_theta, rope_scaling or None)."""
    params = dict(params)
    theta = float(params.pop("rope_theta", 10000.0))
    params.pop("type", None)  # legacy alias of rope_type
    if params.get("rope_type", "default") == "default" and set(params) <= {"rope_type", "partial_rotary_factor"}:
        return theta, None
    return theta, params


def _rope_from_target(get) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a target config, old (v4) or new (v5 rope_parameters) style;
    RopeConflictError when the config gives rope_theta twice with different values."""
    conflict = rope_theta_conflict(get)
    if conflict:
        raise RopeConflictError(f"target config: {conflict}")
    params = get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return _split_rope_parameters(params)
    theta = float(get("rope_theta", 10000.0) or 10000.0)
    scaling = get("rope_scaling")
    if not scaling:
        return theta, None
    scaling = dict(scaling)
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling["type"]
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    return theta, (None if scaling.get("rope_type") == "default" and len(scaling) == 1 else scaling)
