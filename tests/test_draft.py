"""The EAGLE-3 draft: TTT alignment against a per-row plain-math reference and against serving
with the KV cache, propose() against a greedy loop from scratch, the same for the variants
(EAGLE-3.1's fc_norm, vLLM's norm_before_residual and norm_output) against vLLM's math, the
export format of docs/export.md, and from_target_config on Llama, DeepSeek-V3 and Kimi-K2.5-like
configs."""

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV3Config, Kimi_K25Config, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from eagleforge.draft import EXPORT_TENSOR_NAMES, Eagle3Config, Eagle3Draft, load_draft, save_draft
from eagleforge.extract.native.plan import KIMI_K25_TEXT_CONFIG

ROPES = {
    "default": None,
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5},
}


# The draft's variant switches (Eagle3Config), each alone and all together.
VARIANTS = {
    "fc_norm": {"fc_norm": True},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_output": {"norm_output": True},
    "all": {"fc_norm": True, "norm_before_residual": True, "norm_output": True},
}


def make_config(rope="default", draft_vocab_size=67, kv_heads=2, **variant):
    # Odd sizes: hidden 40, head_dim 10, target hidden 24 != hidden, 3 aux layers, Vd < V.
    return Eagle3Config(
        hidden_size=40, num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=10, intermediate_size=72,
        vocab_size=151, draft_vocab_size=draft_vocab_size, target_hidden_size=24, aux_layer_ids=[0, 2, 5],
        rms_norm_eps=1e-5, rope_theta=5000.0, rope_scaling=copy.deepcopy(ROPES[rope]), max_position_embeddings=256,
        target_num_layers=8, **variant,
    )


def random_vocab(config, seed):
    """A random sorted draft vocabulary [Vd] of target ids, and its d2t / t2d."""
    g = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(config.vocab_size, generator=g)[: config.draft_vocab_size].sort().values
    d2t = vocab - torch.arange(config.draft_vocab_size)
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    return vocab, d2t, t2d


def make_draft(config, seed=0):
    torch.manual_seed(seed)
    draft = Eagle3Draft(config)
    draft.reset_parameters(std=0.15)  # large enough that every piece moves the logits
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight") or name.startswith("fc_norm."):  # every norm, fc_norm.{i} too
                p.copy_(1 + 0.2 * torch.randn_like(p))
        draft.embed_tokens.weight.normal_()
    _, d2t, t2d = random_vocab(config, seed + 1)
    draft.set_vocab_map(d2t, t2d)
    return draft.eval()


def random_inputs(config, batch, rows, seed):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(batch, rows, config.fc_in_features, generator=g)
    ids = torch.randint(0, config.vocab_size, (batch, rows), generator=g)
    return aux, ids


# --------------------------------------------------------------------------- plain-math reference


def hf_rope(config):
    hf = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                     head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                     rope_theta=config.rope_theta, rope_scaling=copy.deepcopy(config.rope_scaling))
    return LlamaRotaryEmbedding(hf)


def naive_ttt_logits(draft, aux, ids, steps):
    """[steps, T, Vd] float64 for ONE sequence (aux [T, k*Ht], ids [T]), row by row from the
    definition: transformers' RMSNorm and RoPE, attention as explicit per-head softmax loops.

    The config's switches as vLLM's llama_eagle3.py computes them: fc_norm, each aux chunk [Ht]
    through its own RMSNorm before fc (combine_hidden_states); norm_before_residual, the
    residual is hidden_norm(h) (_norm_before_residual); norm_output, the next step is fed the
    final norm's output (LlamaModel.forward's aux_output)."""
    cfg, t_len = draft.config, ids.shape[0]
    w = {n: p.detach().double() for n, p in draft.named_parameters()}
    rope = hf_rope(cfg)

    def rms(x, weight):
        norm = LlamaRMSNorm(x.shape[-1], eps=cfg.rms_norm_eps).double()
        norm.weight.data.copy_(weight)
        return norm(x)

    def rotate(x, pos):  # x [heads, D] at position pos
        cos, sin = rope(x.float()[None], torch.tensor([[pos]]))
        cos, sin = cos[0, 0].double(), sin[0, 0].double()
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    keys, values, fed = {}, {}, {}  # (step, row) -> [nkv, D] / [H] (fed: what step j hands step j + 1)
    logits = torch.empty(steps, t_len, cfg.draft_vocab_size, dtype=torch.float64)
    for j in range(steps):
        for t in range(t_len):
            token = int(ids[t + 1 + j]) if t + 1 + j < t_len else 0
            if j == 0:
                chunks = aux[t].double().split(cfg.target_hidden_size)
                if cfg.fc_norm:
                    chunks = [rms(c, w[f"fc_norm.{i}.weight"]) for i, c in enumerate(chunks)]
                h_in = torch.cat(chunks) @ w["fc.weight"].T
            else:
                h_in = fed[(j - 1, t)]
            x = torch.cat([rms(w["embed_tokens.weight"][token], w["midlayer.input_layernorm.weight"]),
                           rms(h_in, w["midlayer.hidden_norm.weight"])])
            residual = rms(h_in, w["midlayer.hidden_norm.weight"]) if cfg.norm_before_residual else h_in
            q = rotate((w["midlayer.self_attn.q_proj.weight"] @ x).view(nh, d), t + j)
            keys[(j, t)] = rotate((w["midlayer.self_attn.k_proj.weight"] @ x).view(nkv, d), t + j)
            values[(j, t)] = (w["midlayer.self_attn.v_proj.weight"] @ x).view(nkv, d)
            visible = [(0, s) for s in range(t + 1)] + [(i, t) for i in range(1, j + 1)]
            heads = []
            for h in range(nh):
                g = h // (nh // nkv)
                scores = torch.stack([q[h] @ keys[v][g] for v in visible]) / d ** 0.5
                probs = scores.softmax(0)
                heads.append(sum(p * values[v][g] for p, v in zip(probs, visible)))
            h_mid = residual + w["midlayer.self_attn.o_proj.weight"] @ torch.cat(heads)
            y = rms(h_mid, w["midlayer.post_attention_layernorm.weight"])
            mlp = w["midlayer.mlp.down_proj.weight"] @ (
                torch.nn.functional.silu(w["midlayer.mlp.gate_proj.weight"] @ y) * (w["midlayer.mlp.up_proj.weight"] @ y))
            out = h_mid + mlp
            normed = rms(out, w["norm.weight"])
            fed[(j, t)] = normed if cfg.norm_output else out
            logits[j, t] = w["lm_head.weight"] @ normed
    return logits


