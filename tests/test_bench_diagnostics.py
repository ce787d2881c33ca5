"""The benchmarks' peak-memory replay (benchmarks/_bench_common.peak_breakdown) on hand-made
allocator traces: the peak's moment, the blocks live then, frees of blocks older than the trace."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
from _bench_common import gpu_busy_ms, peak_breakdown  # noqa: E402


def frame(rel: str, line: int, name: str) -> list[dict]:
    # innermost first, as torch records them; a torch frame inside ours is skipped for ours
    return [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": str(ROOT / rel), "line": line, "name": name}]


def test_peak_breakdown_groups_blocks_live_at_the_peak():
    gib = 2**30
    events = [
        {"action": "free_completed", "addr": 99, "size": gib},  # allocated before the trace
        {"action": "alloc", "addr": 1, "size": 2 * gib, "frames": frame("draft/model.py", 10, "qkv")},
        {"action": "alloc", "addr": 2, "size": gib, "frames": frame("draft/model.py", 10, "qkv")},
        {"action": "alloc", "addr": 3, "size": 3 * gib, "frames": frame("kernels/soft_ce.py", 5, "loss")},
        {"action": "free_requested", "addr": 3, "size": 3 * gib},  # ignored: completion counts
        {"action": "free_completed", "addr": 3, "size": 3 * gib},
        {"action": "alloc", "addr": 4, "size": gib, "frames": frame("kernels/soft_ce.py", 7, "grad")},
        {"action": "free_completed", "addr": 1, "size": 2 * gib},
        {"action": "segment_alloc", "addr": 5, "size": 50 * gib},  # segments are not allocations
    ]
    out = peak_breakdown(events)
    # running total: -1, 1, 2, 5 (peak), 2, 3, 1
    assert out["peak_delta_GiB"] == 5.0
    assert out["peak_at"] == "kernels/soft_ce.py:5 loss"
    assert out["freed_preexisting_GiB"] == 1.0
    assert out["groups"] == [("draft/model.py:10 qkv", 3.0, 2), ("kernels/soft_ce.py:5 loss", 3.0, 1)]


def test_peak_breakdown_of_an_empty_trace():
    out = peak_breakdown([])
    assert out["peak_delta_GiB"] == 0 and out["groups"] == [] and out["peak_at"] == "(no allocation)"


def test_gpu_busy_is_the_union_of_device_intervals():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(device, start, end):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))

    # us: [0, 10] and [5, 12] overlap (12), [20, 25] (5), a nested [21, 22] adds nothing; CPU rows ignored
    events = [event(cuda, 20, 25), event(cuda, 0, 10), event(cpu, 0, 100), event(cuda, 5, 12), event(cuda, 21, 22)]
    assert gpu_busy_ms(SimpleNamespace(events=lambda: events)) == 17 / 1e3
