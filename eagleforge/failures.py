"""How a stage that fails says so: one line on stderr, once, also when torchrun runs many ranks.

One process: `error: <message>` and exit code 2 (`run_main` in eagleforge/config.py).

Under torchrun (WORLD_SIZE > 1) every rank runs the same code, so a bad input usually fails
every rank the same way, and a rank that fails alone leaves the others blocked in a collective,
which fail with a transport error of their own once it exits. Printed as they come, that is one
line per rank plus a traceback per blocked rank, and torchrun's summary may name a blocked rank
as the first failure. So the ranks meet on torchrun's own key-value store (the TCPStore at
MASTER_ADDR:MASTER_PORT that the agent keeps for the whole run):

  - a rank with a user error posts its line there, then waits up to AGREE_SECONDS for the other
    ranks' lines;
  - when every rank posted the same line, rank 0 prints it: `error: <message>`;
  - else the lowest rank that posted prints each distinct line once, with the ranks that posted
    it: `error: rank 3: <message>`, `error: ranks 1, 3: <message>` (a claim key per line keeps
    two ranks that decide at the same moment from both printing it);
  - the rank that printed writes the same line to torchrun's error file (TORCHELASTIC_ERROR_FILE,
    as torch's `@record` does, without a traceback) and exits first, with code 2; the other
    ranks print nothing and wait until torchrun stops them, so its summary names the rank that
    printed, with the line;
  - a rank that fails with any other exception while another rank posts a user error (within
    AGREE_SECONDS: its collective lost that peer, which closes its connections as its error
    unwinds, a moment before it posts) prints nothing: its failure is a consequence.

Without a store to meet on (a launcher that set WORLD_SIZE but keeps no store, or a store that
is not up yet), each failing rank prints its own line, with its rank number.

A rank that fails while the others are busy elsewhere (a group's leader whose disk filled, while
other groups go on extracting, or ranks blocked in a collective with it that NCCL would hold until
the process group's timeout) must not leave them running: every rank watches the store
(`watch_other_ranks`, a daemon thread) and, once another rank posted a user error, ends itself
within seconds of that line being printed (torchrun usually stops it first).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import NoReturn

from eagleforge.errors import UserInputError

# How long a failed rank waits for the other ranks' errors before printing. A rank that fails
# later does not print the same line again (it finds it claimed); only the "rank R:" label differs.
AGREE_SECONDS = 3.0
CONNECT_SECONDS = 5.0  # to reach the store
STOP_WAIT_SECONDS = 60.0  # how long a rank that prints nothing waits to be stopped by torchrun
POLL_SECONDS = 0.05
WATCH_SECONDS = 0.5  # how often a rank looks for another rank's posted error
# After another rank's line is printed: how long a watching rank leaves torchrun to stop it (so
# the summary blames the rank that failed) before it ends itself; outside torchrun, at once.
STOP_GRACE_SECONDS = 5.0


# The longest error line printed: a message built from a crafted file (a config.json naming 20,000
# aux layers) is cut there, with the count of what was cut; it starts with the file it names.
MAX_LINE_CHARS = 2000


def one_line(err: BaseException) -> str:
    """The error's message on one line (a message of several lines is joined with spaces), at most
    MAX_LINE_CHARS characters and a count of the rest."""
    from eagleforge.errors import bounded_text

    parts = [part.strip() for part in str(err).splitlines() if part.strip()]
    return bounded_text(" ".join(parts), MAX_LINE_CHARS) or type(err).__name__


def out_of_memory(stage: str, key: str, value: int, planned_bytes: float | None, device=None) -> Exception:
    """The one line for a GPU out of memory in `stage`: the batch-size key to lower, its value, and
    what the stage's memory plan counted (None: no plan for this path)."""

    where = f" on {device}" if device is not None else ""
    plan = (f"the memory plan counted {planned_bytes / 2**30:.1f} GiB per GPU at this size" if planned_bytes
            else "no memory plan covers this path")
    return UserInputError(f"{stage}: out of GPU memory{where} at {key}={value} ({plan}); lower {key} "
                          f"(`make plan` prints the plan for the native backend and online training)")