# --------------------------------------------------------------------------- building blocks


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_matches_transformers(rope):
    config = make_config(rope)
    draft = Eagle3Draft(config)
    positions = torch.tensor([[0, 1, 5, 17, 40, 199]])
    cos, sin = draft.rope(positions)
    ref_cos, ref_sin = hf_rope(config)(torch.zeros(1, 1, dtype=torch.float32), positions)
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=1e-6)


def test_rope_frequencies_copied_once_per_device_and_follow_a_new_table():
    """rope() keeps inv_freq's copy on the positions' device (a copy per call is a blocking
    host -> device transfer on CUDA); a replaced inv_freq is picked up, not the stale copy."""
    draft = Eagle3Draft(make_config("default"))
    positions = torch.arange(7)[None]
    cos, _ = draft.rope(positions)
    assert draft._inv_freq_on(positions.device) is draft._inv_freq_on(positions.device)
    draft.inv_freq = draft.inv_freq * 2
    cos2, _ = draft.rope(positions)
    torch.testing.assert_close(cos2, torch.cat([positions[..., None] * draft.inv_freq] * 2, -1).cos())
    assert not torch.equal(cos, cos2)


def test_rmsnorm_matches_transformers_in_bf16():
    draft = make_draft(make_config()).to(torch.bfloat16)
    x = torch.randn(3, 5, 40, dtype=torch.bfloat16) * 7
    ref = LlamaRMSNorm(40, eps=1e-5).to(torch.bfloat16)
    ref.weight.data.copy_(draft.norm.weight.data)
    torch.testing.assert_close(draft.norm(x), ref(x), atol=0, rtol=0)


# --------------------------------------------------------------------------- (a) TTT alignment


