"""The online memory plan (train/online_plan.py) against hand arithmetic: every line of the
pilot's fullest stage at pp 8 (written out below from the buffers the code holds, not from the
planner's formulas), the checkpoint mode auto picks, the stages cut by memory where the cut by
compute does not fit (tp 2 x pp 4), the cut against brute force, the refusal with the batch
that fits, and the feed's worker."""

from __future__ import annotations

import itertools
import random

import pytest

from eagleforge.config import load_config
from eagleforge.errors import UserInputError
from eagleforge.extract.native.model import ModelArgs
from eagleforge.extract.native.plan import KIMI_K25_TEXT_CONFIG, cut_stages, plan_memory
from eagleforge.train.online_plan import GIB, check_online_fits, plan_online

H, HEADS, HD, INTER, VD, VOCAB, K = 7168, 64, 128, 18432, 32000, 163840, 3
# the default draft is EAGLE-3.1: 4 norms of H and a norm of Ht = H per aux state before fc (fc_norm)
TRAINABLE = 3 * H * H + 3 * HEADS * HD * 2 * H + HEADS * HD * H + 3 * H * INTER + VD * H + 4 * H + 3 * H
ROW = (K + 1) * H * 2 + 4  # one token's rows as the last stage sends them: aux + last in bf16, an int32 greedy token
PADDED = (K + 1) * H * 2 + 8 + 8 + 1  # one token of a Batch: the states, input id and greedy token int64, mask bool
# the draft's activations per token (tests/test_step_plan.py writes the same numbers out)
S_ALL = (62.7 - 22.3) * 2**30 / (32768 - 8192)
RERUN = (1904.8 - 1163.5) / 5 * 1024
GPU = 96e9  # the pilot's RTX PRO 6000


def _cfg(name: str, *extra: str):
    # target.path that does not exist here: the built-in Kimi-K2.5 config (the planner says so)
    return load_config(f"configs/{name}.yaml", ["train.source=online", "target.path=/nonexistent/Kimi-K2.5", *extra])


def _line(stage, name: str) -> float:
    lines = [line for line in stage.held if line.name.startswith(name)]
    lines += [line for phase in stage.phases.values() for line in phase if line.name.startswith(name)]
    assert len(lines) == 1, (name, [line.name for line in lines])
    return lines[0]


