"""A stage started outside torchrun runs itself under torch.distributed.run when its config needs
several processes (eagleforge/launch.py): the process count per config and GPU count, the
one-line errors, and real launches on the CPU (gloo) whose ranks report their world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagleforge.config import load_config
from eagleforge.errors import UserInputError
from eagleforge.launch import processes_needed, relaunch

REPO = Path(__file__).resolve().parents[1]
PILOT, B300 = str(REPO / "configs" / "kimi_k25_pilot.yaml"), str(REPO / "configs" / "kimi_k25_b300.yaml")
TIMEOUT_S = 120


def _needed(config: str | None, stage: str, gpus: int, *overrides: str) -> int:
    return processes_needed(load_config(config, list(overrides)), stage, gpus).processes


# ----------------------------------------------------------------------------- how many processes


@pytest.mark.parametrize("config", [PILOT, B300])
def test_kimi_configs_on_gpus(config):
    """Groups of 8 (the B300's tp 8, the pilot's 8 pipeline stages), native: extraction and
    online training run whole groups over the visible GPUs, offline training every visible GPU."""
    assert _needed(config, "extract", 8) == 8
    assert _needed(config, "extract", 16) == 16  # two groups
    assert _needed(config, "extract", 12) == 8  # whole groups only
    assert _needed(config, "train", 8) == 8
    assert _needed(config, "train", 6) == 6  # offline: the draft alone, every GPU
    assert _needed(config, "train", 1) == 1
    assert _needed(config, "train", 16, "train.source=online") == 16
    assert _needed(config, "train", 12, "train.source=online") == 8
    assert _needed(config, "extract", 8, "target.tp=4", "target.pp=1") == 8  # two groups of 4
    assert _needed(config, "extract", 8, "launch.nproc=4", "target.tp=4", "target.pp=1") == 4
    assert _needed(config, "extract", 8, "target.tp=2", "target.pp=2") == 8  # two groups of 2 stages of tp 2
    assert _needed(config, "train", 8, "launch.nproc=2") == 2


def test_online_training_leaves_the_extract_and_vocab_stages_nothing_to_do(tmp_path):
    """`make extract train CONFIG=configs/kimi_k25_pilot.yaml OVERRIDES=train.source=online`: the
    extract stage needs one process (no launch for 8 stages) and, like the vocab stage, says in one
    line that the train stage does its work, exits 0 and writes nothing."""
    assert _needed(PILOT, "extract", 8, "train.source=online") == 1
    for module, line in (("eagleforge.extract", "extract: train.source=online: nothing to extract"),
                         ("eagleforge.vocab", "vocab: train.source=online: the train stage counts the draft vocabulary")):
        run = tmp_path / module
        result = subprocess.run([sys.executable, "-m", module, "--config", PILOT, f"run_dir={run}", "train.source=online"],
                                env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=TIMEOUT_S)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.startswith(line), result.stdout
        assert not run.exists()


def test_hf_backend_and_the_cpu():
    """The hf backend's group is one rank; on the CPU one group (native: target.tp processes)."""
    assert _needed(None, "extract", 0) == 1 and _needed(None, "train", 0) == 1  # the embedded default
    assert _needed(None, "extract", 4) == 4 and _needed(None, "train", 4) == 4  # device auto: every GPU
    assert _needed(None, "extract", 4, "target.tp=2") == 4  # tp is the native backend's only
    assert _needed(None, "extract", 4, "target.device=cpu") == 1
    assert _needed(None, "train", 4, "train.device=cpu") == 1
    native2 = ("target.backend=native", "target.tp=2", "target.device=cpu", "train.device=cpu")
    assert _needed(None, "extract", 0, *native2) == 2
    assert _needed(None, "extract", 8, *native2) == 2  # GPUs present, the config says cpu
    assert _needed(None, "train", 0, *native2) == 1  # offline training does not run the target
    assert _needed(None, "train", 0, *native2, "train.source=online") == 2
    assert _needed(None, "train", 0, "launch.nproc=3") == 3  # the CPU takes any count (gloo)
    assert _needed(None, "train", 0, *native2, "train.source=online", "launch.nproc=4") == 4


