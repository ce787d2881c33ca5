"""The native extract stage end to end: data parallelism over tensor-parallel groups, the planner,
the loader's refusals.

A tiny Kimi-K2.5-layout checkpoint is extracted once by a single process (tp 1, pre-tokenized
JSONL read straight from data.source) and once by 4 gloo processes as 2 groups of tp 2 (the
torchrun environment variables set by hand). Every sample must be written exactly once, listed in
one manifest, with the same states, greedy tokens, ids and masks as the single process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from procs import spawn_ranks

from eagleforge.config import load_config
from eagleforge.errors import UserInputError
from eagleforge.extract.driver import extract as extract_native
from eagleforge.extract.native.loader import read_checkpoint_info
from eagleforge.extract.native.model import ModelArgs
from eagleforge.extract.native.plan import KIMI_K25_TEXT_CONFIG, check_fits, count_parameters, plan_memory
from eagleforge.shards import ShardReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # kimi_shaped: the benchmarks' Kimi-shaped model


def overrides(ckpt, run_dir, tp: int, source: str = "stdlib") -> list[str]:
    return [f"run_dir={run_dir}", f"target.path={ckpt}", "target.backend=native", f"target.tp={tp}",
            "target.expert_layout=ep", "target.dtype=float32", "target.device=cpu", "extract.aux_layers=[0,2]",
            "extract.samples_per_shard=2", "extract.batch_tokens=64", "extract.storage_dtype=float32",
            f"data.source={source}"]


def _rank_main(rank: int, world: int, args: list[str]) -> None:
    torch.set_num_threads(1)  # torchrun's environment comes from spawn_ranks; the stage joins the group itself
    extract_native(load_config(None, args))


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from test_native_fixtures import write_tiny_kimi

    path = tmp_path_factory.mktemp("kimi_tiny")
    write_tiny_kimi(path, seed=3, n_routed_experts=9)  # 9 experts over 2 ranks: 5 + 4
    return path


def make_samples(n: int = 7, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(3, 30, (1,), generator=g))
        rows.append({"id": i, "input_ids": torch.randint(0, 250, (length,), generator=g).tolist(),
                     "loss_mask": torch.randint(0, 2, (length,), generator=g).tolist()})
    return rows


def test_two_groups_of_two_equal_one_process(tiny_ckpt, tmp_path):
    samples = make_samples()
    # single process: pre-tokenized JSONL as data.source (no id field: id = line index), no data stage
    source = tmp_path / "pretokenized.jsonl"
    source.write_text("".join(json.dumps({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}) + "\n" for r in samples))
    single = tmp_path / "single"
    manifest = extract_native(load_config(None, overrides(tiny_ckpt, single, tp=1, source=str(source))))
    assert sorted(i for e in manifest["shards"] for i in e["sample_ids"]) == list(range(len(samples)))
    # 4 processes = 2 groups of tp 2, reading RUN/data/samples.jsonl
    multi = tmp_path / "multi"
    (multi / "data").mkdir(parents=True)
    (multi / "data" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    spawn_ranks(_rank_main, (overrides(tiny_ckpt, multi, tp=2),), world=4)

    hidden = multi / "hidden"
    merged = json.loads((hidden / "manifest.json").read_text())
    ids = [i for e in merged["shards"] for i in e["sample_ids"]]
    assert sorted(ids) == list(range(len(samples))), f"each sample exactly once, got {ids}"
    assert {e["group"] for e in merged["shards"]} == {0, 1}
    assert sorted(p.name for p in hidden.glob("shard-*.safetensors")) == sorted(e["file"] for e in merged["shards"])
    assert merged["target"]["architecture"] == "KimiK25ForConditionalGeneration"

    one, many = ShardReader(single / "hidden", verify_checksums=True), ShardReader(hidden, verify_checksums=True)
    position = {sample_id: k for k, sample_id in enumerate(many.sample_ids())}
    for k, sample_id in enumerate(one.sample_ids()):
        a, b = one[k], many[position[sample_id]]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.equal(a["input_ids"].long(), torch.tensor(samples[sample_id]["input_ids"]))
        assert a["aux_hidden_states"].shape == (len(samples[sample_id]["input_ids"]), 2 * 64)
        torch.testing.assert_close(b["aux_hidden_states"], a["aux_hidden_states"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b["last_hidden_state"], a["last_hidden_state"], rtol=1e-4, atol=1e-4)
        assert torch.equal(a["target_argmax"], b["target_argmax"]), f"sample {sample_id}: greedy tokens differ"


# ---------------------------------------------------------------------------- planner


def test_planner_parameter_count_matches_config_arithmetic_and_transformers():
    """1.026T for Kimi-K2.5's language model: planner = hand arithmetic = transformers' own model."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    c = KIMI_K25_TEXT_CONFIG
    counted = sum(count_parameters(ModelArgs.from_config(c)).values())
    H, L, E, heads = c["hidden_size"], c["num_hidden_layers"], c["n_routed_experts"], c["num_attention_heads"]
    attention = (H * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * heads * 192
                 + H * (512 + 64) + 512 + 512 * heads * (128 + 128) + heads * 128 * H)
    by_hand = (2 * c["vocab_size"] * H + L * (attention + 2 * H) + H + 3 * H * c["intermediate_size"]
               + (L - 1) * (E * H + E + 3 * H * 2048 * (E + 1)))
    assert counted == by_hand
    assert round(counted / 1e12, 3) == 1.026
    kwargs = {k: v for k, v in c.items() if k not in ("model_type", "scoring_func", "topk_method")}
    with torch.device("meta"):
        reference = DeepseekV3ForCausalLM(DeepseekV3Config(**kwargs))
    assert sum(p.numel() for p in reference.parameters()) + sum(
        b.numel() for n, b in reference.named_buffers() if n.endswith("e_score_correction_bias")) == counted


