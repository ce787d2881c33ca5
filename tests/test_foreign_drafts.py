"""Drafts other trainers write, loaded as the engines read them (docs/export.md "Loading"): one
written by SpecForge's own save code (its LlamaForCausalLMEagle3.save_pretrained, with SpecForge
importable: PYTHONPATH=<unpacked specforge wheel>), and a fixture of each other form, each made from
a draft of the project's and loaded back to compute what it computed."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_draft import make_config, make_draft, random_inputs

from eagleforge.draft import load_draft, save_draft

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def logits(draft, config, seed=3):
    aux, ids = random_inputs(config, 2, 6, seed=seed)
    with torch.no_grad():
        return [draft.logits(h) for h in draft.forward_ttt(aux, ids, 3)]


def assert_same_draft(loaded, draft):
    """The same weights, vocabulary map and logits (the drafts share their input embedding)."""
    assert loaded.config.aux_layer_ids == draft.config.aux_layer_ids
    for name, tensor in draft.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)
    for a, b in zip(logits(loaded, draft.config), logits(draft, draft.config)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def load(out, draft, **kwargs):
    """load_draft with the draft's input embedding (the target's, in the engines)."""
    return load_draft(out, embed_tokens=draft.embed_tokens.weight, **kwargs)


def exported_draft(tmp_path, name="ours", **variant):
    """A random draft of make_config (bf16-exact weights), saved as the project exports it."""
    draft = make_draft(make_config(**variant), seed=7)
    draft.to(torch.bfloat16).float()
    return draft, save_draft(draft, tmp_path / name)


def rewrite(out, config=None, tensors=None):
    """Replace config.json and/or model.safetensors of the draft directory `out` (callables: old -> new)."""
    if config is not None:
        path = out / "config.json"
        path.write_text(json.dumps(config(json.loads(path.read_text()))))
    if tensors is not None:
        path = out / "model.safetensors"
        save_file(tensors(load_file(str(path))), str(path), metadata={"format": "pt"})
    return out


def without(mapping, *keys):
    return {k: v for k, v in mapping.items() if k not in keys}


# --------------------------------------------------------------------------------------------
# SpecForge


@pytest.mark.skipif(importlib.util.find_spec("specforge") is None,
                    reason="SpecForge is not importable (PYTHONPATH=<unpacked specforge 0.2.0 wheel>; not a dependency)")
@pytest.mark.parametrize("fc_norm", [False, True], ids=["eagle3", "eagle3.1"])
def test_specforge_save_pretrained_loads_as_trained(tmp_path, fc_norm):
    """SpecForge 0.2.0's LlamaForCausalLMEagle3 with our draft's weights, saved by its own
    save_pretrained (transformers 5: rope_parameters, no rope_theta at top level; the ids only in
    eagle_config, in SGLang's numbering; its embed_tokens.weight; d2t and t2d) and by its export's
    apply_legacy_rope_scaling: loads as the draft it was made from."""
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    config = make_config(rope="yarn", fc_norm=fc_norm)
    config.aux_layer_ids = [1, 3, 5]  # SpecForge's default shape: the first id 1 (see test_engines)
    draft = make_draft(config, seed=11)
    draft.to(torch.bfloat16).float()
    sf_config = LlamaConfig(
        hidden_size=40, num_attention_heads=4, num_key_value_heads=2, head_dim=10, intermediate_size=72, vocab_size=151,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=5000.0, rope_scaling=copy.deepcopy(config.rope_scaling),
        num_hidden_layers=1, tie_word_embeddings=False, architectures=["LlamaForCausalLMEagle3"])
    sf_config.draft_vocab_size, sf_config.target_hidden_size = 67, 24
    sf_config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}
    if fc_norm:
        sf_config.fc_norm = True
    model = LlamaForCausalLMEagle3(sf_config, attention_backend="sdpa")
    state = {k: v for k, v in draft.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    out = tmp_path / "specforge"
    model.save_pretrained(out)
    hf = json.loads((out / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in hf and hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {"embed_tokens.weight", "d2t", "t2d"} <= set(f.keys())
    assert_same_draft(load_draft(out), draft)  # its own embedding (the target's, as SpecForge saves it)
    apply_legacy_rope_scaling(str(out))  # what SpecForge's exporters do after save_pretrained
    assert "rope_scaling" in json.loads((out / "config.json").read_text())
    assert_same_draft(load_draft(out, embed_tokens=draft.embed_tokens.weight), draft)


# --------------------------------------------------------------------------------------------
# The other forms


def test_ids_only_in_eagle_config(tmp_path):
    """SpecForge's form: eagle_config's ids in SGLang's numbering, none at top level. A first id of
    1 is read alike by every SGLang target (layer outputs); another first id is refused (SGLang's
    DeepSeek-V2-family targets read it as layer inputs, its others as outputs)."""
    config = make_config()
    config.aux_layer_ids = [1, 3, 5]
    draft = make_draft(config, seed=7)
    draft.to(torch.bfloat16).float()
    out = rewrite(save_draft(draft, tmp_path / "d"), config=lambda hf: without(hf, "eagle_aux_hidden_state_layer_ids"))
    assert_same_draft(load(out, draft), draft)
    _, out = exported_draft(tmp_path, "first-not-1")  # aux layers [0, 2, 5]
    rewrite(out, config=lambda hf: without(hf, "eagle_aux_hidden_state_layer_ids"))
    with pytest.raises(ValueError, match=re.escape(
            f"{out / 'config.json'}: eagle_config.eagle_aux_hidden_state_layer_ids is [0, 2, 5] and there are no top-level "
            "eagle_aux_hidden_state_layer_ids: SGLang 0.5.23 reads a list whose first id is not 1 as layer outputs on most")):
        load_draft(out)


def test_ids_at_top_level_and_in_eagle_config_must_agree(tmp_path):
    """Both lists, naming other layers to the two engines: refused, naming both. The same list in
    both with a first id other than 1 is what SGLang's DeepSeek-V2 family reads as layer inputs."""
    draft, out = exported_draft(tmp_path)  # aux [0, 2, 5]: top level [1, 3, 6], eagle_config [0, 2, 5]
    rewrite(out, config=lambda hf: {**hf, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}})
    with pytest.raises(ValueError, match=re.escape(
            f"{out / 'config.json'}: eagle_aux_hidden_state_layer_ids [1, 3, 6] and eagle_config.eagle_aux_hidden_state_layer_ids "
            "[1, 3, 5] name different layers: vLLM captures the inputs of layers [1, 3, 6] (the outputs of [0, 2, 5]), SGLang "
            "0.5.23 the outputs of [1, 3, 5] on most targets and the inputs of [2, 4, 6] on DeepSeek-V2-family targets; "
            "write the project's ids [0, 2, 5] in eagle_config")):
        load_draft(out)
    rewrite(out, config=lambda hf: {**hf, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}})
    with pytest.raises(ValueError, match="name different layers"):  # first id 1: SGLang adds one everywhere
        load_draft(out)
    config = make_config()
    config.aux_layer_ids = [2, 3, 5]
    draft = make_draft(config, seed=7)
    draft.to(torch.bfloat16).float()
    out = rewrite(save_draft(draft, tmp_path / "deepseek-form"),
                  config=lambda hf: {**hf, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 4, 6]}})
    assert_same_draft(load(out, draft), draft)
    rewrite(out, config=lambda hf: {**hf, "eagle_aux_hidden_state_layer_ids": [0, 4, 6]})
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids is \[0, 4, 6\]: vLLM's id j is the input of layer j"):
        load_draft(out)


