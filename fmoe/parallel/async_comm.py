"""Wait handles for asynchronous collectives: c10d's work handles order the streams, fmoe adds no stream.

    out, handle = all_to_all_async(x, ...)   # issued now
    ...compute that does not need `out`...
    handle.wait()                            # now `out` may be read (on a device: queued reads may)

What NCCL does (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp; HCCL's ProcessGroupHCCL in torch_npu
follows the same design, not checked against its source here):
  1. issue (`async_op=True`): the collective runs on the process group's own internal stream, which is
     made to wait on the current stream first (`syncStream`), so it sees every write queued before it.
     With TORCH_NCCL_AVOID_RECORD_STREAMS (the default) the work stashes its input and output tensors.
  2. `Work.wait()` with no timeout: `synchronize()` makes the *current* stream wait on the work's end
     event ("block the current stream on the NCCL stream") and unstashes the tensors; the host does not
     block (unless TORCH_NCCL_BLOCKING_WAIT). Kernels queued afterwards on the current stream read the
     collective's result; the caching allocator reuses its buffers only after it.
  3. `Work.wait(timeout)`: the same, and then, because a timeout was given, the host busy-waits until
     the work completes ("In case of blockingWait or a timeout value is specified by the user, we block
     the CPU thread until the work is completed or timed out"): the CPU can no longer run ahead.
So a side stream of fmoe's own orders nothing useful: an event recorded on it after the issue completes
before the collective does (the collective is on NCCL's stream, not on it). This module therefore has no
stream: on a device `wait()` calls `work.wait()` without a timeout, from the stream that will read the
result (the process group's own timeout and watchdog bound a hung collective there); on CPU gloo runs
the work on its own threads and `wait(timeout)` blocks the host, bounded by the handle's `timeout`.
The handle keeps the collective's tensors alive until wait() (as c10d's stash does), and a handle
dropped without wait() still orders the current stream after the work before releasing them.
Checked on CPU against a fake work/stream model (tests/test_parallel_units.py), never on a GPU or NPU.

A `LinkModel` (link_model.py) gives a handle a `not_before` time: `wait()` does not return before it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from fmoe._compat import disable_functorch
from fmoe._work import wait_work
from fmoe.parallel.counters import CommCounters
from fmoe.parallel.failure import describe_failure


class CommHandle:
    """Completion of one or more collectives; `wait()` once before reading their outputs.

    `wait()` waits the c10d works (`wait_work`: on `device` an accelerator, stream ordering only; on CPU
    blocking, bounded by `timeout`), then releases the tensors kept alive for the collective (`keep`),
    then (with a link model) sleeps until `not_before` (a `time.perf_counter()` value), then runs the
    `on_wait` callbacks. A failed collective raises `CollectiveError` (failure.py), again at every
    further wait(). The blocked time is added to `counters.wait_s[op]`. A second wait() after success
    is a no-op.
    """

    def __init__(self, op: str, works: Sequence[dist.Work | None] = (), *, device: torch.device | None = None,
                 timeout: timedelta | None = None, keep: Sequence[torch.Tensor] = (), not_before: float = 0.0,
                 counters: CommCounters | None = None, on_wait: Sequence[Callable[[], None]] = (),
                 ranks: list[int] | None = None):
        self.op = op
        self.ranks = ranks
        self._works = [w for w in works if w is not None]
        self.device = device
        self.timeout = timeout
        self._keep = tuple(keep)  # input / output buffers of the collective, alive until it is waited
        self.not_before = not_before
        self._counters = counters
        self._on_wait = list(on_wait)
        self.done = False

    @property
    def on_device(self) -> bool:
        """True when the collective's tensors live on an accelerator (its wait orders streams only)."""
        return self.device is not None and self.device.type != "cpu"

    def wait(self) -> None:
        """Block (CPU) or order the current stream (device) until the collectives are complete. Idempotent."""
        if self.done:
            return
        t0 = time.perf_counter()
        # Outside the Function that issued it, under torch.func the wait would be seen as an in-place
        # write to a captured tensor (gloo copies results at wait): run it below the transforms.
        try:
            with disable_functorch():
                for w in self._works:
                    wait_work(w, self.device, self.timeout)
        except Exception as e:  # a peer raised, died or timed out: say so, don't leave a raw gloo error
            raise describe_failure(self.op, self.ranks, e) from e
        self._keep = ()  # the current stream (the one that reuses memory) is now queued after the works
        delay = self.not_before - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        for cb in self._on_wait:
            cb()
        self.done = True
        if self._counters is not None:
            self._counters.add_wait(self.op, time.perf_counter() - t0)

    def order_stream(self) -> None:
        """On a device, makes the current stream wait for the collectives' end (c10d's `work.wait()`: no
        host block; the handle stays unwaited: `wait()` still orders the stream that reads the results);
        on CPU the same as `wait()`. For a side stream that reads what the collectives brought
        (fmoe/parallel/host_read.py)."""
        if not self.on_device:
            self.wait()
            return
        try:
            with disable_functorch():
                for w in self._works:
                    w.wait()
        except Exception as e:
            raise describe_failure(self.op, self.ranks, e) from e

    def __del__(self) -> None:
        # Dropped without wait() on a device: queue the current stream after the works (no host block)
        # before the kept buffers go back to the allocator. On CPU gloo keeps its own buffers alive.
        if not self.done and self._keep and self.on_device:
            with contextlib.suppress(Exception):  # interpreter shutdown, a failed work: nothing to protect
                for w in self._works:
                    w.wait()

    def is_completed(self) -> bool:
        """True when the works are done and `not_before` has passed (on a device: done on the device)."""
        return self.done or (all(w.is_completed() for w in self._works)
                             and time.perf_counter() >= self.not_before)

    @staticmethod
    def all(handles: Sequence[CommHandle], op: str = "group") -> CommHandle:
        """One handle whose `wait()` waits every handle in `handles`, in order."""
        return CommHandle(op, on_wait=[h.wait for h in handles])