def test_device_map_is_one_process_that_spreads_the_target():
    """target.device_map: one process places the target over every GPU (refused under torchrun)."""
    assert _needed(None, "extract", 8, "target.device_map=auto") == 1
    assert _needed(None, "train", 8, "target.device_map=auto", "train.source=online") == 1
    assert _needed(None, "train", 8, "target.device_map=auto") == 8  # offline training runs no target
    with pytest.raises(UserInputError, match=r"^config key 'launch.nproc' = 2 with target.device_map=auto: "):
        _needed(None, "extract", 8, "target.device_map=auto", "launch.nproc=2")


def test_launch_mode_none_is_one_process_even_when_it_would_not_fit():
    assert _needed(PILOT, "extract", 2, "launch.mode=none") == 1
    assert _needed(None, "train", 8, "launch.mode=none") == 1


@pytest.mark.parametrize("config,stage,gpus,overrides,line", [
    (B300, "extract", 4, (), "config key 'target.tp' = 8 needs 8 GPUs, 4 visible on this node"),
    (B300, "train", 4, ("train.source=online",), "config key 'target.tp' = 8 needs 8 GPUs, 4 visible on this node"),
    (PILOT, "extract", 4, (), "config key 'target.tp x target.pp' = 8 needs 8 GPUs, 4 visible on this node"),
    (None, "train", 8, ("launch.nproc=16",), "config key 'launch.nproc' = 16 needs 16 GPUs, 8 visible on this node"),
    (None, "extract", 0, ("target.device=cuda", "launch.nproc=2"), "config key 'launch.nproc' = 2 needs 2 GPUs, 0 visible on this node"),
    (B300, "extract", 8, ("launch.nproc=12",), "config key 'launch.nproc' = 12 is not a multiple of target.tp = 8"),
    (PILOT, "extract", 8, ("launch.nproc=12",), "config key 'launch.nproc' = 12 is not a multiple of target.tp x target.pp = 8"),
    # device auto on a node whose GPUs are not visible: refused, not run as 8 CPU ranks
    (B300, "extract", 0, (), "config key 'target.tp' = 8 needs 8 GPUs, 0 visible on this node; target.device=cpu runs it on the CPU (gloo)"),
])
def test_more_processes_than_gpus_is_one_line_naming_the_key_and_both_numbers(config, stage, gpus, overrides, line, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(UserInputError) as err:
        _needed(config, stage, gpus, *overrides)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_under_torchrun_nothing_is_launched(monkeypatch):
    """A rank of a torchrun job (WORLD_SIZE or RANK set) runs the stage itself, whatever it needs."""
    cfg = load_config(PILOT, [])
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert relaunch(cfg, "extract", []) is None  # would need 8 GPUs here: no error either
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "0")
    assert relaunch(cfg, "extract", []) is None
    monkeypatch.delenv("RANK")
    assert relaunch(load_config(PILOT, ["launch.mode=none"]), "extract", []) is None
    with pytest.raises(UserInputError, match=r"'target.tp x target.pp' = 8 needs 8 GPUs, 0 visible"):  # this CPU machine
        relaunch(cfg, "extract", [])


# ----------------------------------------------------------------------------- real launches (gloo)


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(REPO / "tests"), "OMP_NUM_THREADS": "1", **extra}


def _probe(run: Path, *overrides: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    result = subprocess.run([sys.executable, "-m", "launch_probe", f"run_dir={run}", *overrides], env=_env(**env),
                            capture_output=True, text=True, timeout=TIMEOUT_S, cwd=run.parent)
    ranks = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in run.glob("rank-*.json")}
    return result, ranks


