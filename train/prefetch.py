"""One worker thread that makes the trainer's batches ahead of the step that trains on them.

    feed = Prefetcher(source_load, slots, depth=2, device=cuda, side_stream=True)
    slot, batch = feed.get()      # in the order of `slots`
    feed.close()

The worker runs `produce(item)` for each item of an iterable (consumed lazily: the trainer's
schedule to its last step) and puts `(item, result)` in a bounded queue of `depth` results, so it
is never more than `depth` items ahead; `depth` 0 produces in line, in `get`. From shards it
reads and pads the coming micro-batches on the host (mmap page faults, fp8 dequantization,
the embedding rows) while the GPU trains; online it runs the target's forwards. With
`side_stream` on CUDA it works on its own stream: each result carries an event the consumer's
stream waits on, and its tensors are recorded on that stream (their memory is not reused before
the consumer is done with them). An error in `produce` reaches the consumer as an exception at
its `get` (never a hang), and `close` stops the worker wherever it is.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Callable, Iterable

import torch

THREAD_NAME = "batch-prefetch"


class Prefetcher:
    _DONE = object()

    def __init__(self, produce: Callable, items: Iterable, depth: int, device: torch.device | None = None,
                 side_stream: bool = False, what: str = "reading a batch"):
        self.produce, self.what = produce, what
        self.items = iter(items)
        self.device = device
        self.stream = torch.cuda.Stream(device) if side_stream and device is not None and device.type == "cuda" else None
        self.thread = None
        if depth > 0:
            self.queue: queue.Queue = queue.Queue(maxsize=depth)
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self.thread.start()

    def _make(self, item):
        result = self.produce(item)
        event = None
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
        return item, result, event

    def _run(self) -> None:
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                for item in self.items:
                    if self.stop.is_set():
                        return
                    self._put(self._make(item))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(err)
        else:
            self._put(self._DONE)

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
            try:
                entry = self._make(next(self.items))
            except StopIteration:
                entry = self._DONE
        else:
            entry = self.queue.get()
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
    """The tensors of a result: a tensor, a dataclass of them (Batch), or a tuple/list of either."""
    if isinstance(result, torch.Tensor):
        return [result]
    if hasattr(result, "__dataclass_fields__"):
        return [t for t in (getattr(result, name) for name in result.__dataclass_fields__) if isinstance(t, torch.Tensor)]
    if isinstance(result, (tuple, list)):
        return [t for part in result for t in _tensors(part)]
    return []