def exit_with_user_error(err: BaseException) -> NoReturn:
    """Print a user's mistake as one `error: ...` line (once over all ranks) and exit 2."""
    line = one_line(err)
    rank, world = _rank_and_world()
    if world <= 1:
        _report([f"error: {line}"])
        raise SystemExit(2)
    board = _Board.connect()
    if board is None:
        _report([f"error: rank {rank}: {line}"])
        raise SystemExit(2)
    try:
        board.post(rank, line)
        lines = _lines_to_print(rank, world, board.wait_for(world, AGREE_SECONDS), board)
    except Exception:  # the store went away (its host exited): say it here
        lines = [f"error: rank {rank}: {line}"]
    if lines:
        _report(lines)
        board.mark_printed()
        raise SystemExit(2)
    if not board.wait_to_be_stopped():
        _report([f"error: rank {rank}: {line}"])  # nobody printed it after all
    raise SystemExit(2)


def exit_if_another_rank_failed(err: BaseException) -> None:
    """For an exception that is not a user error: when another rank posts a user error within
    AGREE_SECONDS, this one is its consequence (a collective that lost its peer: the failed rank
    closes its connections as its exception unwinds, just before it posts), so print nothing,
    wait to be stopped, exit 1. Otherwise return, and the caller raises it as usual."""
    rank, world = _rank_and_world()
    if world <= 1:
        return
    board = _Board.connect()
    if board is None:
        return
    try:
        others = board.wait_for_another(rank, AGREE_SECONDS)
    except Exception:  # no store, no report: the exception is shown as it is
        return
    if others and board.wait_to_be_stopped():
        raise SystemExit(1)


_watch_stop = threading.Event()
_watcher: threading.Thread | None = None


def watch_other_ranks() -> None:
    """Under torchrun (WORLD_SIZE > 1, its store reachable): a daemon thread that ends this rank
    (exit code 1, nothing printed) once another rank has posted a user error and it was printed,
    so a failure stops every rank within seconds wherever they are, not at their next collective
    with the failed rank (which NCCL may hold until the process group's timeout). A rank that
    posted an error itself leaves its own exit to exit_with_user_error."""
    rank, world = _rank_and_world()
    if world <= 1 or not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        return

    def watch() -> None:
        board = _Board.connect()
        while board is None:  # the store may come up only with the process group (rank 0 holds it outside torchrun)
            if _watch_stop.wait(WATCH_SECONDS):
                return
            board = _Board.connect()
        try:
            while True:
                posted = board.posted()
                if rank in posted:
                    return
                if posted:
                    break
                if _watch_stop.wait(WATCH_SECONDS):
                    return
        except Exception:  # noqa: BLE001 - no store any more (the run ended): nothing to watch
            return
        try:
            deadline = time.monotonic() + AGREE_SECONDS + 2.0  # the failed rank prints after AGREE_SECONDS
            while not board.store.check([board.prefix + "printed"]) and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS * 4)
            if rank in board.posted():
                return
            time.sleep(STOP_GRACE_SECONDS if "TORCHELASTIC_RUN_ID" in os.environ else POLL_SECONDS)
        except Exception:  # noqa: BLE001 - the store went with the rank that failed (it held it)
            pass
        sys.stderr.flush()
        os._exit(1)  # from any state: blocked in a collective, in a forward, in a write (all atomic)

    global _watcher
    _watch_stop.clear()
    _watcher = threading.Thread(target=watch, name="other-ranks-failures", daemon=True)
    _watcher.start()