@pytest.mark.parametrize("rope,kv_heads", [("default", 2), ("yarn", 1), ("llama3", 4)])
def test_forward_ttt_matches_plain_math_reference(rope, kv_heads):
    config = make_config(rope, kv_heads=kv_heads)
    draft = make_draft(config, seed=3)
    aux, ids = random_inputs(config, batch=2, rows=9, seed=4)
    steps = 4
    for attention in ("reference", "fast"):
        with torch.no_grad():
            normed = draft.forward_ttt(aux, ids, steps, attention=attention)
        assert len(normed) == steps and all(h.shape == (2, 9, 40) for h in normed)
        for b in range(2):
            got = torch.stack([draft.logits(h[b]) for h in normed]).double()
            torch.testing.assert_close(got, naive_ttt_logits(draft, aux[b], ids[b], steps), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_forward_ttt_matches_serving_one_row_at_a_time(rope):
    """Unrolled TTT == serving: rows extended one at a time into the KV cache, then the chain
    fed its own hidden and the TRUE next tokens; same logits at every step and row."""
    config = make_config(rope)
    draft = make_draft(config, seed=5)
    batch, rows, steps = 2, 11, 5
    aux, ids = random_inputs(config, batch, rows, seed=6)
    with torch.no_grad():
        ttt = [draft.logits(h) for h in draft.forward_ttt(aux, ids, steps, attention="fast")]  # steps x [B, T, Vd]
    padded = torch.cat([ids, torch.zeros(batch, steps + 1, dtype=ids.dtype)], dim=1)  # token 0 past the end
    for b in range(batch):
        cache = draft.new_cache()
        for t in range(rows):
            draft.extend(cache, aux[b:b + 1, t:t + 1], padded[b:b + 1, t + 1:t + 2])
            assert cache.length == t + 1
            chained = draft.logits(draft.chain(cache, padded[b:b + 1, t + 2:t + 1 + steps]))  # [1, steps, Vd]
            assert cache.length == t + 1, "chain must leave the cache as it was"
            for j in range(steps):
                torch.testing.assert_close(chained[0, j], ttt[j][b, t], atol=1e-5, rtol=1e-5,
                                           msg=lambda m, j=j, t=t: f"step {j} row {t}: {m}")


# --------------------------------------------------------------------------- (b) variants: EAGLE-3.1 and vLLM's switches


def test_fuse_with_fc_norm_matches_plain_torch():
    """fc_norm (EAGLE-3.1): the fused input is fc applied to the aux chunks, each [Ht] through its
    own RMSNorm x / sqrt(mean(x^2) + eps) * w_i: 2 aux layers, Ht = 19, non-unit random weights."""
    config = Eagle3Config(hidden_size=36, num_attention_heads=3, num_key_value_heads=1, head_dim=12, intermediate_size=50,
                          vocab_size=97, draft_vocab_size=41, target_hidden_size=19, aux_layer_ids=[1, 4],
                          rms_norm_eps=1e-6, fc_norm=True)
    draft = Eagle3Draft(config)
    assert [n for n, _ in draft.named_parameters() if n.startswith("fc_norm")] == ["fc_norm.0.weight", "fc_norm.1.weight"]
    assert all(torch.equal(p, torch.ones(19)) for n, p in draft.named_parameters() if n.startswith("fc_norm"))
    g = torch.Generator().manual_seed(40)
    with torch.no_grad():
        for norm in draft.fc_norm:
            norm.weight.copy_(torch.rand(19, generator=g) * 3)  # anything but ones
        draft.fc.weight.copy_(torch.randn(36, 38, generator=g))
    aux = torch.randn(3, 7, 38, generator=g) * torch.tensor([0.1] * 19 + [30.0] * 19)  # chunks of very different scale
    ref = []
    for i in range(2):
        x = aux[..., 19 * i: 19 * (i + 1)].double()
        ref.append(x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * draft.fc_norm[i].weight.double())
    ref = torch.cat(ref, -1) @ draft.fc.weight.double().T  # [3, 7, 36]
    with torch.no_grad():
        got = draft.fuse(aux)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    plain = Eagle3Draft(Eagle3Config(**{**config.__dict__, "fc_norm": False}))
    assert plain.fc_norm is None and not any(n.startswith("fc_norm") for n in plain.state_dict())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_ttt_variants_match_plain_math_reference(variant):
    """fc_norm, norm_before_residual, norm_output (and all three): forward_ttt's logits equal the
    per-row float64 reference of vLLM's math at every step (4 steps, GQA, odd sizes)."""
    config = make_config("yarn", kv_heads=2, **VARIANTS[variant])
    draft = make_draft(config, seed=41)
    aux, ids = random_inputs(config, batch=2, rows=8, seed=42)
    steps = 4
    for attention in ("reference", "merged"):
        with torch.no_grad():
            normed = draft.forward_ttt(aux, ids, steps, attention=attention)
        for b in range(2):
            got = torch.stack([draft.logits(h[b]) for h in normed]).double()  # fp32 math against float64
            torch.testing.assert_close(got, naive_ttt_logits(draft, aux[b], ids[b], steps), atol=3e-5, rtol=1e-5)
    # Each switch changes the numbers (the reference is not blind to it).
    plain = Eagle3Draft(make_config("yarn", kv_heads=2))
    plain.load_state_dict({k: v for k, v in draft.state_dict().items() if not k.startswith("fc_norm")})
    with torch.no_grad():
        other = plain.forward_ttt(aux, ids, steps, attention="reference")
    assert (other[1] - normed[1]).abs().max() > 1e-2


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_ttt_variants_match_serving(variant):
    """The decoding path (extend, then chain fed the true next tokens) gives forward_ttt's logits
    at every step and row with each switch on, and propose() equals the greedy loop from scratch
    on the plain-math reference."""
    config = make_config("default", **VARIANTS[variant])
    draft = make_draft(config, seed=43)
    batch, rows, steps = 2, 7, 4
    aux, ids = random_inputs(config, batch, rows, seed=44)
    with torch.no_grad():
        ttt = [draft.logits(h) for h in draft.forward_ttt(aux, ids, steps, attention="merged")]  # steps x [B, T, Vd]
    padded = torch.cat([ids, torch.zeros(batch, steps + 1, dtype=ids.dtype)], dim=1)
    for b in range(batch):
        cache = draft.new_cache()
        for t in range(rows):
            draft.extend(cache, aux[b:b + 1, t:t + 1], padded[b:b + 1, t + 1:t + 2])
            chained = draft.logits(draft.chain(cache, padded[b:b + 1, t + 2:t + 1 + steps]))  # [1, steps, Vd]
            for j in range(steps):
                torch.testing.assert_close(chained[0, j], ttt[j][b, t], atol=1e-5, rtol=1e-5,
                                           msg=lambda m, j=j, t=t: f"{variant} step {j} row {t}: {m}")
    vocab, _, _ = random_vocab(config, 44)  # make_draft's vocabulary (seed + 1)
    n, k = 5, 4
    proposal = _fresh_propose(draft, aux[:1, :n], ids[:1, 1:n + 1], k)
    proposed = []
    for j in range(k):
        ids_ext = torch.cat([ids[0, :n + 1], torch.tensor(proposed, dtype=ids.dtype)])
        aux_ext = torch.cat([aux[0, :n], torch.zeros(1 + j, aux.shape[-1])])
        proposed.append(int(vocab[naive_ttt_logits(draft, aux_ext, ids_ext, j + 1)[j, n - 1].argmax()]))
    assert proposal[0].tolist() == proposed


@pytest.mark.parametrize("checkpoint", ["step", ("selective", "selective_all", "none")])
def test_variants_train_the_same_under_checkpointing_and_fused_weight_grads(checkpoint):
    """All switches on: the trainer's paths (merged attention, activation checkpointing, the fused
    midlayer weight gradients) give the reference run's outputs and every gradient, fc_norm's
    weights included (trainable, counted by trainable_parameter_count)."""
    from eagleforge.train import weight_grads as grad_accum
    from eagleforge.train.step_plan import trainable_parameter_count

    config = make_config("llama3", kv_heads=2, **VARIANTS["all"])
    draft = make_draft(config, seed=45)
    aux, ids = random_inputs(config, 2, 9, seed=46)
    weights = torch.randn(3, 2, 9, config.draft_vocab_size, generator=torch.Generator().manual_seed(47))
    ref_out, ref_grads = _ttt_grads(draft, aux, ids, 3, weights, attention="reference")
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(ref_grads)
    assert all(ref_grads[f"fc_norm.{i}.weight"].abs().max() > 0 for i in range(3))
    plain = make_draft(make_config("llama3", kv_heads=2), seed=45)
    assert trainable_parameter_count(draft) == trainable_parameter_count(plain) + 3 * config.target_hidden_size
    grad_accum.fuse_weight_grads(draft)
    out, grads = _ttt_grads(draft, aux, ids, 3, weights, attention="merged", checkpoint=checkpoint)
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        err = (grads[name] - g).norm() / g.norm()
        assert err < 1e-5, f"{checkpoint} {name}: relative gradient error {err:.2e}"


def test_extend_in_chunks_equals_row_by_row_and_rollback():
    config = make_config()
    draft = make_draft(config, seed=7)
    aux, ids = random_inputs(config, 1, 10, seed=8)
    nxt = ids[:, 1:]  # row t fed token t+1
    aux = aux[:, :9]
    one = draft.new_cache()
    for t in range(9):
        draft.extend(one, aux[:, t:t + 1], nxt[:, t:t + 1])
    chunked = draft.new_cache()
    for lo, hi in [(0, 4), (4, 5), (5, 9)]:
        draft.extend(chunked, aux[:, lo:hi], nxt[:, lo:hi])
    for a, b in [(one.keys, chunked.keys), (one.values, chunked.values), (one.hidden, chunked.hidden)]:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Rollback to 5 rows, re-extend differently, then back: equals a cache built directly.
    draft.rollback(chunked, 4)
    assert chunked.length == 5
    torch.testing.assert_close(chunked.hidden, one.hidden[:, :5])
    assert torch.equal(draft.propose(chunked, 4), _fresh_propose(draft, aux[:, :5], nxt[:, :5], 4))
    with pytest.raises(ValueError, match="rollback"):
        draft.rollback(chunked, 6)


def _fresh_propose(draft, aux, nxt, k):
    cache = draft.new_cache()
    draft.extend(cache, aux, nxt)
    return draft.propose(cache, k)


# --------------------------------------------------------------------------- (e) propose


@pytest.mark.parametrize("rope,kv_heads", [("default", 2), ("llama3", 1)])
def test_propose_equals_greedy_loop_from_scratch(rope, kv_heads):
    config = make_config(rope, kv_heads=kv_heads)
    draft = make_draft(config, seed=9)
    vocab, _, _ = random_vocab(config, 10)  # the draft's vocabulary (make_draft used seed + 1)
    n, k = 6, 5
    aux, ids = random_inputs(config, 1, n + 1, seed=11)
    cache = draft.new_cache()
    draft.extend(cache, aux[:, :n], ids[:, 1:])
    proposal = draft.propose(cache, k)
    assert proposal.shape == (1, k) and proposal.dtype == torch.int64
    assert cache.length == n

    # Greedy from scratch: every token recomputes all rows and steps with the plain-math
    # reference; row n-1 at step j is fed the j-th proposal (ids_ext[n + j]).
    proposed = []
    for j in range(k):
        ids_ext = torch.cat([ids[0], torch.tensor(proposed, dtype=ids.dtype)])  # [n + 1 + j]
        aux_ext = torch.cat([aux[0, :n], torch.zeros(1 + j, aux.shape[-1])])  # rows >= n: unseen by row n-1
        logits = naive_ttt_logits(draft, aux_ext, ids_ext, j + 1)[j, n - 1]
        proposed.append(int(vocab[logits.argmax()]))
    assert proposal[0].tolist() == proposed


def test_propose_maps_draft_ids_through_d2t():
    config = make_config()
    draft = make_draft(config, seed=12)
    vocab, _, _ = random_vocab(config, 13)
    assert torch.equal(draft.to_target_ids(torch.arange(config.draft_vocab_size)), vocab)
    assert bool(draft.t2d[vocab].all()) and int(draft.t2d.sum()) == config.draft_vocab_size


# --------------------------------------------------------------------------- (c) export

EXPORT_NAMES = [
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "fc.weight", "norm.weight", "lm_head.weight",
]


@pytest.mark.parametrize("draft_vocab_size", [67, 151])
def test_export_format_and_reload(tmp_path, draft_vocab_size):
    config = make_config(draft_vocab_size=draft_vocab_size)
    draft = make_draft(config, seed=14)
    draft.to(torch.bfloat16).float()  # the export is bf16: round first so the reload is exact
    out = save_draft(draft, tmp_path / "draft")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["draft"], "no temporary directories left behind"

    h, kh, inter, vd, v = 40, 2 * 10, 72, draft_vocab_size, 151
    shapes = {
        "midlayer.self_attn.q_proj.weight": (40, 2 * h), "midlayer.self_attn.k_proj.weight": (kh, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kh, 2 * h), "midlayer.self_attn.o_proj.weight": (h, 40),
        "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter), "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,), "midlayer.post_attention_layernorm.weight": (h,),
        "fc.weight": (h, 3 * 24), "norm.weight": (h,), "lm_head.weight": (vd, h),
    }
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        expected = set(EXPORT_NAMES) | ({"d2t", "t2d"} if vd < v else set())
        assert names == expected
        assert names <= set(EXPORT_TENSOR_NAMES)
        for name in EXPORT_NAMES:
            tensor = f.get_tensor(name)
            assert tuple(tensor.shape) == shapes[name] and tensor.dtype == torch.bfloat16, name
        if vd < v:
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
            assert d2t.dtype == torch.int64 and tuple(d2t.shape) == (vd,)
            assert t2d.dtype == torch.bool and tuple(t2d.shape) == (v,)
            vocab, _, _ = random_vocab(config, 15)
            assert torch.equal(torch.arange(vd) + d2t, vocab)  # draft id i -> target id i + d2t[i]
            assert torch.equal(t2d.nonzero().flatten(), vocab)

    hf = json.loads((out / "config.json").read_text())
    assert hf == {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 40,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 10,
        "intermediate_size": 72, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 5000.0,
        "rope_scaling": None, "max_position_embeddings": 256, "vocab_size": 151, "draft_vocab_size": vd,
        "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
        "eagle_aux_hidden_state_layer_ids": [1, 3, 6], "target_hidden_size": 24,
        # SGLang reads the ids only here, as layer outputs for a target of unknown architecture
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 5], "use_aux_hidden_state": True},
    }

    loaded = load_draft(out, embed_tokens=draft.embed_tokens.weight)
    aux, ids = random_inputs(config, 2, 7, seed=16)
    with torch.no_grad():
        want = [draft.logits(x) for x in draft.forward_ttt(aux, ids, 3)]
        got = [loaded.logits(x) for x in loaded.forward_ttt(aux, ids, 3)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    assert loaded.config.aux_layer_ids == [0, 2, 5]

    # Overwriting an existing export is atomic too (here through the Hugging Face-style methods),
    # and an nn.Embedding is accepted.
    loaded.save_pretrained(out)
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []  # no temporary left
    again = Eagle3Draft.from_pretrained(out, embed_tokens=draft.embed_tokens, dtype=torch.bfloat16)
    assert again.fc.weight.dtype == torch.bfloat16 and again.d2t.dtype == torch.int64
    with torch.no_grad():
        torch.testing.assert_close(again.fc.weight, loaded.fc.weight.bfloat16(), atol=0, rtol=0)


def test_hidden_size_equal_to_target_omits_target_hidden_size():
    config = make_config()
    config.target_hidden_size = config.hidden_size
    assert "target_hidden_size" not in config.to_hf_dict()
    assert Eagle3Config.from_hf_dict(config.to_hf_dict()).target_hidden_size == config.hidden_size


def test_load_rejects_bad_exports(tmp_path):
    from safetensors.torch import load_file, save_file

    draft = make_draft(make_config(), seed=17)
    out = save_draft(draft, tmp_path / "d")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_draft(tmp_path)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, "lm_head.bias": torch.zeros(67)}, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unknown tensors \['lm_head.bias'\]"):
        load_draft(out)
    save_file({**tensors, "embed_tokens.weight": torch.zeros(151, 41)}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \(151, 41\), config.json implies \(151, 40\)"):
        load_draft(out)
    save_file({k: t for k, t in tensors.items() if k != "fc.weight"}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        load_draft(out)
    bad = {**tensors, "fc.weight": torch.zeros(40, 71, dtype=torch.bfloat16)}
    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight has shape"):
        load_draft(out)


def test_export_fc_norm_round_trip(tmp_path):
    """EAGLE-3.1: config.json gets "fc_norm": true at the top level (and nothing of the other
    switches, off), the weights fc_norm.0/1/2.weight [Ht]; the reload computes what was saved."""
    from eagleforge.draft import expected_tensors

    config = make_config(**VARIANTS["fc_norm"])
    draft = make_draft(config, seed=48)
    draft.to(torch.bfloat16).float()  # the export is bf16: round first so the reload is exact
    out = save_draft(draft, tmp_path / "draft")
    hf = json.loads((out / "config.json").read_text())
    assert hf["fc_norm"] is True
    assert not {"norm_output", "norm_before_residual", "norm_before_fc"} & set(hf)
    assert {k: v for k, v in hf.items() if k != "fc_norm"} == make_config().to_hf_dict()
    fc_norm_names = ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(EXPORT_NAMES) | {"d2t", "t2d"} | set(fc_norm_names)
        for name in fc_norm_names:
            tensor = f.get_tensor(name)
            assert tuple(tensor.shape) == (24,) and tensor.dtype == torch.bfloat16
            assert torch.equal(tensor.float(), draft.state_dict()[name])
    assert set(expected_tensors(config)) == names and not set(fc_norm_names) & set(expected_tensors(make_config()))
    loaded = load_draft(out, embed_tokens=draft.embed_tokens.weight)
    assert loaded.config == Eagle3Config(**{**config.__dict__, "target_num_layers": 0})
    aux, ids = random_inputs(config, 2, 6, seed=49)
    with torch.no_grad():
        for a, b in zip(loaded.forward_ttt(aux, ids, 3), draft.forward_ttt(aux, ids, 3)):
            torch.testing.assert_close(loaded.logits(a), draft.logits(b), atol=0, rtol=0)


def test_load_refuses_fc_norm_tensors_and_config_that_disagree(tmp_path):
    """fc_norm tensors without "fc_norm": true (vLLM would refuse them, SGLang drop them), and
    "fc_norm": true with a tensor missing: a ValueError naming the file, the tensor and the key."""
    from safetensors.torch import load_file, save_file

    out = save_draft(make_draft(make_config(**VARIANTS["fc_norm"]), seed=50), tmp_path / "d")
    weights, config_json = out / "model.safetensors", out / "config.json"
    tensors, hf = load_file(str(weights)), json.loads(config_json.read_text())
    config_json.write_text(json.dumps({k: v for k, v in hf.items() if k != "fc_norm"}))
    with pytest.raises(ValueError, match=rf'^{re.escape(str(weights))}: holds fc_norm.0.weight but '
                                         rf'{re.escape(str(config_json))} does not set "fc_norm": true'):
        load_draft(out)
    config_json.write_text(json.dumps({**hf, "fc_norm": False}))
    with pytest.raises(ValueError, match='holds fc_norm.0.weight but .* does not set "fc_norm": true'):
        load_draft(out)
    config_json.write_text(json.dumps(hf))
    save_file({k: t for k, t in tensors.items() if k != "fc_norm.1.weight"}, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf'^{re.escape(str(weights))}: has no fc_norm.1.weight but '
                                         rf'{re.escape(str(config_json))} sets "fc_norm": true'):
        load_draft(out)
    save_file({k: t for k, t in tensors.items() if not k.startswith("fc_norm.")}, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match='has no fc_norm.0.weight but .* sets "fc_norm": true'):
        load_draft(out)
    save_file({**tensors, "fc_norm.3.weight": tensors["fc_norm.0.weight"].clone()}, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unknown tensors \['fc_norm.3.weight'\]"):
        load_draft(out)
    save_file({**tensors, "fc_norm.2.weight": torch.ones(40, dtype=torch.bfloat16)}, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"fc_norm.2.weight has shape \(40,\), config.json implies \(24,\)"):
        load_draft(out)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert load_draft(out).config.fc_norm  # the export as written loads
    for bad in ("true", 1):
        config_json.write_text(json.dumps({**hf, "fc_norm": bad}))
        with pytest.raises(ValueError, match=rf"{re.escape(str(config_json))}: fc_norm is {bad!r}, expected true or false"):
            load_draft(out)


def test_variant_switches_in_config_json():
    """Each switch is written at the top level only when true and read back; bad values refused."""
    for variant in VARIANTS.values():
        cfg = make_config(**variant)
        hf = json.loads(json.dumps(cfg.to_hf_dict()))
        assert {k for k in ("fc_norm", "norm_before_residual", "norm_output") if k in hf} == set(variant)
        assert all(hf[k] is True for k in variant)
        assert Eagle3Config.from_hf_dict(hf) == Eagle3Config(**{**cfg.__dict__, "target_num_layers": 0})
    hf = make_config().to_hf_dict()
    assert Eagle3Config.from_hf_dict({**hf, "norm_output": False, "fc_norm": None}) == Eagle3Config.from_hf_dict(hf)
    with pytest.raises(ValueError, match="norm_before_residual is 'yes', expected true or false"):
        Eagle3Config.from_hf_dict({**hf, "norm_before_residual": "yes"})
    with pytest.raises(ValueError, match="Eagle3Config.norm_output must be true or false, got 1"):
        make_config(norm_output=1)


def test_draft_imports_alone():
    """Serving users import the draft library alone: no extract/train/core config modules."""
    code = ("import sys; from eagleforge import draft; "
            "bad = [m for m in sys.modules if m.startswith(('eagleforge.extract', 'eagleforge.train', "
            "'eagleforge.config', 'eagleforge.target', 'eagleforge.kernels'))]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)

    import eagleforge.draft as draft_pkg

    for path in Path(draft_pkg.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+torch\.distributed", text, re.M), path
        assert not re.search(r"^\s*from\s+\.\.|eagleforge\.(extract|train|config|target|kernels)", text, re.M), path


# --------------------------------------------------------------------------- (d) from_target_config


def test_from_target_config_llama(tiny_llama_config):
    cfg = Eagle3Config.from_target_config(tiny_llama_config, 101, [1, 2, 3])
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (48, 3, 1, 16)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.draft_vocab_size) == (80, 211, 101)
    assert (cfg.target_hidden_size, cfg.target_num_layers, cfg.max_position_embeddings) == (48, 7, 256)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.to_hf_dict()["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert "target_hidden_size" not in cfg.to_hf_dict()

    # Overrides win when non-zero; zeros (DraftConfig defaults) mean "derive".
    over = Eagle3Config.from_target_config(tiny_llama_config, 101, [1, 2, 3], hidden_size=32, num_attention_heads=4,
                                           num_key_value_heads=0, head_dim=8, intermediate_size=0)
    assert (over.hidden_size, over.num_attention_heads, over.num_key_value_heads, over.head_dim) == (32, 4, 1, 8)
    assert over.intermediate_size == 80 and over.target_hidden_size == 48
    assert over.to_hf_dict()["target_hidden_size"] == 48
    with pytest.raises(ValueError, match="unknown override"):
        Eagle3Config.from_target_config(tiny_llama_config, 101, [1, 2, 3], hidden=3)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        Eagle3Config.from_target_config(tiny_llama_config, 101, [1, 2, 9])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_target_config(tiny_llama_config, 500, [1, 2, 3])

    # A Llama-3 style rope_scaling is carried over.
    llama3 = LlamaConfig(hidden_size=48, num_attention_heads=3, head_dim=16, rope_theta=500000.0,
                         rope_scaling=copy.deepcopy(ROPES["llama3"]), vocab_size=211, intermediate_size=80)
    cfg = Eagle3Config.from_target_config(llama3, 100, [1, 2, 3])
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == ROPES["llama3"]


# Kimi-K2.5's text config: the one table (docs/kimi-k25.md), without its model_type key
KIMI_TEXT = {k: v for k, v in KIMI_K25_TEXT_CONFIG.items() if k != "model_type"}
# MLA: as many kv heads as query heads, head_dim = v_head_dim
KIMI_DRAFT = dict(hidden_size=KIMI_TEXT["hidden_size"], num_attention_heads=KIMI_TEXT["num_attention_heads"],
                  num_key_value_heads=KIMI_TEXT["num_attention_heads"], head_dim=KIMI_TEXT["v_head_dim"],
                  intermediate_size=KIMI_TEXT["intermediate_size"], vocab_size=KIMI_TEXT["vocab_size"],
                  target_hidden_size=KIMI_TEXT["hidden_size"], target_num_layers=KIMI_TEXT["num_hidden_layers"])


def _check_kimi(cfg):
    for key, value in KIMI_DRAFT.items():
        assert getattr(cfg, key) == value, key
    assert cfg.rope_theta == 50000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 64.0
    assert cfg.rope_scaling["original_max_position_embeddings"] == 4096 and "rope_theta" not in cfg.rope_scaling
    hf = cfg.to_hf_dict()
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58] and "target_hidden_size" not in hf
    # SGLang's DeepSeek-V2 family adds one to eagle_config's ids starting at 1: the project's ids
    assert hf["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True}


def test_from_target_config_deepseek_v3_and_kimi():
    tiny = DeepseekV3Config(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, kv_lora_rank=16,
                            q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20,
                            intermediate_size=96, vocab_size=300)
    cfg = Eagle3Config.from_target_config(tiny, 200, [1, 2, 3])
    # MLA: no plain kv heads -> as many as query heads, head_dim = v_head_dim.
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 4, 20)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.target_num_layers) == (64, 96, 300, 5)

    aux = [1, 29, 57]
    _check_kimi(Eagle3Config.from_target_config(DeepseekV3Config(**KIMI_TEXT), 32000, aux))
    _check_kimi(Eagle3Config.from_target_config(Kimi_K25Config(text_config=dict(model_type="deepseek_v3", **KIMI_TEXT)), 32000, aux))
    # The raw config.json dict (text_config wrapper, v4-style rope keys) works as well.
    raw = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
           "text_config": {"model_type": "deepseek_v3", **KIMI_TEXT}, "vision_config": {}}
    cfg = Eagle3Config.from_target_config(raw, 32000, aux)
    _check_kimi(cfg)
    assert Eagle3Config.from_hf_dict(cfg.to_hf_dict()) == Eagle3Config(**{**cfg.__dict__, "target_num_layers": 0, "target_architecture": ""})
    # The Kimi-sized draft builds on the meta device (no memory) with the export's shapes.
    with torch.device("meta"):
        kimi = Eagle3Draft(cfg)
    H, heads, hd = KIMI_DRAFT["hidden_size"], KIMI_DRAFT["num_attention_heads"], KIMI_DRAFT["head_dim"]
    assert tuple(kimi.midlayer.self_attn.q_proj.weight.shape) == (heads * hd, 2 * H)
    assert tuple(kimi.fc.weight.shape) == (H, 3 * H) and tuple(kimi.lm_head.weight.shape) == (32000, H)


@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_from_target_config_refuses_two_different_rope_thetas(rope_key):
    """rope_theta at the top level and inside the RoPE dict (rope_parameters as transformers 5
    writes it, or rope_scaling) with different values: one line naming both; equal values pass."""
    from eagleforge.draft.config import RopeConflictError

    rope = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0}
    text = {**KIMI_TEXT, "rope_theta": 50000.0, "rope_scaling": None, rope_key: rope}
    raw = {"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3", **text}}
    with pytest.raises(RopeConflictError) as caught:
        Eagle3Config.from_target_config(raw, 32000, [1, 29, 57])
    assert str(caught.value) == (f"target config: rope_theta = 50000.0 but {rope_key}.rope_theta = 10000.0: the RoPE base "
                                 "is given twice with different values (transformers 5 reads the rope dict's, older readers "
                                 "the top level's); set both to the model's value")
    rope["rope_theta"] = 50000  # the same value (an int here): accepted
    cfg = Eagle3Config.from_target_config(raw, 32000, [1, 29, 57])
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling["factor"] == 64.0 and "rope_theta" not in cfg.rope_scaling


