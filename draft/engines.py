"""Which target layers vLLM and SGLang capture for a draft's config.json (docs/export.md).

Both engines capture the residual stream at the INPUT of decoder layer j (vLLM's numbering); the
project's aux layer i is the OUTPUT of layer i, which is the input of layer i + 1
(docs/aux-layers.md). Each engine finds the ids in its own place and numbering. Read from the
sources of the versions named below; tests/test_engines.py resolves configs with vLLM's own code
and checks SGLang's rule as written here (SGLang does not import without its GPU libraries).

vLLM (0.32.0's default V1 model runner, also its CPU build's: vllm/v1/worker/gpu_model_runner.py
`_get_eagle3_aux_layers_from_config`; the V2 runner, 0.34.0's only one:
vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py `get_eagle3_aux_layers_from_config`): the
top-level `eagle_aux_hidden_state_layer_ids`, as layer inputs. Without them 0.32 takes
`eagle_config.eagle_aux_hidden_state_layer_ids` (as layer inputs too), 0.34 does not look there;
failing both, the target's defaults (2, L//2, L-3). The draft's fc width (llama_eagle3.py) is
`num_aux_hidden_states`, else the length of eagle_config's ids, else 3: never the top-level ids.

SGLang 0.5.23 (srt/model_executor/model_runner_components/spec_aux_hidden_state.py
`_resolve_eagle_aux_hidden_state`): ONLY `eagle_config.eagle_aux_hidden_state_layer_ids` (and
`eagle_config.use_aux_hidden_state`), handed to the target model's
`set_eagle3_layers_to_capture`, whose numbering depends on the target (SGLANG_RULES): most add one
to every id (the ids name layer outputs, as the project's do); the DeepSeek-V2 family adds one only
when the first id is 1 and otherwise takes the ids as layer inputs; gpt-oss adds one unless the
largest id equals the layer count. Without ids: [2, L//2, L-3] as layer inputs. Its fc width:
`num_aux_hidden_states`, else the length of eagle_config's ids, else 3.

The export (Eagle3Config.to_hf_dict) therefore writes the ids twice: at top level in vLLM's
numbering, and in eagle_config in the numbering SGLang applies to the target it was trained on.
"""

from __future__ import annotations

VLLM_VERSIONS = ("0.32.0", "0.34.0")
SGLANG_VERSION = "0.5.23"

# How SGLang's set_eagle3_layers_to_capture turns eagle_config ids into captured layer inputs.
PLUS_ONE = "adds 1 to every id"
PLUS_ONE_IF_FIRST_IS_ONE = "adds 1 to every id when the first is 1, else takes the ids as layer inputs"
PLUS_ONE_UNLESS_MAX_IS_DEPTH = "takes the ids as layer inputs when the largest is the layer count, else adds 1 to every id"

# Target architectures (config.json `architectures[0]`) whose SGLang 0.5.23 model class does not
# add one to every id; every other EAGLE-3 target of SGLang does (srt/models/llama.py, qwen2.py,
# qwen3.py, qwen3_moe.py, gemma3_causal.py, glm4_moe.py, ...).
SGLANG_RULES = {
    # srt/models/deepseek_v2.py DeepseekV2ForCausalLM.set_eagle3_layers_to_capture and its subclasses
    "DeepseekV2ForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,
    "DeepseekV3ForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,
    "DeepseekV32ForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,
    "GlmMoeDsaForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,  # srt/models/glm4_moe.py
    "MistralLarge3ForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,  # srt/models/mistral_large_3.py
    "KimiK25ForConditionalGeneration": PLUS_ONE_IF_FIRST_IS_ONE,  # srt/models/kimi_k25.py: its DeepseekV3 language model
    "Glm4MoeLiteForCausalLM": PLUS_ONE_IF_FIRST_IS_ONE,  # srt/models/glm4_moe_lite.py
    "GptOssForCausalLM": PLUS_ONE_UNLESS_MAX_IS_DEPTH,  # srt/models/gpt_oss.py
}

# Where the rule of an architecture is written, for messages.
_RULE_SOURCE = {
    PLUS_ONE: "srt/models/llama.py and most other targets",
    PLUS_ONE_IF_FIRST_IS_ONE: "srt/models/deepseek_v2.py",
    PLUS_ONE_UNLESS_MAX_IS_DEPTH: "srt/models/gpt_oss.py",
}

