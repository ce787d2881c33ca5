"""Online training (train.source=online) under faults: a corrupt or truncated cache shard that a
later epoch reads, the disk filling while the cache is written, a target forward that yields
NaN/Inf for one sample, and a resume with another train.cache_gb. Each is one line or survived;
none trains on bad states. The target is a tiny random Llama (hf backend), one process."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from test_out_of_memory import stage_error_line
from test_train_online import _assert_same_losses, _losses, _new_run, _samples, _train_overrides
from tiny_runs import write_tiny_llama

from eagleforge.config import load_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CACHE = "train.cache_gb=0.0002"  # about half of the first epoch (the two-rank online test's figure)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The target, 22 samples, and an uninterrupted online run with the cache (2 epochs)."""
    from eagleforge.train.loop import train

    root = tmp_path_factory.mktemp("online_faults")
    target = write_tiny_llama(root / "target")
    rows = _samples(22, seed=4, vocab=211)
    whole = _new_run(root, "whole", rows)
    train(load_config(None, _train_overrides(whole, target, "train.source=online", CACHE)))
    return {"root": root, "target": target, "rows": rows, "whole": whole}


def _cfg(setup, run, *extra):
    return load_config(None, _train_overrides(run, setup["target"], "train.source=online", "train.save_every=2", *extra))


def _epoch_steps(cfg) -> int:
    from eagleforge.train.schedule import make_batches
    from eagleforge.vocab import training_sample_count

    lengths = [len(r["input_ids"]) for r in json.loads("[" + ",".join(
        (cfg.run / "data" / "samples.jsonl").read_text().splitlines()) + "]")]
    n_train = training_sample_count(len(lengths), cfg.train.holdout_samples, "samples")
    return len(make_batches(lengths, list(range(n_train)), cfg.train.batch_tokens, cfg.train.seed, 0))


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_cache_shard_is_refused_by_name_when_a_later_epoch_needs_it(setup, damage, capsys):
    from eagleforge.train.loop import train

    run = _new_run(setup["root"], f"damaged_{damage}", setup["rows"])
    cfg = _cfg(setup, run, CACHE)
    train(cfg, stop_after_step=_epoch_steps(cfg))  # the first epoch, its cache written
    shard = sorted((run / "hidden").glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    shard.write_bytes(bytes(data))
    line = stage_error_line(capsys, lambda _: train(_cfg(setup, run, CACHE)))
    assert line.startswith(f"error: {shard}: ") and ("corrupt" if damage == "flipped" else "truncated") in line, line


def test_two_cache_shards_swapped_with_their_checksums_rewritten_are_refused_by_name(setup, capsys):
    """Two cache shards of the first epoch (of equal sample counts) swapped, the manifest's sizes
    and sha256 rewritten to match: each passes its checksum, and the resumed run trained the
    second epoch on states of other tokens (exit 0). Every cached row is now checked against its
    sample's input_ids when it is read: one line naming the shard."""
    from eagleforge.shards import file_sha256
    from eagleforge.train.loop import train

    run = _new_run(setup["root"], "swapped", setup["rows"])
    whole_epoch = "train.cache_gb=0.01"  # its 5 batches hold 2, 3, 5, 3 and 5 samples
    cfg = _cfg(setup, run, whole_epoch)
    train(cfg, stop_after_step=_epoch_steps(cfg))
    manifest_file = run / "hidden" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    by_count: dict[int, list[dict]] = {}
    for entry in manifest["shards"]:
        by_count.setdefault(entry["samples"], []).append(entry)
    a, b = next(entries for entries in by_count.values() if len(entries) > 1)[:2]
    data_a, data_b = (run / "hidden" / a["file"]).read_bytes(), (run / "hidden" / b["file"]).read_bytes()
    (run / "hidden" / a["file"]).write_bytes(data_b)
    (run / "hidden" / b["file"]).write_bytes(data_a)
    for entry in (a, b):
        entry["bytes"], entry["sha256"] = (run / "hidden" / entry["file"]).stat().st_size, file_sha256(run / "hidden" / entry["file"])
    manifest_file.write_text(json.dumps(manifest))
    line = stage_error_line(capsys, lambda _: train(_cfg(setup, run, whole_epoch)))
    assert line.startswith(f"error: {run / 'hidden'}/") and "are of other tokens than the sample's" in line, line
    assert any(f"/{entry['file']}: the cached states of sample" in line for entry in (a, b)), line


def test_a_cache_of_other_samples_under_the_same_ids_is_refused_before_it_is_used(setup, capsys):
    """A fresh online run whose RUN/hidden holds the cache of a run on other samples with the same
    ids: the first epoch took those shards for its own (same ids, so "complete") and the second
    trained on their states (exit 0). The shards' recorded content sha256 refuses the first one
    the first epoch would keep."""
    import shutil

    from eagleforge.train.loop import train

    changed = [{**row, "input_ids": [3 + (t - 2) % 208 for t in row["input_ids"]]} for row in setup["rows"]]
    run = _new_run(setup["root"], "stale_cache", changed)
    shutil.copytree(setup["whole"] / "hidden", run / "hidden")
    line = stage_error_line(capsys, lambda _: train(_cfg(setup, run, CACHE)))
    assert line.startswith(f"error: {run / 'hidden'}/shard-") and "made from other samples" in line, line
    assert not list((run / "checkpoints").glob("step-*"))


def test_a_resume_after_the_samples_changed_under_the_same_ids_is_refused_at_its_start(setup, capsys):
    """samples.jsonl made again with other tokens under the same ids after the first epoch: the
    resumed run read the first epoch's cached states for samples they do not belong to, and
    trained on them (exit 0). The checkpoint's fingerprint of the samples refuses the resume."""
    from eagleforge.train.loop import train

    run = _new_run(setup["root"], "changed_samples", setup["rows"])
    cfg = _cfg(setup, run, CACHE)
    train(cfg, stop_after_step=_epoch_steps(cfg))
    [ckpt] = sorted((run / "checkpoints").glob("step-*"))[-1:]
    changed = [{**row, "input_ids": [3 + (t - 2) % 208 for t in row["input_ids"]]} for row in setup["rows"]]  # same lengths
    (run / "data" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed))
    line = stage_error_line(capsys, lambda _: train(_cfg(setup, run, CACHE)))
    assert line.startswith(f"error: {ckpt}: trained on other inputs than this run's: {run / 'data' / 'samples.jsonl'} (sha256 "), line
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*"))[-1] == ckpt.name


