"""Eval stage entry point: acceptance length by real speculative decoding.

    python -m eagleforge.eval [--config FILE] [section.key=value ...]
    python -m eagleforge.eval target.path=/models/target eval.draft_path=/runs/x/draft run_dir=runs/x

The work lives in eagleforge.train.evaluate (see its docstring for what is measured and
written: RUN/eval/results.json and PNG plots beside it).
"""

from __future__ import annotations

from .config import Config, run_main


def main(cfg: Config) -> dict:
    from .train.evaluate import main as evaluate_main

    return evaluate_main(cfg)


if __name__ == "__main__":
    run_main(main, "Evaluate an EAGLE-3 draft by real speculative decoding against its target")
