"""tests/procs.py: ranks under a deadline that name the rank that failed or hung, and are gone after."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from procs import RanksFailed, port_nobody_listens_on, spawn_ranks


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _all_reduce(rank: int, world: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from procs import PROCESS_GROUP_TIMEOUT

    dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)  # env:// on the parent's store
    try:
        x = torch.tensor([1.0, float(rank)])
        dist.all_reduce(x)
        Path(out_dir, f"rank{rank}.txt").write_text(f"{x.tolist()} {os.environ['RANK']} {os.environ['WORLD_SIZE']}")
        dist.barrier()  # leave together: a gloo rank that tears its group down while another still
        # reads from it makes that one abort at exit (SIGABRT, 'terminate called without an active exception')
    finally:
        dist.destroy_process_group()


def test_ranks_form_a_gloo_group_on_the_parent_s_store(tmp_path):
    spawn_ranks(_all_reduce, (str(tmp_path),), world=3, timeout_s=300)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(3)] == [f"[3.0, 3.0] {r} 3" for r in range(3)]


def _fail_on(rank: int, world: int, how: str, pid_dir: str) -> None:
    import time

    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        while how != "hang" and not Path(pid_dir, "rank0.pid").exists():  # rank 0 is up and waiting: it must be ended
            time.sleep(0.05)
        if how == "raise":
            raise ValueError("rank one's own error")
        if how == "exit":
            os._exit(7)
        time.sleep(3600)  # "hang"
    if how != "hang":
        time.sleep(3600)  # a healthy rank waiting for the failed one, as at a collective


@pytest.mark.parametrize("how,message", [
    ("raise", r"_fail_on: rank 1 of 2 raised:\n(.|\n)*ValueError: rank one's own error"),
    ("exit", r"_fail_on: rank 1 of 2 ended with exit code 7"),
])
def test_the_failed_rank_is_named_and_the_others_are_ended(tmp_path, how, message):
    with pytest.raises(RanksFailed, match=message):
        spawn_ranks(_fail_on, (how, str(tmp_path)), world=2, timeout_s=300)
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
    assert not [pid for pid in pids if _pid_alive(pid)]  # rank 0, waiting for ever, was ended too


def test_a_hung_rank_is_named_with_its_stack_and_killed(tmp_path):
    # rank 0 returns, rank 1 sleeps: at the deadline only rank 1 runs (rank 0 may still be
    # starting on a loaded machine: then both are named)
    with pytest.raises(RanksFailed) as err:
        spawn_ranks(_fail_on, ("hang", str(tmp_path)), world=2, timeout_s=15)
    text = str(err.value)
    assert "of 2 still running after 15 s; all ranks killed" in text and ("rank 1 of 2" in text or "ranks 0, 1 of 2" in text), text
    assert "--- rank 1 stacks ---" in text
    if (tmp_path / "rank1.pid").exists():  # it got as far as fn: its stack shows where it waits
        assert "_fail_on" in text, text
        assert not _pid_alive(int((tmp_path / "rank1.pid").read_text()))


_TIMED_OUT_TEST = """
import os
import time

import pytest

from procs import spawn_ranks


def sleeper(rank, world, out):
    with open(os.path.join(out, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)


@pytest.mark.timeout(TIMEOUT)
def test_hangs(tmp_path_factory):
    spawn_ranks(sleeper, (OUT,), world=2, timeout_s=3600)
"""


def test_pytest_timeout_fails_a_hung_spawn_and_its_ranks_end(tmp_path):
    """The suite-wide timeout (pytest-timeout, signal method, pyproject.toml) on a test whose ranks
    hang past it: that test fails with pytest-timeout's message and its ranks are gone."""
    pytest.importorskip("pytest_timeout")
    tests = Path(__file__).resolve().parent
    (tmp_path / "test_hung.py").write_text(textwrap.dedent(_TIMED_OUT_TEST).replace("TIMEOUT", "25").replace("OUT", repr(str(tmp_path))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    # the repository's pyproject.toml is the config (its timeout_method); the file's mark sets 25 s
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tests.parent / "pyproject.toml"),
                             "--rootdir", str(tmp_path), str(tmp_path / "test_hung.py")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Timeout" in result.stdout and "1 failed" in result.stdout, result.stdout[-3000:]
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 2, result.stdout[-3000:]
    deadline = time.monotonic() + 30
    while [pid for pid in pids if _pid_alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _pid_alive(pid)], "ranks outlived their test"


def test_a_port_nobody_listens_on_refuses_and_stays_ours():
    import errno
    import socket

    with port_nobody_listens_on() as port:
        with socket.socket() as c, pytest.raises(ConnectionRefusedError):
            c.connect(("127.0.0.1", port))
        with socket.socket() as other, pytest.raises(OSError) as err:
            other.bind(("127.0.0.1", port))
        assert err.value.errno == errno.EADDRINUSE
