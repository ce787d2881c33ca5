"""Profile target: the routed experts of one Kimi-K2.5 MoE layer, INT4 (kernels/int4_moe.py) and the bf16 grouped_mm
reference, each in its own NVTX range, for Nsight Compute (what bounds the INT4 kernels).

Launch configs are pinned (no search: every launch under the profiler is one of the ones asked
for). Each variant runs `--reps` times inside its range; ncu's --launch-skip takes the warm-up
calls out.

    ncu --clock-control none --nvtx --nvtx-include "int4/" --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 benchmarks/profile_moe.py --tokens 16384
    python3 benchmarks/profile_moe.py --tokens 4096 16384 --time     # no profiler: ms per config

--gate-up / --down: launch configs as impl,BT,BN,BK,warps,stages[,maxnreg] (the default: int4_moe's
first candidates for the shape). With --time, every config given is timed (do_bench median) on
the same routing, each against the bf16 grouped_mm experts of the same run.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import median_ms  # noqa: E402
from bench_moe import dequantized_slices, random_int4_experts  # noqa: E402
from kimi_shaped import KIMI_MOE  # noqa: E402  (imports eagleforge from a bare checkout)

from eagleforge.kernels import int4_moe  # noqa: E402

H, I, E, K = KIMI_MOE


def parse_config(text: str) -> tuple:
    impl, *nums = text.split(",")
    return (impl, *map(int, nums))


def random_routing(T: int, device, seed=1):
    """[T, K] distinct experts per token, uniform (what a random router gives), and softmax weights."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(T, E, generator=gen, device=device).topk(K, dim=1).indices
    weights = torch.rand(T, K, generator=gen, device=device).softmax(1)
    return weights, ids


def pin(gate_up: tuple, down: tuple) -> None:
    """Make int4_moe launch exactly these configs (its search would launch every candidate)."""
    for table, config in ((int4_moe.V3_CONFIGS, gate_up), (int4_moe.V3_DOWN_CONFIGS, down)):
        for bucket in table:
            table[bucket] = [config]
    int4_moe._CHOSEN.clear()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384])
    p.add_argument("--gate-up", type=parse_config, nargs="+", default=[int4_moe.V3_CONFIGS["large"][0]])
    p.add_argument("--down", type=parse_config, nargs="+", default=[int4_moe.V3_DOWN_CONFIGS["large"][0]])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--time", action="store_true", help="time each config instead of profiling")
    a = p.parse_args(argv)
    device = torch.device("cuda")
    packs = random_int4_experts(H, I, E, torch.Generator(device=device).manual_seed(0))  # bench_moe's draw
    pk = [packs[f"{proj}_{part}"] for proj in ("gate", "up", "down") for part in ("packed", "scale")]
    int4_moe._pick_config = lambda name, configs, key, run: configs[0]  # pinned: no search
    for T in a.tokens:
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        w, ids = random_routing(T, device)
        if a.time:
            time_configs(T, x, w, ids, packs, pk, a.gate_up, a.down)
            continue
        pin(a.gate_up[0], a.down[0])
        with torch.no_grad():
            torch.cuda.nvtx.range_push("int4")
            for _ in range(a.reps):
                int4_moe.int4_moe(x, w, ids, *pk)
            torch.cuda.nvtx.range_pop()
            gu_t, dn_t = dequantized_weights(packs)
            torch.cuda.nvtx.range_push("ref")
            for _ in range(a.reps):
                int4_moe.bf16_grouped_mm_moe(x, w, ids, gu_t, dn_t)
            torch.cuda.nvtx.range_pop()
            del gu_t, dn_t
        torch.cuda.synchronize()


def dequantized_weights(packs: dict):
    """The same experts in bf16, grouped_mm's layout: gate+up [E, H, 2I], down [E, I, H]."""
    gu_t = torch.empty(E, H, 2 * I, dtype=torch.bfloat16, device=packs["gate_packed"].device)
    dn_t = torch.empty(E, I, H, dtype=torch.bfloat16, device=gu_t.device)
    for sl, g, u, d in dequantized_slices(packs, E):
        gu_t[sl, :, :I], gu_t[sl, :, I:], dn_t[sl] = g.transpose(1, 2), u.transpose(1, 2), d.transpose(1, 2)
    return gu_t, dn_t


def time_configs(T, x, w, ids, packs, pk, gate_ups, downs) -> None:
    """ms of the whole int4_moe per (gate+up, down) pair: first each gate+up with the first down,
    then each down with the first gate+up; the kernel's own share is the difference between rows."""
    ms = functools.partial(median_ms, device=x.device)
    with torch.no_grad():
        gu_t, dn_t = dequantized_weights(packs)
        ref = ms(lambda: int4_moe.bf16_grouped_mm_moe(x, w, ids, gu_t, dn_t))  # noqa: F821 (bound on the line above; deleted after the call)
        del gu_t, dn_t
        torch.cuda.empty_cache()
        print(f"T={T} grouped_mm bf16 experts: {ref:.3f} ms")
        pairs = [(g, downs[0]) for g in gate_ups] + [(gate_ups[0], d) for d in downs[1:]]
        for g, d in pairs:
            pin(g, d)
            try:
                t = ms(lambda: int4_moe.int4_moe(x, w, ids, *pk))
            except int4_moe._compile_errors() as err:
                print(f"T={T} gate_up {g} down {d}: failed {str(err)[:200]}")
                continue
            print(f"T={T} gate_up {g} down {d}: {t:.3f} ms  ({ref / t:.3f}x grouped_mm experts)")


if __name__ == "__main__":
    main()