def test_hf_dict_roundtrip():
    for rope in ROPES:
        cfg = make_config(rope)
        back = Eagle3Config.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())))
        assert back == Eagle3Config(**{**cfg.__dict__, "target_num_layers": 0})
    with pytest.raises(ValueError, match="architectures"):
        Eagle3Config.from_hf_dict({**make_config().to_hf_dict(), "architectures": ["LlamaForCausalLM"]})


def test_forward_ttt_gradients_fast_equal_reference():
    config = make_config("yarn", kv_heads=1)
    draft = make_draft(config, seed=18)
    aux, ids = random_inputs(config, 2, 13, seed=19)
    weights = torch.randn(4, 2, 13, config.draft_vocab_size, generator=torch.Generator().manual_seed(20))
    grads = {}
    for attention in ("reference", "fast"):
        draft.zero_grad()
        normed = draft.forward_ttt(aux, ids, 4, attention=attention)
        sum((draft.logits(h) * w).sum() for h, w in zip(normed, weights)).backward()
        grads[attention] = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in grads["fast"], "embed_tokens is frozen"
    for name, g in grads["reference"].items():
        # Sums over thousands of fp32 terms in different orders: compare relative to the norm.
        err = (grads["fast"][name] - g).norm() / g.norm()
        assert err < 1e-5, f"{name}: relative gradient error {err:.2e} (norm {g.norm():.3e})"


