"""The command line of every stage: `--config FILE section.key=value ...`, the relaunch under
torchrun when a config needs several processes (eagleforge/launch.py), the watcher that stops a
rank when another fails (eagleforge/failures.py), the sweep of killed writes' leftovers, and the
one-line user errors. Each stage's `__main__` calls run_main; nothing imports this module back.
"""

from __future__ import annotations

import os
import sys
import typing
from typing import Any

from eagleforge import failures
from eagleforge.atomic import sweep_leftovers
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
             launch_module: str | None = None) -> None:
    """Entry-point wrapper: a user's mistake is one line on stderr and exit 2, no traceback; under
    torchrun that line is printed once over all ranks (eagleforge/failures.py).
    sections: the config sections the stage reads (its --help lists their keys).
    launch: the stage's name ("extract", "train") when it runs under torchrun: started outside
    it with a config that needs several processes, it runs `launch_module` (default
    eagleforge.<launch>) with the same argv under torch.distributed.run and exits with its code
    (eagleforge/launch.py)."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        cfg = parse_cli(argv, description, sections)
        if launch is not None:
            code = relaunch(cfg, launch, sys.argv[1:] if argv is None else argv, launch_module)
            if code is not None:
                raise SystemExit(code)
            stop_with_launcher()  # a rank: ends with its launcher, even one killed with SIGKILL
        failures.watch_other_ranks()  # and within seconds of another rank's failure
        _sweep_killed_writes(cfg)
        main(cfg)
        failures.stop_watching()
    except (ConfigError, FileNotFoundError, UserInputError) as err:
        failures.exit_with_user_error(err)
    except Exception as err:
        failures.exit_if_another_rank_failed(err)  # a rank blocked by another rank's user error: silent
        raise


def _sweep_killed_writes(cfg: Config) -> None:
    """Remove what killed writes of earlier runs on this host left in RUN and in the cache (one
    process per host; a live writer's temporary files, and other hosts', are left alone)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from eagleforge.target.loading import cache_root

    sweep_leftovers(cfg.run)
    sweep_leftovers(cache_root(), depth=1)