# ---- Kimi-K2.5's resident target by hand (docs/kimi-k25.md's config, the one table of
# benchmarks/kimi_shaped.py; extract/native/plan.py's docstrings say what each term holds). H 7168,
# 64 heads (qk 128 + 64 rope, v 128), q_lora 1536, kv_lora 512, 61 layers (layer 0 dense, 18432 wide;
# 60 MoE: 384 experts 2048 wide, 8 routed + 1 shared a token, a router of 384 x H bf16 + 384 fp32
# biases), vocabulary 163840, bf16 (2 bytes).
H, HEADS, Q_LORA, KV_LORA = (KIMI_K25_TEXT_CONFIG[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank"))
NOPE, ROPE, V = (KIMI_K25_TEXT_CONFIG[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
LAYERS, DENSE, VOCAB = (KIMI_K25_TEXT_CONFIG[k] for k in ("num_hidden_layers", "intermediate_size", "vocab_size"))
E, MOE, TOPK = (KIMI_K25_TEXT_CONFIG[k] for k in ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok"))
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


def test_draft_parameters_by_hand():
    """Kimi's draft: fc [H, 3H], q/k/v [64*128, 2H], o [H, 64*128], MLP 3 x H x 18432, lm_head
    [32000, H], 4 norms; the embedding [163840, H] frozen, on the host beside pipeline stages."""
    plan = plan_online(_cfg("kimi_k25_pilot"), world=8)
    stage = plan.stages[4]
    # bf16 parameters (auto on CUDA): weight, gradient, int16 master remainder 2 bytes each, fp32 moments 8; / 8 ranks
    assert _line(stage, "weights + grads + AdamW state").at(0) == 14 * TRAINABLE // 8
    assert _line(stage, "frozen embedding [V, H] (on the host)").at(0) == 0
    assert _line(stage, "teacher head").at(0) == 2 * VD * H
    fp32 = plan_online(_cfg("kimi_k25_pilot", "train.param_dtype=float32", "train.embed_device=device"), world=8).stages[4]
    assert _line(fp32, "weights + grads + AdamW state").at(0) == 16 * TRAINABLE // 8
    assert _line(fp32, "frozen embedding [V, H]").at(0) == 4 * VOCAB * H
    assert _line(fp32, "then gathered weights / reduce-scatter copy (4 bytes)").at(0) == 4 * TRAINABLE  # an fp32 reduce


def test_the_pilot_at_pp8_line_by_line():
    """configs/kimi_k25_pilot.yaml online on 96 GB cards: 8 stages (8, 8, 8, 8, 8, 8, 8, 5
    layers), 8192 tokens per rank, every line of the fullest stage (layers 32-39, eight MoE
    layers) and the leader's own, by hand; auto picks step*5+selective_all*2 (step*4 is short)."""
    cfg = _cfg("kimi_k25_pilot")
    assert (cfg.target.tp, cfg.target.pp, cfg.train.batch_tokens, cfg.extract.batch_tokens) == (1, 8, 8192, 8192)
    plan = plan_online(cfg, world=8, gpu_bytes=GPU)
    t, T, p = 8192, 8192, TRAINABLE
    assert [len(r) for r in plan.ranges] == [8, 8, 8, 8, 8, 8, 8, 5]
    stage = plan.stages[4]
    assert plan.fullest is stage and stage.target.layers == range(32, 40)
    a = ModelArgs.from_config(KIMI_K25_TEXT_CONFIG)
    target = plan_memory(a, 1, "ep", True, 2, T, 2048, [1, 29, 57], range(32, 40), 4, 8)  # the extraction plan's stage
    activations = target.components["activations"]
    reserve = 2**30 + 2**30 + int(0.10 * activations)  # context, NCCL, the allocator's cache over the activations
    message = (1 + 2) * T * H * 2  # hidden + the 2 aux states captured before layer 32 (1, 29), [T, 3H] bf16
    weights = target.total_bytes - activations - reserve - (message + 2 * message)
    held = {
        "target weights": weights,
        "target pipeline buffers": message + message,  # the next receive posted ahead, one send in flight
        "target runtime reserve": reserve,
        "weights + grads + AdamW state": 14 * p // 8,
        "frozen embedding [V, H] (on the host)": 0,
        "teacher head": 2 * VD * H,
    }
    for name, value in held.items():
        assert _line(stage, name).at(t) == pytest.approx(value, abs=1), name
    slope = S_ALL - 5 * RERUN  # step*5+selective_all*2
    phases = {
        "forward": activations + message + t * ROW,  # the second send, this rank's rows arriving
        "making the batch": t * (2 * ROW + 17),  # received + unpacked rows, then unpacked + padded
        "gather": 4 * p,  # the all-gather output and the gathered bf16 weights
        "step": 2 * p + 1.10 * slope * t,  # gathered weights, activations (incl. the batch), the allocator's 10%
        "end of the backward": 2 * p + 2 * p + t * PADDED,  # bf16 grads, then gathered weights / a bf16 reduce copy, the batch
    }
    got = stage.phase_bytes(t)
    for name, value in phases.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name
    total = sum(held.values()) + max(phases.values())
    assert plan.checkpoint == "step*5+selective_all*2" and stage.peak_phase(t) == "step"
    assert plan.total_bytes() == pytest.approx(total, abs=2) and total <= GPU  # fits 96 GB
    assert total / GIB == pytest.approx(88.97, abs=0.01)
    # one rerun step fewer does not fit (the stage holds eight MoE layers in every cut of 61 layers in 8 stages)
    assert total + 1.10 * RERUN * t > GPU
    assert plan.max_batch_tokens(GPU) == 8192  # 9216 tokens are short
    # the leader: rows of two forwards in flight to the earlier stages, none arriving
    leader = plan.stages[7]
    assert _line(leader, "rows in flight to earlier stages").at(t) == 2 * T * ROW
    assert [line.name for line in leader.phases["forward"]] == ["target activations (its largest phase of one forward)"]
    check_online_fits(cfg, int(GPU), 8)  # the trainer's check passes


def test_stages_cut_by_memory_where_the_cut_by_compute_does_not_fit():
    """tp 2 x pp 4 on 96 GB: the cut by compute (16, 16, 16, 13: the head's cost on the last
    stage) leaves the stages of sixteen MoE layers over the card beside the draft; the plan cuts
    16, 15, 15, 15 (the first stage's layer 0 is the small dense one; the last stage, with the
    head and the rows it sends, has room for two layers more), where every stage fits, the most
    balanced such cut."""
    cfg = _cfg("kimi_k25_pilot", "target.tp=2", "target.pp=4")
    plan = plan_online(cfg, world=8, gpu_bytes=GPU)
    assert [len(r) for r in plan.ranges] == [16, 15, 15, 15]
    assert all(stage.total_bytes(8192) <= GPU for stage in plan.stages)
    by_compute = plan_online(cfg, world=8)  # no size: the cut by compute, the same mode
    assert [len(r) for r in by_compute.ranges] == [16, 16, 16, 13]
    from eagleforge.train.online_plan import _Planner

    planner = _Planner(cfg, 8)
    assert planner.stage(range(16, 32), 1, plan.checkpoint).total_bytes(8192) > GPU  # sixteen MoE layers
    assert planner.stage(range(48, 61), 3, plan.checkpoint).total_bytes(8192) <= GPU


@pytest.mark.parametrize("trial", range(20))
def test_cut_by_memory_is_the_best_balance_among_the_cuts_that_fit(trial):
    """cut_stages with a memory condition against brute force over every cut: the smallest
    largest-stage cost among the cuts whose every stage fits (sizes per layer, a stage's extra
    bytes by position, a budget), None when none fits."""
    rng = random.Random(2000 + trial)
    n = rng.randint(2, 10)
    pp = rng.randint(1, n)
    costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
    sizes = [rng.uniform(1.0, 3.0) for _ in range(n)]
    extra = [rng.uniform(0.0, 3.0) for _ in range(pp)]
    budget = rng.uniform(max(sizes) + max(extra), sum(sizes) / pp * 1.6 + max(extra))
    fits = lambda start, stop, stage: sum(sizes[start:stop]) + extra[stage] <= budget  # noqa: E731
    best = None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = [0, *cuts, n]
        if all(fits(a, b, s) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))):
            value = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
            best = value if best is None else min(best, value)
    ranges = cut_stages(costs, pp, 0.0, fits)
    if best is None:
        assert ranges is None
        return
    assert [i for r in ranges for i in r] == list(range(n))
    assert all(fits(r.start, r.stop, s) for s, r in enumerate(ranges))
    assert max(sum(costs[i] for i in r) for r in ranges) == pytest.approx(best, rel=1e-9)


def test_refused_with_the_shortfall_and_the_batch_that_fits():
    """16K tokens per rank do not fit the pilot at pp 8 on 96 GB (the plan's stretch): refused,
    naming the stage, the mode and the batch that fits; the B300 config fits its own batch."""
    with pytest.raises(UserInputError, match=r"target.tp = 1, target.pp = 8, train.batch_tokens = 16384: needs .* \(stage \d of 8\)"
                                              r".* short by \d+\.\d GiB; train.batch_tokens <= \d+ fits"):
        check_online_fits(_cfg("kimi_k25_pilot", "train.batch_tokens=16384"), int(GPU), 8)
    b300 = _cfg("kimi_k25_b300")
    plan = check_online_fits(b300, int(288e9), 8)
    assert plan.total_bytes() <= 288e9 and plan.max_batch_tokens(288e9) >= b300.train.batch_tokens
    # the B300 config's extraction plan (make plan: 82.2 GiB), by hand: tp 8, ep layout, bf16, INT4 experts,
    # extract.batch_tokens 32768, aux layers 1, 29, 57
    assert plan.target.total_bytes == B300_TARGET_BYTES, (plan.target.components, B300_TARGET_BYTES)
    assert plan.target.total_bytes / GIB == pytest.approx(82.2, abs=0.1)


def test_largest_batch_is_the_edge_of_the_refusal():
    """On a 141 GB GPU the pilot layout fits up to some batch: that batch passes, 1024 more is refused."""
    cfg = _cfg("kimi_k25_pilot", "train.activation_checkpoint=selective_all")
    best = plan_online(cfg, world=8, gpu_bytes=141e9).max_batch_tokens(141e9)
    assert best > 16384
    check_online_fits(_cfg("kimi_k25_pilot", "train.activation_checkpoint=selective_all", f"train.batch_tokens={best}"),
                      int(141e9), 8)
    with pytest.raises(UserInputError, match=f"train.batch_tokens <= {best} fits"):
        check_online_fits(_cfg("kimi_k25_pilot", "train.activation_checkpoint=selective_all",
                               f"train.batch_tokens={best + 1024}"), int(141e9), 8)


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
    """benchmarks/bench_online.py --tiny (CPU) runs all three modes and reports the ratio and the plan;
    --stage runs the pipeline-online path of one stage."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_online.py"
    spec = importlib.util.spec_from_file_location("bench_online", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--tiny", "--steps", "2", "--warmup", "1"])
    assert result["online_tokens_per_s"] > 0 and result["ratio_to_serial"] > 0 and result["plan_gib"] > 0
    # --stage: one middle pipeline stage online (its link in process, rows arriving, host embedding rows)
    stage = bench.main(["--tiny", "--stage", "2", "--steps", "2", "--warmup", "1"])
    assert stage["stage_tokens_per_s"] > 0 and stage["draft_tokens_per_s"] > 0 and stage["plan_gib"] > 0


def test_online_projection_by_hand():
    """A group's online tokens/s: the target's forwards of the group's batches, then each GPU's draft
    step on its own, in turn: per token 1 / target + (1 + recompute) / (gpus x draft rate), the
    draft's rate bench-train's 11822 tokens/s on an H200 (751 TFLOP/s) scaled by the matmul rate."""
    from eagleforge.train.online_plan import project_online

    draft = 11822 * 500 / 751 / (1 + 5 / 21)  # step*5+selective_all*2 reruns 5 of 7 steps' forwards
    assert project_online(35974.0, 8, 500.0, 5 / 21) == pytest.approx(1 / (1 / 35974 + 1 / (8 * draft)))


def test_auto_layout_is_the_fastest_split_that_fits():
    """target.layout=auto online: of the 4 splits of 8 GPUs, pp 8 on the 96 GB card (fastest by the
    stated rates, and it fits); on an 88 GiB card pp 8 does not fit even rerunning every step, and
    tp 2 x pp 4 is chosen, the line saying which fit; extraction alone picks pp 8."""
    from eagleforge.extract.native.preflight import choose_extract_layout
    from eagleforge.train.online_plan import choose_online_layout

    cfg = _cfg("kimi_k25_pilot")
    assert cfg.target.layout == "auto"
    tp, pp, line = choose_online_layout(cfg, GPU, 8)
    assert (tp, pp) == (1, 8)
    assert line.startswith("layout: target.tp=1 target.pp=8 (target.layout=auto: the fastest of the 4 splits of 8 GPUs")
    assert "step*5+selective_all*2" in line and "tp 8 x pp 1" in line and "does not fit" not in line
    tp, pp, line = choose_online_layout(cfg, 88 * GIB, 8)
    assert (tp, pp) == (2, 4) and "tp 1 x pp 8" in line and "(does not fit)" in line
    assert plan_online(_cfg("kimi_k25_pilot", "train.activation_checkpoint=step"), world=8,
                       gpu_bytes=88 * GIB).total_bytes() > 88 * GIB
    assert choose_extract_layout(cfg, GPU)[:2] == (1, 8)
    from eagleforge.errors import ConfigError

    with pytest.raises(ConfigError, match="target.layout"):
        load_config(None, ["target.layout=auto"])  # the hf backend has no tp x pp to choose
