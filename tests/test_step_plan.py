"""The trainer's step plan (train/step_plan.py): the draft's memory by hand arithmetic, and what
train.activation_checkpoint=auto / train.compile=auto resolve to on the CPU and on a GPU of a
given size."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from eagleforge.config import TrainConfig, load_config
from eagleforge.draft import Eagle3Draft
from eagleforge.errors import ConfigError
from eagleforge.train.step_plan import GIB, RESERVE, draft_activation_bytes_per_token, plan_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from kimi_shaped import DraftShape  # noqa: E402 - the one table of Kimi-K2.5's dimensions

KIMI = DraftShape.kimi()
H, HEADS, HD, INTER, VD, VOCAB = KIMI.hidden, KIMI.heads, KIMI.head_dim, KIMI.intermediate, KIMI.draft_vocab, KIMI.vocab


def _kimi_draft() -> Eagle3Draft:
    with torch.device("meta"):  # sizes only, no memory
        draft = Eagle3Draft(KIMI.draft_config())
    draft.embed_tokens.weight.requires_grad_(False)
    return draft


TRAINABLE = 3 * H * H + 3 * HEADS * HD * 2 * H + HEADS * HD * H + 3 * H * INTER + VD * H + 4 * H


def test_fixed_memory_by_hand():
    draft = _kimi_draft()
    bf16 = plan_step(TrainConfig(batch_tokens=8192), draft, torch.bfloat16, torch.device("cpu"))
    # bf16 weight 2 + bf16 gradient 2 + int16 master remainder 2 + fp32 moments 8 bytes per parameter
    assert list(bf16.fixed.values()) == [14 * TRAINABLE, 2 * VOCAB * H, 2 * VD * H]
    fp32 = plan_step(TrainConfig(batch_tokens=8192), draft, torch.float32, torch.device("cpu"), world=4)
    assert list(fp32.fixed.values()) == [16 * TRAINABLE // 4, 4 * VOCAB * H, 4 * VD * H]


def test_auto_on_the_cpu_is_the_plain_step():
    plan = plan_step(TrainConfig(), _kimi_draft(), torch.float32, torch.device("cpu"))
    assert (plan.activation_checkpoint, plan.compile) == ("none", False)


# The slopes by hand (KiB and GiB per token of the Kimi draft, 7 TTT steps): bench-train's measured
# selective_all (22.3 GiB at 8K, 62.7 at 32K), selective 0.37 GiB per 1K less (measured), and the
# CPU count of benchmarks/draft_activation_memory.py: selective_all 1904.8 KiB, step 1135.0,
# step*m+selective_all*(7-m) 1904.8 - 148.26 m down to step's.
S_ALL = (62.7 - 22.3) * 2**30 / (32768 - 8192)
S_SEL = S_ALL - 0.37 * 2**30 / 1024
RERUN = (1904.8 - 1163.5) / 5 * 1024  # bytes per token each rerun step saves
S_STEP = S_ALL - (1904.8 - 1135.0) * 1024


def test_slopes_by_hand():
    assert draft_activation_bytes_per_token(H, 7, "selective_all") == pytest.approx(S_ALL)
    assert draft_activation_bytes_per_token(H, 7, "selective") == pytest.approx(S_SEL)
    assert draft_activation_bytes_per_token(H, 7, "step") == pytest.approx(S_STEP)
    assert S_STEP / 1024 == pytest.approx(953.9, abs=0.1)  # KiB per token: 7.45 GiB at 8K
    for m in range(1, 6):
        mode = f"step*{m}+selective_all*{7 - m}"
        assert draft_activation_bytes_per_token(H, 7, mode) == pytest.approx(S_ALL - m * RERUN), mode
    assert draft_activation_bytes_per_token(H, 7, "step*6+selective_all*1") == pytest.approx(S_STEP)  # capped at step's
    # half the hidden size and 14 steps: the same per hidden x steps, the rerun saving per step by hidden only
    assert draft_activation_bytes_per_token(H // 2, 14, "step*2+selective_all*12") == pytest.approx(S_ALL - RERUN)
    for mode in ("none", "selective*3+selective_all*4", "selective_all*3+step*4"):
        with pytest.raises(ValueError, match="no activation slope"):
            draft_activation_bytes_per_token(H, 7, mode)


def test_candidates_ordered_by_recompute_by_hand():
    """The modes auto chooses from, by the matmul FLOPs each recomputes: a rerun step a third of
    its own forward + backward; selective the gate/up GEMMs of every step."""
    from eagleforge.train.step_plan import checkpoint_candidates

    forward = 2 * H * (HEADS * HD + 2 * HEADS * HD) + HEADS * HD * H + 3 * H * INTER  # MACs per token of one TTT step
    selective = 2 * H * INTER / (3 * forward)
    assert selective == pytest.approx(0.10909, abs=1e-5)
    got = checkpoint_candidates(_kimi_draft().config, 7)
    want = [("selective_all", 0.0), ("step*1+selective_all*6", 1 / 21), ("step*2+selective_all*5", 2 / 21),
            ("selective", selective), ("step*3+selective_all*4", 3 / 21), ("step*4+selective_all*3", 4 / 21),
            ("step*5+selective_all*2", 5 / 21), ("step*6+selective_all*1", 6 / 21), ("step", 1 / 3)]
    assert [m for m, _ in got] == [m for m, _ in want]
    assert [c for _, c in got] == pytest.approx([c for _, c in want])


def test_auto_on_a_gpu_picks_the_least_recompute_that_fits(caplog):
    """The first candidate whose activations fit the GPU's memory less the reserve and the fixed
    states; step with a warning when none does. The edges computed by hand from the slopes."""
    draft = _kimi_draft()
    fixed = 14 * TRAINABLE + 2 * VOCAB * H + 2 * VD * H
    gpu = int(141e9)
    room = gpu * (1 - RESERVE) - fixed
    edges = [("selective_all", S_ALL), ("step*1+selective_all*6", S_ALL - RERUN), ("step*2+selective_all*5", S_ALL - 2 * RERUN),
             ("selective", S_SEL), ("step*3+selective_all*4", S_ALL - 3 * RERUN), ("step*4+selective_all*3", S_ALL - 4 * RERUN),
             ("step*5+selective_all*2", S_ALL - 5 * RERUN), ("step*6+selective_all*1", S_STEP)]
    cuda = torch.device("cuda")
    cases = [(32768, "selective_all")]
    for (mode, slope), (_, next_slope) in zip(edges, edges[1:] + [("step", 0.0)]):
        edge = int(room // slope)
        if edge > cases[-1][0]:
            cases += [(edge, mode)]
            if next_slope and int(room // next_slope) > edge:
                cases += [(edge + 1, edges[edges.index((mode, slope)) + 1][0])]
    cases += [(int(room // S_STEP) + 1, "step")]
    for tokens, mode in cases:
        with caplog.at_level(logging.WARNING, logger="eagleforge.train.step_plan"):
            caplog.clear()
            plan = plan_step(TrainConfig(batch_tokens=tokens, ttt_steps=7), draft, torch.bfloat16, cuda, gpu_bytes=gpu)
        assert (plan.activation_checkpoint, plan.compile) == (mode, True), tokens
        assert ("does not fit" in caplog.text) == (tokens > room // S_STEP), tokens
    assert plan_step(TrainConfig(batch_tokens=32768, ttt_steps=7), draft, torch.bfloat16, cuda,
                     gpu_bytes=gpu).total_bytes / GIB < 0.9 * gpu / GIB  # 32K tokens on an H200: planned to fit
    # another plan's choice (online training's) stands in for auto
    assert plan_step(TrainConfig(batch_tokens=8192, ttt_steps=7), draft, torch.bfloat16, cuda, gpu_bytes=gpu,
                     planned_mode="step*5+selective_all*2").activation_checkpoint == "step*5+selective_all*2"


def test_explicit_settings_are_kept():
    tc = TrainConfig(activation_checkpoint="selective*3+step*4", compile=False, ttt_steps=7, batch_tokens=10**6)
    plan = plan_step(tc, _kimi_draft(), torch.bfloat16, torch.device("cuda"), gpu_bytes=int(80e9))
    assert (plan.activation_checkpoint, plan.compile) == ("selective*3+step*4", False)


def test_compile_key_takes_auto_and_booleans_only():
    assert load_config(None, ["train.compile=true"]).train.compile is True
    assert load_config(None, ["train.compile=auto"]).train.compile == "auto"
    assert load_config(None, []).train.activation_checkpoint == "auto"
    with pytest.raises(ConfigError, match=r"train.compile' must be one of \[auto, true, false\], got 'dynamic'"):
        load_config(None, ["train.compile=dynamic"])
    with pytest.raises(ConfigError, match="train.activation_checkpoint' must be one of"):
        load_config(None, ["train.activation_checkpoint=sometimes"])