def test_planner_kimi_on_96gb_and_refusal():
    a = ModelArgs.from_config(KIMI_K25_TEXT_CONFIG)
    for layout in ("ep", "tp"):
        plan = plan_memory(a, 8, layout)
        # docs/kimi-k25.md: about 76 GB of weights per GPU at 8-way, routed experts 9.5 GB per layer
        assert 74e9 < plan.weights_bytes < 78e9, plan.components
        assert plan.total_bytes < 96e9
    assert plan_memory(a, 4, "ep").total_bytes > 96e9
    assert plan_memory(a, 16, "ep").total_bytes < plan_memory(a, 8, "ep").total_bytes
    cfg = load_config(None, ["target.tp=4", "target.dtype=bfloat16", "target.backend=native"])
    with pytest.raises(UserInputError, match=r"short by \d+\.\d GiB"):
        check_fits(cfg, a, True, int(96e9))
    with pytest.raises(ValueError, match="num_attention_heads = 64"):
        plan_memory(a, 24, "ep")


def test_planner_activations_follow_the_attention_kernel():
    """bf16 runs the fused attention in one call (no [T, T] scores): the activation estimate grows
    linearly in T; fp32 runs the math kernel in query chunks, so its scores term is bounded by
    the chunk: quadratic only up to ATTENTION_CHUNK_TOKENS, then linear."""
    from eagleforge.extract.native.model import ATTENTION_CHUNK_TOKENS

    a = ModelArgs.from_config(KIMI_K25_TEXT_CONFIG)

    def act(T, b):
        return plan_memory(a, 8, "ep", dtype_bytes=b, batch_tokens=T, max_length=T).components["activations"]

    for T in (8192, 16384, 32768):
        assert act(2 * T, 2) <= 2 * act(T, 2), T  # linear (plus constants)
    big = 4 * ATTENTION_CHUNK_TOKENS
    heads = a.num_attention_heads // 8
    assert act(big, 4) >= ATTENTION_CHUNK_TOKENS * heads * big * 4  # the chunk's fp32 scores are counted
    assert act(2 * big, 4) <= 2 * act(big, 4)  # past the chunk linear: not [T, T] scores (4x)


def test_planner_held_states_follow_the_aux_layer_ids():
    """The states a forward holds at once: the aux outputs before a layer plus its input (unless
    the input is one of them); a count alone plans the most."""
    from eagleforge.extract.native.plan import _held_states

    a = ModelArgs.from_config({**KIMI_K25_TEXT_CONFIG, "num_hidden_layers": 4})
    assert _held_states(a, [1, 2, 3], range(1, 4)) == 2  # layer 3: outputs of 1 and 2, its input is 2's
    assert _held_states(a, [1], range(1, 4)) == 2  # layer 2 or 3: output of 1 and the input
    assert _held_states(a, [3], range(0, 1)) == 1  # the dense layer 0: only its input
    kimi = ModelArgs.from_config(KIMI_K25_TEXT_CONFIG)
    assert _held_states(kimi, [1, 29, 57], range(1, 61)) == 4 == _held_states(kimi, 3, range(1, 61))


