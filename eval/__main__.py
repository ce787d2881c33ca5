"""Eval stage entry point: acceptance length by real speculative decoding.

    python -m eagleforge.eval [--config FILE] [section.key=value ...]
    python -m eagleforge.eval target.path=/models/target eval.draft_path=/runs/x/draft run_dir=runs/x

What is measured and written (RUN/eval/results.json, PNG plots beside it): eagleforge.eval.evaluate.
"""

from eagleforge.cli import run_main
from eagleforge.eval.evaluate import main

if __name__ == "__main__":
    run_main(main, "Evaluate an EAGLE-3 draft by real speculative decoding against its target", sections=("target", "eval"))