def _ttt_grads(draft, aux, ids, steps, weights, **kwargs):
    """(normed outputs, gradients by name) of a fixed linear function of every step's logits."""
    draft.zero_grad()
    normed = draft.forward_ttt(aux, ids, steps, **kwargs)
    sum((draft.logits(h) * w).sum() for h, w in zip(normed, weights)).backward()
    return [h.detach() for h in normed], {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpoint", ["step", "selective", "selective_all", ("selective", "none", "step", "selective"),
                                        "selective*2+step+selective_all"])
@pytest.mark.parametrize("attention", ["merged", "sdpa"])
def test_forward_ttt_checkpoint_modes_equal_no_checkpoint(checkpoint, attention):
    """Activation checkpointing changes memory, not numbers: outputs and gradients match the
    un-checkpointed plain-reference-attention run (GQA, odd T, batch 2, 4 steps)."""
    config = make_config("llama3", kv_heads=2)
    draft = make_draft(config, seed=21)
    aux, ids = random_inputs(config, 2, 11, seed=22)
    weights = torch.randn(4, 2, 11, config.draft_vocab_size, generator=torch.Generator().manual_seed(23))
    ref_out, ref_grads = _ttt_grads(draft, aux, ids, 4, weights, attention="reference")
    out, grads = _ttt_grads(draft, aux, ids, 4, weights, attention=attention, checkpoint=checkpoint)
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for name, g in ref_grads.items():
        err = (grads[name] - g).norm() / g.norm()
        assert err < 1e-5, f"{checkpoint}/{attention} {name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("checkpoint", ["none", "step", "selective", ("selective_all", "none", "step", "selective")])
