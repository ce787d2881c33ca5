"""Print the metrics that decide a kernel's bound from Nsight Compute CSV files (--csv --page details).

    python3 benchmarks/ncu_summary.py ncu_int4_16384.csv ...

Per kernel launch: duration, the speed-of-light throughputs (SM, memory, L1, L2, DRAM), the
tensor pipes' activity, occupancy and registers, and the largest stall reasons (cycles per issued
instruction). Kernels under --min-ms are left out (the reference's small sort/gather kernels).
"""

from __future__ import annotations

import argparse
import csv
import io
from collections import defaultdict

KEEP = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "L1/TEX Cache Throughput", "L2 Cache Throughput",
        "DRAM Throughput", "L2 Hit Rate", "Achieved Occupancy", "Theoretical Occupancy", "Registers Per Thread",
        "Block Limit Registers", "Block Limit Shared Mem", "Dynamic Shared Memory Per Block", "Executed Ipc Active",
        "Issue Slots Busy", "Warp Cycles Per Issued Instruction", "Grid Size", "Block Size", "Mem Busy", "Max Bandwidth",
        "lts__t_bytes.sum.per_second")


def read(path: str) -> dict:
    """{launch id: {"name": kernel, metric: "value unit"}} from one CSV (lines before the header dropped)."""
    text = open(path, errors="replace").read()
    start = text.find('"ID"')
    if start < 0:
        return {}
    kernels: dict = defaultdict(dict)
    for row in csv.DictReader(io.StringIO(text[start:])):
        k = kernels[row["ID"]]
        k["name"] = row["Kernel Name"][:60]
        # a name can repeat across sections ("Memory Throughput": % in speed of light, then
        # bytes/s in the memory section): the first, speed of light's, is kept
        k.setdefault(row["Metric Name"], f'{row["Metric Value"]} {row["Metric Unit"]}'.strip())
    return kernels


def number(text: str) -> float | None:
    """The leading number of "1,234.5 unit" (None for "n/a" and other non-numbers)."""
    try:
        return float(text.split()[0].replace(",", ""))
    except (ValueError, IndexError):
        return None


def duration_ms(k: dict) -> float:
    text = k.get("Duration", "0 ms")
    scale = {"ms": 1, "us": 1e-3, "usecond": 1e-3, "msecond": 1, "ns": 1e-6, "nsecond": 1e-6, "s": 1e3, "second": 1e3}
    return (number(text) or 0.0) * scale.get(text.partition(" ")[2], 1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--min-ms", type=float, default=0.5)
    p.add_argument("--stalls", type=int, default=6, help="largest stall reasons shown")
    a = p.parse_args(argv)
    for path in a.files:
        for launch, k in read(path).items():
            if duration_ms(k) < a.min_ms:
                continue
            print(f"== {path.rsplit('/', 1)[-1]} #{launch} {k['name']}")
            print("   " + "; ".join(f"{m} {k[m]}" for m in KEEP if m in k))
            pipes = {m: v for m, v in k.items() if "pipe_tensor" in m}
            print("   " + "; ".join(f"{m.split('.')[0]} {v}" for m, v in sorted(pipes.items())))
            stalls = sorted(((number(v), m) for m, v in k.items() if "issue_stalled" in m and number(v) is not None), reverse=True)
            print("   stalls: " + "; ".join(f"{m.replace('smsp__average_warps_issue_stalled_', '').replace('_per_issue_active.ratio', '')} {v:.2f}"
                                          for v, m in stalls[:a.stalls]))


if __name__ == "__main__":
    main()
