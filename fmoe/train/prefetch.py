"""The next step's batch, read while this step trains.

    batches = Prefetcher(read, device)            # read(start) -> [(ids_BS, targets_BS)] on the host
    for step ...: mbs = batches.get(start, next_start)   # on `device`; the read of next_start begins

One background thread reads the samples at stream position `next_start` (memory-mapped files, the
epoch's document order) while the caller trains on `start`'s. On CUDA the host tensors are pinned in
the thread and copied with non_blocking=True, so the copy is queued on the current stream without the
host waiting for it (the caching host allocator keeps the pinned block alive until the copy is done). A
request for another position than the one read ahead (a resume, a first step) is read on the spot, so
what a step gets is always read(start): the thread changes when, never what. An error in the read ahead
is raised by the `get` that asks for it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

Batches = list[tuple[torch.Tensor, torch.Tensor]]

__all__ = ["Prefetcher"]


class Prefetcher:
    """Reads `read(start)` one step ahead on a background thread and moves it to `device` (module
    docstring)."""

    def __init__(self, read: Callable[[int], Batches], device: torch.device) -> None:
        self.read, self.device = read, device
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fmoe-data")
        self._ahead: tuple[int, Future] | None = None

    def _host(self, start: int) -> Batches:
        batches = self.read(start)
        return [(ids.pin_memory(), t.pin_memory()) for ids, t in batches] if self.pin else batches

    def get(self, start: int, next_start: int | None) -> Batches:
        """The batches of stream position `start` on the device; starts reading `next_start` (None: no
        further step)."""
        if self._ahead is not None and self._ahead[0] == start:
            host = self._ahead[1].result()
        else:
            if self._ahead is not None:
                self._ahead[1].cancel()
            host = self._host(start)
        self._ahead = None if next_start is None else (next_start, self._pool.submit(self._host, next_start))
        return [(ids.to(self.device, non_blocking=self.pin), t.to(self.device, non_blocking=self.pin))
                for ids, t in host]

    def close(self) -> None:
        """Stops the thread (a read in flight finishes first)."""
        self._ahead = None
        self._pool.shutdown(wait=True, cancel_futures=True)