def test_fused_weight_grads_equal_autograd_accumulation(checkpoint, monkeypatch):
    """Fused weight gradients through Eagle3Draft.midlayer_linear (train/weight_grads.py: each
    midlayer matmul's weight gradient added into .grad in its backward) give the reference run's
    outputs and every parameter's gradient, under each
    checkpoint mode (the recomputed forward must not add twice): 7 matmuls x 4 steps, each
    weight gradient added by the fused path exactly once."""
    from eagleforge.train import weight_grads as grad_accum

    config = make_config("llama3", kv_heads=2)
    draft = make_draft(config, seed=31)
    aux, ids = random_inputs(config, 2, 13, seed=32)
    weights = torch.randn(4, 2, 13, config.draft_vocab_size, generator=torch.Generator().manual_seed(33))
    ref_out, ref_grads = _ttt_grads(draft, aux, ids, 4, weights, attention="reference")
    calls = []
    original = grad_accum.accumulate_weight_grad
    monkeypatch.setattr(grad_accum, "accumulate_weight_grad", lambda w, *a: (calls.append(w), original(w, *a)))
    grad_accum.fuse_weight_grads(draft)
    out, grads = _ttt_grads(draft, aux, ids, 4, weights, attention="merged", checkpoint=checkpoint)
    assert len(calls) == 7 * 4, len(calls)
    assert {id(w) for w in calls} == {id(m.weight) for m in draft.midlayer.modules() if isinstance(m, torch.nn.Linear)}
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        err = (grads[name] - g).norm() / g.norm()
        assert err < 1e-5, f"fused {checkpoint} {name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulating_linear_matches_linear(dtype):
    """Three calls on one weight (odd shapes, a gradient already in .grad, a frozen weight, an
    input without grad): dx as F.linear's, W.grad = old + the sum of the three dW."""
    from eagleforge.train.weight_grads import accumulating_linear

    g = torch.Generator().manual_seed(7)
    w = torch.randn(13, 29, generator=g).to(dtype).requires_grad_()
    xs = [torch.randn(2, n, 29, generator=g).to(dtype).requires_grad_() for n in (5, 1, 7)]
    ups = [torch.randn(2, n, 13, generator=g).to(dtype) for n in (5, 1, 7)]
    old = torch.randn(13, 29, generator=g).to(dtype)
    ref_w = w.detach().clone().requires_grad_()
    ref_xs = [x.detach().clone().requires_grad_() for x in xs]
    sum((torch.nn.functional.linear(x, ref_w) * u).sum() for x, u in zip(ref_xs, ups)).backward()
    w.grad = old.clone()
    sum((accumulating_linear(x, w) * u).sum() for x, u in zip(xs, ups)).backward()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}
    for x, rx in zip(xs, ref_xs):
        torch.testing.assert_close(x.grad, rx.grad, **tol)
    torch.testing.assert_close(w.grad.float(), (old.float() + ref_w.grad.float()), **tol)
    frozen = w.detach()
    y = accumulating_linear(xs[0], frozen)
    y.sum().backward()  # no weight gradient asked: nothing added anywhere
    assert frozen.grad is None
    with pytest.raises(ValueError, match="dtype"):
        accumulating_linear(xs[0].float(), w.double())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast to torch.bfloat16"):
        accumulating_linear(xs[0].float(), w.detach().float())  # fp32 masters under autocast: refused


