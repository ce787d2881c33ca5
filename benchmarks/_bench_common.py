"""Shared helpers of the benchmark scripts: import eagleforge from a bare checkout, timing, matmul rate."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def import_eagleforge() -> None:
    """Make `import eagleforge` work on a machine where the package is not installed (the device
    machine runs a bare checkout): a folder in /tmp maps the package-dir layout of pyproject.toml."""
    try:
        import eagleforge  # noqa: F401
        return
    except ImportError:
        pass
    shim = Path(os.environ.get("TMPDIR", "/tmp")) / f"eagleforge_shim_{os.getpid()}"
    package = shim / "eagleforge"
    if not package.exists():
        package.parent.mkdir(parents=True, exist_ok=True)
        package.symlink_to(ROOT / "core", target_is_directory=True)
    # eagleforge.<sub> resolves inside core/ through __path__: extend it with the other folders
    sys.path.insert(0, str(shim))
    import eagleforge

    eagleforge.__path__.append(str(ROOT))  # eagleforge.extract -> ROOT/extract, eagleforge.kernels -> ROOT/kernels


def median_ms(fn, device: torch.device, rep_ms: int = 100, cpu_reps: int = 3, fixed_iters: int | None = None) -> float:
    """do_bench median on CUDA; perf_counter median on the CPU.

    fixed_iters: time exactly that many calls (after 3 warm-up calls), each between CUDA events.
    Needed where fn holds collectives: do_bench picks its number of calls from each rank's own
    first timings, so ranks would issue different numbers of all-reduces, which then pair with
    the wrong calls or hang at exit (phase N, 2026-11-30)."""
    if device.type == "cuda" and fixed_iters:
        for _ in range(3):
            fn()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(fixed_iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = sorted(start.elapsed_time(end) for start, end in events)
        return times[len(times) // 2]
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    """bf16 n x n x n matmul rate measured now (the MFU denominator), TFLOP/s."""
    if device.type != "cuda":
        n = 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ a, device)
    return 2 * n**3 / ms / 1e9
