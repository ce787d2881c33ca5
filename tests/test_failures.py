"""A failure under torchrun is printed once, by the right rank, and torchrun's summary names it.

Real torchrun (`python -m torch.distributed.run --standalone`, 2 gloo processes, each rank's
stdout and stderr redirected to its own file): a stage whose rank 1 (or rank 0) raises a
UserInputError while the other waits at a barrier, and one whose ranks all raise it. The ranks'
stderr, all files together, must be that one line; the summary's root cause must be the rank
that failed (the blocked rank dies of a lost gloo peer, a failure that must not be shown or
blamed). Then the native extract stage itself at tp 2 on a tiny checkpoint whose expert, read
by rank 1 only, is missing from its file. The decision of who prints what is also tested
without processes, on an in-memory store.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from eagleforge import failures

STAGE = """
import datetime
import os
import torch.distributed as dist
from eagleforge.cli import run_main
from eagleforge.errors import UserInputError

def main(cfg):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))  # a hang fails, in bounded time
    if str(dist.get_rank()) in os.environ["FAIL_RANKS"].split(","):
        raise UserInputError(f"{cfg.run_dir}/bad.jsonl line 3: not JSON")
    dist.barrier()  # a healthy rank waits here, as a stage waits at its next collective

run_main(main, "a stage whose ranks FAIL_RANKS fail")
"""


def torchrun(tmp_path: Path, args: list[str], env: dict | None = None, timeout: int = 120):
    """(exit code, torchrun's own stderr, the ranks' stderr files concatenated)."""
    logs = tmp_path / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    run_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(logs), "--redirects", "3", *args],
                          cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=timeout)
    ranks = "".join(p.read_text() for p in sorted(logs.rglob("stderr.log")))
    assert len(list(logs.rglob("stderr.log"))) == 2
    return proc.returncode, proc.stderr, ranks


def root_cause(summary: str) -> tuple[int, int, str]:
    """(rank, exit code, message) of the summary's 'Root Cause' entry."""
    section = summary.split("Root Cause (first observed failure):", 1)[1]
    rank = int(re.search(r"rank\s*: (\d+)", section).group(1))
    code = int(re.search(r"exitcode\s*: (-?\d+)", section).group(1))
    message = re.search(r"traceback : (.*)", section).group(1).strip()
    return rank, code, message


@pytest.mark.parametrize("fail_ranks,line", [
    ("1", "error: rank 1: runs/x/bad.jsonl line 3: not JSON"),
    ("0", "error: rank 0: runs/x/bad.jsonl line 3: not JSON"),
    ("0,1", "error: runs/x/bad.jsonl line 3: not JSON"),
])
def test_a_user_error_under_torchrun_is_one_line_from_one_rank(tmp_path, fail_ranks, line):
    (tmp_path / "stage.py").write_text(STAGE)
    code, summary, ranks = torchrun(tmp_path, ["stage.py", "run_dir=runs/x"], env={"FAIL_RANKS": fail_ranks})
    assert code != 0
    assert ranks == line + "\n"
    blamed = 0 if fail_ranks == "0,1" else int(fail_ranks)
    assert root_cause(summary) == (blamed, 2, line)


def test_native_extract_missing_expert_on_one_rank_under_torchrun(tmp_path):
    """tp 2, ep layout: the last expert of layer 2 is read by rank 1 alone and is missing from the
    file the index names for it. Rank 1 says so in one line, before reading weights; rank 0,
    blocked at the next collective, prints no error and no traceback; the summary blames rank 1."""
    from test_native_fixtures import write_tiny_kimi

    ckpt = tmp_path / "ckpt"
    write_tiny_kimi(ckpt, seed=2, n_routed_experts=4, num_hidden_layers=3)
    name = "language_model.model.layers.2.mlp.experts.3.gate_proj.weight_scale"
    file = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(ckpt / file), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if n != name}
    save_file(tensors, str(ckpt / file), metadata={"format": "pt"})
    source = tmp_path / "samples.jsonl"
    source.write_text(json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}) + "\n")
    code, summary, ranks = torchrun(tmp_path, [
        "-m", "eagleforge.extract", "run_dir=run", f"target.path={ckpt}", "target.backend=native", "target.tp=2",
        "target.expert_layout=ep", "target.dtype=float32", "target.device=cpu", "extract.aux_layers=[0,1]",
        f"data.source={source}"])
    line = f"error: rank 1: {ckpt / file}: tensor {name} is missing (model.safetensors.index.json names this file for it)"
    assert code != 0
    assert [text for text in ranks.splitlines() if "error" in text.lower()] == [line]
    assert "Traceback" not in ranks
    assert root_cause(summary) == (1, 2, line)


# ---------------------------------------------------------------------------- who prints, no processes


class MemoryStore:
    """The few TCPStore calls the board makes, in a dict."""

    def __init__(self):
        self.data = {}

    def append(self, key, value):
        self.data[key] = self.data.get(key, b"") + value.encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]

    def add(self, key, n):
        self.data[key] = int(self.data.get(key, 0)) + n
        return self.data[key]

    def set(self, key, value):
        self.data[key] = value


def test_who_prints_each_line():
    board = failures._Board(MemoryStore(), "p/")
    same = {0: "a", 1: "a", 2: "a"}
    assert [failures._lines_to_print(r, 3, same, board) for r in (1, 2, 0)] == [[], [], ["error: a"]]
    # not every rank failed: the lowest rank that did prints every distinct line once, with its ranks
    board = failures._Board(MemoryStore(), "p/")
    posted = {3: "b", 1: "a", 2: "b"}
    assert failures._lines_to_print(2, 4, posted, board) == []
    assert failures._lines_to_print(1, 4, posted, board) == ["error: rank 1: a", "error: ranks 2, 3: b"]
    # a rank that saw fewer lines and decided first has claimed its line: it is not printed again
    board = failures._Board(MemoryStore(), "p/")
    assert failures._lines_to_print(2, 4, {2: "b"}, board) == ["error: rank 2: b"]
    assert failures._lines_to_print(1, 4, {1: "a", 2: "b"}, board) == ["error: rank 1: a"]