def test_disk_full_while_the_cache_is_written_stops_with_one_line_and_resumes_with_a_smaller_cache(setup, capsys, monkeypatch):
    """The fourth cache shard finds the disk full: one line naming it, training stopped cleanly
    (its last checkpoint kept). Resumed with train.cache_gb=0 (no cache), the run finishes with
    the uninterrupted run's losses (the cache changes which states are read, not their values)."""
    import safetensors.torch

    from eagleforge.train.loop import train

    run = _new_run(setup["root"], "disk_full", setup["rows"])
    save_file, written = safetensors.torch.save_file, []

    def fills_up(tensors, filename, *args, **kwargs):
        if "shard-" in os.path.basename(filename):
            if len(written) >= 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written.append(filename)
        return save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", fills_up)
    line = stage_error_line(capsys, lambda _: train(_cfg(setup, run, "train.cache_gb=0.001")))  # most of the first epoch
    assert "cannot write, no space left on device (errno ENOSPC" in line and "/hidden/shard-" in line, line
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")), "no checkpoint kept"
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    train(_cfg(setup, run, "train.cache_gb=0"))
    _assert_same_losses(run, setup["whole"], rel=1e-5)


@pytest.mark.parametrize("resumed_with", ["train.cache_gb=0.0001", "train.cache_gb=0", "train.cache_gb=0.001"])
def test_a_resume_with_another_cache_size_keeps_what_the_cache_holds(setup, resumed_with):
    """Killed in the second epoch (after a checkpoint), resumed with a smaller, no or a larger
    cache: the uninterrupted run's losses; the larger plan does not wait for shards the first
    epoch never wrote (before: the resume was refused, the config had changed)."""
    from eagleforge.train.loop import train

    run = _new_run(setup["root"], f"resized_{resumed_with.split('=')[1]}", setup["rows"])
    cfg = _cfg(setup, run, CACHE)
    train(cfg, stop_after_step=_epoch_steps(cfg) + 2)
    train(_cfg(setup, run, resumed_with))
    _assert_same_losses(run, setup["whole"], rel=1e-5)


def test_a_target_forward_with_nan_for_one_sample_skips_it_and_counts_it(setup, monkeypatch, caplog):
    """The target's states of one training sample hold NaN (in every epoch): the sample is skipped
    (no loss row, its states never cached) and counted in train_summary.json, the run finishes with
    finite losses and no skipped step."""
    from eagleforge.target import hf
    from eagleforge.train.loop import train
    from eagleforge.train.schedule import make_batches

    run = _new_run(setup["root"], "nan_sample", setup["rows"])
    cfg = _cfg(setup, run, CACHE)
    lengths = [len(r["input_ids"]) for r in setup["rows"]]
    first = make_batches(lengths, list(range(len(lengths) - cfg.train.holdout_samples)), cfg.train.batch_tokens,
                         cfg.train.seed, 0)[0][0]  # in the first batch of epoch 0: one the cache keeps
    poisoned = setup["rows"][first]["input_ids"]
    forward = hf.forward_batch  # the packed rows of the forward's samples, in their order

    def nan_for_one(model, capture, input_ids, *args, **kwargs):
        rows = forward(model, capture, input_ids, *args, **kwargs)
        start = 0
        for ids in input_ids:
            if ids == poisoned:
                with torch.inference_mode():  # the forward's rows are inference tensors
                    rows["aux_hidden_states"][start:start + len(ids)] = float("nan")
            start += len(ids)
        return rows

    monkeypatch.setattr(hf, "forward_batch", nan_for_one)
    summary = train(cfg)
    assert summary["skipped_samples"] == 1
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in _losses(run))
    assert f"sample {first}: the target's hidden states held NaN/Inf; skipped" in caplog.text
    from eagleforge.shards import ShardReader

    reader = ShardReader(run / "hidden", verify_checksums=True)
    assert first not in reader.sample_ids() and any(first in e.get("skipped_ids", []) for e in reader.shards)
