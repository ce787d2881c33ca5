"""The online memory plan (train/online_plan.py): the draft's parameters by hand arithmetic, the
pilot config refused with its shortfall, the B300 config fitting, and the largest batch consistent
with the refusal."""

from __future__ import annotations

import pytest

from eagleforge.config import UserInputError, load_config
from eagleforge.train.online_plan import GIB, check_online_fits, plan_online


def _cfg(name: str, *extra: str):
    # target.path that does not exist here: the built-in Kimi-K2.5 config (the planner says so);
    # the pilot trains online at tp 8 (README: its pipeline stages leave the draft no room)
    layout = ["target.tp=8", "target.pp=1"] if name == "kimi_k25_pilot" else []
    return load_config(f"configs/{name}.yaml", ["train.source=online", "target.path=/nonexistent/Kimi-K2.5", *layout, *extra])


def test_draft_parameters_by_hand():
    """Kimi's draft: fc [H, 3H], q/k/v [64*128, 2H], o [H, 64*128], MLP 3 x H x 18432, lm_head
    [32000, H], 4 norms; the embedding [163840, H] frozen."""
    plan = plan_online(_cfg("kimi_k25_pilot"), world=8)
    H, heads, hd, inter, vd, vocab = 7168, 64, 128, 18432, 32000, 163840
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
    assert plan.target.total_bytes / GIB == pytest.approx(82.2, abs=0.1)  # the extraction plan of README's grid


def test_pipeline_stages_plan_their_fullest_stage_beside_the_draft():
    """Online at the pilot config's own 8 stages: every GPU holds its stage and the draft's share;
    on 96 GB cards no batch fits (README), on 141 GB ones the same layout fits a batch."""
    stages = _cfg("kimi_k25_pilot", "target.tp=1", "target.pp=8")
    plan = plan_online(stages, world=8)
    assert plan.target.pp == 8 and plan.target.total_bytes / GIB == pytest.approx(78.3, abs=0.1)  # the fullest stage
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
