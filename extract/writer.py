"""Overlapped writing of captured hidden states, and the optional fp8 storage format.

OverlappedWriter: after a forward, `submit` copies the captured GPU tensors into pinned host
buffers on a side CUDA stream (asynchronous: the compute stream goes on with the next forward)
and queues them; one writer thread waits for each copy's event and hands the host tensors to a
`sink` (which writes a shard, or appends to one). The queue holds at most `max_pending` items:
when the disk is slower than the GPU the queue fills and `submit` blocks; the time it blocked is
`stats.submit_blocked_s`, the number a benchmark reports as "the GPU waited on the disk".

Pinned buffers are taken from a small pool keyed by (shape, dtype) and returned after the sink
has run, so a sink must not keep references to the tensors it is given (copy what it keeps).
On the CPU, `submit` clones instead (nothing to overlap with).

fp8 storage (e4m3, one fp32 scale per token and per block of columns, block = H so each aux
layer of a token gets its own scale): `quantize_fp8` / `dequantize_fp8`; bytes per token
(k + 1) * H * 1 + 4 * (k + 1) instead of (k + 1) * H * 2. The reader multiplies back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


@dataclass
class WriterStats:
    items: int = 0
    bytes: int = 0
    submit_blocked_s: float = 0.0  # producer (GPU loop) waiting for a free queue slot
    copy_wait_s: float = 0.0  # writer thread waiting for device -> host copies
    sink_s: float = 0.0  # writer thread inside the sink (serialization + disk)

    def bytes_per_s(self) -> float:
        return self.bytes / self.sink_s if self.sink_s else float("inf")


class OverlappedWriter:
    """submit(tensors, meta) from the compute loop; sink(meta, host_tensors) runs on one thread.

    Use as a context manager; `close()` drains the queue, joins the thread and re-raises the
    sink's first exception (also raised at the next `submit`).
    """

    _STOP = object()

    def __init__(self, sink: Callable[[Any, dict[str, torch.Tensor]], None], max_pending: int = 2,
                 pool_size: int | None = None):
        if max_pending < 1:
            raise ValueError(f"OverlappedWriter: max_pending = {max_pending}, must be >= 1")
        self.sink = sink
        self.stats = WriterStats()
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self._pool_size = pool_size if pool_size is not None else max_pending + 2
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._stream = None
        self._thread = threading.Thread(target=self._run, name="eagleforge-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side

    def submit(self, tensors: dict[str, torch.Tensor], meta: Any = None) -> None:
        """Queue device -> host copies of `tensors`; returns once they are enqueued (not copied)."""
        self._raise_if_failed()
        event, host = None, {}
        on_cuda = any(t.is_cuda for t in tensors.values())
        if on_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            compute = torch.cuda.current_stream()
            self._stream.wait_stream(compute)  # the copies start after the forward that made the tensors
            with torch.cuda.stream(self._stream):
                for name, t in tensors.items():
                    buf = self._take(t.shape, t.dtype)
                    buf.copy_(t, non_blocking=True)
                    t.record_stream(self._stream)  # keep the source alive until the copy ran
                    host[name] = buf
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            host = {name: t.detach().clone() for name, t in tensors.items()}
        start = time.perf_counter()
        self._queue.put((event, host, meta))
        self.stats.submit_blocked_s += time.perf_counter() - start

    def _take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            free = self._pool.get((tuple(shape), dtype))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _give_back(self, host: dict[str, torch.Tensor]) -> None:
        with self._lock:
            for t in host.values():
                free = self._pool.setdefault((tuple(t.shape), t.dtype), [])
                if t.is_pinned() and len(free) < self._pool_size:
                    free.append(t)

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            event, host, meta = item
            if self._error is not None:
                continue  # drain without writing after a failure
            try:
                start = time.perf_counter()
                if event is not None:
                    event.synchronize()
                copied = time.perf_counter()
                self.sink(meta, host)
                done = time.perf_counter()
                self.stats.copy_wait_s += copied - start
                self.stats.sink_s += done - copied
                self.stats.items += 1
                self.stats.bytes += sum(t.numel() * t.element_size() for t in host.values())
                if event is not None:
                    self._give_back(host)
            except BaseException as err:  # surfaced to the producer at its next call
                log.error("writer sink failed on %r: %s", meta, err)
                self._error = err

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"OverlappedWriter: the sink failed: {self._error}") from self._error

    def close(self) -> WriterStats:
        if self._thread.is_alive():
            self._queue.put(self._STOP)
            self._thread.join()
        self._raise_if_failed()
        return self.stats

    def __enter__(self) -> "OverlappedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the original error with the sink's
            self._queue.put(self._STOP)
            self._thread.join()


# ---------------------------------------------------------------------------- fp8 storage


def quantize_fp8(x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (e4m3 [N, D], fp32 scales [N, D / block]); block defaults to D (one scale a token).

    scale = amax(|x| over the block) / 448, so every block uses the full e4m3 range; all-zero
    rows get scale 1 (stored zeros stay zeros). Non-finite inputs stay non-finite in the scale,
    which the reader's finiteness check then catches.
    """
    N, D = x.shape
    block = block or D
    if D % block:
        raise ValueError(f"quantize_fp8: {D} columns are not a multiple of the scale block {block}")
    blocks = x.float().view(N, D // block, block)
    amax = blocks.abs().amax(-1)  # [N, D/block]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(N, D), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(e4m3 [N, D], fp32 [N, D / block]) -> dtype [N, D]."""
    N, D = q.shape
    if scale.shape[0] != N or D % scale.shape[1]:
        raise ValueError(f"dequantize_fp8: scales {tuple(scale.shape)} do not fit values {tuple(q.shape)}")
    blocks = q.float().view(N, scale.shape[1], -1) * scale.unsqueeze(-1)
    return blocks.view(N, D).to(dtype)


def fp8_error(x: torch.Tensor, block: int | None = None) -> dict[str, float]:
    """Round-trip error of fp8 storage against bf16 storage of the same states, relative to |x|."""
    ref = x.float()
    bf16 = x.to(torch.bfloat16).float()
    q, scale = quantize_fp8(x, block)
    fp8 = dequantize_fp8(q, scale, torch.float32)
    norm = ref.norm()

    def cos(a: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a, ref, dim=-1).min())

    return {"fp8_rel_l2": float((fp8 - ref).norm() / norm), "bf16_rel_l2": float((bf16 - ref).norm() / norm),
            "fp8_min_token_cosine": cos(fp8), "bf16_min_token_cosine": cos(bf16)}
