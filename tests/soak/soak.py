"""Kill-and-resume soak: every stage of a tiny run SIGKILLed at seeded random moments, rerun until
it finishes, and its outputs compared with an uninterrupted run's.

    python tests/soak/soak.py                         # the long soak (make soak): >= 200 kills
    python tests/soak/soak.py --kills 3 --seed 7      # 3 kills per stage
    python tests/soak/soak.py --stages train,eval --kills 20 --out runs/soak --keep

The run is the embedded default's pipeline at toy size: stdlib prompts answered greedily by a
tiny random Llama target (hidden 48, 7 layers, SmolLM2's tokenizer and chat template, bf16 as
the default), extracted to shards, a draft vocabulary of 64, 8 training steps with a checkpoint
every 2 and the export, then eval on 2 HumanEval prompts. Stages, each started from the
uninterrupted run's outputs of the stages before it:

    data     regeneration (8 prompts, 2 per batch)    -> data/
    extract  target forward, 2 samples per shard      -> hidden/
    vocab                                             -> vocab/
    train    offline, one process                     -> checkpoints/, train_log.csv, draft/
    online   train.source=online, train.cache_gb holding part of the first epoch (-> hidden/)
    train2   offline, 2 processes over gloo (launch.nproc=2: the stage runs torchrun itself)
    eval                                              -> eval/

A trial copies the stage's inputs, starts the stage, kills it (1 to 3 times, each at a new
moment, on the rerun after the kill before), reruns it to the end, then compares. A kill moment
is one of
  - a time drawn uniformly over the uninterrupted run's duration;
  - the n-th appearance of one of the stage's write phases seen from outside, in the run
    directory (a checkpoint's .tmp-step directory, the export's .tmp-draft directory, a shard's or
    the cache's .tmp-shard file, ...), plus a few random milliseconds;
  - right before or right after one of the uninterrupted run's file-system calls (os.fsync,
    os.replace, os.rename, os.unlink, os.rmdir under RUN: after a shard's fsync and before its
    rename, between a directory swap's two renames, half-way through removing an old
    checkpoint), in the process (rank) that made it: tests/soak/hook/sitecustomize.py wraps
    those calls in the stage's processes and stops the process there; the stage's code is not
    changed.
At the moment, the stage's whole process tree (the launcher and its ranks) is stopped (SIGSTOP),
the run directory is read (what was being written tells the phase the kill landed in; the
stage's last log line is kept) and every process gets SIGKILL.

After the final rerun, the outputs must equal the uninterrupted run's: shards, samples, vocab
and export files by sha256 (vocab files: their tensors and metadata), train_log.csv every step
once with the same numbers (tokens/s aside), the same checkpoints kept with equal tensor data,
RNG and state, the final checkpoint's every tensor bitwise in its own dtype (the weights, fp32
or, with train.param_dtype=bfloat16, bf16 with the optimizer's int16 master remainder of each:
together the exact fp32 masters; the fp32 moments and step counts), JSON files equal but for
timings and this process's counters; no file or directory that the uninterrupted run does not
have (temp files, half-pruned checkpoints), none missing, and no process of the trial still
running. --set KEY=VALUE runs every stage with an override (--set train.param_dtype=bfloat16
--set train.bf16=true: the CUDA default's bf16 parameters, on the CPU); Soak.trial takes
overrides for one stage's runs.

By default a stage runs in a child forked from one process that has imported torch,
transformers and eagleforge (a few seconds per start saved, so kills land in the work rather
than in imports); --spawn starts every run as `python -m eagleforge.<stage>` instead.
The seed, each trial's seed, the kills per stage, the phases hit and every failure (stage, trial
seed, phase, what differed or was left, the log's last lines) are printed, and written to
OUT/report.json. Exit code 1 when anything failed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
HOOK_DIR = Path(__file__).resolve().parent / "hook"  # sitecustomize.py: the file-system kill points
POLL_S = 0.002

# The tiny run: one config for every stage (only launch/source keys differ between stages).
COMMON = [
    "target.device=cpu",
    "data.num_prompts=8", "data.max_new_tokens=12", "data.gen_batch_size=2", "data.extra_modules=[]",
    "extract.samples_per_shard=2", "extract.batch_tokens=512",
    "vocab.draft_vocab_size=64",
    "train.device=cpu", "train.epochs=2", "train.batch_tokens=256", "train.ttt_steps=3", "train.holdout_samples=2",
    "train.log_every=1", "train.save_every=2", "train.keep_last=2",
    "eval.n_prompts=2", "eval.max_new_tokens=8", "eval.k=3",
]
# About half of the online run's first epoch (393 bytes per token at bf16, ~770 tokens in 4
# batches: the first 2 or 3 batches are cached, the others forwarded again in the second epoch).
ONLINE = ["train.source=online", "train.cache_gb=0.00025"]

# Keys whose values are timings or this process's own counters (documented so: the online
# source's target_tokens/target_seconds/cache_read_tokens, the data stage's generation figures: answered now/before, new_tokens).
VOLATILE_KEYS = {
    "seconds", "new_tokens_per_s", "prompts_answered_now", "prompts_answered_before", "train_tokens_per_s",
    "new_tokens", "target_seconds", "target_tokens", "cache_read_tokens", "wall_s", "tokens_per_s", "ngram_wall_s",
    "ngram_tokens_per_s", "cached_from",
    "run_id",  # a checkpoint's run identity: each run that starts afresh draws its own
}


# ----------------------------------------------------------------------------- run directory


def scan(root: Path) -> dict[str, tuple[int, int, bool]]:
    """Every path under `root`: relative path -> (size, mtime_ns, is_dir)."""
    out = {}
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            rel = os.path.relpath(entry.path, root)
            is_dir = entry.is_dir(follow_symlinks=False)
            out[rel] = (st.st_size, st.st_mtime_ns, is_dir)
            if is_dir:
                stack.append(Path(entry.path))
    return out


def names(root: Path) -> set[str]:
    return set(scan(root))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_temp(rel: str) -> bool:
    """eagleforge's temporary names (.tmp-NAME-HOST-PID, .old-NAME-HOST-PID: eagleforge/atomic.py; a pruned
    checkpoint's .pruned-step-N) and the .tmpXXXXXX file that safetensors' save_file writes beside
    its target before renaming it."""
    return any(part.startswith((".tmp-", ".old-", ".pruned-")) or _SAFETENSORS_TMP.fullmatch(part)
               for part in rel.split(os.sep))


_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


# ----------------------------------------------------------------------------- processes


def _proc_table() -> dict[int, int]:
    """pid -> ppid of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        table[int(entry)] = int(fields[1])
    return table


