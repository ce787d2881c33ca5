"""Tiny Kimi-K2.5-layout checkpoints for the native backend's tests, and the INT4 format tests.

`write_tiny_kimi(dir, **overrides)` builds transformers' own DeepseekV3ForCausalLM with random
weights, quantizes its routed experts to INT4 (packed with compressed-tensors' pack_to_int32),
rounds every other weight to bf16, writes the checkpoint in the real Kimi-K2.5 layout (kimi_k25
wrapper config with text_config, `language_model.` prefix, a stub vision tower and projector,
two safetensors files and an index, the fp32 correction bias) and returns the reference model
holding exactly the dequantized weights, in float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from safetensors.torch import save_file

from eagleforge.extract.native import int4

YARN_K25 = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

TINY_TEXT = dict(
    model_type="deepseek_v3", vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=10,
    num_experts_per_tok=3, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827,
    norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", q_lora_rank=48, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, hidden_act="silu", rms_norm_eps=1e-5,
    rope_theta=50000.0, rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False,
    attention_bias=False,
)

QUANT_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32,
                                              "strategy": "group", "dynamic": False}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}


def tiny_text_config(**overrides) -> dict:
    text = dict(TINY_TEXT)
    text.update(overrides)
    return text


def reference_model(text: dict, seed: int):
    """transformers' DeepseekV3ForCausalLM, float64, random weights (incl. norms and bias)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    kwargs = {k: v for k, v in text.items() if k not in ("model_type", "scoring_func", "topk_method")}
    config = DeepseekV3Config(**kwargs)
    config._attn_implementation = "sdpa"  # eager rounds its softmax to fp32; sdpa stays float64
    config._experts_implementation = "eager"  # the looped reference (grouped_mm has no float64)
    model = DeepseekV3ForCausalLM(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(text["n_routed_experts"]))
    return model


def _quantize_expert(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> (packed int32 [out, in/8], scale bf16 [out, in/32], dequantized float64)."""
    q, scale = int4.quantize_int4(weight)
    packed = pack_to_int32(q, 4)
    dequant = (q.double().unflatten(-1, (-1, 32)) * scale.double().unsqueeze(-1)).flatten(-2)
    return packed, scale, dequant


def _text_tensors(model, text: dict) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (transformers names, no prefix) in Kimi dtypes; the model gets the same values."""
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                continue
            if name.endswith("e_score_correction_bias"):
                tensors[name] = p.float().clone()
                continue
            stored = p.to(torch.bfloat16)
            p.copy_(stored.double())  # the reference computes with exactly the stored values
            tensors[name] = stored.clone()
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(b.float().double())
                tensors[name] = b.float().clone()
        I = text["moe_intermediate_size"]
        for i, layer in enumerate(model.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            for e in range(text["n_routed_experts"]):
                gate, up = experts.gate_up_proj[e, :I], experts.gate_up_proj[e, I:]
                for proj, weight, target in (("gate_proj", gate, gate), ("up_proj", up, up),
                                             ("down_proj", experts.down_proj[e], experts.down_proj[e])):
                    packed, scale, dequant = _quantize_expert(weight)
                    base = f"model.layers.{i}.mlp.experts.{e}.{proj}"
                    tensors[f"{base}.weight_packed"] = packed
                    tensors[f"{base}.weight_scale"] = scale
                    tensors[f"{base}.weight_shape"] = torch.tensor(list(weight.shape), dtype=torch.int64)
                    target.copy_(dequant)
    return tensors


def write_tiny_kimi(path: Path, seed: int = 0, prefix: str = "language_model.", wrapper: bool = True, **overrides):
    """Write a tiny Kimi-K2.5-layout checkpoint to `path`; returns (reference model float64, text config)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = tiny_text_config(**overrides)
    model = reference_model(text, seed)
    tensors = {prefix + k: v for k, v in _text_tensors(model, text).items()}
    text_json = dict(text)
    text_json["quantization_config"] = QUANT_CONFIG
    if wrapper:
        tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, dtype=torch.bfloat16)
        tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.randn(24, 8, dtype=torch.bfloat16)
        tensors["mm_projector.proj.0.weight"] = torch.randn(64, 32, dtype=torch.bfloat16)
        config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                  "text_config": text_json, "vision_config": {"model_type": "kimi_k25_vision", "hidden_size": 8}}
    else:
        config = dict(text_json, architectures=["DeepseekV3ForCausalLM"])
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in files.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return model, text


def reference_states(model, input_ids: torch.Tensor, aux_layers: list[int]):
    """(aux [B, T, k*H], final normed [B, T, H], greedy [B, T]) from transformers, via forward hooks."""
    captured = {}
    handles = [model.model.layers[i].register_forward_hook(
        lambda m, a, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in aux_layers]
    handles.append(model.model.norm.register_forward_hook(lambda m, a, out: captured.__setitem__("norm", out)))
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits
    for h in handles:
        h.remove()
    aux = torch.cat([captured[i] for i in sorted(aux_layers)], -1)
    return aux, captured["norm"], logits.argmax(-1)


# ---------------------------------------------------------------------------- INT4 format tests


@pytest.mark.parametrize("out_features,in_features", [(5, 32), (7, 96), (3, 256)])
def test_int4_dequant_matches_compressed_tensors_and_reference(out_features, in_features):
    torch.manual_seed(out_features * in_features)
    q = torch.randint(-8, 8, (out_features, in_features), dtype=torch.int8)
    q[0, :8] = torch.tensor([-8, 7, -1, 0, 1, -7, 6, -8], dtype=torch.int8)  # top nibbles >= 8: negative int32
    packed = pack_to_int32(q, 4)
    scale = (torch.rand(out_features, in_features // 32) + 0.01).to(torch.bfloat16)
    assert packed.dtype == torch.int32 and packed.shape == (out_features, in_features // 8)
    assert (packed < 0).any(), "fixture should hold negative words"
    assert torch.equal(int4.unpack_int4(packed), q)
    assert torch.equal(int4.unpack_int4(packed), unpack_from_int32(packed, 4, q.shape))
    expected = q.double() * scale.double().repeat_interleave(32, dim=1)
    assert torch.equal(int4.dequantize_int4(packed, scale, torch.float64), expected)
    assert torch.equal(int4.dequantize_int4_reference(packed, scale), expected)
    assert torch.equal(int4.dequantize_int4(packed, scale, torch.bfloat16), expected.to(torch.bfloat16))


def test_int4_rejects_mismatched_scale():
    packed = pack_to_int32(torch.zeros(4, 64, dtype=torch.int8), 4)
    with pytest.raises(ValueError, match="weight_scale shape"):
        int4.dequantize_int4(packed, torch.ones(4, 3, dtype=torch.bfloat16))
