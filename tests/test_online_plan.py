"""The online memory plan (train/online_plan.py): the draft's parameters by hand arithmetic, the
pilot config refused with its shortfall, the B300 config fitting, and the largest batch consistent
with the refusal."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagleforge.config import UserInputError, load_config
from eagleforge.train.online_plan import GIB, check_online_fits, plan_online

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from kimi_shaped import KIMI_K25_TEXT, DraftShape  # noqa: E402 - the one table of Kimi-K2.5's dimensions


def _cfg(name: str, *extra: str):
    # target.path that does not exist here: the built-in Kimi-K2.5 config (the planner says so);
    # the pilot trains online at tp 8 (README: its pipeline stages leave the draft no room)
    layout = ["target.tp=8", "target.pp=1"] if name == "kimi_k25_pilot" else []
    return load_config(f"configs/{name}.yaml", ["train.source=online", "target.path=/nonexistent/Kimi-K2.5", *layout, *extra])


# ---- Kimi-K2.5's resident target by hand (docs/kimi-k25.md's config, the one table of
# benchmarks/kimi_shaped.py; extract/native/plan.py's docstrings say what each term holds). H 7168,
# 64 heads (qk 128 + 64 rope, v 128), q_lora 1536, kv_lora 512, 61 layers (layer 0 dense, 18432 wide;
# 60 MoE: 384 experts 2048 wide, 8 routed + 1 shared a token, a router of 384 x H bf16 + 384 fp32
# biases), vocabulary 163840, bf16 (2 bytes).
H, HEADS, Q_LORA, KV_LORA = (KIMI_K25_TEXT[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank"))
NOPE, ROPE, V = (KIMI_K25_TEXT[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
LAYERS, DENSE, VOCAB = (KIMI_K25_TEXT[k] for k in ("num_hidden_layers", "intermediate_size", "vocab_size"))
E, MOE, TOPK = (KIMI_K25_TEXT[k] for k in ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok"))
QK = NOPE + ROPE


def _int4(rows, cols):  # packed nibbles, one bf16 scale per 32 input columns, the int64 [2] shape
    return rows * cols // 2 + rows * (cols // 32) * 2 + 16


EXPERT = 2 * _int4(MOE, H) + _int4(H, MOE)  # gate, up [2048, H]; down [H, 2048]: 24,772,656 bytes
REPLICATED_ATTENTION = H * Q_LORA + Q_LORA + H * (KV_LORA + ROPE) + KV_LORA + 2 * H  # q_a, its norm, kv_a, its norm, 2 layer norms


def _split_attention(heads):  # q_b, kv_b, o_proj for this rank's heads
    return heads * QK * Q_LORA + KV_LORA * heads * (NOPE + V) + heads * V * H


def _reserve(ranks, activations):  # context 1 GiB, NCCL 1 GiB (several ranks), 10% of the activations' peak
    return (1 << 30) + (1 << 30 if ranks > 1 else 0) + int(0.10 * activations)


# tp 8, whole model, T = 32768 tokens a forward: rank 0 holds vocabulary rows 0-20479, 48 experts a
# MoE layer, 8 heads, 1/8 of the dense and shared MLPs
_T, TP = 32768, 8
_NH = _T * H * 2  # one [T, H] bf16 state
_B300_ACTIVATIONS = max(
    # MoE, the peak: 4 states held (aux 1, 29, 57 and the input of layer 60) + 5 more, the 8 slots'
    # [8T, 2048 + H] and their 20 bytes of routing each
    4 * _NH + 5 * _NH + TOPK * _T * (MOE + H) * 2 + TOPK * _T * 20,  # 9,064,939,520
    4 * _NH + 2 * _NH + _T * (Q_LORA + KV_LORA + ROPE) * 2 + _T * (HEADS // TP) * (3 * QK + NOPE + V + V) * 2
    + _T * (HEADS // TP) * 4,  # attention: 3,461,349,376
    1 * _NH + 2 * _NH + 4 * _T * (DENSE // TP) * 2,  # the dense MLP of layer 0: 2,013,265,920
    8 * _NH,  # the end: the aux states, the final norm, their packed copies: 3,758,096,384
)
B300_TARGET_BYTES = (
    2 * (VOCAB // TP) * H * 2  # embedding and lm_head rows
    + LAYERS * (REPLICATED_ATTENTION + _split_attention(HEADS // TP)) * 2
    + 1 * 3 * H * (DENSE // TP) * 2  # dense MLP
    + (LAYERS - 1) * E * (H * 2 + 4)  # router
    + (LAYERS - 1) * 3 * H * (MOE // TP) * 2  # shared expert
    + (LAYERS - 1) * (E // TP) * EXPERT  # routed experts, INT4
    + _B300_ACTIVATIONS + _reserve(8, _B300_ACTIVATIONS)
)  # 88,301,634,560 bytes = 82.24 GiB

# pp 8, tp 1, stage 4 (layers 32-39, all MoE), T = 8192: every head and expert, no embedding or head;
# aux 1 and 29 arrive from earlier stages and leave with this one's output
_T8 = 8192
_NH8 = _T8 * H * 2
_STAGE_ACTIVATIONS = max(
    3 * _NH8 + 5 * _NH8 + TOPK * _T8 * (MOE + H) * 2 + TOPK * _T8 * 20,  # MoE (2 aux + the input): 2,148,794,368
    3 * _NH8 + 2 * _NH8 + _T8 * (Q_LORA + KV_LORA + ROPE) * 2 + _T8 * HEADS * (3 * QK + NOPE + V + V) * 2
    + _T8 * HEADS * 4,  # attention: 1,630,535,680
)
PILOT_STAGE_BYTES = (
    8 * (REPLICATED_ATTENTION + _split_attention(HEADS)) * 2
    + 8 * E * (H * 2 + 4)  # router
    + 8 * 3 * H * MOE * 2  # shared expert
    + 8 * E * EXPERT  # routed experts, INT4
    + _STAGE_ACTIVATIONS
    + (1 + 2) * _NH8 + 2 * (1 + 2) * _NH8  # the next receive posted ahead, 2 sends in flight: hidden + 2 aux rows each
    + _reserve(8, _STAGE_ACTIVATIONS)
)  # 84,036,631,756 bytes = 78.27 GiB


def test_draft_parameters_by_hand():
    """Kimi's draft: fc [H, 3H], q/k/v [64*128, 2H], o [H, 64*128], MLP 3 x H x 18432, lm_head
    [32000, H], 4 norms; the embedding [163840, H] frozen."""
    plan = plan_online(_cfg("kimi_k25_pilot"), world=8)
    s = DraftShape.kimi()
    H, heads, hd, inter, vd, vocab = s.hidden, s.heads, s.head_dim, s.intermediate, s.draft_vocab, s.vocab
    trainable = 3 * H * H + 3 * heads * hd * 2 * H + heads * hd * H + 3 * H * inter + vd * H + 4 * H
    assert plan.gathered == 2 * trainable and plan.grads == 6 * trainable
    # bf16 parameters (auto on CUDA): weight, gradient, int16 master remainder 2 bytes each, fp32 moments 8; / 8 ranks
    assert list(plan.fixed.values()) == [14 * trainable // 8, 2 * vocab * H, 2 * vd * H]
    fp32 = plan_online(_cfg("kimi_k25_pilot", "train.param_dtype=float32"), world=8)
    assert list(fp32.fixed.values()) == [16 * trainable // 8, 4 * vocab * H, 4 * vd * H]


def test_pilot_refused_with_the_shortfall_and_b300_fits():
    pilot = _cfg("kimi_k25_pilot")  # bf16 parameters: a smaller batch per rank fits
    best = plan_online(pilot, world=8).max_batch_tokens(96e9)
    assert 0 < best < pilot.train.batch_tokens
    with pytest.raises(UserInputError, match=rf"short by \d+\.\d GiB; train.batch_tokens <= {best} fits"):
        check_online_fits(pilot, int(96e9), 8)
    with pytest.raises(UserInputError, match=r"short by \d+\.\d GiB; no train.batch_tokens fits"):
        check_online_fits(_cfg("kimi_k25_pilot", "train.param_dtype=float32"), int(96e9), 8)
    b300 = _cfg("kimi_k25_b300")
    plan = check_online_fits(b300, int(288e9), 8)
    assert plan.total_bytes() <= 288e9 and plan.max_batch_tokens(288e9) >= b300.train.batch_tokens
    # the extraction plan of README's grid (82.2 GiB), by hand: tp 8, ep layout, bf16, INT4 experts,
    # extract.batch_tokens 32768, aux layers 1, 29, 57
    assert plan.target.total_bytes == B300_TARGET_BYTES, (plan.target.components, B300_TARGET_BYTES)
    assert plan.target.total_bytes / GIB == pytest.approx(82.2, abs=0.1)


def test_pipeline_stages_plan_their_fullest_stage_beside_the_draft():
    """Online at the pilot config's own 8 stages: every GPU holds its stage and the draft's share;
    on 96 GB cards no batch fits (README), on 141 GB ones the same layout fits a batch."""
    stages = _cfg("kimi_k25_pilot", "target.tp=1", "target.pp=8")
    plan = plan_online(stages, world=8)
    # the fullest stage: 8 MoE layers, 32-39 (the cut itself is tested against brute force in
    # test_pipeline.py), with its bytes by hand
    assert plan.target.pp == 8 and plan.target.layers == range(32, 40)
    assert plan.target.total_bytes == PILOT_STAGE_BYTES, (plan.target.components, PILOT_STAGE_BYTES)
    assert plan.target.total_bytes / GIB == pytest.approx(78.3, abs=0.1)
    assert any("rows arriving from the last stage (7 slots ahead)" in name for name in plan.in_flight_per_token)
    with pytest.raises(UserInputError, match=r"target.tp = 1, target.pp = 8, .* no train.batch_tokens fits"):
        check_online_fits(stages, int(96e9), 8)
    assert plan.max_batch_tokens(141e9) > 0


def test_largest_batch_is_the_edge_of_the_refusal():
    """On a 141 GB GPU the pilot layout fits up to some batch: that batch passes, 1024 more is refused."""
    best = plan_online(_cfg("kimi_k25_pilot"), world=8).max_batch_tokens(141e9)
    assert best > 0
    check_online_fits(_cfg("kimi_k25_pilot", f"train.batch_tokens={best}"), int(141e9), 8)
    with pytest.raises(UserInputError, match=f"train.batch_tokens <= {best} fits"):
        check_online_fits(_cfg("kimi_k25_pilot", f"train.batch_tokens={best + 1024}"), int(141e9), 8)


def test_prefetcher_keeps_order_and_hands_errors_to_the_consumer():
    """The producer thread's results come in item order through the bounded queue, and an error
    in a forward reaches the training thread as an exception (never a hang)."""
    import torch

    from eagleforge.train.prefetch import Prefetcher

    seen = []
    prefetcher = Prefetcher(lambda i: (seen.append(i) or i * 10), list(range(5)), 2, torch.device("cpu"))
    assert [prefetcher.get() for _ in range(5)] == [(i, i * 10) for i in range(5)]
    prefetcher.close()
    assert seen == list(range(5))

    def failing(i):
        if i == 1:
            raise ValueError("target forward broke")
        return i

    prefetcher = Prefetcher(failing, [0, 1, 2], 1, torch.device("cpu"), what="the online target forward")
    assert prefetcher.get() == (0, 0)
    with pytest.raises(RuntimeError, match="online target forward failed") as err:
        prefetcher.get()
    assert isinstance(err.value.__cause__, ValueError)
    prefetcher.close()


def test_bench_online_runs_on_tiny_shapes():
    """benchmarks/bench_online.py --tiny (CPU) runs all three modes and reports the ratio and the plan."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_online.py"
    spec = importlib.util.spec_from_file_location("bench_online", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--tiny", "--steps", "2", "--warmup", "1"])
    assert result["online_tokens_per_s"] > 0 and result["ratio_to_serial"] > 0 and result["plan_gib"] > 0
