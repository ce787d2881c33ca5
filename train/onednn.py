"""Bounds on oneDNN's per-shape kernel caches, for CPU training whose batch shapes change every step.

On the CPU, torch runs bf16 matmuls (autocast's linears, the fused loss's chunks, and the blocks
of its flash attention) through oneDNN, which compiles a kernel for each problem shape and keeps
it in two caches of 1024 entries each: oneDNN's own primitive cache
(ONEDNN_PRIMITIVE_CACHE_CAPACITY) and the one of ideep, torch's layer over it
(LRU_CACHE_CAPACITY). An entry holds about 0.45 MB whatever the matrix sizes. The trainer's
batches are whole samples padded to the longest, so nearly every step brings new shapes, whose
kernels are never used again. At the default capacities the entries alone reach hundreds of MB,
and as they are allocated between each step's large short-lived tensors, the heap around them
can be neither reused for the next, differently sized, tensors nor returned: the trainer's
anonymous memory grew every step on the embedded default's shapes, most of it free heap; with 64
entries it stays within its per-batch working set.

A training step uses about 30 shapes, each many times (every TTT step repeats the linears',
the flash attention runs thousands of blocks of a few shapes): 64 entries keep those hits (no
slower than the defaults), 0 would compile again on every call (slower). Measured: BENCHMARKS.md,
"CPU training over a run: memory and speed".

Both libraries read their capacity once, at their first use in the process: `bound_caches()`
runs before the first CPU matmul (the train stage's entry calls it first). A capacity set in the
environment is kept.
"""

from __future__ import annotations

import os

CACHE_CAPACITY = 64
CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_caches(capacity: int = CACHE_CAPACITY) -> None:
    """Both caches hold at most `capacity` kernels, unless the environment sets their capacity."""
    for name in CAPACITY_VARIABLES:
        os.environ.setdefault(name, str(capacity))
