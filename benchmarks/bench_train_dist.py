"""Benchmark: data-parallel training throughput of the Kimi-K2.5-shaped draft at 1 and 2 GPUs:
tokens/s, scaling, step time, peak memory, MFU.

Shape: kimi_shaped.DraftShape.kimi() (hidden 7168, one layer, 64/64 heads of 128, intermediate
18432, vocab 163840, Vd 32000, TTT 7). What is timed is the trainer itself: Trainer.train_step() with
the train settings of --config (default the B300 config's: bf16 parameters by train.param_dtype
auto, selective_all checkpointing, merged_cudnn attention, compile), FSDP2 over the ranks, on a
run directory of Kimi-shaped shards written by the project's writer (bench_train.
write_kimi_shaped_run; each rank reads its own batch of --tokens tokens per step, ahead of the
step on the prefetch worker). Weak scaling: tokens per GPU fixed, so the ideal is tokens/s x
(number of GPUs).

Both GPU counts in one command (each a torchrun of this script; a table at the end):

    python benchmarks/bench_train_dist.py --launch 1 2 --json $OUT/bench_train_dist.json

One count by hand:

    torchrun --nproc-per-node 2 benchmarks/bench_train_dist.py --tokens 8192 --steps 6

On the CPU (gloo, tiny shape) to check the script:

    python benchmarks/bench_train_dist.py --tiny --launch 1 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import import_eagleforge  # noqa: E402

import_eagleforge()

log = logging.getLogger("bench_train_dist")


def build(args, env) -> tuple:
    """(shape, trainer) on this rank: the trainer itself (Trainer, as `make train` builds it from
    the train settings of --config) over a run directory of Kimi-shaped shards that rank 0 writes
    with the project's writer (bench_train.write_kimi_shaped_run): world x (warmup + steps)
    samples of --tokens tokens, one batch per rank per step."""
    from bench_train import write_kimi_shaped_run
    from kimi_shaped import DraftShape

    from eagleforge.config import load_config
    from eagleforge.train.loop import Trainer

    shape = DraftShape.tiny() if args.tiny else DraftShape.kimi()
    run = Path(args.workdir) / f"dist-{env.world_size}"
    used_ids = torch.sort(torch.randperm(shape.vocab, generator=torch.Generator().manual_seed(0))[: shape.draft_vocab]).values
    if env.is_main:
        import shutil

        shutil.rmtree(run, ignore_errors=True)
        write_kimi_shaped_run(run, shape, [args.tokens] * (env.world_size * (args.warmup + args.steps)), used_ids)
    env.barrier()
    overrides = [f"run_dir={run}", f"train.batch_tokens={args.tokens}", "train.holdout_samples=0", "train.epochs=1",
                 f"train.device={env.device.type}", "train.save_every=0", f"train.parallel={args.parallel}",
                 f"train.attention={args.attention}", f"train.ttt_steps={shape.ttt}", *args.override]
    torch.manual_seed(0)
    return shape, Trainer(load_config(args.config, overrides), env)


def worker(args) -> dict:
    """One rank under torchrun (or alone): time --steps trainer steps after --warmup."""
    from bench_train import flops_per_token

    from eagleforge.layout import init_layout

    env = init_layout("cpu" if args.tiny else "cuda")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    shape, trainer = build(args, env)
    for _ in range(args.warmup):
        trainer.train_step()
    if env.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    env.all_reduce_sum([0.0])  # line the ranks up before the clock starts
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step()
    if env.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if env.device.type == "cuda" else 0.0
    slowest, peak_max = _max_over_ranks(seconds, env), _max_over_ranks(peak, env)
    tokens = args.tokens * env.world_size
    row = {
        "gpus": env.world_size, "parallel": trainer.parallel, "param_dtype": str(trainer.param_dtype).removeprefix("torch."),
        "activation_checkpoint": trainer.step_plan.activation_checkpoint, "tokens_per_gpu": args.tokens,
        "step_ms": round(slowest * 1e3, 1), "tokens_per_s": round(tokens / slowest), "peak_GiB": round(peak_max, 2),
        "MFU": round(tokens * flops_per_token(shape, args.tokens, shape.draft_vocab) / slowest / 1e12 / env.world_size / args.peak_tflops, 3),
        "device": torch.cuda.get_device_name() if env.device.type == "cuda" else "cpu",
    }
    if env.is_main:
        log.info("%s", row)
        if args.json:
            Path(args.json).write_text(json.dumps(row))
    trainer.close()
    env.shutdown()
    return row


def _max_over_ranks(value: float, env) -> float:
    return max(env.all_reduce_sum([value if r == env.rank else 0.0 for r in range(env.world_size)]))


def launch(args) -> list[dict]:
    """torchrun this script once per GPU count; the rows and a table with the scaling."""
    rows = []
    forwarded = ["--tokens", str(args.tokens), "--steps", str(args.steps), "--warmup", str(args.warmup), "--parallel",
                 args.parallel, "--attention", args.attention, "--peak-tflops", str(args.peak_tflops), "--config", args.config,
                 "--workdir", str(args.workdir), "--override", *args.override] + (["--tiny"] if args.tiny else [])
    for n in args.launch:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                   str(Path(__file__).resolve()), *forwarded, "--json", str(out)]
            log.info("%s", " ".join(cmd))
            done = subprocess.run(cmd, check=False)
            rows.append(json.loads(out.read_text()) if done.returncode == 0 and out.is_file()
                        else {"gpus": n, "error": f"exit code {done.returncode}"})
    base = next((r["tokens_per_s"] for r in rows if r.get("gpus") == 1 and "error" not in r), None)
    print("| GPUs | parallel | tokens/GPU | step ms | tokens/s | scaling vs 1 | peak GiB | MFU |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['gpus']} | {r['error']} | | | | | | |")
            continue
        r["scaling"] = round(r["tokens_per_s"] / base, 3) if base else None
        print(f"| {r['gpus']} | {r['parallel']} | {r['tokens_per_gpu']} | {r['step_ms']} | {r['tokens_per_s']} | "
              f"{r['scaling']} | {r['peak_GiB']} | {r['MFU']} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launch", type=int, nargs="+", default=None, help="GPU counts to torchrun one after the other")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per step (one sample)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--parallel", default="auto", choices=["auto", "fsdp", "ddp"])
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="MFU denominator (H200 dense bf16)")
    ap.add_argument("--config", default="configs/kimi_k25_b300.yaml", help="the train settings the trainer runs with")
    ap.add_argument("--override", nargs="*", default=[], help="key=value overrides of the config")
    ap.add_argument("--workdir", default="runs/bench_train_dist", help="where rank 0 writes the shards")
    ap.add_argument("--tiny", action="store_true", help="tiny shape on the CPU (gloo): checks the script")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.tiny:
        args.tokens = min(args.tokens, 256)
        args.attention = "merged" if args.attention == "auto" else args.attention
        args.override = ["train.compile=false", *args.override]
    if args.launch:
        return launch(args)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench_train_dist: no CUDA device (use --tiny on a CPU machine)")
    return worker(args)


if __name__ == "__main__":
    main()