def test_no_ids_anywhere_reads_the_targets_defaults(tmp_path):
    """No ids (as vLLM's example drafts ship): both engines capture the inputs of (2, L//2, L-3),
    the project's [1, L//2 - 1, L - 4]; read given the target's depth, refused without it."""
    config = make_config()
    config.aux_layer_ids = [1, 3, 4]  # the default for 8 layers
    draft = make_draft(config, seed=7)
    draft.to(torch.bfloat16).float()
    out = rewrite(save_draft(draft, tmp_path / "d"), config=lambda hf: without(hf, "eagle_aux_hidden_state_layer_ids", "eagle_config"))
    with pytest.raises(ValueError, match=r"names no aux layers .* give the target's depth"):
        load_draft(out)
    assert_same_draft(load(out, draft, target_num_layers=8), draft)
    rewrite(out, config=lambda hf: {**hf, "num_aux_hidden_states": 2})
    with pytest.raises(ValueError, match="num_aux_hidden_states is 2 but the config names 3 aux layers"):
        load_draft(out, target_num_layers=8)


def test_t2d_missing_and_draft_vocab_size_absent(tmp_path):
    """d2t without t2d (t2d is derived); no draft_vocab_size and no d2t: the target's vocabulary."""
    draft, out = exported_draft(tmp_path)
    rewrite(out, tensors=lambda t: without(t, "t2d"))
    assert_same_draft(load(out, draft), draft)
    full = make_draft(make_config(draft_vocab_size=151), seed=8)
    full.to(torch.bfloat16).float()
    out = rewrite(save_draft(full, tmp_path / "full"), config=lambda hf: without(hf, "draft_vocab_size"))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert not {"d2t", "t2d"} & set(f.keys())
    loaded = load(out, full)
    assert loaded.config.draft_vocab_size == 151 and torch.equal(loaded.d2t, torch.zeros(151, dtype=torch.int64))
    assert_same_draft(loaded, full)
    rewrite(out, config=lambda hf: {**hf, "draft_vocab_size": 67})
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(151, 40\), config.json implies \(67, 40\)"):
        load_draft(out)