# Activations of the extraction loop measured on H200s (benchmarks/check_plan.py, BENCHMARKS.md):
# the 4-layer Kimi-shaped bench model, aux layers [1, 2, 3], peak allocated
# minus weights, GiB, by (tp, layout, batch tokens).
MEASURED_ACTIVATIONS_GIB = {(1, "ep", 16384): 3.79, (1, "ep", 32768): 7.58, (2, "ep", 16384): 3.82,
                            (2, "ep", 32768): 7.58, (2, "tp", 16384): 3.54, (2, "tp", 32768): 7.08}


# Device memory in use after the loop (what nvidia-smi shows), with expandable segments: tp 1.
MEASURED_IN_USE_GIB = {(1, "ep", 8192): 35.52, (1, "ep", 16384): 37.52, (1, "ep", 32768): 41.72}


@pytest.mark.parametrize("key", sorted(MEASURED_IN_USE_GIB))
def test_planner_total_matches_the_h200_memory_in_use(key):
    """The planner's goal, at the size one GPU allows: weights + activations + the runtime reserve
    within 5% of the memory in use (measured +0.7% to +0.9%)."""
    from kimi_shaped import kimi_args

    tp, layout, tokens = key
    plan = plan_memory(kimi_args(4), tp, layout, batch_tokens=tokens, max_length=tokens, aux_layers=[1, 2, 3])
    assert abs(plan.total_bytes / 2**30 / MEASURED_IN_USE_GIB[key] - 1) < 0.05, plan.components


@pytest.mark.parametrize("key", sorted(MEASURED_ACTIVATIONS_GIB))
def test_planner_activations_match_the_h200_measurement(key):
    """The planner's goal is within 5% of the memory per GPU; the activation model (MoE
    phase: held states, 5 [T, H] tensors, the experts' [T*k, I] and [T*k, H] buffers) must stay
    within 3% of what the GPU measured, so a change to the forward's buffers shows here."""
    from kimi_shaped import kimi_args

    tp, layout, tokens = key
    plan = plan_memory(kimi_args(4), tp, layout, batch_tokens=tokens, max_length=tokens, aux_layers=[1, 2, 3])
    measured = MEASURED_ACTIVATIONS_GIB[key]
    assert abs(plan.components["activations"] / 2**30 / measured - 1) < 0.03, (plan.components["activations"] / 2**30, measured)


@pytest.mark.parametrize("layers,experts,tp", [(61, 384, 8), (12, 384, 8), (4, 384, 2), (4, 100, 8), (5, 384, 16)])
@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_planner_weights_equal_the_built_model_on_every_rank(layers, experts, tp, layout):
    """The memory check at sizes no test machine holds: the planner's weight bytes per GPU
    against the bytes of the parameters and buffers the native model builds on each rank (meta
    tensors, no memory): Kimi-K2.5 at tp 8 and 16, the Kimi-shaped 12- and 4-layer bench models,
    and 100 experts over 8 ranks (uneven: the planner must plan for the fullest rank)."""
    from eagleforge.extract.native.model import DeepseekV3ForExtraction
    from eagleforge.extract.native.parallel import TensorParallel

    args = ModelArgs.from_config({**KIMI_K25_TEXT_CONFIG, "num_hidden_layers": layers, "n_routed_experts": experts})
    plan = plan_memory(args, tp, layout)
    built = []
    for rank in range(tp):
        with torch.device("meta"):
            model = DeepseekV3ForExtraction(args, TensorParallel(size=tp, rank=rank), layout, torch.bfloat16, True)
        built.append(sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]))
    assert abs(plan.weights_bytes - max(built)) <= 1e-4 * max(built), (plan.components, built)
    if layout == "ep" and experts % tp:
        assert min(built) < max(built)  # uneven expert ranges: the ranks differ, the plan takes the fullest


# ---------------------------------------------------------------------------- loader refusals


