"""A GPU out of memory in the extract or train stage is one line: the stage, the batch-size key to
lower with its value, and what the memory plan counted. The OOM is faked on the CPU (raised by
the forward that would run out), on every path a user reaches: extraction with the hf and the
native backend, the draft's training step, and online training's target forward."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_vocab import build_tiny_run
from tiny_runs import configure, write_tiny_llama

from eagleforge.cli import run_main
from eagleforge.config import load_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _raise_oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def stage_error_line(capsys, main) -> str:
    """Run `main(cfg)` through run_main as a stage does; its stderr, which must be one error line."""
    with pytest.raises(SystemExit) as exit_:
        run_main(main, "a stage", argv=[])
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "%|" not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_extract_hf(tmp_path, monkeypatch, capsys):
    from eagleforge.extract.driver import extract
    from eagleforge.target.hf import HFTarget

    target = write_tiny_llama(tmp_path / "tiny-llama")
    (tmp_path / "run" / "data").mkdir(parents=True)
    (tmp_path / "run" / "data" / "samples.jsonl").write_text(json.dumps({"id": 0, "input_ids": [5, 6, 7], "loss_mask": [1, 1, 1]}))
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"target.path={target}", "target.device=cpu", "extract.batch_tokens=777"])
    monkeypatch.setattr(HFTarget, "forward", _raise_oom)
    line = stage_error_line(capsys, lambda _: extract(cfg))
    assert line == ("error: extract: out of GPU memory on cpu at extract.batch_tokens=777 (no memory plan covers this path); "
                    "lower extract.batch_tokens (`make plan` prints the plan for the native backend and online training)")


def test_extract_native_names_the_plan(tmp_path, monkeypatch, capsys):
    from test_native_fixtures import write_tiny_kimi

    from eagleforge.extract.driver import extract
    from eagleforge.extract.native.target import NativeTarget

    write_tiny_kimi(tmp_path / "kimi", seed=1)
    source = tmp_path / "ids.jsonl"
    source.write_text(json.dumps({"input_ids": [3, 4, 5, 6]}) + "\n")
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"target.path={tmp_path / 'kimi'}", "target.backend=native",
                             "target.device=cpu", "target.dtype=float32", "extract.aux_layers=[0,1]", f"data.source={source}",
                             "target.gpu_memory_gib=80", "extract.batch_tokens=96"])
    monkeypatch.setattr(NativeTarget, "forward", _raise_oom)
    line = stage_error_line(capsys, lambda _: extract(cfg))
    assert re.fullmatch(r"error: extract: out of GPU memory on cpu at extract.batch_tokens=96 \(the memory plan counted "
                        r"\d+\.\d GiB per GPU at this size\); lower extract.batch_tokens .*", line), line


def test_train_step(tmp_path, tiny_llama_config, monkeypatch, capsys):
    from eagleforge.train.loop import Trainer, train
    from eagleforge.vocab import main as vocab_main

    cfg, _, _ = build_tiny_run(tmp_path, tiny_llama_config, n_samples=10, with_argmax=True)
    configure(cfg, device="cpu", batch_tokens=123, holdout_samples=2)
    vocab_main(cfg)
    monkeypatch.setattr(Trainer, "batch_loss", _raise_oom)
    line = stage_error_line(capsys, lambda _: train(cfg))
    assert line.startswith("error: train: out of GPU memory on cpu at train.batch_tokens=123 (no memory plan covers this path); "
                           "lower train.batch_tokens"), line


def test_online_target_forward(tmp_path, monkeypatch, capsys):
    from eagleforge.train.loop import train
    from eagleforge.train.online import OnlineSource

    target = write_tiny_llama(tmp_path / "tiny-llama")
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    (run / "data" / "samples.jsonl").write_text("".join(
        json.dumps({"id": i, "input_ids": torch.randint(3, 211, (12,), generator=g).tolist(), "loss_mask": [1] * 12}) + "\n"
        for i in range(8)))
    cfg = configure(load_config(None, [f"run_dir={run}", f"target.path={target}", "target.device=cpu", "train.device=cpu",
                                       "target.dtype=float32", "train.source=online",
                                       "extract.batch_tokens=55"]), holdout_samples=2, epochs=1)
    monkeypatch.setattr(OnlineSource, "load", _raise_oom)  # in line, on the training thread (the feed's get)
    line = stage_error_line(capsys, lambda _: train(cfg))
    assert line.startswith("error: train (the online target's forward): out of GPU memory on cpu at extract.batch_tokens=55 "
                           "(no memory plan covers this path); lower extract.batch_tokens"), line