def test_speculators_format(tmp_path):
    """vLLM's speculators format: the layer's Llama config in transformer_layer_config, the
    decoder layer's tensors under layers.0., its own embed_tokens.weight, norm_before_residual
    true unless set (as vLLM reads it)."""
    config = make_config(norm_before_residual=True)
    config.rms_norm_eps = 1e-6
    draft = make_draft(config, seed=9)
    draft.to(torch.bfloat16).float()
    out = save_draft(draft, tmp_path / "speculators")
    hf = json.loads((out / "config.json").read_text())
    layer = {k: hf[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                                "vocab_size", "rope_theta", "max_position_embeddings", "num_hidden_layers", "hidden_act",
                                "rms_norm_eps")}
    speculators = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 67,
                   "target_hidden_size": 24, "eagle_aux_hidden_state_layer_ids": [1, 3, 6],
                   "transformer_layer_config": {"model_type": "llama", **layer},
                   "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                          "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                          "verifier": {"name_or_path": "target", "architectures": ["LlamaForCausalLM"]}}}
    rewrite(out, config=lambda _: speculators, tensors=lambda t: {
        **{("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in t.items()},
        "embed_tokens.weight": draft.embed_tokens.weight.bfloat16()})
    loaded = load_draft(out)
    assert loaded.config.norm_before_residual and loaded.config.rms_norm_eps == 1e-6
    assert_same_draft(loaded, draft)
    rewrite(out, config=lambda hf: {**hf, "norm_before_residual": False})
    assert not load_draft(out).config.norm_before_residual
    rewrite(out, config=lambda hf: {**hf, "transformer_layer_config": {**hf["transformer_layer_config"], "model_type": "qwen3"}})
    with pytest.raises(ValueError, match="transformer_layer_config.model_type is 'qwen3'; this draft is the Llama one"):
        load_draft(out)


def test_sglang_legacy_fc_norm_names(tmp_path):
    """SGLang's legacy EAGLE-3.1 form: "use_aux_norm": true and aux_norm_low/mid/high.weight."""
    draft, out = exported_draft(tmp_path, fc_norm=True)
    names = {"fc_norm.0.": "aux_norm_low.", "fc_norm.1.": "aux_norm_mid.", "fc_norm.2.": "aux_norm_high."}

    def legacy(t):
        return {next((names[p] + k[len(p):] for p in names if k.startswith(p)), k): v for k, v in t.items()}

    rewrite(out, config=lambda hf: {**without(hf, "fc_norm"), "use_aux_norm": True}, tensors=legacy)
    assert_same_draft(load(out, draft), draft)
    rewrite(out, config=lambda hf: without(hf, "use_aux_norm"))
    with pytest.raises(ValueError, match='holds fc_norm.0.weight but .* does not set "fc_norm": true'):
        load_draft(out)


def test_own_embedding(tmp_path, caplog):
    """A draft's own embed_tokens.weight is its embedding when no target embedding is given; a
    given one wins (as SGLang runs it), with a warning where they differ (vLLM would run the draft's)."""
    draft, out = exported_draft(tmp_path)
    own = torch.randn(151, 40).bfloat16()
    rewrite(out, tensors=lambda t: {**t, "embed_tokens.weight": own})
    assert torch.equal(load_draft(out).embed_tokens.weight, own.float())
    with caplog.at_level(logging.WARNING, logger="eagleforge.draft.io"):
        assert_same_draft(load_draft(out, embed_tokens=draft.embed_tokens.weight), draft)
    assert "embed_tokens.weight differs from the target's input embedding" in caplog.text
