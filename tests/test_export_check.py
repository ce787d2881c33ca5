"""`python -m eagleforge.export check DRAFT [--target TARGET]`: each verdict of the report (how
vLLM and SGLang will read a draft), its exit code and its error lines."""

from __future__ import annotations

import copy
import json

import pytest
from safetensors.torch import load_file, save_file
from test_engines import KIMI, LLAMA

from eagleforge.draft import Eagle3Config, Eagle3Draft, save_draft
from eagleforge.export import check_draft, main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def draft_for(target: dict, aux: list[int], tmp_path, name="draft", **overrides):
    vocab = (target.get("text_config") or target)["vocab_size"]
    return save_draft(Eagle3Draft(Eagle3Config.from_target_config(copy.deepcopy(target), vocab // 2, aux, **overrides)), tmp_path / name)


def edit(draft, config=None, tensors=None):
    if config is not None:
        path = draft / "config.json"
        path.write_text(json.dumps(config(json.loads(path.read_text()))))
    if tensors is not None:
        path = draft / "model.safetensors"
        save_file(tensors(load_file(str(path))), str(path), metadata={"format": "pt"})
    return draft


def without(mapping, *keys):
    return {k: v for k, v in mapping.items() if k not in keys}


def target_dir(tmp_path, config, name="target"):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    return tmp_path / name


def test_the_export_reads_as_trained_in_both_engines(tmp_path, capsys):
    """The whole report of an export for a Llama target; exit 0."""
    draft = draft_for(LLAMA, [1, 2, 3], tmp_path)
    target = target_dir(tmp_path, LLAMA)
    assert main(["check", str(draft), "--target", str(target)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"draft: {draft}",
        "architecture: LlamaForCausalLMEagle3: one Llama decoder layer, hidden 48, 3 heads / 1 kv heads x 16, intermediate 80, "
        "fc 3 x 48 -> 48",
        "target: LlamaForCausalLM, 7 layers, hidden 48, vocabulary 211",
        "aux layers (outputs of target layers): [1, 2, 3]",
        "  vLLM 0.32.0/0.34.0: captures the inputs of [2, 3, 4] (top-level eagle_aux_hidden_state_layer_ids): as trained",
        "  SGLang 0.5.23: captures the inputs of [2, 3, 4] (eagle_config [1, 2, 3]; a LlamaForCausalLM target adds 1 to every "
        "id): as trained",
        "vocabulary: Vd 105 of V 211; d2t present, t2d present",
        "RoPE: default, theta 10000; max_position_embeddings 256 (target 256)",
        "norms: fc_norm false, norm_before_residual false, norm_output false",
        "verdict: both engines read it as it was trained",
    ]
    assert main(["check", str(draft)]) == 0  # without the target: the same list reads alike on every SGLang target
    assert "SGLang 0.5.23: captures the inputs of [2, 3, 4] (eagle_config [1, 2, 3], on every target): as trained" in capsys.readouterr().out


def test_ids_only_in_eagle_config_are_misread_by_vllm_032(tmp_path, capsys):
    """SpecForge's form: vLLM 0.32 reads eagle_config's ids as layer inputs (one layer early), 0.34
    captures its defaults (here the same layers); exit 2 with the fix."""
    draft = edit(draft_for(LLAMA, [1, 2, 3], tmp_path), config=lambda hf: without(hf, "eagle_aux_hidden_state_layer_ids"))
    assert main(["check", str(draft), "--target", str(target_dir(tmp_path, LLAMA))]) == 2
    out = capsys.readouterr().out.splitlines()
    assert "  vLLM 0.32.0: captures the inputs of [1, 2, 3] (no top-level ids: eagle_config's, as layer inputs): NOT the " \
           "trained [2, 3, 4]" in out
    assert "  vLLM 0.34.0: captures the inputs of [2, 3, 4] (no top-level ids; eagle_config's are not read): as trained" in out
    assert out[-2:] == ["verdict: 1 problem: an engine would not run it as it was trained",
                        "error: vLLM 0.32.0 captures the inputs of layers [1, 2, 3] (no top-level ids: eagle_config's, as layer "
                        "inputs) but the draft was trained on the outputs of [1, 2, 3], the inputs of [2, 3, 4]; write top-level "
                        "eagle_aux_hidden_state_layer_ids [2, 3, 4]"]


def test_no_ids_reads_the_targets_defaults(tmp_path):
    """No ids: the engines' defaults for the target's depth; without the target the draft does not
    say what it was trained on (an error)."""
    draft = edit(draft_for(LLAMA, [1, 2, 3], tmp_path), config=lambda hf: without(hf, "eagle_aux_hidden_state_layer_ids", "eagle_config"))
    report = check_draft(draft, LLAMA)
    assert not report.errors and not report.warnings
    assert "  vLLM 0.32.0/0.34.0: captures the inputs of [2, 3, 4] (no top-level ids): as trained" in report.lines
    report = check_draft(draft)
    assert len(report.errors) == 1 and "names no aux layers" in report.errors[0]


def test_sglang_on_deepseek_family_targets(tmp_path):
    """Kimi-K2.5 (SGLang adds one only to a list starting at 1): the export of [2, 30, 58] writes
    eagle_config [3, 31, 59], right there and wrong on a Llama target of the same depth; a draft of
    layer 0 cannot be read by SGLang there; without a target, the reading that depends on it is a warning."""
    draft = draft_for(KIMI, [2, 30, 58], tmp_path)
    report = check_draft(draft, KIMI)
    assert not report.errors, report.errors
    assert ("  SGLang 0.5.23: captures the inputs of [3, 31, 59] (eagle_config [3, 31, 59]; a KimiK25ForConditionalGeneration "
            "target adds 1 to every id when the first is 1, else takes the ids as layer inputs): as trained") in report.lines
    llama61 = {**KIMI["text_config"], "architectures": ["LlamaForCausalLM"]}
    assert check_draft(draft, llama61).errors == [
        "SGLang 0.5.23 captures the inputs of layers [4, 32, 60] (eagle_config [3, 31, 59]; a LlamaForCausalLM target adds 1 "
        "to every id) but the draft was trained on the outputs of [2, 30, 58], the inputs of [3, 31, 59]; write eagle_config's "
        "eagle_aux_hidden_state_layer_ids [2, 30, 58]"]
    report = check_draft(draft)
    assert not report.errors and report.warnings == [
        "SGLang 0.5.23 reads eagle_config [3, 31, 59] as other layers on Llama, Qwen, Gemma, gpt-oss and most targets: "
        "give --target to check"]
    zero = draft_for(LLAMA, [0, 2, 5], tmp_path, "layer0")  # a Llama export of layer 0 ...
    text61 = {**LLAMA, "num_hidden_layers": 61}
    errors = check_draft(zero, {**KIMI, "text_config": text61}).errors  # ... checked for a Kimi-architecture target
    assert len(errors) == 1 and errors[0].startswith(
        "SGLang 0.5.23 captures the inputs of layers [0, 2, 5] (eagle_config [0, 2, 5]; a KimiK25ForConditionalGeneration target")
    assert "; no eagle_config list can say them: aux layers [0, 2, 5] (vLLM ids [1, 3, 6]) cannot be given to SGLang" in errors[0]


def test_ids_past_the_targets_depth(tmp_path):
    """Aux layer 6, the last of 7: vLLM captures the last layer's output, SGLang's Llama captures
    only layer inputs (none after the last layer); on a 5-layer target the draft is refused."""
    draft = draft_for(LLAMA, [1, 2, 6], tmp_path)
    assert check_draft(draft, LLAMA).errors == [
        "SGLang 0.5.23 would capture the inputs of layers [2, 3, 7]: it captures none past 6 on the target's 7 layers"]
    assert check_draft(draft, {**LLAMA, "num_hidden_layers": 5}).errors == [
        f"{draft / 'config.json'}: Eagle3Config.aux_layer_ids [1, 2, 6] exceed the target's 5 layers",
        "vLLM 0.32.0/0.34.0 would capture the inputs of layers [2, 3, 7]: it captures none past 5 on the target's 5 layers",
        "SGLang 0.5.23 would capture the inputs of layers [2, 3, 7]: it captures none past 4 on the target's 5 layers"]


def test_norm_before_residual_is_misread_by_sglang(tmp_path):
    draft = draft_for(LLAMA, [1, 2, 3], tmp_path, norm_before_residual=True)
    assert check_draft(draft, LLAMA).errors == [
        "norm_before_residual is true: SGLang 0.5.23 does not read it and runs the draft with the residual h instead of "
        "hidden_norm(h); vLLM 0.32.0/0.34.0 reads it"]


def test_context_lowered_by_vllm_033_for_a_shorter_yarn_draft(tmp_path):
    yarn = {**LLAMA, "max_position_embeddings": 4096,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    draft = draft_for(yarn, [1, 2, 3], tmp_path)
    assert check_draft(draft, yarn).warnings == []
    edit(draft, config=lambda hf: {**hf, "max_position_embeddings": 2048})
    report = check_draft(draft, yarn)
    assert not report.errors and report.warnings[0].startswith(
        "vLLM >= 0.33 serves the target at the draft's context, 2048 instead of 4096: a yarn RoPE draft with a shorter "
        "max_position_embeddings lowers max_model_len with a log warning only")
    plain = draft_for(LLAMA, [1, 2, 3], tmp_path, "plain")
    edit(plain, config=lambda hf: {**hf, "max_position_embeddings": 128})
    assert check_draft(plain, LLAMA).warnings == []  # default RoPE: vLLM raises the draft's instead


def test_forms_an_engine_refuses_loudly_are_warnings(tmp_path):
    """The speculators format (SGLang cannot load it), SGLang's legacy fc_norm names (vLLM cannot),
    a fc sized for other than the engines' count: warnings, not misreads."""
    draft = draft_for(LLAMA, [1, 2, 3], tmp_path, norm_before_residual=True)
    hf = json.loads((draft / "config.json").read_text())
    layer = {k: hf[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                                "vocab_size", "rms_norm_eps", "max_position_embeddings", "num_hidden_layers", "hidden_act")}
    edit(draft, config=lambda _: {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                                  "draft_vocab_size": hf["draft_vocab_size"], "eagle_aux_hidden_state_layer_ids": [2, 3, 4],
                                  "transformer_layer_config": {"model_type": "llama", **layer}},
         tensors=lambda t: {(k.replace("midlayer.", "layers.0.")): v for k, v in t.items()})
    report = check_draft(draft, LLAMA)
    assert not report.errors and report.warnings == [
        "SGLang 0.5.23 cannot load this draft: it reads no speculators format (speculators_model_type)"]
    assert "norms: fc_norm false, norm_before_residual true, norm_output false" in report.lines

    legacy = draft_for(LLAMA, [1, 2, 3], tmp_path, "legacy", fc_norm=True)
    names = {"fc_norm.0.": "aux_norm_low.", "fc_norm.1.": "aux_norm_mid.", "fc_norm.2.": "aux_norm_high."}
    edit(legacy, config=lambda hf: {**without(hf, "fc_norm"), "use_aux_norm": True},
         tensors=lambda t: {next((names[p] + k[len(p):] for p in names if k.startswith(p)), k): v for k, v in t.items()})
    report = check_draft(legacy, LLAMA)
    assert not report.errors and report.warnings == [
        'vLLM 0.32.0/0.34.0 refuses this EAGLE-3.1 draft: it reads only "fc_norm": true and the names fc_norm.{i}.weight '
        "(here use_aux_norm, aux_norm_high.weight); SGLang 0.5.23 reads both"]

    two = edit(draft_for(LLAMA, [1, 3], tmp_path, "two"), config=lambda hf: without(hf, "eagle_config"))
    report = check_draft(two, LLAMA)
    assert report.warnings == [
        "vLLM 0.32.0/0.34.0 and SGLang 0.5.23 size fc for 3 aux states (144 inputs; num_aux_hidden_states, else eagle_config's "
        "ids, else 3) but fc.weight has 96: they refuse to load it; write eagle_config's eagle_aux_hidden_state_layer_ids"]
    assert report.errors == [  # and SGLang, without eagle_config, captures its defaults
        "SGLang 0.5.23 captures the inputs of layers [2, 3, 4] (no eagle_config ids; a LlamaForCausalLM target adds 1 to every "
        "id) but the draft was trained on the outputs of [1, 3], the inputs of [2, 4]; write eagle_config's "
        "eagle_aux_hidden_state_layer_ids [1, 3]"]


def test_target_mismatch_and_unreadable_drafts(tmp_path, capsys):
    draft = draft_for(LLAMA, [1, 2, 3], tmp_path)
    assert check_draft(draft, {**LLAMA, "vocab_size": 300, "hidden_size": 64}).errors == [
        "the draft's vocab_size 211 is not the target's 300: d2t maps draft ids into another vocabulary",
        "the draft reads aux states of width 48 (target_hidden_size, else hidden_size) but the target's are 64"]
    bad = edit(draft_for(LLAMA, [1, 2, 3], tmp_path, "bad"), config=lambda hf: {**hf, "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [5, 6, 7]}})
    report = check_draft(bad, LLAMA)
    assert "aux layers (outputs of target layers): unknown (see the errors)" in report.lines
    assert report.errors[0].startswith(f"{bad / 'config.json'}: eagle_aux_hidden_state_layer_ids [2, 3, 4] and "
                                       "eagle_config.eagle_aux_hidden_state_layer_ids [5, 6, 7] name different layers")
    assert main(["check", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"error: draft {tmp_path / 'missing'}: missing config.json\n"