def _edit_config(path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def test_loader_refuses_unsupported_quantization_and_names_bad_tensors(tiny_ckpt, tmp_path):
    import shutil

    from eagleforge.extract.native.loader import build_model, load_weights
    from eagleforge.extract.native.parallel import TensorParallel

    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    _edit_config(bad, lambda c: c["text_config"]["quantization_config"].update(quant_method="fp8"))
    with pytest.raises(ValueError, match="quant_method = 'fp8' is not supported"):
        read_checkpoint_info(bad)
    _edit_config(bad, lambda c: c["text_config"]["quantization_config"].update(quant_method="compressed-tensors"))
    _edit_config(bad, lambda c: c["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8))
    with pytest.raises(ValueError, match="config_groups.group_0"):
        read_checkpoint_info(bad)
    _edit_config(bad, lambda c: c["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=4))
    _edit_config(bad, lambda c: c["text_config"].update(kv_lora_rank=64))  # config disagrees with the weights
    info = read_checkpoint_info(bad)
    model = build_model(info, TensorParallel(), "ep", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"tensor language_model\.model\.layers\.0\.self_attn\.kv_a_proj_with_mqa\.weight has shape"):
        load_weights(model, info, show_progress=False)
    _edit_config(bad, lambda c: c["text_config"].update(scoring_func="softmax"))
    with pytest.raises(ValueError, match="scoring_func = 'softmax' is not supported"):
        read_checkpoint_info(bad)


def test_loader_reads_plain_deepseek_layout(tmp_path):
    """Un-prefixed names and a plain deepseek_v3 config (DeepSeek-V3 / Kimi-K2 style) load too."""
    from test_native_fixtures import write_tiny_kimi

    write_tiny_kimi(tmp_path, seed=5, prefix="", wrapper=False, num_hidden_layers=2)
    info = read_checkpoint_info(tmp_path)
    assert info.prefix == "" and info.quantized_experts and info.args.num_hidden_layers == 2


# ---------------------------------------------------------------------------- bad and overlong rows


def test_pretokenized_source_rows_checked_and_cut_to_max_length(tiny_ckpt, tmp_path):
    """data.source read directly (no data stage): rows longer than data.max_length are cut (the
    manifest's max_length holds), a token id outside the vocabulary or a non-UTF-8 file is a
    UserInputError naming the file, before any weight is read."""
    rows = make_samples(n=3, seed=4)
    source = tmp_path / "pretokenized.jsonl"
    source.write_text("".join(json.dumps({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}) + "\n" for r in rows))
    manifest = extract_native(load_config(None, overrides(tiny_ckpt, tmp_path / "cut", tp=1, source=str(source))
                                          + ["data.max_length=6"]))
    reader = ShardReader(tmp_path / "cut" / "hidden")
    assert manifest["max_length"] == 6 and reader.sample_lengths() == [min(6, len(r["input_ids"])) for r in rows]
    assert [reader[i]["input_ids"].tolist() for i in range(3)] == [r["input_ids"][:6] for r in rows]

    vocab = read_checkpoint_info(tiny_ckpt).args.vocab_size
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, vocab]}) + "\n")
    with pytest.raises(UserInputError, match=rf"bad.jsonl: sample 0: token id {vocab} is not in the target's vocabulary"):
        extract_native(load_config(None, overrides(tiny_ckpt, tmp_path / "bad", tp=1, source=str(bad))))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"input_ids": [1, 2], "note": "caf\xe9"}\n')
    with pytest.raises(UserInputError, match="latin.jsonl: not UTF-8"):
        extract_native(load_config(None, overrides(tiny_ckpt, tmp_path / "latin", tp=1, source=str(latin))))


def test_native_resume_refuses_changed_data_under_the_same_ids(tiny_ckpt, tmp_path):
    """The native backend's resume keys on the samples' content, as the hf backend's: a data
    source with the same ids and other tokens is refused naming the shard, never reused."""
    rows = make_samples(n=4, seed=7)
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    samples = run / "data" / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = overrides(tiny_ckpt, run, tp=1)
    first = extract_native(load_config(None, args))
    assert extract_native(load_config(None, args))["shards"] == first["shards"]  # unchanged: resumed, nothing redone
    rows[3]["input_ids"] = [(t + 1) % 250 for t in rows[3]["input_ids"]]  # chunk 1 (2 per shard), same id and length
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserInputError, match=rf"{first['shards'][1]['file']}: made from other samples than chunk 1"):
        extract_native(load_config(None, args))


@pytest.mark.parametrize("user_var", [None, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_expandable_segments_only_where_the_user_set_no_allocator_config(monkeypatch, user_var):
    """The native backend asks for expandable segments, but never over a configuration the user
    gave under any of the names torch reads."""
    from eagleforge.layout import ALLOC_CONF_VARS, use_expandable_segments

    for name in ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    if user_var:
        monkeypatch.setenv(user_var, "max_split_size_mb:512")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert use_expandable_segments() is (user_var is None)
    if user_var:
        assert os.environ[user_var] == "max_split_size_mb:512"  # untouched
        assert user_var == "PYTORCH_CUDA_ALLOC_CONF" or "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    else:
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
