"""Train an EAGLE-3 draft on the hidden-state shards of RUN/hidden/ and export it to RUN/draft/.

Needs RUN/hidden/ (python -m eagleforge.extract) and RUN/vocab/ (python -m eagleforge.vocab).
Writes RUN/config.yaml, RUN/checkpoints/step-NNNNNN/, RUN/train_log.csv, RUN/train_summary.json
(held-out loss, per-step accuracy, simulated acceptance length) and RUN/draft/.

The embedded default (SmolLM2-135M on the CPU), after `make extract`:

    python -m eagleforge.vocab run_dir=runs/default
    python -m eagleforge.train run_dir=runs/default

With a config file and overrides (any key, section.key=value):

    python -m eagleforge.train --config configs/kimi_k25_pilot.yaml run_dir=runs/kimi train.lr=1e-4 train.epochs=2

On one GPU (bf16 weights whose optimizer keeps an exact fp32 master, the fused loss):

    python -m eagleforge.train run_dir=runs/x train.device=cuda

On one node of 8 GPUs (FSDP2 by default; train.parallel=ddp for DDP), the stage started as one
process runs itself under torch.distributed.run on every visible GPU (eagleforge/launch.py;
launch.nproc=N for N, launch.mode=none for one process), the same as

    torchrun --nproc-per-node 8 -m eagleforge.train --config configs/kimi_k25_b300.yaml run_dir=/data/runs/kimi

On N nodes (the same command on every node; RUN on storage that every node can write):

    torchrun --nnodes N --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m eagleforge.train --config configs/kimi_k25_b300.yaml run_dir=/data/runs/kimi

HOST:PORT is one node's address and a free port (e.g. head-node:29500). On CPUs (gloo), for a
check: `python -m eagleforge.train run_dir=... train.device=cpu launch.nproc=2`.

Each optimizer step takes world x train.grad_accum batches of train.batch_tokens padded tokens
(rank r runs batches r, r + world, ...): 2 GPUs with grad_accum 1 train exactly like 1 GPU with
grad_accum 2. A run resumes by itself from the newest RUN/checkpoints/step-*, also on another
number of ranks: the checkpoint is torch.distributed.checkpoint, and the data position is global.
train.resume=false starts afresh, and is refused where an earlier run's checkpoints are.
"""

from eagleforge.cli import run_main
from eagleforge.config import Config, save_config
from eagleforge.layout import env_rank, use_expandable_segments
from eagleforge.train.loop import train
from eagleforge.train.onednn import bound_caches


def main(cfg: Config) -> None:
    bound_caches()  # before the first CPU matmul: each library reads its capacity once
    use_expandable_segments()  # before CUDA starts: the step plan counts no allocator fragments
    if env_rank() == 0:  # one writer under torchrun
        save_config(cfg, cfg.run / "config.yaml")
    summary = train(cfg)
    if env_rank() != 0:
        return
    sal = summary.get("simulated_acceptance_length")
    if sal is not None:
        print(f"simulated acceptance length {sal:.3f} at k={summary['simulated_acceptance_length_k']}; draft in {cfg.run / 'draft'}")
    else:
        print(f"trained {summary['steps']} steps; draft in {cfg.run / 'draft'}")


if __name__ == "__main__":
    run_main(main, "Train an EAGLE-3 draft with training-time test and export it.",
             sections=("target", "data", "extract", "vocab", "draft", "train", "eval", "launch"), launch="train")
