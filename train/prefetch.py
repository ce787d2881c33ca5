"""One worker thread that makes the trainer's batches ahead of the step that trains on them.

    feed = Prefetcher(source_load, slots, depth=2, device=cuda, side_stream=True)
    slot, batch = feed.get()      # in the order of `slots`
    feed.close()

The worker runs `produce(item)` for each item of an iterable (consumed lazily: the trainer's
schedule to its last step) and puts `(item, result)` in a bounded queue of `depth` results, so it
is never more than `depth` items ahead; `depth` 0 produces in line, in `get`. A result with a
`wait()` (online rows still on their way from a later pipeline stage) is waited for only once
`lookahead` more items have been started, so the stages keep working on the next forwards. From shards it
reads and pads the coming micro-batches on the host (mmap page faults, fp8 dequantization,
the embedding rows) while the GPU trains; online it runs the target's forwards. With
`side_stream` on CUDA it works on its own stream: each result carries an event the consumer's
stream waits on, and its tensors are recorded on that stream (their memory is not reused before
the consumer is done with them). An error in `produce` reaches the consumer as an exception at
its `get` (never a hang), and `close` stops the worker wherever it is.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from typing import Callable, Iterable

import torch

from eagleforge.errors import ConfigError, UserInputError

THREAD_NAME = "batch-prefetch"


class Prefetcher:
    _DONE = object()

    def __init__(self, produce: Callable, items: Iterable, depth: int, device: torch.device | None = None,
                 side_stream: bool = False, what: str = "reading a batch", lookahead: int = 0):
        self.produce, self.what, self.lookahead = produce, what, lookahead
        self.items = iter(items)
        self._started: collections.deque = collections.deque()  # (item, result not waited for yet)
        self.device = device
        self.stream = torch.cuda.Stream(device) if side_stream and device is not None and device.type == "cuda" else None
        self.thread = None
        if depth > 0:
            self.queue: queue.Queue = queue.Queue(maxsize=depth)
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self.thread.start()

    def _next(self):
        """The next (item, result, event), or _DONE: `produce` runs up to `lookahead` items ahead
        of the one finished here (a result with a wait(), such as rows still coming from a later
        pipeline stage, is waited for only now, while the forwards started after it run)."""
        while len(self._started) <= self.lookahead:
            try:
                item = next(self.items)
            except StopIteration:
                break
            self._started.append((item, self.produce(item)))
        if not self._started:
            return self._DONE
        item, result = self._started.popleft()
        if hasattr(result, "wait"):
            result = result.wait()
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        return item, result, event

    def _run(self) -> None:
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                while not self.stop.is_set():
                    entry = self._next()
                    self._put(entry)
                    if entry is self._DONE:
                        return
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(err)

    def _put(self, entry) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(entry, timeout=0.5)
                return
            except queue.Full:
                continue

    def get(self):
        """The next (item, result), its tensors ready for the current stream."""
        if self.thread is None:  # in line
            entry = self._next()
        else:
            entry = self.queue.get()
        if isinstance(entry, (torch.OutOfMemoryError, ConfigError, FileNotFoundError, UserInputError)):
            raise entry  # the caller says these in one line (the stage, the file, the key)
        if isinstance(entry, BaseException):
            raise RuntimeError(f"{self.what} failed") from entry
        if entry is self._DONE:
            raise RuntimeError(f"the batch feed ran out ({self.what}) before the trainer did")
        item, result, event = entry
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in _tensors(result):
                t.record_stream(current)
        return item, result

    def close(self) -> None:
        if self.thread is None:
            return
        self.stop.set()
        while True:  # unblock a worker waiting to put
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        self.thread.join(timeout=60)


def _tensors(result) -> list[torch.Tensor]:
    """The CUDA tensors of a result: a tensor, a dataclass of them (Batch), or a tuple/list of
    either (host tensors, such as embedding rows gathered into pinned memory, are copied to the
    device by the consumer later: no stream to record them on)."""
    if isinstance(result, torch.Tensor):
        return [result] if result.is_cuda else []
    if hasattr(result, "__dataclass_fields__"):
        return [t for t in (getattr(result, name) for name in result.__dataclass_fields__) if isinstance(t, torch.Tensor) and t.is_cuda]
    if isinstance(result, (tuple, list)):
        return [t for part in result for t in _tensors(part)]
    return []
