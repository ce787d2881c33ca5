"""A stage entry point for tests/test_launch.py: started as a plain process, it goes through the
same run_main -> eagleforge.launch path as extract and train, and each rank it ends up as writes
what its process group says (rank, world size, a collective's result) to RUN/rank-<r>.json.

    PYTHONPATH=tests python -m launch_probe [--config F] key=value ...

LAUNCH_PROBE_STAGE: the stage whose rule decides (extract | train; default train).
LAUNCH_PROBE_EXIT: rank 1 exits with this code after writing its file (default 0; "kill": SIGKILL);
"user": every rank fails at once with the same UserInputError; "hang": every rank sleeps after
writing its file (its pid in it) until it is stopped.
"""

from __future__ import annotations

import json
import os
import signal

from eagleforge.cli import run_main
from eagleforge.config import Config
from eagleforge.errors import UserInputError

STAGE = os.environ.get("LAUNCH_PROBE_STAGE", "train")


def main(cfg: Config) -> None:
    if os.environ.get("LAUNCH_PROBE_EXIT") == "user":
        raise UserInputError(f"{cfg.run / 'probe.jsonl'}: line 3: not what the probe expects")
    from eagleforge.layout import init_layout

    # gloo under torchrun; for extract, the native backend's grouping of the world the launch made
    env = init_layout("cpu", tp=cfg.target.tp if STAGE == "extract" else 1)
    record = {"rank": env.rank, "world_size": env.world_size, "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")},
              # the ranks and their sum as the process group itself adds them up
              "reduced": env.all_reduce_sum([1.0, float(env.rank)]), "pid": os.getpid()}
    if STAGE == "extract" and env.distributed:
        record["groups"] = {"num_groups": env.num_groups, "group_index": env.group_index, "tp_rank": env.tp_rank}
    cfg.run.mkdir(parents=True, exist_ok=True)
    # written whole, then renamed: a reader that sees rank-<r>.json sees all of it
    partial = cfg.run / f".rank-{env.rank}.json.partial"
    partial.write_text(json.dumps(record))
    os.replace(partial, cfg.run / f"rank-{env.rank}.json")
    code = os.environ.get("LAUNCH_PROBE_EXIT", "0")
    if code == "hang":
        import time

        time.sleep(300)
    env.shutdown()
    if code == "kill" and env.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if code not in ("kill", "user", "hang") and int(code) and env.rank == 1:
        raise SystemExit(int(code))


if __name__ == "__main__":
    run_main(main, "launch probe", launch=STAGE, launch_module="launch_probe")
