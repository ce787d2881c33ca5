"""The command line of every stage: `--config FILE section.key=value ...`, the relaunch under
torchrun when a config needs several processes (eagleforge/launch.py), the watcher that stops a
rank when another fails (eagleforge/failures.py), the sweep of killed writes' leftovers, and the
one-line user errors. Each stage's `__main__` calls run_main; nothing imports this module back.
"""

from __future__ import annotations

import errno
import os
import sys
import typing
from pathlib import Path
from typing import Any

from eagleforge import failures
from eagleforge.atomic import probe_write, sweep_leftovers
from eagleforge.config import Config, config_keys_help, load_config
from eagleforge.errors import ConfigError, UserInputError
from eagleforge.launch import relaunch, stop_with_launcher


def parse_cli(argv: list[str] | None = None, description: str = "",
              sections: typing.Sequence[str] | None = None) -> Config:
    """`--config FILE` plus `section.key=value` overrides; --help lists the keys of `sections`."""
    import argparse

    parser = argparse.ArgumentParser(description=description, epilog=config_keys_help(sections),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.environ.get("CONFIG") or None, help="YAML file of overrides")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    return cfg


def run_main(main: typing.Callable[[Config], Any], description: str, argv: list[str] | None = None,
             sections: typing.Sequence[str] | None = None, launch: str | None = None,
             launch_module: str | None = None, writes_run_dir: bool = True) -> None:
    """Entry-point wrapper: a user's mistake is one line on stderr and exit 2, no traceback; under
    torchrun that line is printed once over all ranks (eagleforge/failures.py).
    sections: the config sections the stage reads (its --help lists their keys).
    launch: the stage's name ("extract", "train") when it runs under torchrun: started outside
    it with a config that needs several processes, it runs `launch_module` (default
    eagleforge.<launch>) with the same argv under torch.distributed.run and exits with its code
    (eagleforge/launch.py).
    writes_run_dir: the stage writes in run_dir, which is checked first (check_run_dir)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        cfg = parse_cli(argv, description, sections)
        if writes_run_dir:
            check_run_dir(cfg.run)
        if launch is not None:
            code = relaunch(cfg, launch, sys.argv[1:] if argv is None else argv, launch_module)
            if code is not None:
                raise SystemExit(code)
            stop_with_launcher()  # a rank: ends with its launcher, even one killed with SIGKILL
        failures.watch_other_ranks()  # and within seconds of another rank's failure
        _sweep_killed_writes(cfg)
        main(cfg)
    except (ConfigError, FileNotFoundError, UserInputError) as err:
        failures.exit_with_user_error(err)
    except Exception as err:
        failures.exit_if_another_rank_failed(err)  # a rank blocked by another rank's user error: silent
        raise
    finally:
        # Also on the way out with an error: a watcher thread still inside a store call (C++) while
        # the interpreter shuts down aborts the process (SIGABRT, "terminate called without an
        # active exception"), seen when a rank failed before the store was up.
        failures.stop_watching()


def check_run_dir(run: Path) -> None:
    """run_dir as a directory this process can write in, or one UserInputError naming it and why
    not: a file there or above it, a read-only file system, no permission. A stage finds out
    before any work, not at its first write with a traceback. Nothing is left written: an
    existing run_dir gets an empty file made and removed in it (probe_write); for a missing one
    (the stage makes it) the nearest existing folder above it is looked at, not written."""
    existing = next(path for path in (run, *run.parents) if path.exists())  # "/" or "." at the latest
    if not existing.is_dir():
        what = "is a file" if existing == run else f"is under {existing}, which is a file"
        raise UserInputError(f"run_dir={run}: {what}, not a directory; give a directory (it is made if missing)")
    where, code = "", None
    if existing == run:
        try:
            probe_write(run)
        except OSError as err:
            code = err.errno
    else:
        where = f" ({existing})"
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            code = errno.EROFS
        elif not os.access(existing, os.W_OK | os.X_OK):
            code = errno.EACCES
    if code is not None:
        raise UserInputError(f"run_dir={run}: cannot write there: {os.strerror(code).lower()}{where} "
                             f"(errno {errno.errorcode.get(code, code)})")


def _sweep_killed_writes(cfg: Config) -> None:
    """Remove what killed writes of earlier runs on this host left in RUN and in the cache (one
    process per host; a live writer's temporary files, and other hosts', are left alone)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from eagleforge.target.loading import cache_root

    sweep_leftovers(cfg.run)
    sweep_leftovers(cache_root(), depth=1)