def test_accumulating_linear_under_autocast_matches_linear():
    """bf16 weight, fp32 input under bf16 autocast (the trainer with bf16 parameters; the shards'
    states may come in fp32): the same output and gradients as F.linear under the same autocast,
    and the input's gradient in the input's dtype."""
    from eagleforge.train.weight_grads import accumulating_linear

    g = torch.Generator().manual_seed(11)
    w = torch.randn(9, 17, generator=g).bfloat16().requires_grad_()
    x = torch.randn(3, 5, 17, generator=g).requires_grad_()
    up = torch.randn(3, 5, 9, generator=g)
    ref_w, ref_x = w.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.linear(ref_x, ref_w)
        out = accumulating_linear(x, w)
    (ref.float() * up).sum().backward()
    (out.float() * up).sum().backward()
    assert out.dtype == ref.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)


def test_selective_policy_saves_the_wide_matmuls_only():
    """The policy keeps matmuls whose inner dimension exceeds H (q/k/v from 2H, o_proj from
    heads*D > H, down from the intermediate) and recomputes gate/up (inner dim H)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from eagleforge.draft.checkpointing import selective_policy

    policy = selective_policy(40, save_all_matmuls=False)
    mm = torch.ops.aten.mm.default
    assert policy(None, mm, torch.empty(3, 80), torch.empty(80, 40)) == CheckpointPolicy.MUST_SAVE  # qkv from 2H
    assert policy(None, mm, torch.empty(3, 40), torch.empty(40, 72)) == CheckpointPolicy.PREFER_RECOMPUTE  # gate/up
    assert policy(None, mm, torch.empty(3, 72), torch.empty(72, 40)) == CheckpointPolicy.MUST_SAVE  # down
    assert policy(None, torch.ops.aten.mul.Tensor, torch.empty(3), torch.empty(3)) == CheckpointPolicy.PREFER_RECOMPUTE
    assert selective_policy(40, True)(None, mm, torch.empty(3, 40), torch.empty(40, 72)) == CheckpointPolicy.MUST_SAVE
    with pytest.raises(ValueError, match="checkpoint"):
        make_draft(make_config()).forward_ttt(*random_inputs(make_config(), 1, 5, seed=1), 2, checkpoint="some")
    with pytest.raises(ValueError, match=r"\(2 steps\).*got 1 steps"):
        make_draft(make_config()).forward_ttt(*random_inputs(make_config(), 1, 5, seed=1), 2, checkpoint=["step"])


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint,variant", [("none", None), ("selective", None), ("selective", "all")])
def test_forward_ttt_compiled_equals_eager(checkpoint, variant, compiled):
    """compile=True (inductor on the CPU) gives the eager outputs and gradients: once with the
    compiled layer pieces, once with the compiled selectively-checkpointed step, once more so
    with every variant switch on (norm_before_residual's compiled norm)."""
    config = make_config("default", kv_heads=2, **VARIANTS.get(variant, {}))
    draft = make_draft(config, seed=24)
    aux, ids = random_inputs(config, 1, 9, seed=25)
    weights = torch.randn(3, 1, 9, config.draft_vocab_size, generator=torch.Generator().manual_seed(26))
    _assert_matches_reference(draft, aux, ids, weights, f"compiled {checkpoint}", checkpoint=checkpoint, compile=True)


def _assert_matches_reference(draft, aux, ids, weights, what: str, **options) -> None:
    """3 TTT steps with merged attention and `options` against the reference attention, eager:
    outputs within 1e-4 and every parameter's gradient within 1e-4 relative."""
    ref_out, ref_grads = _ttt_grads(draft, aux, ids, 3, weights, attention="reference")
    out, grads = _ttt_grads(draft, aux, ids, 3, weights, attention="merged", **options)
    for a, b in zip(out, ref_out):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for name, g in ref_grads.items():
        err = (grads[name] - g).norm() / g.norm()
        assert err < 1e-4, f"{what} {name}: relative gradient error {err:.2e}"


@pytest.mark.slow
def test_forward_ttt_dynamic_compile_one_graph_for_every_length(compiled):
    """compile="dynamic" (the trainer's: its batches vary in length) equals eager at two
    sequence lengths, and the second length compiles no new graph; a bad value is refused."""
    from torch._dynamo.utils import counters

    config = make_config("default", kv_heads=2)
    draft = make_draft(config, seed=27)
    graphs = []
    for t in (9, 14):
        aux, ids = random_inputs(config, 2, t, seed=t)
        weights = torch.randn(3, 2, t, config.draft_vocab_size, generator=torch.Generator().manual_seed(t))
        _assert_matches_reference(draft, aux, ids, weights, f"dynamic T={t}", compile="dynamic")
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0], f"graphs after each length: {graphs}"
    aux, ids = random_inputs(config, 1, 5, seed=1)
    with pytest.raises(ValueError, match="compile must be one of"):
        draft.forward_ttt(aux, ids, 2, compile="static")


def test_checkpoint_modes_per_step_forms_and_errors():
    from eagleforge.modes import checkpoint_modes

    assert checkpoint_modes("selective_all", 3) == ["selective_all"] * 3
    assert checkpoint_modes("selective*3+selective_all*4", 7) == ["selective"] * 3 + ["selective_all"] * 4
    assert checkpoint_modes(["none", "step"], 2) == ["none", "step"]
    assert checkpoint_modes("selective*7", 7) == ["selective"] * 7
    assert checkpoint_modes("selective *3 + selective_all*4", 7) == ["selective"] * 3 + ["selective_all"] * 4
    for spec, steps, what in (("selective*3+selective_all*3", 7, "got 6 steps"), ("selective*2+fast*1", 3, "unknown"),
                              ("selective*0+step*2", 2, "MODE\\*N"), ("bogus", 2, "unknown")):
        with pytest.raises(ValueError, match=what):
            checkpoint_modes(spec, steps)

