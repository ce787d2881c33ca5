"""`python -m eagleforge.extract --config F key=value`: target forward with hooks -> RUN/hidden/.

    python -m eagleforge.extract run_dir=runs/x                        # the processes the config needs
    torchrun --nproc-per-node 8 -m eagleforge.extract run_dir=runs/x   # data parallel (hf: 1 rank = 1 group)
    torchrun --nnodes 4 --nproc-per-node 8 -m eagleforge.extract --config configs/kimi_k25_b300.yaml

Started outside torchrun, the stage runs itself under torch.distributed.run when its config
needs several processes here: target.tp x the whole groups the visible GPUs hold, one group on
the CPU (eagleforge/launch.py; launch.nproc=N, launch.mode=none).

With train.source=online there is nothing to extract: the stage says so and stops (the train
stage runs the target itself). One loop for both backends (extract/driver.py): target.backend=hf runs any transformers causal LM
(eagleforge/target/hf.py); target.backend=native runs the DeepSeek-V3 / Kimi-K2.5 tensor-parallel backend
(extract/native/).
"""

from __future__ import annotations

from eagleforge.cli import run_main
from eagleforge.config import Config


def main(cfg: Config) -> None:
    if cfg.train.source == "online":  # `make extract train ... train.source=online`: the train stage runs the target
        print("extract: train.source=online: nothing to extract; the train stage runs the target and keeps no hidden "
              "states (train/online.py)")
        return
    from eagleforge.extract.driver import extract

    extract(cfg)


if __name__ == "__main__":
    run_main(main, "Extract target hidden states into RUN/hidden/ (docs/shards.md).",
             sections=("target", "data", "extract", "launch"), launch="extract")
