"""Kill-and-resume in the CUDA default's precision, on the CPU: train.param_dtype=bfloat16 with
train.bf16=true (bf16 weights and gradients, an int16 master remainder per weight that makes it an
exact fp32 master, fp32 moments: train/optimizer.py; bf16 autocast), the target and the shards in
bf16. `python -m eagleforge.train` is SIGKILLed mid-run and started again: its losses, export and
final checkpoint (weights, master remainders, moments, step counts) equal an uninterrupted run's
bit for bit. The uninterrupted run is run twice first (a fresh process, and the test's own) and
the two are equal the same way: the CPU's bf16 path is deterministic (one thread, the same batches
in the same order), so nothing less than equality is taken. The offline pipeline: a tiny random
Llama target (hf backend) -> extract -> vocab -> train."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_online import _new_run, _samples, _train_overrides
from tiny_runs import sigkill_at_checkpoint, write_tiny_llama

from eagleforge.config import load_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "soak"))
import soak  # noqa: E402 - the soak's comparison of a checkpoint's tensors in their own dtypes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPAWN_TIMEOUT_S = 300
BF16 = ("target.dtype=bfloat16", "extract.storage_dtype=bfloat16", "train.param_dtype=bfloat16", "train.bf16=true")
# 18 training samples of 8-40 tokens in batches of 120 tokens, 2 per step: 3 steps an epoch, 15 in
# all; a checkpoint every 2 steps (the last two kept), the kill right after step 4's is published.
TRAIN = ("train.grad_accum=2", "train.epochs=5", "train.save_every=2", "train.keep_last=2")
KILL_AFTER = "step-000004"


def _overrides(run: Path, target: Path) -> list[str]:
    return _train_overrides(run, target, *BF16, *TRAIN)


def _copy_inputs(base: Path, run: Path) -> Path:
    shutil.rmtree(run, ignore_errors=True)
    for part in ("data", "hidden", "vocab"):
        shutil.copytree(base / part, run / part)
    return run


def _command(run: Path, target: Path) -> list[str]:
    return [sys.executable, "-m", "eagleforge.train", *_overrides(run, target)]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _train_process(run: Path, target: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(_command(run, target), env=_env(), capture_output=True, timeout=SPAWN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The inputs (extract -> vocab in bf16), two uninterrupted runs (a `python -m
    eagleforge.train` process, then train() in this one), and a `python -m eagleforge.train`
    process SIGKILLed right after its checkpoint at KILL_AFTER is published, then run again to
    the end."""
    from eagleforge.extract.driver import extract
    from eagleforge.train.loop import train
    from eagleforge.vocab import main as vocab_main

    root = tmp_path_factory.mktemp("resume_bf16")
    target = write_tiny_llama(root / "target")
    base = _new_run(root, "base", _samples(22, seed=5, vocab=211))
    cfg = load_config(None, _overrides(base, target))
    extract(cfg)
    vocab_main(cfg)
    out = {"target": target, "whole": _copy_inputs(base, root / "whole"), "again": _copy_inputs(base, root / "again")}
    _train_process(out["whole"], target)
    train(load_config(None, _overrides(out["again"], target)))  # in this process: equal to a fresh one's
    run = out["killed"] = _copy_inputs(base, root / "killed")
    process = subprocess.Popen(_command(run, target), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sigkill_at_checkpoint(process, run, KILL_AFTER, SPAWN_TIMEOUT_S)
    out["at_kill"] = {"steps": len(_log(run)), "checkpoints": sorted(p.name for p in (run / "checkpoints").glob("step-*"))}
    out["rerun"] = _train_process(run, target).stderr.decode()
    return out


def _log(run: Path) -> list[dict]:
    with open(run / "train_log.csv", newline="") as f:
        return list(csv.DictReader(f))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_same_run(got: Path, want: Path) -> dict:
    """Every step logged once with the same numbers as written (tokens/s aside), the same
    summary (timings aside), the same export files, the same checkpoints kept, and the newest
    one's every tensor bitwise in its own dtype; -> {kind and dtype: tensors compared}."""
    a, b = _log(got), _log(want)
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(b) == 15
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k != "tokens_per_s"} == {k: v for k, v in y.items() if k != "tokens_per_s"}, (x, y)
    timing = lambda summary: {k: v for k, v in summary.items() if not k.endswith("_per_s")}  # noqa: E731
    sa, sb = (json.loads((run / "train_summary.json").read_text()) for run in (got, want))
    assert timing(sa) == timing(sb)
    exported = sorted(p.name for p in (want / "draft").iterdir())
    assert sorted(p.name for p in (got / "draft").iterdir()) == exported and "model.safetensors" in exported
    for name in exported:
        assert _sha256(got / "draft" / name) == _sha256(want / "draft" / name), name
    kept = sorted(p.name for p in (want / "checkpoints").glob("step-*"))
    assert sorted(p.name for p in (got / "checkpoints").glob("step-*")) == kept
    for name in ("rng-00000.safetensors", "draft_config.json"):
        assert _sha256(got / "checkpoints" / kept[-1] / name) == _sha256(want / "checkpoints" / kept[-1] / name), name
    diffs, compared = soak.compare_final_state(got, want)
    assert not diffs, "\n".join(diffs[:12])
    return compared


def test_the_uninterrupted_bf16_run_is_deterministic(runs):
    """Two uninterrupted runs: the same steps, export and final state bit for bit, which is what
    lets the resumed run be held to equality. The state is what the CUDA default keeps: bf16
    weights, one int16 master remainder and two fp32 moments per weight."""
    compared = _assert_same_run(runs["again"], runs["whole"])
    weights = compared.get("weight bfloat16", 0)
    # fc, 7 midlayer linears, lm_head, 4 norms and 3 fc_norm norms (the default draft is EAGLE-3.1)
    assert weights == 16 and "weight float32" not in compared, compared
    assert compared.get("master remainder int16") == weights and compared.get("moment float32") == 2 * weights, compared


def test_a_sigkilled_bf16_run_resumes_to_the_uninterrupted_run_bit_for_bit(runs):
    """SIGKILL right after the checkpoint at KILL_AFTER is published (wherever the run then is: a
    step, the next checkpoint's write), then the same command again: it resumes from its last
    checkpoint, restoring the bf16 weights, their master remainders and the fp32 moments, and ends
    where the uninterrupted run ends, bit for bit."""
    at_kill = runs["at_kill"]
    assert KILL_AFTER in at_kill["checkpoints"] and at_kill["steps"] < 15, f"the kill landed too late: {at_kill}"
    assert "resumed from" in runs["rerun"], runs["rerun"][-3000:]
    compared = _assert_same_run(runs["killed"], runs["whole"])
    assert compared.get("master remainder int16") == compared.get("weight bfloat16") == 16, compared