def descendants(pid: int) -> list[int]:
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for child, parent in table.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] not in ("Z", "X")


def tagged(tag: str) -> list[int]:
    """Processes started with SOAK_TAG=`tag` in their environment (exec'd ones: the ranks)."""
    needle = f"SOAK_TAG={tag}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read() + b"\0"
        except OSError:
            continue
        if b"\0" + needle in b"\0" + env and alive(int(entry)):
            found.append(int(entry))
    return found


def freeze(pid: int) -> list[int]:
    """SIGSTOP `pid` and all its descendants (again until no new one appears); returns them."""
    stopped: list[int] = []
    todo = [pid]
    for _ in range(20):
        for p in todo:
            try:
                os.kill(p, signal.SIGSTOP)
                stopped.append(p)
            except ProcessLookupError:
                pass
        todo = [p for p in descendants(pid) if p not in stopped]
        if not todo:
            break
    return stopped


def kill_all(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ----------------------------------------------------------------------------- zygote


def zygote_main() -> None:
    """Import what the stages import, then fork one child per request (JSON lines on stdin:
    module, argv, env, log, cwd); answers {"pid"} at once and {"exit", "rc"} when a child ends.
    Children adopted after their parent died (ranks of a killed launcher) are reaped here too."""
    import ctypes

    try:  # PR_SET_CHILD_SUBREAPER: orphaned ranks become our children, reaped below
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    import eagleforge.data.stage  # noqa: F401
    import eagleforge.eval.evaluate  # noqa: F401
    import eagleforge.launch  # noqa: F401
    import eagleforge.shards  # noqa: F401
    import eagleforge.target.hf  # noqa: F401
    import eagleforge.train.loop  # noqa: F401
    import eagleforge.train.online  # noqa: F401

    threads = len(os.listdir("/proc/self/task"))
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # nothing else may write into the answers' pipe
    print(json.dumps({"ready": True, "threads": threads}), file=out)
    stdin, buffered, reading = sys.stdin.buffer.fileno(), b"", True
    while reading:
        ready, _, _ = select.select([stdin], [], [], 0.005)
        if ready:
            chunk = os.read(stdin, 1 << 16)
            reading = bool(chunk)
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    out.close()
                    _child(request)  # never returns
                print(json.dumps({"pid": pid}), file=out)
        while _reap(out, block=False) is not None:
            pass
    while _reap(out, block=True) is not None:  # stdin closed: wait for the children still running
        pass


def _reap(out, block: bool) -> int | None:
    try:
        pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return None
    if pid == 0:
        return None
    rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    print(json.dumps({"exit": pid, "rc": rc}), file=out)
    return pid


def _child(request: dict) -> None:
    import runpy
    import traceback

    code, hook = 1, None
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdin = open(os.devnull)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if os.environ.get("SOAK_FAULT"):  # what sitecustomize does at a fresh interpreter's start
            import importlib.util

            spec = importlib.util.spec_from_file_location("soak_sitecustomize", HOOK_DIR / "sitecustomize.py")
            hook = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(hook)
        sys.argv = [request["module"], *request["argv"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if isinstance(exit_.code, str):
                print(exit_.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - the child's traceback goes to its log
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        if hook is not None:
            hook.dump()  # atexit does not run before os._exit
    finally:
        os._exit(code)


class Proc:
    def __init__(self, pid: int, poll: Callable[[], int | None]):
        self.pid, self._poll = pid, poll

    def poll(self) -> int | None:
        return self._poll()

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.poll()
            if rc is not None:
                return rc
            time.sleep(0.01)
        return None


class Zygote:
    """Stage runs forked from one process that imported everything once."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--zygote"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
        self.exits: dict[int, int] = {}
        self.pids: list[int] = []
        self.ready: dict | None = None
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()  # it imports while the caller works

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.cond:
                if "ready" in message:
                    self.ready = message
                    if message["threads"] != 1:
                        print(f"soak: warning: the zygote has {message['threads']} threads before forking", flush=True)
                elif "pid" in message:
                    self.pids.append(message["pid"])
                else:
                    self.exits[message["exit"]] = message["rc"]
                self.cond.notify_all()

    def start(self, module: str, argv: list[str], env: dict, log: Path) -> Proc:
        request = {"module": module, "argv": argv, "env": env, "log": str(log), "cwd": str(REPO)}
        with self.cond:
            if not self.cond.wait_for(lambda: self.ready is not None or self.proc.poll() is not None, timeout=600) \
                    or self.ready is None:
                raise RuntimeError("the zygote process did not start")
            before = len(self.pids)
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            if not self.cond.wait_for(lambda: len(self.pids) > before, timeout=60):
                raise RuntimeError("the zygote did not fork")
            pid = self.pids[before]

        def poll() -> int | None:
            with self.cond:
                return self.exits.get(pid)

        return Proc(pid, poll)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Spawner:
    """Each stage run a fresh `python -m` process."""

    def __init__(self, env: dict):
        self.env = env

    def start(self, module: str, argv: list[str], env: dict, log: Path) -> Proc:
        with open(log, "ab") as f:
            proc = subprocess.Popen([sys.executable, "-m", module, *argv], env={**self.env, **env}, cwd=REPO,
                                    stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        return Proc(proc.pid, proc.poll)

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- stages


@dataclasses.dataclass
class Event:
    """A write phase seen from outside: the paths (relative to RUN) that exist while it runs."""

    name: str
    match: Callable[[str], bool]
    jitter_s: float = 0.03


def _under(prefix: str, start: str) -> Callable[[str], bool]:
    return lambda rel: rel.startswith(prefix) and os.path.basename(rel).startswith(start) and rel.count(os.sep) == prefix.count("/")


@dataclasses.dataclass
class Stage:
    name: str
    module: str
    base: str | None  # the reference stage whose outputs this one starts from
    extra: list[str]
    events: list[Event]
    timeout_s: float = 600.0


STAGES = {
    "data": Stage("data", "eagleforge.data", None, [], [
        Event("generation", lambda rel: rel == "data/conversations.jsonl", 0.2),
        Event("samples write", _under("data/", ".tmp-samples"), 0.002),
    ]),
    "extract": Stage("extract", "eagleforge.extract", "data", [], [
        Event("shard write", _under("hidden/", ".tmp-shard"), 0.005),
        Event("forward", _under("hidden/", "shard-"), 0.05),
    ]),
    "vocab": Stage("vocab", "eagleforge.vocab", "extract", [], [
        Event("vocab write", _under("vocab/", ".tmp-"), 0.005),
        Event("safetensors temp file", lambda rel: rel.startswith("vocab/") and bool(_SAFETENSORS_TMP.fullmatch(rel[6:])), 0.0),
    ]),
    "train": Stage("train", "eagleforge.train", "vocab", [], [
        Event("checkpoint save", _under("checkpoints/", ".tmp-step"), 0.03),
        Event("export", _under("", ".tmp-draft"), 0.02),
        Event("train step", _under("checkpoints/", "step-"), 0.05),
    ]),
    "online": Stage("online", "eagleforge.train", "data", ONLINE, [
        Event("cache write", _under("hidden/", ".tmp-shard"), 0.005),
        Event("checkpoint save", _under("checkpoints/", ".tmp-step"), 0.03),
        Event("export", _under("", ".tmp-draft"), 0.02),
    ]),
    "train2": Stage("train2", "eagleforge.train", "vocab", ["launch.nproc=2"], [
        Event("checkpoint save", _under("checkpoints/", ".tmp-step"), 0.05),
        Event("export", _under("", ".tmp-draft"), 0.02),
        Event("train step", _under("checkpoints/", "step-"), 0.05),
    ]),
    "eval": Stage("eval", "eagleforge.eval", "train", [], [
        Event("results write", _under("eval/", ".tmp-results"), 0.002),
        Event("plots", lambda rel: rel == "eval/results.json", 0.05),
    ]),
}
ORDER = list(STAGES)


def classify(stage: Stage, snap: dict, before: dict, started_ns: int, total_steps: int | None, run: Path,
             log: str = "") -> str:
    """The phase a kill landed in, from the run directory as it was at the kill (`before`: as it
    was when this run started; temp files an earlier kill left there say nothing about this one)
    and this run's log lines (`log`)."""
    fresh = {rel for rel, (_, mtime, _) in snap.items() if mtime >= started_ns}
    temp = sorted(rel for rel in snap if is_temp(rel) and before.get(rel) != snap[rel])

    def has(prefix: str) -> bool:
        return any(part.startswith(prefix) for rel in temp for part in rel.split(os.sep))

    if has(".tmp-step"):
        step_dir = next(rel for rel in temp if os.path.basename(rel).startswith(".tmp-step"))
        return "checkpoint save (publish)" if f"{step_dir}/checksums.json" in snap else "checkpoint save (write)"
    if has(".old-step"):
        return "checkpoint swap"
    if has(".pruned-step"):
        return "checkpoint prune"
    if has(".tmp-draft") or has(".old-draft"):
        return "export"
    if has(".tmp-shard"):
        return "cache write" if stage.name == "online" else "shard write"
    if has(".tmp-manifest"):
        return "cache manifest write" if stage.name == "online" else "manifest write"
    for prefix, phase in ((".tmp-vocab_map", "vocab write"), (".tmp-target_head", "vocab write"),
                          (".tmp-samples", "samples write"), (".tmp-stats", "stats write"),
                          (".tmp-train_summary", "summary write"), (".tmp-results", "results write"),
                          (".tmp-config", "config write")):
        if has(prefix):
            return phase
    for rel in temp:
        if _SAFETENSORS_TMP.fullmatch(os.path.basename(rel)):  # inside save_file, before its own rename
            where = os.path.dirname(rel)
            return {"vocab": "vocab write", "hidden": "cache write" if stage.name == "online" else "shard write"}.get(
                where, "write of a safetensors file in " + (where or "RUN")) + " (safetensors' temp file)"
    if temp:
        return "write of " + temp[0]
    if "config.yaml" not in fresh:
        return "startup"
    if stage.name == "data":
        conv = run / "data" / "conversations.jsonl"
        if "regeneration:" not in log:  # logged as the first batch starts
            return "prompts and target load"
        data = conv.read_bytes() if "data/conversations.jsonl" in snap else b""
        if data and not data.endswith(b"\n"):
            return "conversations append (torn line)"
        if data.count(b"\n") < 8:
            return "generation"
        return "tokenize" if "data/samples.jsonl" not in fresh else "exit"
    if stage.name == "extract":
        return "target load" if not any(rel.startswith("hidden") for rel in fresh) else "forward"
    if stage.name == "vocab":
        return "counting" if not any(rel.startswith("vocab" + os.sep) for rel in fresh) else "exit"
    if stage.name in ("train", "online", "train2"):
        done = any(rel.startswith("draft") for rel in fresh)
        if done:
            return "exit"
        partial = [rel for rel, (_, _, d) in snap.items() if d and rel.startswith("checkpoints" + os.sep + "step-")
                   and rel.count(os.sep) == 1 and rel + os.sep + "checksums.json" not in snap]
        if partial:
            return "checkpoint prune"
        rows = _csv_steps(run / "train_log.csv") if "train_log.csv" in snap else []
        if "train_log.csv" not in fresh:
            return "setup (target/draft load, resume)"
        if total_steps is not None and rows and rows[-1] >= total_steps:
            return "final checkpoint and held-out eval"
        return "train steps" if stage.name != "online" else "target forward and train steps"
    if stage.name == "eval":
        if "eval: " not in log:  # logged as decoding starts
            return "target and draft load"
        if "eval/results.json" not in fresh:
            return "decoding"
        return "plots"
    return "running"


def _fs_lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def _fs_hit(path: Path) -> dict | None:
    if not path.exists():
        return None
    return next((line for line in _fs_lines(path) if line.get("hit")), None)


def _fs_calls(path: Path) -> dict[str, list]:
    """RANK -> the [op, paths] calls under RUN of that rank's process, in order (count mode)."""
    out: dict[str, list] = {}
    for line in _fs_lines(path):
        if "calls" in line and line["calls"]:
            out.setdefault(line["rank"], []).extend(line["calls"])
    return out


def _short(path: str, run: Path, cache: Path, digits: bool = True) -> str:
    """`path` from RUN (or EAGLEFORGE_CACHE/) on; digits as N unless `digits` is false."""
    for root, name in ((str(run), ""), (str(cache), "EAGLEFORGE_CACHE/")):
        if path.startswith(root + os.sep):
            path = name + path[len(root) + 1:]
    if not digits:
        return path
    return re.sub(r"\d+", "N", re.sub(r"[0-9a-f]{16,}", "<hash>", path))


def fs_point(hit: dict, run: Path, cache: Path) -> str:
    """'after replace hidden/.tmp-shard-N.safetensors -> hidden/shard-N.safetensors' (digits as N)."""
    paths = " -> ".join(_short(p, run, cache) for p in hit["paths"])
    rank = f" (rank {hit['rank']})" if hit.get("rank") else ""
    return f"{hit['when']} {hit['op']} {paths}{rank}"


def _path_pattern(rel: str) -> str:
    """A regular expression for `rel` in any run: the host and process id that name a temporary
    file's directory or a directory swap's (`.tmp-<name>-<host>-<pid>`, `.old-<name>-<host>-<pid>`:
    eagleforge/atomic.py) match any."""
    out, pos = [], 0
    for m in re.finditer(r"\.(?:tmp|old)-[^/]+?-([A-Za-z0-9._]+-\d+)(?=/|$)", rel):
        out += [re.escape(rel[pos:m.start(1)]), r"[A-Za-z0-9._]+-\d+"]
        pos = m.end(1)
    return "^" + "".join(out) + re.escape(rel[pos:]) + "$"


def fs_plans(ref: "Reference") -> list[dict]:
    """Every file-system kill point of the reference run, before and after each call of each rank:
    the n-th call of that op on that path (a path regular expression: the export's temporary
    directory is named by the process id), which a resumed run reaches when it redoes that write."""

    plans = []
    for rank, calls in sorted(ref.fs_calls.items()):
        seen: Counter = Counter()
        for op, paths in calls:
            rel = _short(paths[0], ref.run, ref.cache, digits=False)
            pattern = _path_pattern(rel)
            seen[(op, pattern)] += 1
            for when in ("before", "after"):
                point = fs_point({"op": op, "paths": paths, "when": when, "rank": rank}, ref.run, ref.cache)
                plans.append({"kind": "fs", "rank": rank, "op": op, "path": pattern, "n": seen[(op, pattern)],
                              "when": when, "point": point})
    return plans


def fs_phase(stage: Stage, hit: dict, run: Path, cache: Path) -> str:
    """The write phase that a file-system kill point belongs to."""
    op = hit["op"]
    path = _short(hit["paths"][0], run, cache)
    dest = _short(hit["paths"][-1], run, cache)
    online = stage.name == "online"
    if path in ("checkpoints", "checkpoints" + os.sep):
        return "checkpoint save (publish)"  # the directory's fsync after the rename (replace_dir)
    if path.startswith("checkpoints"):
        if ".old-step" in path or ".old-step" in dest:
            return "checkpoint swap"
        if ".pruned-step" in path or ".pruned-step" in dest:
            return "checkpoint prune"
        if ".tmp-step" in path:
            return "checkpoint save (publish)" if op in ("replace", "rename") and ".tmp-step" not in dest else "checkpoint save (write)"
        return "checkpoint save (publish)" if op in ("replace", "rename") else "checkpoint prune"
    if "draft" in path.split(os.sep)[0]:
        return "export"
    if path.startswith("hidden"):
        if "manifest" in path:
            return "cache manifest write" if online else "manifest write"
        return "cache write" if online else "shard write"
    for needle, phase in (("vocab", "vocab write"), ("samples", "samples write"), ("stats", "stats write"),
                          ("conversations", "generation (append)"), ("config.yaml", "config write"),
                          ("train_summary", "summary write"), ("eval/", "results write"),
                          ("EAGLEFORGE_CACHE/ngram", "ngram cache write")):
        if needle in path:
            return phase
    if op == "fsync" and path in ("", "data", "eval"):
        return f"{path or 'RUN'}/ directory fsync after a rename"
    return f"file-system: {op} {path}"


def _csv_steps(path: Path) -> list[int]:
    try:
        with open(path, newline="") as f:
            return [int(row["step"]) for row in csv.DictReader(f) if row.get("step", "").isdigit()]
    except OSError:
        return []


# ----------------------------------------------------------------------------- comparisons


def _norm(obj, run: str):
    if isinstance(obj, dict):
        return {k: _norm(v, run) for k, v in obj.items() if k not in VOLATILE_KEYS}
    if isinstance(obj, list):
        return [_norm(v, run) for v in obj]
    if isinstance(obj, str):
        return obj.replace(run, "<RUN>")
    return obj


def _json(path: Path, run: Path):
    return _norm(json.loads(path.read_text(encoding="utf-8")), str(run))


def _diff(a, b, where: str = "") -> str:
    """The first place where two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{where}.{key}: only in {'the resumed run' if key in a else 'the reference'}"
            if a[key] != b[key]:
                return _diff(a[key], b[key], f"{where}.{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _diff(x, y, f"{where}[{i}]")
    return f"{where}: {str(a)[:120]} != {str(b)[:120]}"


def _dcp_metadata(checkpoint: Path) -> dict:
    from eagleforge.train.checkpoint_integrity import safe_reader

    metadata = safe_reader(checkpoint).read_metadata()
    return {key: value for key, value in vars(metadata).items() if key != "storage_meta"}


def _safetensors_content(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


def compare_file(rel: str, got: Path, want: Path, got_run: Path, want_run: Path) -> str | None:
    """None when the resumed run's file equals the reference's (by the file's contract)."""
    g, w = got / rel, want / rel
    base = os.path.basename(rel)
    if base.endswith(".json") and base != "checksums.json":
        a, b = _json(g, got_run), _json(w, want_run)
        return None if a == b else f"{rel}: {_diff(a, b)}"
    if base == "checksums.json":  # config.yaml, .metadata, state.json: compared by themselves (run directory, run_id apart)
        a, b = json.loads(g.read_text()), json.loads(w.read_text())
        for name in ("config.yaml", ".metadata", "state.json"):
            a.pop(name, None), b.pop(name, None)
        return None if a == b else f"{rel}: {_diff(a, b)}"
    if base == ".metadata":  # DCP's index; its storage_meta holds the path written and random save ids
        a, b = _dcp_metadata(g.parent), _dcp_metadata(w.parent)
        return None if a == b else f"{rel}: DCP's tensor index differs"
    if base == "config.yaml":
        a, b = g.read_text().replace(str(got_run), "<RUN>"), w.read_text().replace(str(want_run), "<RUN>")
        return None if a == b else f"{rel}: differs beyond the run directory"
    if base == "train_log.csv":
        return compare_train_log(g, w)
    if base == "conversations.jsonl":
        return compare_conversations(g, w)
    if rel.startswith("vocab" + os.sep) and base.endswith(".safetensors"):
        if sha256(g) == sha256(w):
            return None
        (ma, ta), (mb, tb) = _safetensors_content(g), _safetensors_content(w)
        if ma != mb:
            return f"{rel}: metadata {_diff(ma, mb)}"
        for key in sorted(set(ta) | set(tb)):
            if key not in ta or key not in tb or not _bitwise_equal(ta[key], tb[key]):
                return f"{rel}: tensor {key} differs"
        return None  # same tensors and metadata; the bytes differ only in the header's key order
    return None if sha256(g) == sha256(w) else f"{rel}: sha256 differs"


def _bitwise_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def compare_train_log(got: Path, want: Path) -> str | None:
    def rows(path):
        with open(path, newline="") as f:
            return list(csv.DictReader(f))

    a, b = rows(got), rows(want)
    steps = [r["step"] for r in a]
    if len(set(steps)) != len(steps):
        twice = sorted({s for s in steps if steps.count(s) > 1}, key=int)
        return f"train_log.csv: steps logged more than once: {twice}"
    if steps != [r["step"] for r in b]:
        return f"train_log.csv: steps {steps} != the reference's {[r['step'] for r in b]}"
    for x, y in zip(a, b):
        for key in y:
            if key != "tokens_per_s" and x.get(key) != y[key]:
                return f"train_log.csv: step {y['step']} {key} {x.get(key)} != {y[key]}"
    return None


def compare_conversations(got: Path, want: Path) -> str | None:
    a = [json.loads(line) for line in got.read_text(encoding="utf-8").splitlines()]
    b = [json.loads(line) for line in want.read_text(encoding="utf-8").splitlines()]
    ids = [r["id"] for r in a]
    if len(set(ids)) != len(ids):
        return f"conversations.jsonl: ids answered more than once: {sorted({i for i in ids if ids.count(i) > 1})}"
    if sorted(a, key=lambda r: r["id"]) != sorted(b, key=lambda r: r["id"]):
        return "conversations.jsonl: the answers differ from the reference's"
    return None


def checkpoint_tensors(checkpoint: Path) -> dict:
    """Every tensor of a checkpoint, full, on the CPU, in the dtype it was saved in: the model's
    (`model.draft.*`: fp32 weights, or bf16 weights with train.param_dtype=bfloat16) and the
    optimizer's (`optim.*`: fp32 moments and step counts; the int16 master remainders of bf16
    weights), whatever number of ranks wrote it. Read through the checksum and metadata checks that
    resume and export use."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from eagleforge.train.checkpoint import _single_process_ok, read_state
    from eagleforge.train.checkpoint_integrity import dcp_errors, safe_reader

    read_state(checkpoint)  # every file matches checksums.json
    reader = safe_reader(checkpoint)
    with dcp_errors(reader, checkpoint):
        index = reader.read_metadata().state_dict_metadata
    tensors = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in index.items()
               if isinstance(entry, TensorStorageMetadata)}
    with _single_process_ok(), dcp_errors(reader, checkpoint):
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def state_kind(key: str, tensor) -> str:
    """What a checkpoint tensor is: a weight, a buffer (the vocabulary maps), a master remainder, a
    moment, a step count."""
    if key.startswith("model."):
        return "weight" if tensor.is_floating_point() else "buffer"
    if key.endswith(".master_remainder"):
        return "master remainder"
    if key.endswith((".exp_avg", ".exp_avg_sq")):
        return "moment"
    if key.endswith(".step"):
        return "step count"
    return "optimizer state"


def compare_final_state(got: Path, want: Path) -> tuple[list[str], dict]:
    """The newest checkpoints of two runs, tensor by tensor in their own dtypes, bitwise: weights
    (fp32, or bf16 with their int16 master remainders: together the exact fp32 masters), fp32
    moments and step counts. (differences, {kind and dtype: tensors compared})."""
    from eagleforge.train.checkpoint import latest_checkpoint

    a, b = latest_checkpoint(got), latest_checkpoint(want)
    if a is None or b is None or a.name != b.name:
        return [f"final checkpoint {a and a.name} != {b and b.name}"], {}
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    diffs, compared = [], Counter()
    for key in sorted(set(ta) | set(tb)):
        kind = state_kind(key, tb.get(key, ta.get(key)))
        if key not in ta or key not in tb:
            diffs.append(f"final state: {key} ({kind}) only in {'the resumed run' if key in ta else 'the reference'}")
            continue
        x, y = ta[key], tb[key]
        if x.dtype != y.dtype or x.shape != y.shape:
            diffs.append(f"final state: {key} ({kind}) is {x.dtype} {tuple(x.shape)}, the reference's {y.dtype} {tuple(y.shape)}")
        elif not _bitwise_equal(x, y):
            diffs.append(f"final state: {key} ({kind}, {y.dtype}) differs in {_differing(x, y)} of {y.numel()} elements")
        else:
            compared[f"{kind} {str(y.dtype).replace('torch.', '')}"] += 1
    return diffs, dict(compared)


def _differing(a, b) -> int:
    """How many elements of two tensors of one dtype and shape differ in their bits."""
    import torch

    bits = [t.contiguous().view(-1).view(torch.uint8).view(-1, t.element_size()) for t in (a, b)]
    return int((bits[0] != bits[1]).any(dim=1).sum())


def compare_runs(stage: Stage, got: Path, want: Path, got_cache: Path) -> tuple[list[str], list[str]]:
    """(differences, things left behind) of a resumed run against the reference."""
    a, b = names(got), names(want)
    left = sorted(rel for rel in a - b)
    left += [f"EAGLEFORGE_CACHE/{rel}" for rel in names(got_cache) if is_temp(rel)]
    diffs = [f"missing: {rel}" for rel in sorted(b - a)]
    for rel in sorted(a & b):
        if (got / rel).is_dir():
            continue
        problem = compare_file(rel, got, want, got, want)
        if problem:
            diffs.append(problem)
    if stage.name in ("train", "online", "train2"):
        # the checkpoints' files are compared by sha256 above; this names what differs in the final one
        try:
            state_diffs, compared = compare_final_state(got, want)
        except Exception as err:  # noqa: BLE001 - an unreadable checkpoint is a difference, not a crash of the soak
            state_diffs, compared = [f"final state: cannot be read ({str(err).splitlines()[0][:200]})"], {}
        diffs += state_diffs
        weights = compared.get("weight float32", 0) + compared.get("weight bfloat16", 0)
        if not state_diffs and not weights:
            diffs.append(f"final state: no weights compared ({compared})")
        elif not state_diffs and compared.get("master remainder int16", 0) != compared.get("weight bfloat16", 0):
            diffs.append(f"final state: not one master remainder per bf16 weight ({compared})")
    return diffs, left


# ----------------------------------------------------------------------------- the soak


@dataclasses.dataclass
class Reference:
    run: Path
    seconds: float
    appearances: dict[str, int]
    total_steps: int | None
    fs_calls: dict[str, list]  # RANK ("" = the one process) -> its [op, paths] calls under RUN, in order
    cache: Path  # its EAGLEFORGE_CACHE


class Soak:
    def __init__(self, out: Path, seed: int, spawn: bool, log: Callable[[str], None] = print, overrides: list[str] = ()):
        out = Path(out).resolve()  # the file-system points are absolute paths
        self.out, self.seed, self.log, self.overrides = out, seed, log, list(overrides)
        self.env = base_env()
        self.runner = Spawner(self.env) if spawn else Zygote(self.env)
        self.refs: dict[tuple[str, tuple[str, ...]], Reference] = {}  # (stage, its overrides) -> its uninterrupted run
        self.kills: list[dict] = []
        self.trials: list[dict] = []
        self.failures: list[dict] = []
        self.target = out / "target"
        self.counter = 0

    def close(self) -> None:
        self.runner.close()

    # -- running one attempt

    def args(self, stage: Stage, run: Path, overrides: tuple[str, ...] = ()) -> list[str]:
        return [f"run_dir={run}", f"target.path={self.target}", *COMMON, *stage.extra, *self.overrides, *overrides]

    def attempt(self, stage: Stage, run: Path, cache: Path, logfile: Path, plan: dict | None, tag: str,
                total_steps: int | None = None, overrides: tuple[str, ...] = ()) -> dict:
        """Run the stage once (`overrides`: config overrides of this run on top of the soak's);
        with a plan, SIGKILL it at the planned moment (else count its write phases and
        file-system calls). Returns what happened."""
        env = {"EAGLEFORGE_CACHE": str(cache), "SOAK_TAG": tag}
        fault_file = logfile.with_name(f"{logfile.stem}-fs-{self._tag()}.jsonl")
        if plan is None or plan["kind"] == "fs":
            env.update(SOAK_FAULT="count" if plan is None else f"{plan['op']}:{plan['n']}:{plan['when']}",
                       SOAK_FAULT_RANK="" if plan is None else plan["rank"], SOAK_FAULT_FILE=str(fault_file),
                       SOAK_FAULT_PATH="" if plan is None else plan["path"],
                       SOAK_FAULT_ROOTS=os.pathsep.join([str(run), str(cache)]),
                       PYTHONPATH=os.pathsep.join([str(HOOK_DIR), *filter(None, [self.env.get("PYTHONPATH")])]))
        with open(logfile, "a") as f:
            f.write(f"\n===== {stage.module} {' '.join(self.args(stage, run, overrides))}  plan={json.dumps(plan)}\n")
        before = scan(run)
        started_ns = time.time_ns()
        t0 = time.monotonic()
        proc = self.runner.start(stage.module, self.args(stage, run, overrides), env, logfile)
        try:
            seen: dict[str, set] = {e.name: {rel for rel in before if e.match(rel)} for e in stage.events}
            counts = Counter()
            kind = plan["kind"] if plan else None
            event = next((e for e in stage.events if kind == "event" and e.name == plan["event"]), None)
            fire_at = t0 + plan["delay_s"] if kind == "timed" else None
            deadline = t0 + stage.timeout_s
            hit = None
            while True:
                rc = proc.poll()
                if rc is not None:
                    return {"killed": False, "rc": rc, "seconds": time.monotonic() - t0, "appearances": dict(counts),
                            "fs_calls": _fs_calls(fault_file) if plan is None else {}}
                now = time.monotonic()
                if now > deadline:
                    pids = freeze(proc.pid)
                    kill_all(pids)
                    proc.wait(30)
                    return {"killed": False, "rc": None, "hung": True, "seconds": now - t0, "appearances": dict(counts)}
                if kind in (None, "event") and fire_at is None:
                    current = scan(run)
                    for e in stage.events:
                        now_present = {rel for rel in current if e.match(rel)}
                        counts[e.name] += len(now_present - seen[e.name])
                        seen[e.name] = now_present
                    if event is not None and counts[event.name] >= plan["occurrence"]:
                        fire_at = now + plan["jitter_s"]
                if kind == "fs" and fire_at is None:
                    hit = _fs_hit(fault_file)
                    if hit is not None:
                        fire_at = now
                if fire_at is not None and now >= fire_at:
                    break
                time.sleep(POLL_S if kind != "timed" else min(POLL_S * 5, max(0.0, fire_at - now)))
            pids = freeze(proc.pid)
            at = time.monotonic() - t0
            snap = scan(run)
            section = _tail(logfile, 20000).rsplit("\n===== ", 1)[-1]  # this run's lines
            phase = fs_phase(stage, hit, run, cache) if hit else classify(stage, snap, before, started_ns, total_steps, run, section)
            kill_all(pids)
            rc = proc.wait(30)
            gone = time.monotonic() + 10
            while time.monotonic() < gone and any(alive(p) for p in pids):
                time.sleep(0.02)
            survivors = [p for p in pids if alive(p)] + [p for p in tagged(tag) if p not in pids]
            kill_all(survivors)
            if rc is not None and rc != -signal.SIGKILL:  # it had ended by itself just before
                return {"killed": False, "rc": rc, "seconds": at, "appearances": dict(counts)}
            record = {"killed": True, "at_s": round(at, 3), "phase": phase, "processes": len(pids),
                      "temp_at_kill": sorted(rel for rel in snap if is_temp(rel) and before.get(rel) != snap[rel])[:6],
                      "last_line": _last_line(logfile), "survivors": survivors}
            if hit:
                record["fs_point"] = fs_point(hit, run, cache)
            return record
        except BaseException:  # Ctrl-C or SIGTERM of the soak: no stage process outlives it
            kill_all(freeze(proc.pid))
            raise

    # -- references

    def reference(self, name: str, overrides: tuple[str, ...] = ()) -> Reference:
        """The stage run uninterrupted on the reference outputs of the stages before it;
        `overrides`: config overrides of this stage's runs (the stages before it are the soak's
        own references), e.g. train.param_dtype=bfloat16 for a train stage."""
        overrides = tuple(overrides)
        if (name, overrides) in self.refs:
            return self.refs[(name, overrides)]
        stage, label = STAGES[name], _label(name, overrides)
        run = self.out / "ref" / label
        self._fresh_run(stage, run)
        cache = self.out / "ref" / f"cache-{label}"
        result = self.attempt(stage, run, cache, self.out / "ref" / f"{label}.log", None, self._tag(), overrides=overrides)
        if result["rc"] != 0:
            raise RuntimeError(f"the uninterrupted {label} stage failed (rc {result['rc']}): see {self.out / 'ref' / f'{label}.log'}"
                               f"\n{_tail(self.out / 'ref' / f'{label}.log')}")
        steps = _csv_steps(run / "train_log.csv")
        ref = Reference(run, result["seconds"], result["appearances"], steps[-1] if steps else None, result["fs_calls"], cache)
        self.refs[(name, overrides)] = ref
        calls = {rank or "one process": dict(Counter(op for op, _ in c)) for rank, c in ref.fs_calls.items()}
        self.log(f"reference {label}: {ref.seconds:.1f} s, write phases seen {ref.appearances}, file-system calls {calls}")
        return ref

    def _fresh_run(self, stage, run: Path) -> None:
        """`run` emptied, then holding the stage's base reference run (or nothing) to start from."""
        shutil.rmtree(run, ignore_errors=True)
        if stage.base:
            shutil.copytree(self.reference(stage.base).run, run, symlinks=True)
        else:
            run.mkdir(parents=True)

    def check_reference(self, name: str, overrides: tuple[str, ...] = ()) -> None:
        """A second uninterrupted run must equal the first, or no comparison means anything."""
        overrides = tuple(overrides)
        stage, ref, label = STAGES[name], self.reference(name, overrides), _label(name, overrides)
        run = self.out / "ref" / f"{label}-again"
        self._fresh_run(stage, run)
        cache = self.out / "ref" / f"cache-{label}-again"
        result = self.attempt(stage, run, cache, self.out / "ref" / f"{label}-again.log", None, self._tag(), overrides=overrides)
        diffs, left = compare_runs(stage, run, ref.run, cache) if result["rc"] == 0 else ([f"rc {result['rc']}"], [])
        if diffs or left:
            self.fail({"stage": name, "overrides": list(overrides), "trial_seed": None, "phase": "none (two uninterrupted runs)",
                       "symptom": "the uninterrupted run is not deterministic", "differences": diffs, "left_behind": left})
        else:
            self.log(f"reference {label}: a second uninterrupted run is equal")
            shutil.rmtree(run, ignore_errors=True)

    def _tag(self) -> str:
        self.counter += 1
        return f"{os.getpid()}-{self.counter}"

    def fail(self, failure: dict) -> None:
        self.failures.append(failure)
        self.log("FAIL " + json.dumps(failure, indent=1)[:4000])

    # -- trials

    def plan(self, rng: random.Random, stage: Stage, ref: Reference, cover: list[str]) -> dict:
        """A kill moment: a time (uniform over the reference's duration), the n-th appearance of a
        write phase plus a few ms, or right before/after one of the reference's file-system calls
        (the n-th call of that op on that path in that rank's process). `cover`: moments to take
        first, by write phase name or by a regular expression over the file-system points'
        descriptions ("fs:REGEX": a random match, "fs-first:REGEX", "fs-last:REGEX")."""
        events = [e for e in stage.events if ref.appearances.get(e.name)]
        points = fs_plans(ref)
        while cover:
            wanted = cover.pop(0)
            if wanted.startswith(("fs:", "fs-first:", "fs-last:")):  # a random matching point, the first, the last
                how, regex = wanted.split(":", 1)
                matching = [p for p in points if re.search(regex, p["point"])]
                if matching:
                    return dict({"fs": rng.choice(matching), "fs-first": matching[0], "fs-last": matching[-1]}[how])
                self.log(f"soak: no file-system point of {stage.name} matches {wanted!r}")
                continue
            event = next((e for e in events if e.name == wanted), None)
            if event is not None:
                return {"kind": "event", "event": wanted, "occurrence": rng.randint(1, ref.appearances[wanted]),
                        "jitter_s": round(rng.uniform(0, event.jitter_s), 4)}
        draw = rng.random()
        if draw < 0.35 and points:  # a point's description first (each write as likely), then one of its calls
            point = rng.choice(sorted({p["point"] for p in points}))
            return dict(rng.choice([p for p in points if p["point"] == point]))
        if draw < 0.7 and events:
            event = rng.choice(events)
            return {"kind": "event", "event": event.name, "occurrence": rng.randint(1, ref.appearances[event.name]),
                    "jitter_s": round(rng.uniform(0, event.jitter_s), 4)}
        return {"kind": "timed", "delay_s": round(rng.uniform(0, ref.seconds), 3)}

    def trial(self, name: str, trial_seed: int, kills: int, cover: list[str] = (), keep: bool = False,
              overrides: tuple[str, ...] = ()) -> dict:
        """Copy the stage's inputs, start and kill the stage `kills` times (each at a new moment,
        `cover`'s first), rerun it to the end, compare with the uninterrupted run of the same
        `overrides` (Soak.reference); the trial's record."""
        cover, overrides = list(cover), tuple(overrides)
        stage, ref, label = STAGES[name], self.reference(name, overrides), _label(name, overrides)
        rng = random.Random(trial_seed)
        root = self.out / "trials" / f"{label}-{trial_seed}"
        shutil.rmtree(root, ignore_errors=True)
        run, cache, logfile = root / "run", root / "cache", root / "stage.log"
        if stage.base:
            shutil.copytree(self.reference(stage.base).run, run, symlinks=True)
        else:
            run.mkdir(parents=True)
        tag = self._tag()
        planned, kills, problems = kills, [], []
        for _ in range(planned):
            plan = self.plan(rng, stage, ref, cover)
            result = self.attempt(stage, run, cache, logfile, plan, tag, ref.total_steps, overrides)
            if not result["killed"]:
                if result["rc"] != 0:
                    problems.append({"symptom": f"a run ended with rc {result['rc']} (after {len(kills)} kills)",
                                     "log_tail": _tail(logfile)})
                break
            record = {"stage": name, "trial_seed": trial_seed, "plan": plan, **result}
            kills.append(record)
            if result["survivors"]:
                problems.append({"symptom": "processes outlived the kill", "pids": result["survivors"], "phase": result["phase"]})
        if not problems:
            final = self.attempt(stage, run, cache, logfile, None, tag, ref.total_steps, overrides)
            if final["rc"] != 0:
                problems.append({"symptom": f"the rerun failed (rc {final['rc']}{', hung' if final.get('hung') else ''})",
                                 "log_tail": _tail(logfile)})
            left_running = tagged(tag)
            if left_running:
                kill_all(left_running)
                problems.append({"symptom": "processes left running after the rerun", "pids": left_running})
        if not problems:
            diffs, left = compare_runs(stage, run, ref.run, cache)
            if diffs:
                problems.append({"symptom": "outputs differ from the uninterrupted run's", "differences": diffs[:12]})
            if left:
                problems.append({"symptom": "left behind after the rerun", "paths": left[:12]})
        self.kills += kills
        phases = ", ".join(f"{k['phase']}{' [' + k['fs_point'] + ']' if 'fs_point' in k else ''} @{k['at_s']:.2f}s" for k in kills)
        status = "outputs equal, nothing left" if not problems else "FAIL: " + "; ".join(p["symptom"] for p in problems)
        self.log(f"[{label} seed={trial_seed}] {len(kills)} kill(s): {phases or '-'}; {status}")
        trial = {"stage": name, **({"overrides": list(overrides)} if overrides else {}), "trial_seed": trial_seed,
                 "kills": len(kills), "ok": not problems,
                 "phases": [k["phase"] for k in kills], "fs_points": [k.get("fs_point") for k in kills],
                 "problems": problems, "dir": str(root)}
        self.trials.append(trial)
        for problem in problems:
            self.fail({"stage": name, **({"overrides": list(overrides)} if overrides else {}), "trial_seed": trial_seed,
                       "phases": [k["phase"] for k in kills], "kills": [{k: v for k, v in rec.items() if k not in ("stage", "trial_seed")}
                                                                         for rec in kills], **problem, "dir": str(root)})
        if not problems and not keep:
            shutil.rmtree(root, ignore_errors=True)
        return trial


def _label(name: str, overrides: tuple[str, ...] = ()) -> str:
    """A stage's name with the overrides of its runs, as a file name: train+train.param_dtype=bfloat16."""
    return "+".join([name, *(re.sub(r"[^A-Za-z0-9._=-]+", "_", item) for item in overrides)])


def _last_line(path: Path) -> str:
    lines = [line for line in _tail(path, 4000).splitlines() if line.strip()]
    return lines[-1][-300:] if lines else ""


def _tail(path: Path, chars: int = 2500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return text.replace("\r", "\n")


def base_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CONFIG", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    return env


def make_target(path: Path) -> None:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (the embedded default's)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagleforge.target.loading import embedded_target_dir

    if (path / "config.json").is_file():
        return
    tokenizer = AutoTokenizer.from_pretrained(embedded_target_dir())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=80, num_hidden_layers=7,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a peaked next-token distribution, as a trained model's (random init is ~uniform)
        model.lm_head.weight.mul_(40.0)
    tmp = Path(tempfile.mkdtemp(dir=path.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)


def run_soak(out: Path, seed: int, kills: int | dict, stages: list[str] | None = None, max_kills: int = 3,
             cover: dict | None = None, check_reference: bool = True, spawn: bool = False, keep: bool = False,
             log: Callable[[str], None] = print, overrides: list[str] = ()) -> dict:
    """Soak `stages` until each has taken `kills` kills (an int, or a dict per stage), trials of 1
    to `max_kills` kills; `cover`: per stage, the kill moments to take first (Soak.plan). The report."""
    stages = stages or ORDER
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    log(f"soak: seed {seed}, {len(stages)} stages, {'fresh processes' if spawn else 'forked from one process'}, out {out}"
        + (f", overrides {' '.join(overrides)}" if overrides else ""))
    start = time.monotonic()
    soak = Soak(out, seed, spawn, log, overrides)  # the zygote imports meanwhile
    make_target(out / "target")
    try:
        for name in stages:
            soak.reference(name)
            if check_reference:
                soak.check_reference(name)
            goal = kills[name] if isinstance(kills, dict) else kills
            covering = list(cover.get(name, [])) if cover else []
            taken, attempts = 0, 0
            while taken < goal and attempts < 4 * goal + 4:
                attempts += 1
                n = rng.randint(1, max(1, min(max_kills, goal - taken)))
                first, covering = covering[:n], covering[n:]
                taken += soak.trial(name, rng.getrandbits(32), n, first, keep)["kills"]
    finally:
        soak.close()
    report = summarize(soak, seed, stages, time.monotonic() - start, spawn)
    report["overrides"] = list(overrides)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    log(format_report(report))
    return report


def summarize(soak: Soak, seed: int, stages: list[str], seconds: float, spawn: bool) -> dict:
    per_stage = {}
    for name in stages:
        kills = [k for k in soak.kills if k["stage"] == name]
        trials = [t for t in soak.trials if t["stage"] == name]
        per_stage[name] = {
            "kills": len(kills), "trials": len(trials), "trials_equal": sum(t["ok"] for t in trials),
            "phases": dict(Counter(k["phase"] for k in kills).most_common()),
            "kill_kinds": dict(Counter(k["plan"]["kind"] for k in kills)),
            "fs_points": dict(Counter(k["fs_point"] for k in kills if "fs_point" in k).most_common()),
        }
    return {"seed": seed, "seconds": round(seconds, 1), "mode": "spawn" if spawn else "fork", "kills": len(soak.kills),
            "trials": len(soak.trials), "stages": per_stage, "failures": soak.failures,
            "reference_seconds": {_label(*k): round(v.seconds, 2) for k, v in soak.refs.items()},
            "kill_log": soak.kills}


def format_report(report: dict) -> str:
    lines = [f"soak seed {report['seed']}: {report['kills']} kills in {report['trials']} trials, "
             f"{report['seconds']:.0f} s ({report['mode']}), {len(report['failures'])} failure(s)"]
    for name, s in report["stages"].items():
        phases = ", ".join(f"{p} {n}" for p, n in s["phases"].items())
        lines.append(f"  {name:8s} {s['kills']:4d} kills, {s['trials_equal']}/{s['trials']} trials equal; {phases}")
    for f in report["failures"]:
        lines.append(f"  FAIL {f['stage']} trial seed {f['trial_seed']} phases {f.get('phases', f.get('phase'))}: {f['symptom']}: "
                     + "; ".join(f.get("differences", []) + f.get("paths", []))[:600])
    return "\n".join(lines)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up as Ctrl-C does: the stage's processes, the zygote


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=30, help="kills per stage (default 30: 210 over the 7 stages)")
    parser.add_argument("--seed", type=int, default=None, help="the soak's seed (default: random, printed)")
    parser.add_argument("--stages", default=",".join(ORDER), help=f"comma-separated, of {','.join(ORDER)}")
    parser.add_argument("--max-kills-per-trial", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--spawn", action="store_true", help="every run a fresh python -m process")
    parser.add_argument("--keep", action="store_true", help="keep the trials that passed too")
    parser.add_argument("--no-reference-check", action="store_true", help="skip the second uninterrupted run per stage")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every stage's runs, e.g. --set train.bf16=false (repeatable)")
    parser.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.zygote:
        zygote_main()
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stage(s) {unknown}; known: {ORDER}")
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(32)
    out = args.out or Path(tempfile.mkdtemp(prefix="eagleforge-soak-"))
    cover = {name: [e.name for e in STAGES[name].events] for name in stages}  # each write phase at least once
    report = run_soak(out, seed, args.kills, stages, args.max_kills_per_trial, cover, check_reference=not args.no_reference_check,
                      spawn=args.spawn, keep=args.keep, log=lambda line: print(line, flush=True), overrides=args.set)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
