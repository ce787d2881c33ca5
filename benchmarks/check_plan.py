"""Memory check: the planner's bytes per GPU against what the extraction loop uses.

BENCHMARKS.md, "Memory planner against the extraction loop": the Kimi-shaped bench model
(`--layers` layers, random weights) at this run's tp in each expert layout asked for, running
extract/driver.py's loop as a NativeTarget (`forward_batch`, the overlapped writer into a sink
that drops the copies). Per rank and batch size:

  weights      memory allocated after the build            vs  plan.weights_bytes
  activations  peak allocated in the loop minus the weights  vs  plan.components["activations"]
  in use       device memory in use after the loop (CUDA context, NCCL, the allocator's cache,
               i.e. what nvidia-smi shows)                  vs  plan.total_bytes (with the reserve)

A layer's activations do not depend on the depth, so a few layers check the planner's model of
the full 61 layers (its weights per GPU: tests/test_native_run.py).

    python3 benchmarks/check_plan.py --batch-tokens 8192 16384 32768 --json $OUT/plan_tp1.json
    torchrun --nproc-per-node 2 benchmarks/check_plan.py --layouts ep tp --batch-tokens 16384 32768
    python3 benchmarks/check_plan.py --cpu-check          # toy shapes on the CPU (checks the script)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import null_sink, write_json  # noqa: E402
from kimi_shaped import bench_layout, build_bench_model, kimi_args, random_rows, tiny_args  # noqa: E402  (imports eagleforge from a bare checkout)

from eagleforge.extract.driver import forward_batches  # noqa: E402
from eagleforge.extract.native.plan import GIB, plan_memory  # noqa: E402
from eagleforge.extract.native.target import NativeTarget  # noqa: E402
from eagleforge.extract.samples import batch_by_tokens  # noqa: E402
from eagleforge.extract.writer import make_writer  # noqa: E402


def run_loop(model, job, aux_layers: list[int], rows: list[dict], batch_tokens: int) -> None:
    """The extraction loop itself (driver.forward_batches over one chunk, batched by tokens as
    extraction batches it); the group leader submits each batch to the overlapped writer."""
    writer = make_writer(null_sink, overlap=True) if job.is_group_leader else None
    target = NativeTarget(model, job, aux_layers, write_target_argmax=True)
    try:
        batches = [(0, positions) for positions in batch_by_tokens([len(r["input_ids"]) for r in rows], batch_tokens)]
        forward_batches(target, [rows], batches, writer)
    finally:
        target.close()
    if writer is not None:
        writer.close()


def measure(model, args, job, layout: str, aux_layers: list[int], batch_tokens: int, max_length: int, reps: int) -> dict:
    """One rank's measured bytes for one batch size, beside the planner's."""
    cuda = job.device.type == "cuda"
    plan = plan_memory(args, job.tp, layout, batch_tokens=batch_tokens, max_length=max_length,
                       aux_layers=aux_layers)
    rows = random_rows(args.vocab_size, batch_tokens, max_length, reps, seed=batch_tokens)
    r = {"rank": job.rank, "layout": layout, "batch_tokens": batch_tokens, "max_length": max_length,
         "plan_weights_GiB": plan.weights_bytes / GIB, "plan_activations_GiB": plan.components["activations"] / GIB,
         "plan_total_GiB": plan.total_bytes / GIB}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the build's and earlier runs' cached blocks are not this loop's
        weights = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    run_loop(model, job, aux_layers, rows, batch_tokens)
    if not cuda:
        return r
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    r.update(weights_GiB=weights / GIB, activations_GiB=(torch.cuda.max_memory_allocated() - weights) / GIB,
             allocated_peak_GiB=torch.cuda.max_memory_allocated() / GIB, reserved_peak_GiB=torch.cuda.max_memory_reserved() / GIB,
             in_use_GiB=(total - free) / GIB, outside_allocator_GiB=(total - free - torch.cuda.memory_reserved()) / GIB)
    return r


def table(rows: list[dict]) -> str:
    """Markdown rows: measured vs planned, error = planned / measured - 1."""
    head = ("| tp | layout | batch tokens | rank | weights GiB (plan) | activations GiB (plan) | in use GiB (plan total) "
            "| error: weights, activations, total | reserved - allocated peak, outside the allocator GiB |\n"
            "|---|---|---|---|---|---|---|---|---|")
    out = [head]
    for r in rows:
        if "weights_GiB" not in r:
            continue
        err = [r[f"plan_{k}_GiB"] / r[m] - 1 for k, m in (("weights", "weights_GiB"), ("activations", "activations_GiB"),
                                                            ("total", "in_use_GiB"))]
        out.append(f"| {r['tp']} | {r['layout']} | {r['batch_tokens']} ({r['max_length']} per sample) | {r['rank']} | "
                   f"{r['weights_GiB']:.2f} ({r['plan_weights_GiB']:.2f}) | {r['activations_GiB']:.2f} "
                   f"({r['plan_activations_GiB']:.2f}) | {r['in_use_GiB']:.2f} ({r['plan_total_GiB']:.2f}) | "
                   + ", ".join(f"{e:+.1%}" for e in err)
                   + f" | {r['reserved_peak_GiB'] - r['allocated_peak_GiB']:.2f}, {r['outside_allocator_GiB']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--layouts", nargs="+", default=["ep"], choices=["ep", "tp"])
    p.add_argument("--batch-tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--max-length", type=int, default=None, help="tokens per sample (default: one sample per batch)")
    p.add_argument("--reps", type=int, default=3, help="batches per measurement")
    p.add_argument("--cpu-check", action="store_true", help="toy shapes on the CPU (gloo under torchrun)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING, format="%(message)s")
    job, tp = bench_layout(a.cpu_check)
    rows: list[dict] = []
    try:
        args = tiny_args(a.layers) if a.cpu_check else kimi_args(a.layers)
        tokens = [64, 96] if a.cpu_check else a.batch_tokens
        aux_layers = sorted({1, max(1, args.num_hidden_layers // 2), args.num_hidden_layers - 1})
        for layout in a.layouts:
            model = build_bench_model(args, job.device, tp=tp, layout=layout)
            for T in tokens:
                r = measure(model, args, job, layout, aux_layers, T, min(a.max_length or T, T), a.reps)
                r["tp"] = tp.size
                rows.extend(job.all_gather_object(r))
            del model
            if job.device.type == "cuda":
                torch.cuda.empty_cache()
        if job.is_main:
            print(table(rows))
            write_json(a.json, rows)
    finally:
        job.shutdown()
    return rows


if __name__ == "__main__":
    main()
