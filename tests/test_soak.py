"""The kill-and-resume soak, short version (tests/soak/soak.py; `make soak` runs the long one with
hundreds of random kills): each stage of a tiny run SIGKILLed at a few chosen moments, among them
the write phases (a file-system point: right before or after a shard's, a checkpoint's, the
cache's, the export's fsync or rename, half-way through removing an old checkpoint), rerun to the
end, and its outputs compared with an uninterrupted run's: shards, samples, vocab and export by
sha256, train_log.csv every step once with the same numbers, the final checkpoint's tensors bitwise
in their own dtypes (fp32 weights; in the bf16 trial bf16 weights, their int16 master remainders
and fp32 moments), nothing left behind, no process left running."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "soak"))
import soak  # noqa: E402

TRIAL_SEED = 20240917

# Per stage, the kill moments of one trial, taken in turn (each on the rerun after the one before,
# so each comes later in the stage's work than the last): file-system points of the uninterrupted
# run, by a regular expression over their description (soak.fs_point: digits as N), a random match
# ("fs:"), the first ("fs-first:") or the last ("fs-last:").
SHORT = {
    "data": ["fs:after fsync data/conversations.jsonl"],
    "extract": ["fs-first:before replace hidden/.tmp-shard", "fs-last:after replace hidden/.tmp-shard"],
    "vocab": ["fs:before replace vocab/.tmp-target_head"],
    # step 2's checkpoint half removed as step 6's is published, then step 8's publish
    "train": ["fs-first:after unlink checkpoints/.pruned-step-N/__", "fs-last:before replace checkpoints/.tmp-step-N -> checkpoints/step-N"],
    # the first cached batch's shard renamed, its manifest not yet; then the last checkpoint's index
    "online": ["fs-first:after replace hidden/.tmp-shard", "fs-last:before rename checkpoints/.tmp-step-N/.metadata.tmp"],
    "train2": ["fs-first:after fsync checkpoints/.tmp-step-N/__N_N.distcp \\(rank 1\\)"],
    # the first results.json written, the plots not yet
    "eval": ["fs-first:after replace eval/.tmp-results"],
}


@pytest.fixture(scope="module")
def short_soak(tmp_path_factory):
    out = tmp_path_factory.mktemp("soak")
    runner = soak.Soak(out, seed=TRIAL_SEED, spawn=False, log=print)
    soak.make_target(out / "target")
    yield runner
    runner.close()


def _check(trial: dict, planned: int) -> None:
    assert trial["ok"], json.dumps(trial["problems"], indent=1)[:4000]
    assert trial["kills"] == planned, f"{planned - trial['kills']} kill(s) never landed: {trial}"


@pytest.mark.parametrize("stage", list(SHORT))
def test_a_killed_stage_reruns_to_the_uninterrupted_outputs(short_soak, stage):
    _check(short_soak.trial(stage, TRIAL_SEED, len(SHORT[stage]), SHORT[stage]), len(SHORT[stage]))


# The CUDA default's precision on the CPU (soak.py --set ... for every stage): bf16 weights, each
# with an int16 master remainder (the exact fp32 master), fp32 moments (train/optimizer.py).
BF16 = ("train.param_dtype=bfloat16", "train.bf16=true")


def test_a_killed_bf16_training_reruns_to_the_uninterrupted_state(short_soak):
    """Killed right after its first checkpoint is published (the rerun restores step 2's weights,
    remainders and moments), then with the last checkpoint's shard written but not yet published
    (the rerun resumes from step 6 and steps again): the same files, and the final checkpoint's
    bf16 weights, int16 remainders and fp32 moments bit for bit (two uninterrupted runs first: the
    CPU's bf16 path is deterministic, so nothing less than equality is taken)."""
    cover = ["fs-first:after replace checkpoints/.tmp-step-N -> checkpoints/step-N",
             "fs-last:after fsync checkpoints/.tmp-step-N/__N_N.distcp"]
    short_soak.check_reference("train", BF16)
    assert not short_soak.failures, json.dumps(short_soak.failures, indent=1)[:4000]
    ref = short_soak.reference("train", BF16).run
    _, compared = soak.compare_final_state(ref, ref)
    assert compared.get("weight bfloat16", 0) > 0 and compared.get("master remainder int16") == compared["weight bfloat16"], compared
    assert "weight float32" not in compared and compared.get("moment float32") == 2 * compared["weight bfloat16"], compared
    _check(short_soak.trial("train", TRIAL_SEED, len(cover), cover, overrides=BF16), len(cover))


# Three moments that once left files behind (RELIABILITY.md, "Kill-and-resume soak").

def test_a_kill_during_the_export_leaves_nothing_behind(short_soak):
    # the new export written, not yet swapped in: the rerun's export removes the dead process's directory
    _check(short_soak.trial("train", TRIAL_SEED, 1, ["fs-last:after fsync \\.tmp-draft-\\S*/model\\.safetensors"]), 1)


def test_a_kill_while_the_last_checkpoint_prunes_an_old_one_leaves_nothing_behind(short_soak):
    # half-way through removing step 6 as step 8 is published: the rerun resumes at step 8, saves nothing,
    # and still finds no half-removed checkpoint, nor a third one where keep_last is 2
    _check(short_soak.trial("train", TRIAL_SEED, 1, ["fs-last:after unlink checkpoints/.pruned-step-N/__"]), 1)


def test_a_kill_just_after_a_re_export_swaps_the_directories_leaves_nothing_behind(short_soak):
    import shutil

    stage, ref = soak.STAGES["train"], short_soak.reference("train")
    run = short_soak.out / "trials" / "re-export" / "run"
    shutil.rmtree(run.parent, ignore_errors=True)
    shutil.copytree(ref.run, run, symlinks=True)  # a finished run: the rerun exports again
    logfile, cache = run.parent / "stage.log", run.parent / "cache"
    # The swap is one exchange of the two names, after which the old export sits under the
    # temporary name until it is removed: killed there, RUN/draft is already the new one.
    plan = {"kind": "fs", "rank": "", "op": "unlink", "path": r"^\.tmp-draft-[A-Za-z0-9._]+-\d+/model\.safetensors$",
            "n": 1, "when": "before"}
    killed = short_soak.attempt(stage, run, cache, logfile, plan, "re-export", ref.total_steps)
    assert killed["killed"], killed
    assert (run / "draft" / "model.safetensors").is_file()
    assert short_soak.attempt(stage, run, cache, logfile, None, "re-export", ref.total_steps)["rc"] == 0, soak._tail(logfile)
    left = sorted(rel for rel in soak.names(run) - soak.names(ref.run))
    assert not left and soak.sha256(run / "draft" / "model.safetensors") == soak.sha256(ref.run / "draft" / "model.safetensors"), left
