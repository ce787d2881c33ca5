"""Train an EAGLE-3 draft on the hidden-state shards of RUN/hidden/ and export it to RUN/draft/.

Needs RUN/hidden/ (python -m eagleforge.extract) and RUN/vocab/ (python -m eagleforge.vocab).
Writes RUN/config.yaml, RUN/checkpoints/step-NNNNNN/, RUN/train_log.csv, RUN/train_summary.json
(held-out loss, per-step accuracy, simulated acceptance length) and RUN/draft/.

The embedded default (SmolLM2-135M on the CPU), after `make extract`:

    python -m eagleforge.vocab run_dir=runs/default
    python -m eagleforge.train run_dir=runs/default

With a config file and overrides (any key, section.key=value):

    python -m eagleforge.train --config configs/kimi_k25_pilot.yaml run_dir=runs/kimi train.lr=1e-4 train.epochs=2

On one GPU (bf16 autocast, fp32 master weights, fused loss when eagleforge.kernels imports):

    python -m eagleforge.train run_dir=runs/x train.device=cuda

The loop is single-process for now; torchrun / FSDP2 (`torchrun --nproc-per-node 8 -m
eagleforge.train ...`) come with the distributed checkpointing issue. A run resumes by itself
from the newest RUN/checkpoints/step-* (train.resume=false starts over).
"""

from eagleforge.config import Config, run_main, save_config

from .loop import train


def main(cfg: Config) -> None:
    save_config(cfg, cfg.run / "config.yaml")
    summary = train(cfg)
    sal = summary.get("simulated_acceptance_length")
    if sal is not None:
        print(f"simulated acceptance length {sal:.3f} at k={summary['simulated_acceptance_length_k']}; draft in {cfg.run / 'draft'}")
    else:
        print(f"trained {summary['steps']} steps; draft in {cfg.run / 'draft'}")


if __name__ == "__main__":
    run_main(main, "Train an EAGLE-3 draft with training-time test and export it.")
