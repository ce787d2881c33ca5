"""Benchmark: the INT4 MoE down kernel, v3 (Triton) against its Gluon variants (kernels/int4_moe_gluon.py).

Same inputs (Kimi-K2.5's down projection: 384 experts, hidden 7168, intermediate 2048, INT4
group 32; random routing of T tokens x 8 slots; h with its columns permuted as the gate+up
kernel writes it; the warp-specialized variants get it in pair order), each kernel timed alone (do_bench median), outputs compared with each other
and, on a sample of rows, with float64 math on the dequantized weights. Needs an sm_90 GPU.

    python3 benchmarks/bench_moe_gluon.py --tokens 4096 16384 --json $OUT/moe_gluon.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import import_eagleforge  # noqa: E402

import_eagleforge()
from eagleforge.extract.native.int4 import dequantize_int4  # noqa: E402
from eagleforge.kernels import int4_moe as v3  # noqa: E402
from eagleforge.kernels import int4_moe_gluon as g  # noqa: E402


def unpermute_k128(a: torch.Tensor) -> torch.Tensor:
    """The inverse of int4_moe.permute_k128: column 8j + n <- column 16n + j in each 128-block."""
    rows, k = a.shape
    return a.reshape(rows, k // 128, 8, 16).transpose(-1, -2).reshape(rows, k)


def make_case(tokens: int, experts: int, k: int, hidden: int, inter: int, group: int, seed: int) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows = tokens * k
    ids = torch.randint(0, experts, (tokens, k), device=dev, generator=gen)
    order, counts = v3.sort_by_expert(ids, experts, 0)
    return {
        "rows": rows, "experts": experts, "group": group,
        "expert_of_row": ids.flatten()[order],  # [rows]: the expert of each sorted row
        "table": v3.tile_table(counts, experts, g.BLOCK_T, rows),
        "h": (torch.randn(rows, inter, device=dev, generator=gen) * 0.5).bfloat16(),
        "packed": torch.randint(-2**31, 2**31 - 1, (experts, hidden, inter // 8), device=dev, dtype=torch.int64,
                                generator=gen).to(torch.int32),
        "scale": (torch.rand(experts, hidden, inter // group, device=dev, generator=gen) * 0.2 + 0.9).mul(0.02 / 4.6).bfloat16(),
        "rows_out": torch.arange(rows, dtype=torch.int32, device=dev),
        "weight": torch.rand(rows, device=dev, generator=gen),
    }


def reference_rows(c: dict, sample: torch.Tensor) -> torch.Tensor:
    """y[r] = weight[r] * W_e(r) @ h_true[r] in float64 for the sampled sorted rows r."""
    h_true = unpermute_k128(c["h"][sample]).double()
    out = []
    for i, r in enumerate(sample.tolist()):
        e = int(c["expert_of_row"][r])
        w = dequantize_int4(c["packed"][e], c["scale"][e], torch.bfloat16).double()  # [H, I]
        out.append(c["weight"][r].double() * (w @ h_true[i]))
    return torch.stack(out)


def run(tokens: int, args) -> dict:
    import triton.testing

    c = make_case(tokens, args.experts, 8, args.hidden, args.inter, 32, seed=tokens)
    config = v3.V3_DOWN_CONFIGS[v3.size_bucket(c["rows"], c["experts"])][0]
    if config[1] != g.BLOCK_T:
        raise SystemExit(f"v3's down config {config} has BLOCK_T {config[1]}, the Gluon kernel {g.BLOCK_T}: one table needs both")
    y3 = torch.zeros(c["rows"], args.hidden, dtype=torch.bfloat16, device="cuda")
    ys = {variant: torch.zeros_like(y3) for variant in args.variants}
    h_pairs = g.permute_pairs(unpermute_k128(c["h"]))  # the "ws" kernels' column order

    def run_v3():
        v3._launch(config, c["h"], None, c["packed"], c["scale"], None, None, y3, c["rows_out"], c["weight"], c["table"],
                   False, False, True)

    def gluon_runner(variant):
        h = h_pairs if variant in g.WS_VARIANTS else c["h"]
        return lambda: g.down_gluon(h, c["packed"], c["scale"], ys[variant], c["rows_out"], c["weight"], c["table"],
                                    variant=variant)

    run_v3()
    for variant in args.variants:
        gluon_runner(variant)()
    torch.cuda.synchronize()
    sample = torch.randperm(c["rows"], device="cuda")[:16].sort().values
    ref = reference_rows(c, sample)
    rel = lambda y: ((y[sample].double() - ref).norm() / ref.norm()).item()  # noqa: E731
    flops = 2 * c["rows"] * args.hidden * args.inter
    ms3 = triton.testing.do_bench(run_v3, rep=args.rep_ms, return_mode="median")
    r = {"tokens": tokens, "v3_config": list(config), "v3_ms": round(ms3, 3), "v3_TFLOPs": round(flops / ms3 / 1e9, 1),
         "v3_rel_err_vs_fp64": float(f"{rel(y3):.2e}"), "y_max_abs": float(f"{y3.float().abs().max().item():.2e}")}
    for variant, y in ys.items():
        ms = triton.testing.do_bench(gluon_runner(variant), rep=args.rep_ms, return_mode="median")
        r[f"gluon_{variant}"] = {"ms": round(ms, 3), "vs_v3": round(ms3 / ms, 3), "TFLOPs": round(flops / ms / 1e9, 1),
                                 "rel_err_vs_fp64": float(f"{rel(y):.2e}"),
                                 "max_abs_vs_v3": float(f"{(y.float() - y3.float()).abs().max().item():.2e}")}
    print(json.dumps(r))
    return r


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--experts", type=int, default=384)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--variants", nargs="+", default=list(g.VARIANTS), choices=list(g.VARIANTS))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_gluon.py needs an sm_90 GPU")
    out = [run(t, a) for t in a.tokens]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