# vLLM >= 0.33 lowers the served context to a shorter draft's max_position_embeddings unless every
# RoPE type of the draft only sizes a cache (vllm/config/speculative.py _CACHE_ONLY_ROPE_TYPES;
# vllm/config/vllm.py _limit_max_model_len_to_draft, a log warning only). 0.32 always raises the
# draft's max_position_embeddings to the target's instead.
VLLM_CACHE_ONLY_ROPE_TYPES = frozenset({"default", "linear", "llama3", "ntk", "proportional"})


def default_capture(num_layers: int) -> list[int]:
    """The layer inputs both engines capture when a draft names none: (2, L//2, L-3), i.e. the
    project's default aux layers [1, L//2 - 1, L - 4] (eagleforge/target/loading.py default_aux_layers)."""
    return [2, num_layers // 2, num_layers - 3]


def sglang_rule(target_architecture: str) -> str:
    """SGLang's numbering of eagle_config ids for a target of this architecture."""
    return SGLANG_RULES.get(target_architecture, PLUS_ONE)


def rule_source(rule: str) -> str:
    return f"SGLang {SGLANG_VERSION} {_RULE_SOURCE[rule]}"


def sglang_captures(eagle_config_ids: list[int] | None, rule: str, num_layers: int | None) -> list[int] | None:
    """The layer inputs SGLang captures for these eagle_config ids on a target with `rule` and
    `num_layers` layers (None where the answer needs the depth and it is unknown)."""
    if not eagle_config_ids:
        return default_capture(num_layers) if num_layers else None
    ids = [int(i) for i in eagle_config_ids]
    if rule == PLUS_ONE_IF_FIRST_IS_ONE:
        return [i + 1 for i in ids] if ids[0] == 1 else ids
    if rule == PLUS_ONE_UNLESS_MAX_IS_DEPTH:
        if num_layers is None:
            return None
        return ids if max(ids) == num_layers else [i + 1 for i in ids]
    return [i + 1 for i in ids]


def sglang_eagle_config_ids(aux_layer_ids: list[int], target_architecture: str = "") -> list[int]:
    """The eagle_config ids SGLang reads as the project's aux layers `aux_layer_ids` (outputs of
    those layers) on a target of this architecture ("" = unknown: the ids of most targets, the
    project's own, which the DeepSeek-V2 family reads alike when the first is 1). ValueError
    where no list can say them."""
    ids = [int(i) for i in aux_layer_ids]
    rule = sglang_rule(target_architecture)
    if rule == PLUS_ONE_IF_FIRST_IS_ONE and ids[0] != 1:
        if ids[0] == 0:
            raise ValueError(
                f"aux layers {ids} (vLLM ids {[i + 1 for i in ids]}) cannot be given to SGLang for a "
                f"{target_architecture} target: {rule_source(rule)} set_eagle3_layers_to_capture {rule}, "
                "so no eagle_config list makes it capture the output of layer 0; choose aux layers from 1 up "
                "(extract.aux_layers)")
        return [i + 1 for i in ids]  # taken as layer inputs: the vLLM ids
    return ids


def vllm_captures(hf: dict, version: str) -> list[int] | None:
    """The layer inputs vLLM `version` (one of VLLM_VERSIONS) captures for config.json `hf`; None
    = the target's defaults (default_capture)."""
    top = hf.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return [int(i) for i in top]
    eagle_config = hf.get("eagle_config")
    if version.startswith("0.32") and isinstance(eagle_config, dict) and eagle_config.get("eagle_aux_hidden_state_layer_ids"):
        return [int(i) for i in eagle_config["eagle_aux_hidden_state_layer_ids"]]
    return None


def fc_aux_count(hf: dict) -> int:
    """How many aux states both engines size the draft's fc for (llama_eagle3.py of each):
    num_aux_hidden_states, else the length of eagle_config's ids, else 3."""
    if hf.get("num_aux_hidden_states") is not None:
        return int(hf["num_aux_hidden_states"])
    eagle_config = hf.get("eagle_config")
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    return len(ids) if ids else 3
