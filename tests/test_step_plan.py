"""The trainer's step plan (train/step_plan.py): the draft's memory by hand arithmetic, and what
train.activation_checkpoint=auto / train.compile=auto resolve to on the CPU and on a GPU of a
given size."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from eagleforge.config import ConfigError, TrainConfig, load_config
from eagleforge.draft import Eagle3Draft
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


def test_auto_on_a_gpu_picks_the_fastest_mode_that_fits(caplog):
    """selective_all while it fits in the GPU's memory less the reserve, then selective, then step
    (with a warning); the edges computed by hand from the measured peaks."""
    draft = _kimi_draft()
    fixed = 14 * TRAINABLE + 2 * VOCAB * H + 2 * VD * H
    gpu = int(141e9)
    usable = gpu * (1 - RESERVE)
    # bench-train's peaks of this Kimi-shaped draft (hidden 7168, 7 TTT steps) with selective_all,
    # measured 2026-11-30 (BENCHMARKS.md's history): 22.3 GiB at 8192 tokens, 62.7 at 32768,
    # so 40.4 GiB per 24576 tokens; selective keeps 0.37 GiB less per 1024 tokens (docs/training.md)
    per_all = (62.7 - 22.3) * GIB / (32768 - 8192)  # ~1.77 MB per token
    per_sel = per_all - 0.37 * GIB / 1024
    assert per_sel < per_all
    assert [draft_activation_bytes_per_token(H, 7, m) for m in ("selective_all", "selective")] == pytest.approx([per_all, per_sel], rel=1e-12)
    edge_all, edge_sel = int((usable - fixed) // per_all), int((usable - fixed) // per_sel)
    cuda = torch.device("cuda")
    for tokens, mode in ((32768, "selective_all"), (edge_all, "selective_all"), (edge_all + 1, "selective"),
                         (edge_sel, "selective"), (edge_sel + 1, "step")):
        with caplog.at_level(logging.WARNING, logger="eagleforge.train.step_plan"):
            caplog.clear()
            plan = plan_step(TrainConfig(batch_tokens=tokens, ttt_steps=7), draft, torch.bfloat16, cuda, gpu_bytes=gpu)
        assert (plan.activation_checkpoint, plan.compile) == (mode, True), tokens
        assert ("does not fit" in caplog.text) == (mode == "step")
    assert plan_step(TrainConfig(batch_tokens=32768, ttt_steps=7), draft, torch.bfloat16, cuda,
                     gpu_bytes=gpu).total_bytes / GIB < 0.9 * gpu / GIB  # 32K tokens on an H200: planned to fit


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
