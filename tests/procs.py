"""Processes the tests start: ranks of a process group under a deadline, and ports without a race.

spawn_ranks(fn, args, world, timeout_s) runs fn(rank, world, *args) in `world` spawned processes
and returns once all of them exited 0. The first rank that fails ends the others at once and the
error names it, with its traceback (an exception) or its exit code or signal; ranks still running
at the deadline are killed and the error names them, with the Python stack of each thread
(faulthandler), so a hang fails in bounded time and says where. A rank also dies with the test
process, should pytest-timeout or a signal end that.

The ranks meet on a TCPStore that this process creates on port 0 (the kernel picks a free port:
nothing can take it between choosing and listening). Each rank has torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and TORCHELASTIC_USE_AGENT_STORE=True,
with which torch's env:// rendezvous connects every rank to that store, as under torchrun's agent,
instead of rank 0 listening on a port chosen beforehand. So
`dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)` in a rank, or the product's own
init from the environment, joins the group.

For a process that listens itself and takes its port as an argument (a server started by a test),
listen_with_retry starts it on a port the kernel just had free and starts it again on another one
when it could not bind (EADDRINUSE: taken in between).
"""

from __future__ import annotations

import datetime
import errno
import faulthandler
import os
import signal
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

# A collective that waits longer than this raises in the rank (gloo's timeout), which then fails
# with a traceback naming the collective: below spawn_ranks' default deadline, long above the
# longest gap between two collectives of the tests' tiny runs (seconds, on a loaded 2-core machine).
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=300)
SPAWN_TIMEOUT_S = 600.0
STACK_WAIT_S = 5.0  # how long a hung rank gets to write its stacks before it is killed


class RanksFailed(AssertionError):
    """Some rank failed or hung; the message names it."""


def rank_env(world: int, port: int) -> dict[str, str]:
    """torchrun's variables for `world` ranks on the agent-style store at 127.0.0.1:`port`, less
    RANK and LOCAL_RANK (one per rank)."""
    return {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True"}


@contextmanager
def rendezvous_store(timeout: datetime.timedelta = PROCESS_GROUP_TIMEOUT) -> Iterator[object]:
    """A TCPStore server on 127.0.0.1, on a port the kernel chose (store.port), for the lifetime of
    the block: ranks started with rank_env(world, store.port) rendezvous on it."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    try:
        yield store
    finally:
        del store


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it ends (prctl PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


_stacks_file = None


def _rank_entry(rank: int, world: int, env: dict, stacks_dir: str, parent: int, fn: Callable, args: tuple) -> None:
    _die_with_parent()
    if os.getppid() != parent:  # the test process ended before this one armed PDEATHSIG
        os._exit(1)
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    # SIGUSR1 writes every thread's stack to this rank's file: what the error shows of a hung rank
    global _stacks_file
    _stacks_file = open(os.path.join(stacks_dir, f"rank{rank}.txt"), "w")  # open while the handler may write
    faulthandler.register(signal.SIGUSR1, file=_stacks_file, all_threads=True)
    fn(rank, world, *args)


def _alive(context) -> list[int]:
    return [rank for rank, process in enumerate(context.processes) if process.is_alive()]


def _stacks_of(context, ranks: list[int], stacks_dir: str) -> str:
    """The Python stacks of `ranks` (SIGUSR1 to each, then their files once written)."""
    for rank in ranks:
        try:
            os.kill(context.processes[rank].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    paths = {rank: Path(stacks_dir) / f"rank{rank}.txt" for rank in ranks}
    deadline = time.monotonic() + STACK_WAIT_S
    while time.monotonic() < deadline and not all(p.exists() and p.stat().st_size for p in paths.values()):
        time.sleep(0.1)
    time.sleep(0.5)  # a file that has its first line gets the rest in the same signal handler
    texts = {rank: p.read_text(errors="replace") for rank, p in paths.items() if p.exists() and p.stat().st_size}
    return "".join(f"\n--- rank {rank} stacks ---\n{texts.get(rank, '(none written)').rstrip()}\n" for rank in ranks)


def _kill_all(context) -> None:
    for process in context.processes:
        if process.is_alive():
            process.kill()
    for process in context.processes:
        process.join(timeout=30)


def spawn_ranks(fn: Callable, args: tuple = (), world: int = 2, timeout_s: float = SPAWN_TIMEOUT_S,
                env: dict | None = None) -> None:
    """Run fn(rank, world, *args) in `world` spawned processes (fn and args picklable, fn a
    module-level function) with torchrun's environment on a store this process holds, plus `env`.
    Returns when every rank exited 0; raises RanksFailed naming the failed rank (its traceback,
    or its exit code or signal), or the ranks still running after `timeout_s` (killed, their
    stacks in the message)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    name = getattr(fn, "__qualname__", repr(fn))
    with rendezvous_store() as store, tempfile.TemporaryDirectory(prefix="rank-stacks-") as stacks_dir:
        child_env = {**rank_env(world, store.port), **(env or {})}
        context = mp.start_processes(_rank_entry, args=(world, child_env, stacks_dir, os.getpid(), fn, tuple(args)),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                        return
                except ProcessRaisedException as err:  # torch ended the other ranks already
                    raise RanksFailed(f"{name}: rank {err.error_index} of {world} raised:\n{err}") from None
                except ProcessExitedException as err:
                    how = f"signal {err.signal_name}" if err.signal_name else f"exit code {err.exit_code}"
                    raise RanksFailed(f"{name}: rank {err.error_index} of {world} ended with {how}") from None
                if time.monotonic() >= deadline:
                    hung = _alive(context)
                    if not hung:  # all ended just now: the next join says how
                        continue
                    stacks = _stacks_of(context, hung, stacks_dir)
                    raise RanksFailed(f"{name}: rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} of {world} "
                                      f"still running after {timeout_s:.0f} s; all ranks killed{stacks}")
        finally:
            _kill_all(context)


def run_jobs_in_group(stage: Callable, jobs: list) -> None:
    """In a rank: one gloo process group for all `jobs` (lists of config overrides), `stage` run
    on each job's config in turn, and the ranks leave together."""
    import torch.distributed as dist

    from eagleforge.config import load_config

    dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    try:
        for args in jobs:
            stage(load_config(None, args))
        dist.barrier()  # leave together: a gloo rank that tears its group down while another still
        # reads from it makes that one abort at exit (SIGABRT, 'terminate called without an active exception')
    finally:
        dist.destroy_process_group()


def listen_with_retry(start: Callable[[int], object], bound: Callable[[object], bool | None], tries: int = 5):
    """Start a process that listens on the port it is given: start(port) on a port the kernel just
    had free; bound(started) polls it: True once it listens, False when it exited because the port
    was taken meanwhile (then it is started again on another port), None while undecided. Returns
    (started, port)."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        started = start(port)
        while (state := bound(started)) is None:
            time.sleep(0.2)
        if state:
            return started, port
    raise OSError(errno.EADDRINUSE, f"no free port after {tries} tries")


def port_in_use(text: str) -> bool:
    """A process's output says it could not bind its port (EADDRINUSE, in the words of the OS,
    Python, c10d or uvicorn)."""
    lowered = text.lower()
    return "address already in use" in lowered or "eaddrinuse" in lowered or "errno 98" in lowered


@contextmanager
def port_nobody_listens_on() -> Iterator[int]:
    """A port bound by this process but not listening, for the block: a connection to it is
    refused, and no other process can take it meanwhile (as one could a port closed after
    choosing it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]
