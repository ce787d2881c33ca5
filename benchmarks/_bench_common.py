"""Shared helpers of the benchmark scripts: import eagleforge from a bare checkout, timing, matmul
rate, the device's name and peak memory, the --json record."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def import_eagleforge() -> None:
    """Make `import eagleforge` work from a checkout where the package is not installed: the root
    on sys.path is enough (eagleforge/__init__.py finds the stage folders beside it)."""
    try:
        import eagleforge  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT))  # ROOT/eagleforge is the root package


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def null_sink(meta, tensors) -> None:
    """A writer's sink that drops the host copies: their cost without the disk's."""


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def write_json(path, record) -> None:
    """The record to --json's path (its folder made), where one was given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=1))


def device_peaks(device: torch.device) -> dict:
    """Peak memory since the last reset, GiB (None on the CPU): allocated, reserved by the
    allocator, and in use on the device (the reserved peak plus what lies outside the allocator:
    the CUDA context, NCCL), the side a memory plan counts."""
    if device.type != "cuda":
        return dict.fromkeys(("peak_allocated_gib", "peak_reserved_gib", "peak_in_use_gib"))
    reserved = torch.cuda.max_memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30, "peak_reserved_gib": reserved / 2**30,
            "peak_in_use_gib": (total - free - torch.cuda.memory_reserved(device) + reserved) / 2**30}


def median_ms(fn, device: torch.device, rep_ms: int = 100, cpu_reps: int = 3, fixed_iters: int | None = None,
              warmup_ms: int = 5) -> float:
    """do_bench median on CUDA; perf_counter median on the CPU.

    fixed_iters: time exactly that many calls (after 3 warm-up calls), each between CUDA events.
    Needed where fn holds collectives: do_bench picks its number of calls from each rank's own
    first timings, so ranks would issue different numbers of all-reduces, which then pair with
    the wrong calls or hang at exit (seen at tp 2)."""
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

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
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


# ----------------------------------------------------------------------------------------------
# Diagnostics: where the peak memory is, where the host waits on the GPU
# ----------------------------------------------------------------------------------------------


def _where(frames: list[dict]) -> str:
    """The innermost frame inside this repository (the code that asked for the memory or made
    the call), as 'path:line function'; else the innermost frame of all."""
    for frame in frames:
        path = str(frame.get("filename", ""))
        if path.startswith(str(ROOT)) and not path.endswith("_bench_common.py"):
            return f"{Path(path).relative_to(ROOT)}:{frame.get('line')} {frame.get('name')}"
    if frames:
        f = frames[0]
        return f"{Path(str(f.get('filename', '?'))).name}:{f.get('line')} {f.get('name')}"
    return "(no frame)"


def peak_breakdown(events: list[dict], top: int = 15) -> dict:
    """Replay an allocator trace (torch.cuda.memory._snapshot()["device_traces"][i]): find the
    moment of the highest allocated memory and group the blocks live then by `_where`.

    Sizes are relative to the start of the trace: blocks allocated before it are not in the
    trace (their frees are, and lower the running total). Returns {"peak_delta_GiB", "peak_at",
    "freed_preexisting_GiB" (freed before the peak), "groups": [(where, GiB, blocks), ...]}."""
    def replay(stop: int | None):
        live, current, best, best_i, freed_old, requested = {}, 0, 0, -1, 0, set()
        for i, e in enumerate(events):
            if stop is not None and i > stop:
                break
            action, addr, size = e.get("action"), e.get("addr"), int(e.get("size", 0))
            if action == "alloc":
                live[addr] = (size, e.get("frames") or [])
                requested.discard(addr)
                current += size
            elif action == "free_requested" or (action == "free_completed" and addr not in requested):
                # memory_allocated drops at the request (a block used on other streams completes later)
                if action == "free_requested":
                    requested.add(addr)
                if live.pop(addr, None) is None:
                    freed_old += size
                current -= size
            else:
                continue
            if current > best:
                best, best_i = current, i
        return live, best, best_i, freed_old

    _, best, best_i, _ = replay(None)
    live, _, _, freed_old = replay(best_i)
    groups: dict[str, list] = {}
    for size, frames in live.values():
        g = groups.setdefault(_where(frames), [0, 0])
        g[0] += size
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    at = _where(events[best_i].get("frames") or []) if best_i >= 0 else "(no allocation)"
    return {"peak_delta_GiB": round(best / 2**30, 3), "peak_at": at, "freed_preexisting_GiB": round(freed_old / 2**30, 3),
            "groups": [(where, round(size / 2**30, 3), count) for where, (size, count) in ranked]}


def memory_at_peak(fn, top: int = 15) -> dict:
    """Run fn once on the current CUDA device with the allocator's history recorded and return
    `peak_breakdown` of its trace, plus the memory allocated before it ("base_GiB")."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    report = peak_breakdown(snapshot["device_traces"][torch.cuda.current_device()], top)
    report["base_GiB"] = round(base / 2**30, 3)
    return report


def host_syncs(fn) -> dict[str, int]:
    """Run fn once with CUDA's sync debug mode on: {where (see `_where`): count} of the calls
    that made the host wait for the GPU (.item(), bool(tensor), nonzero, blocking copies).
    A sync inside a backward is reported where .backward() was called (the autograd engine
    replays its warnings on the calling thread), not at the op that made it."""
    import traceback
    import warnings

    found: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [{"filename": f.filename, "line": f.lineno, "name": f.name} for f in reversed(traceback.extract_stack())]
        where = _where(frames)
        found[where] = found.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return found


def gpu_busy_ms(prof) -> float:
    """Milliseconds in which at least one CUDA kernel or copy ran (the union of their intervals):
    the summed self times of the profiler's table count nested rows twice."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()  # microseconds
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False))  # e.g. Optimizer.step# ranges span idle gaps
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e3