def test_the_board_reads_back_what_ranks_posted():
    board = failures._Board(MemoryStore(), "p/")
    assert board.posted() == {}
    board.post(1, 'line with "quotes"\tand a tab')
    board.post(0, "x")
    assert board.posted() == {1: 'line with "quotes"\tand a tab', 0: "x"}
    assert board.wait_for(2, 0.0) == board.posted()


def test_one_line_joins_a_message_of_several_lines():
    assert failures.one_line(ValueError("first\n  second\n\n")) == "first second"
    assert failures.one_line(ValueError("")) == "ValueError"


def test_one_line_is_bounded_whatever_the_message():
    message = "config.json: ids " + "1, " * 100_000  # joined without its trailing space
    line = failures.one_line(ValueError(message))
    assert len(line) < failures.MAX_LINE_CHARS + 40 and line.startswith("config.json: ids 1, 1, ")
    assert line.endswith(f"... ({len(message.strip()) - failures.MAX_LINE_CHARS} more characters)")


# ---------------------------------------------------------------------------- a leader's failure stops every group

RANK_WITH_FAULTS = """
import errno, os, sys, time
from eagleforge.cli import run_main
from eagleforge.extract.__main__ import main
rank = int(os.environ["RANK"])
if rank == 0:  # the disk is full for this rank's shards
    import safetensors.torch
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    safetensors.torch.save_file = full
else:  # a group with a long way to go: 0.3 s a forward
    from eagleforge.target.hf import HFTarget
    forward = HFTarget.forward
    HFTarget.forward = lambda self, *a, **k: (time.sleep(0.3), forward(self, *a, **k))[1]
run_main(main, "extract with faults", argv=sys.argv[1:])
"""


def test_a_group_leader_s_disk_full_stops_every_group_within_seconds(tmp_path):
    """2 gloo ranks = 2 groups of the hf backend (no torchrun agent to stop them: the ranks alone).
    Rank 0's shard write finds the disk full: its one line says so and it exits 2. Rank 1, with a
    minute of forwards left and no collective with rank 0 until the end, ends silently without
    writing its last shards (before: it went on to its last chunk, then failed at the final barrier)."""
    from procs import port_in_use
    from tiny_runs import write_tiny_llama

    target = write_tiny_llama(tmp_path / "tiny-llama")
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "data" / "samples.jsonl").write_text("".join(
        json.dumps({"id": i, "input_ids": [3 + (i * 7 + j) % 200 for j in range(10)], "loss_mask": [1] * 10}) + "\n"
        for i in range(400)))
    (tmp_path / "rank.py").write_text(RANK_WITH_FAULTS)
    args = [f"run_dir={run}", f"target.path={target}", "target.device=cpu", "extract.samples_per_shard=2",
            "extract.batch_tokens=20", "launch.mode=none"]
    # rank 0 holds the store on MASTER_PORT, as ranks started by hand do: a port free when chosen
    # may be taken before rank 0 listens, and then the ranks start again on another
    for _ in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent))
            procs.append(subprocess.Popen([sys.executable, str(tmp_path / "rank.py"), *args], env=env, cwd=tmp_path,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        try:
            # bounds on a hang only: rank 0 fails at its first shard, rank 1 ends a few seconds later
            _, err0 = procs[0].communicate(timeout=600)
            _, err1 = procs[1].communicate(timeout=600)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        if not port_in_use(err0):
            break
        shutil.rmtree(run / "hidden", ignore_errors=True)
    lines0 = [x for x in err0.splitlines() if x.startswith("error")]
    assert procs[0].returncode == 2 and len(lines0) == 1, err0[-3000:]
    assert lines0[0].startswith("error: rank 0: ") and "no space left" in lines0[0] and "errno ENOSPC" in lines0[0]
    assert procs[1].returncode == 1 and "Traceback" not in err1 and "error" not in err1, err1[-3000:]
    # stopped by rank 0's failure, not by reaching the end: group 1 has 100 shards of 2 samples to
    # write (200 of the 400 samples) at 0.3 s a forward, and wrote only some of them
    written = len(list((run / "hidden").glob("shard-g1-*.safetensors")))
    assert written < 100, f"rank 1 wrote all {written} of its shards: it ran to its end instead of stopping"


def test_the_watcher_thread_ends_when_the_stage_is_done(monkeypatch):
    # stop_watching (run_main, after the stage's work) ends the thread that polls the store, so
    # none is inside a store call (C++) while the process exits.
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from eagleforge import failures

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}.items():
        monkeypatch.setenv(key, value)
    polled = threading.Event()
    posted = failures._Board.posted

    def polling(board):  # the watcher's poll of the store: connected and polling once it has run
        result = posted(board)
        polled.set()
        return result

    monkeypatch.setattr(failures._Board, "posted", polling)
    failures.watch_other_ranks()
    thread = failures._watcher
    assert polled.wait(120), "the watcher never polled the store"  # a bound on a hang only
    assert thread is not None and thread.is_alive()
    failures.stop_watching()
    # stop_watching joins the thread for at most 2 x CONNECT_SECONDS: ended by then, or it would be alive here
    assert not thread.is_alive() and failures._watcher is None
