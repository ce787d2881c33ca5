"""Start a stage under torchrun by itself when its config needs more than one process on this node.

`make extract train CONFIG=configs/kimi_k25_pilot.yaml RUN=...` runs plain `python -m
eagleforge.extract ...`; extraction of Kimi-K2.5 at target.tp 8 needs 8 processes. Here the stage
(extract, train) sees that it was started outside torchrun (no WORLD_SIZE or RANK in the
environment), works out how many processes its config needs on this node, and runs itself again
under torch's own launcher (`torch.distributed.run`, what the `torchrun` command runs: a
standalone rendezvous on this node, OMP_NUM_THREADS=1 unless set) with the same argv, after one
line on stdout saying so. The parent then only waits, and exits with the first failed rank's
exit code (0 when all succeed).

How many processes (`processes_needed`; a group = the target.tp x target.pp ranks running one
target forward, native backend only, the hf backend's group is one rank):

    launch.mode=none      one process: the stage runs as it was started (no re-launch)
    launch.nproc=N        N processes (on GPUs N <= the visible GPUs; a multiple of the group)
    on GPUs (device cuda, or auto with a GPU visible or a group of more than one to run)
                          every visible GPU, in whole groups: extract and online training
                          run 8 // (target.tp x target.pp) groups on 8 GPUs; offline training 8 ranks
    on the CPU (device cpu, or auto with no GPU and a group of one)
                          one group: target.tp x target.pp processes (gloo) for native extract
                          and online training, else one

More processes than visible GPUs (target.tp 8 on 4 GPUs, launch.nproc 16 on 8) is an error line
naming the key and both numbers, before anything is loaded.

Multi-node runs keep using `torchrun --nnodes N ...` on every node: under torchrun nothing here
happens, except that each rank asks the kernel for SIGTERM when its launcher dies
(`stop_with_launcher`): a launcher killed with SIGKILL, which it cannot catch to stop the ranks
itself, leaves no rank holding its GPU.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass

from eagleforge.config import Config
from eagleforge.errors import UserInputError

STAGES = ("extract", "train")  # the stages that run under torchrun
USER_ERROR_EXIT = 2  # run_main's exit code for a user's mistake, its `error:` line already printed


@dataclass(frozen=True)
class Plan:
    """What a stage needs on this node: `processes`, and the reason shown in the launch line."""

    processes: int
    why: str


def under_torchrun() -> bool:
    """True when a launcher already placed this process in a world (torchrun sets both)."""
    return "WORLD_SIZE" in os.environ or "RANK" in os.environ


def visible_gpus() -> int:
    """CUDA devices this process may use (CUDA_VISIBLE_DEVICES applies); 0 without CUDA. Counting
    creates no CUDA context, so the GPUs stay free for the ranks."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def processes_needed(cfg: Config, stage: str, gpus: int) -> Plan:
    """The processes `stage` needs on this node, with `gpus` visible; UserInputError (one line
    naming the key and both numbers) when the config asks for more GPUs than there are."""
    if stage not in STAGES:
        raise ValueError(f"launch: unknown stage {stage!r}, expected one of {list(STAGES)}")
    if cfg.launch.mode == "none":
        return Plan(1, "launch.mode=none")
    if stage == "extract" and cfg.train.source == "online":  # the extract stage only says there is nothing to do
        return Plan(1, "train.source=online")
    runs_target = stage == "extract" or cfg.train.source == "online"
    if runs_target and cfg.target.device_map != "none":  # one process spreads the target over the GPUs
        if cfg.launch.nproc > 1:
            raise UserInputError(f"config key 'launch.nproc' = {cfg.launch.nproc} with target.device_map="
                                 f"{cfg.target.device_map}: the map spreads one copy of the target from one process; "
                                 f"set launch.nproc=0, or target.device_map=none for a copy per process")
        return Plan(1, f"target.device_map={cfg.target.device_map}")
    native = runs_target and cfg.target.backend == "native"
    group = cfg.target.tp * cfg.target.pp if native else 1  # the ranks of one target copy
    group_key = "target.tp" if cfg.target.pp == 1 else "target.tp x target.pp"
    # extract runs on target.device; the train stage (and online, its target) on train.device.
    # auto with no GPU visible and a tp group to run is taken as GPUs (and refused below): a
    # node whose driver is down must not start a Kimi-sized group on its CPUs.
    device_key = "target.device" if stage == "extract" else "train.device"
    device = cfg.target.device if stage == "extract" else cfg.train.device
    on_gpu = device.startswith("cuda") or (device == "auto" and (gpus > 0 or group > 1))
    if cfg.launch.nproc > 0:
        n, key, value, why = cfg.launch.nproc, "launch.nproc", cfg.launch.nproc, f"launch.nproc={cfg.launch.nproc}"
        if n % group:
            raise UserInputError(f"config key 'launch.nproc' = {n} is not a multiple of {group_key} = {group} "
                                 f"(each group of {group_key} processes runs one target)")
    elif on_gpu:  # every visible GPU, in whole groups (at least one group)
        n, key, value = max(gpus // group, 1) * group, group_key, group
        why = f"{group_key} {group} x {n // group} group(s)" if group > 1 else f"every visible GPU ({n})"
    else:  # the CPU: one group
        n, key, value, why = group, group_key, group, f"{group_key} {group} on the CPU"
    if on_gpu and n > max(gpus, 1):  # one process on no GPU is left to the stage's own error
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise UserInputError(f"config key {key!r} = {value} needs {n} GPUs, {gpus} visible on this node"
                             + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                             + (f"; {device_key}=cpu runs it on the CPU (gloo)" if gpus == 0 else ""))
    return Plan(n, why)


def stop_with_launcher() -> None:
    """Under torchrun, on Linux: SIGTERM this rank when the process that started it (the
    torchrun agent: this package's launcher or the torchrun command, which starts its ranks from
    its main thread) dies, SIGKILL included (prctl PR_SET_PDEATHSIG). A parent that died before
    the request took effect is an exit at once. Elsewhere nothing."""
    import ctypes
    import signal

    # TORCHELASTIC_RUN_ID: set by torchrun's agent alone (RANK may come from any script)
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
            return  # refused (a sandbox): the rank lives on as before
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request took effect (torchrun may be PID 1 in a container)
        raise SystemExit(128 + int(signal.SIGTERM))


def torchrun_argv(processes: int, module: str, argv: list[str]) -> list[str]:
    """torch.distributed.run's arguments: one node, a rendezvous of its own, `module` with `argv`."""
    return ["--standalone", "--nnodes", "1", "--nproc-per-node", str(processes), "-m", module, *argv]


def relaunch(cfg: Config, stage: str, argv: list[str], module: str | None = None) -> int | None:
    """Run `module` (default eagleforge.<stage>) with `argv` under torch.distributed.run when this
    process is outside torchrun and the config needs more than one process; returns the exit
    code to leave with, or None when the stage should simply run here."""
    if under_torchrun() or cfg.launch.mode == "none":
        return None
    plan = processes_needed(cfg, stage, visible_gpus())
    if plan.processes <= 1:
        return None
    args = torchrun_argv(plan.processes, module or f"eagleforge.{stage}", list(argv))
    # stdout: stderr stays the errors' (a user error of the ranks is still its one line there)
    print(f"launch: {plan.processes} processes ({plan.why}): torchrun {shlex.join(args)}  "
          f"(launch.mode=none runs one process)", flush=True)
    return _run_torchrun(args)


def _run_torchrun(args: list[str]) -> int:
    """torch.distributed.run in this process (it is the agent: it starts, watches and stops the
    ranks); the exit code of the first rank that failed, 128 + N for one killed by signal N (as
    a shell reports it), 0 when every rank succeeded. A user error (exit code 2) has been printed
    as one line, once over the ranks (eagleforge/failures.py), and nothing is added to it; any
    other failure gets one line here naming the rank. The agent's own log lines about stopping
    the other ranks are left out."""
    import logging
    import signal

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default for several ranks, minus its banner
    quiet = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.startswith("torch.distributed.elastic")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.parse_args(args))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode < 0:
            name = signal.Signals(-failure.exitcode).name if -failure.exitcode in signal.valid_signals() else f"signal {-failure.exitcode}"
            print(f"launch: rank {rank} was killed by {name}; the other ranks were stopped", file=sys.stderr, flush=True)
            return 128 - failure.exitcode
        if failure.exitcode != USER_ERROR_EXIT:
            print(f"launch: rank {rank} exited with code {failure.exitcode}; the other ranks were stopped", file=sys.stderr, flush=True)
        return failure.exitcode or 1
    except SignalException as err:  # Ctrl-C or a kill of this process: the agent has stopped the ranks
        return 128 + int(err.sigval)
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return 0
