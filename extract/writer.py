"""Overlapped writing of captured hidden states, and the optional fp8 storage format.

OverlappedWriter: after a forward, `submit` copies the captured GPU tensors into pinned host
buffers on a side CUDA stream (asynchronous: the compute stream goes on with the next forward)
and queues them; one writer thread waits for each copy's event and hands the host tensors to a
`sink` (which writes a shard, or appends to one). The queue holds at most `max_pending` items:
when the disk is slower than the GPU the queue fills and `submit` blocks; the time it blocked is
`stats.submit_blocked_s`, the number a benchmark reports as "the GPU waited on the disk".

Pinned buffers are flat byte buffers taken from a small pool (best fit by size, since every
batch packs a different number of rows) and returned after the sink has run, so a sink must not
keep references to the tensors it is given (copy what it keeps). On the CPU, `submit` clones
instead; the writer thread still overlaps serialization and the disk with the next forwards.

ShardSink: the sink the extractors use. A chunk (one shard) is extracted in several batches;
each batch's rows are submitted packed ([sum n, D], samples end to end) with a BatchRows meta;
the sink gathers a chunk's batches, leaves out samples with NaN/Inf states (counted), and writes
the shard through ShardWriter when the chunk's last batch arrives. InlineWriter runs the same
sink synchronously (extract.overlap_writes=false): the same bytes, no thread.

fp8 storage (e4m3, one fp32 scale per token and per block of columns, block = H so each aux
layer of a token gets its own scale): `quantize_fp8` / `dequantize_fp8`, defined with the shard
format in eagleforge/shards.py; bytes per token (k + 1) * (H + 4) instead of (k + 1) * 2H. The reader
multiplies back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from eagleforge.errors import ConfigError, UserInputError

# The fp8 format lives with the shard format (eagleforge/shards.py); re-exported here for writers.
from eagleforge.shards import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8, rows_sha256  # noqa: F401

log = logging.getLogger(__name__)



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
        self._free: list[torch.Tensor] = []  # pinned flat byte buffers not in use
        # buffers, not items: an item is a few tensors (aux, last, argmax)
        self._pool_size = pool_size if pool_size is not None else 4 * (max_pending + 2)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._stream = None
        self._thread = threading.Thread(target=self._run, name="eagleforge-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side

    def submit(self, tensors: dict[str, torch.Tensor], meta: Any = None) -> None:
        """Queue device -> host copies of `tensors`; returns once they are enqueued (not copied)."""
        self._raise_if_failed()
        event, host, bases = None, {}, []
        on_cuda = any(t.is_cuda for t in tensors.values())
        if on_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            compute = torch.cuda.current_stream()
            self._stream.wait_stream(compute)  # the copies start after the forward that made the tensors
            with torch.cuda.stream(self._stream):
                for name, t in tensors.items():
                    base, buf = self._take(t.shape, t.dtype)
                    buf.copy_(t, non_blocking=True)
                    t.record_stream(self._stream)  # keep the source alive until the copy ran
                    host[name] = buf
                    bases.append(base)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            host = {name: t.detach().clone() for name, t in tensors.items()}
        start = time.perf_counter()
        self._queue.put((event, host, bases, meta))
        self.stats.submit_blocked_s += time.perf_counter() - start

    def _take(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat pinned uint8 base, a [shape] dtype view of its start): the smallest free buffer
        that is large enough, else a new one with 25% headroom (batches vary in rows)."""
        count = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        nbytes = max(1, count)
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            # by position, never list.remove: that compares tensors elementwise
            base = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if base is None:
            base = self._alloc(nbytes + nbytes // 4)
        return base, base[:count].view(dtype).view(shape)

    @staticmethod
    def _alloc(nbytes: int) -> torch.Tensor:
        """A flat pinned byte buffer (a seam: the CPU test of the pool swaps in plain memory)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _give_back(self, bases: list[torch.Tensor]) -> None:
        with self._lock:
            # keep the largest `pool_size` buffers: any of them fits a smaller batch
            self._free = sorted(self._free + bases, key=lambda b: b.numel())[-self._pool_size:]

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            event, host, bases, meta = item
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
                if bases:
                    self._give_back(bases)
            except BaseException as err:  # surfaced to the producer at its next call
                log.error("writer sink failed on %r: %s", meta, err)
                self._error = err

    def _raise_if_failed(self) -> None:
        if self._error is None:
            return
        if isinstance(self._error, (ConfigError, UserInputError, FileNotFoundError)):
            # A user's problem (disk full, a file of another run): the entry point prints it as
            # one line, so it must arrive as itself, not wrapped.
            raise self._error
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


class InlineWriter:
    """OverlappedWriter's interface, run synchronously in the caller (extract.overlap_writes=false)."""

    def __init__(self, sink: Callable[[Any, dict[str, torch.Tensor]], None]):
        self.sink = sink
        self.stats = WriterStats()

    def submit(self, tensors: dict[str, torch.Tensor], meta: Any = None) -> None:
        start = time.perf_counter()
        # like OverlappedWriter: the sink gets tensors the producer no longer owns
        host = {name: t.detach().cpu() if t.is_cuda else t.detach().clone() for name, t in tensors.items()}
        copied = time.perf_counter()
        self.sink(meta, host)
        self.stats.copy_wait_s += copied - start
        self.stats.sink_s += time.perf_counter() - copied
        self.stats.items += 1
        self.stats.bytes += sum(t.numel() * t.element_size() for t in host.values())

    def close(self) -> WriterStats:
        return self.stats

    def __enter__(self) -> "InlineWriter":
        return self

    def __exit__(self, *exc) -> None:
        pass


# ---------------------------------------------------------------------------- the extractors' sink


def split_rows(packed: dict[str, torch.Tensor], lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    """Packed rows {name: [sum n, ...]} of samples end to end -> per-sample dicts of [n, ...] views."""
    total = sum(lengths)
    for name, t in packed.items():
        if t.shape[0] != total:
            raise ValueError(f"split_rows: {name} has {t.shape[0]} rows, the samples' lengths sum to {total}")
    out, start = [], 0
    for n in lengths:
        out.append({name: t[start:start + n] for name, t in packed.items()})
        start += n
    return out


@dataclass
class BatchRows:
    """Where one forward's packed rows belong: chunk `chunk` (rows = its samples in id order,
    each {"id", "input_ids", "loss_mask"}) and the chunk positions of this batch's samples in
    the order they are packed. The chunk is whole once every position has arrived."""

    chunk: int
    rows: list[dict]
    positions: list[int]


def is_finite(sample: dict[str, torch.Tensor]) -> bool:
    return bool(torch.isfinite(sample["aux_hidden_states"]).all() and torch.isfinite(sample["last_hidden_state"]).all())


class ShardSink:
    """Gathers each chunk's batches and writes the chunk's shard (ShardWriter) when it is whole.

    Samples whose states hold NaN or Inf are not written: they go to the shard's skipped_ids and
    are counted in `skipped`. Runs on the writer thread: it copies what it keeps out of the
    (pooled, reused) pinned buffers it is handed.
    """

    def __init__(self, shard_writer, cause: str | None = None):
        self.shard_writer = shard_writer
        self.cause = cause  # the line naming the target's weight holding NaN/Inf, said with the first skip
        self.skipped = 0
        self.shards_written = 0
        self._pending: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # chunk -> position -> states

    def __call__(self, meta: BatchRows, tensors: dict[str, torch.Tensor]) -> None:
        states = self._pending.setdefault(meta.chunk, {})
        lengths = [len(meta.rows[j]["input_ids"]) for j in meta.positions]
        for j, sample in zip(meta.positions, split_rows(tensors, lengths)):
            states[j] = {k: v.clone() if v.is_pinned() else v for k, v in sample.items()}
        if len(states) < len(meta.rows):
            return
        del self._pending[meta.chunk]
        self.write_chunk(meta.chunk, meta.rows, [states[j] for j in range(len(meta.rows))])

    def write_chunk(self, chunk: int, rows: list[dict], states: list[dict[str, torch.Tensor]]) -> dict:
        written, ids, skipped = [], [], []
        for row, state in zip(rows, states):
            if not is_finite(state):
                skipped.append(int(row["id"]))
                continue
            state["input_ids"] = torch.tensor(row["input_ids"], dtype=torch.int32)
            state["loss_mask"] = torch.tensor(row["loss_mask"], dtype=torch.uint8)
            written.append(state)
            ids.append(int(row["id"]))
        if skipped:
            log.warning("chunk %d: skipped %d samples with NaN/Inf hidden states: %s", chunk, len(skipped), skipped)
            if self.cause is not None and not self.skipped:  # once: most samples may skip for it
                log.warning("%s", self.cause)
        self.skipped += len(skipped)
        entry = self.shard_writer.write_shard(chunk, written, ids, skipped, content_sha256=rows_sha256(rows))
        self.shards_written += 1
        return entry


def make_writer(sink: ShardSink, overlap: bool, max_pending: int = 2):
    """The overlapped writer (a thread, pinned copies on CUDA) or, when `overlap` is off, the inline one."""
    return OverlappedWriter(sink, max_pending=max_pending) if overlap else InlineWriter(sink)


def writer_summary(stats: WriterStats, wall_s: float) -> str:
    """One line for the logs: did the compute loop ever wait on the disk?"""
    verdict = ("the disk kept up: the compute loop never waited on it" if stats.submit_blocked_s < 0.01 * max(wall_s, 1e-9)
               else f"the disk was slower than the compute: the loop waited {stats.submit_blocked_s:.1f} s on it")
    return (f"writer: {stats.items} batches, {stats.bytes / 2**20:.1f} MiB in {stats.sink_s:.1f} s of writing "
            f"({stats.bytes / max(stats.sink_s, 1e-9) / 2**20:.0f} MiB/s); {verdict}")


# ---------------------------------------------------------------------------- fp8 storage


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