def stop_watching() -> None:
    """End `watch_other_ranks`'s thread once the stage's work is done, before the process exits:
    no thread is then inside a store call (C++) while the interpreter and torch shut down."""
    global _watcher
    _watch_stop.set()
    if _watcher is not None:
        _watcher.join(timeout=2 * CONNECT_SECONDS)  # a connect attempt in progress runs out first
        _watcher = None


def _rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _lines_to_print(rank: int, world: int, posted: dict[int, str], board: _Board) -> list[str]:
    """What this rank prints, given the lines posted so far ({rank: line})."""
    if len(posted) == world and len(set(posted.values())) == 1:
        line = posted[0]
        return [f"error: {line}"] if rank == 0 and board.claim(line) else []
    if rank != min(posted):
        return []
    ranks_of: dict[str, list[int]] = {}
    for r in sorted(posted):
        ranks_of.setdefault(posted[r], []).append(r)
    out = []
    for line, ranks in ranks_of.items():
        if board.claim(line):
            who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
            out.append(f"error: {who}: {line}")
    return out


def _report(lines: list[str]) -> None:
    """Write torchrun's error file (when it asked for one), then print the lines."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        text = "\n".join(lines)
        data = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(data, f)
        except OSError:
            pass  # the summary then shows no message; the line below is still printed
    for line in lines:
        print(line, file=sys.stderr, flush=True)


class _Board:
    """This run's failures on torchrun's store: the posted lines (one JSON row per failed rank,
    appended to one key), a claim counter per line, and a flag once a line is printed."""

    def __init__(self, store, prefix: str):
        self.store, self.prefix = store, prefix

    @classmethod
    def connect(cls) -> _Board | None:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        try:
            from torch.distributed import TCPStore

            store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=CONNECT_SECONDS),
                             wait_for_workers=False)
        except Exception:  # no store (or not torch's): each rank reports alone
            return None
        # torchrun's restart count: a restarted attempt must not see the last attempt's lines
        return cls(store, f"eagleforge/failures/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")

    def post(self, rank: int, line: str) -> None:
        self.store.append(self.prefix + "lines", json.dumps([rank, line]) + "\n")

    def posted(self) -> dict[int, str]:
        key = self.prefix + "lines"
        if not self.store.check([key]):
            return {}
        out = {}
        for row in self.store.get(key).decode("utf-8").splitlines():
            rank, line = json.loads(row)
            out.setdefault(int(rank), line)
        return out

    def wait_for(self, world: int, seconds: float) -> dict[int, str]:
        """The posted lines once every rank posted, or when `seconds` have passed."""
        deadline = time.monotonic() + seconds
        while True:
            posted = self.posted()
            if len(posted) >= world or time.monotonic() >= deadline:
                return posted
            time.sleep(POLL_SECONDS)

    def wait_for_another(self, rank: int, seconds: float) -> list[int]:
        """The other ranks that posted, as soon as there is one, or [] after `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            others = [r for r in self.posted() if r != rank]
            if others or time.monotonic() >= deadline:
                return others
            time.sleep(POLL_SECONDS)

    def claim(self, line: str) -> bool:
        """True for the first rank to claim `line` (an atomic counter on the store)."""
        digest = hashlib.sha256(line.encode("utf-8")).hexdigest()[:16]
        return self.store.add(f"{self.prefix}claim/{digest}", 1) == 1

    def mark_printed(self) -> None:
        try:
            self.store.set(self.prefix + "printed", "1")
        except Exception:  # the others then stop at their deadline
            pass

    def wait_to_be_stopped(self) -> bool:
        """Wait while torchrun stops this rank; True once a line was printed (outside torchrun,
        where nobody stops it, return then), False when none was after STOP_WAIT_SECONDS."""
        under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        printed = False
        while time.monotonic() < deadline:
            try:
                printed = printed or self.store.check([self.prefix + "printed"])
            except Exception:  # the store is gone: the run is over
                return printed
            if printed and not under_torchrun:
                return True
            time.sleep(POLL_SECONDS * 4)
        return printed