def test_plain_train_command_runs_as_two_gloo_ranks(tmp_path):
    result, ranks = _probe(tmp_path / "run", "train.device=cpu", "launch.nproc=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(ranks) == [0, 1]
    for r, got in ranks.items():
        assert got["world_size"] == 2 and got["env"] == {"RANK": str(r), "WORLD_SIZE": "2"}
        assert got["reduced"] == [2.0, 1.0]  # both ranks took part in one all-reduce
    launched = [line for line in result.stdout.splitlines() if line.startswith("launch:")]
    assert len(launched) == 1 and "launch: 2 processes (launch.nproc=2): torchrun --standalone --nnodes 1 " \
        f"--nproc-per-node 2 -m launch_probe run_dir={tmp_path / 'run'} train.device=cpu launch.nproc=2" in launched[0]


def test_native_tp2_on_the_cpu_runs_as_one_tp2_group(tmp_path):
    """No launch key: extraction with the native backend at target.tp 2 on the CPU needs 2 processes."""
    result, ranks = _probe(tmp_path / "run", "target.backend=native", "target.tp=2", "target.device=cpu",
                           LAUNCH_PROBE_STAGE="extract")
    assert result.returncode == 0, result.stderr[-3000:]
    assert {r: got["groups"] for r, got in ranks.items()} == {
        0: {"num_groups": 1, "group_index": 0, "tp_rank": 0}, 1: {"num_groups": 1, "group_index": 0, "tp_rank": 1}}
    assert "launch: 2 processes (target.tp 2 on the CPU)" in result.stdout


@pytest.mark.parametrize("how,code,line", [
    ("3", 3, "launch: rank 1 exited with code 3; the other ranks were stopped"),
    ("kill", 128 + 9, "launch: rank 1 was killed by SIGKILL; the other ranks were stopped"),
])
def test_a_failing_rank_s_exit_code_is_the_command_s(tmp_path, how, code, line):
    result, ranks = _probe(tmp_path / "run", "train.device=cpu", "launch.nproc=2", LAUNCH_PROBE_EXIT=how)
    assert sorted(ranks) == [0, 1]  # both ran; then rank 1 failed
    assert result.returncode == code, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert result.stdout.startswith("launch: 2 processes") and lines[-1] == line
    assert not [x for x in lines if "failed (exitcode" in x or "closing signal" in x]  # the agent's log lines left out


def test_ranks_end_when_the_launcher_is_killed(tmp_path):
    """The plain command's launcher (the torchrun agent) killed with SIGKILL, which it cannot
    catch: both ranks it started, alive and waiting, are gone within seconds, not left holding
    their devices."""
    import signal
    import time

    run = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-m", "launch_probe", f"run_dir={run}", "train.device=cpu", "launch.nproc=2"],
                                env=_env(LAUNCH_PROBE_EXIT="hang"), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(list(run.glob("rank-*.json"))) < 2:
            assert launcher.poll() is None, launcher.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        # each file is whole: launch_probe writes it under another name, then renames it
        pids = [json.loads(p.read_text())["pid"] for p in sorted(run.glob("rank-*.json"))]
        assert all(_alive(pid) for pid in pids)
        launcher.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        launcher.wait(timeout=30)
        # A rank left behind would sleep its 300 s; those the launcher's death ends go in well under
        # a second (0.12 s measured on the 2-core machine with another process busy on one core,
        # 2026-12-06): 120 s tells the two apart on any machine.
        deadline = killed + 120
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"ranks gone {time.monotonic() - killed:.2f} s after the launcher's kill")
        assert not [pid for pid in pids if _alive(pid)], "ranks outlived their launcher"
    finally:
        launcher.kill()
        for p in run.glob("rank-*.json"):
            try:
                os.kill(json.loads(p.read_text())["pid"], signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child of init not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_user_error_of_the_ranks_stays_one_line(tmp_path):
    """Every rank fails with the same UserInputError: stderr is that one line (printed once over
    the ranks by eagleforge/failures.py, nothing added by the launch), the exit code 2."""
    result, _ = _probe(tmp_path / "run", "train.device=cpu", "launch.nproc=2", LAUNCH_PROBE_EXIT="user")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'run' / 'probe.jsonl'}: line 3: not what the probe expects"]
    assert result.stdout.startswith("launch: 2 processes")


@pytest.mark.parametrize("module,overrides,line", [
    ("eagleforge.extract", ("target.backend=native", "target.tp=2"),
     "error: config key 'target.tp' = 2 needs 2 GPUs, 0 visible on this node (CUDA_VISIBLE_DEVICES=); target.device=cpu runs it on the CPU (gloo)"),
    ("eagleforge.train", ("train.device=cuda", "launch.nproc=2"),
     "error: config key 'launch.nproc' = 2 needs 2 GPUs, 0 visible on this node (CUDA_VISIBLE_DEVICES=); train.device=cpu runs it on the CPU (gloo)"),
])
def test_stage_commands_check_before_any_work(module, overrides, line, tmp_path):
    """extract's and train's entry points go through the launch: on this GPU-less machine a
    config needing 2 GPUs ends with one line and exit 2 before the stage reads anything."""
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", module, f"run_dir={run}", *overrides], env=_env(CUDA_VISIBLE_DEVICES=""),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [line]
    assert not run.exists()  # nothing written: not even RUN/config.yaml
