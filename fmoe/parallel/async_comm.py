"""Wait handles for asynchronous collectives, and the communication stream they are issued on.

    out, handle = all_to_all_async(x, ...)   # issued now
    ...compute that does not need `out`...
    handle.wait()                            # now `out` may be read

On CUDA / NPU a collective is issued on a side `CommStream` (after an event that orders it behind the
compute already queued), and `wait()` makes the current stream wait on the comm stream's done-event:
the host does not block. The stream calls go through torch's generic `torch.Stream` / `torch.Event` /
`torch.accelerator` API, so one code path serves CUDA and Ascend (torch_npu registers its device there).
On CPU there is no stream: gloo runs the work asynchronously on its own threads and `wait()` blocks.

A `LinkModel` (link_model.py) gives a handle a `not_before` time: `wait()` does not return before it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from fmoe.parallel.counters import CommCounters
from fmoe.parallel.failure import describe_failure


class CommStream:
    """A communication stream on an accelerator `device`; a no-op stand-in on CPU."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.stream: torch.Stream | None = None
        if self.device.type != "cpu":
            self.stream = torch.Stream(device=self.device)

    @contextlib.contextmanager
    def issue(self, *tensors: torch.Tensor) -> Iterator[None]:
        """Run the block on the comm stream, ordered after the work queued so far on the current stream.

        `tensors` (inputs and outputs of the collective) are marked as used on the comm stream, so the
        caching allocator does not reuse their memory before the collective finishes.
        """
        if self.stream is None:
            yield
            return
        compute = torch.accelerator.current_stream(self.device)
        self.stream.wait_event(compute.record_event())
        for t in tensors:
            with contextlib.suppress(TypeError, RuntimeError):  # record_stream wants the backend's stream
                t.record_stream(self.stream)
        torch.accelerator.set_stream(self.stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(compute)

    def done_event(self) -> torch.Event | None:
        """An event recorded on the comm stream after the collectives issued so far (None on CPU)."""
        return None if self.stream is None else self.stream.record_event()


class CommHandle:
    """Completion of one or more collectives; `wait()` once before reading their outputs.

    `wait()` waits the c10d works, then (on a device) makes the current stream wait on the comm event,
    then (with a link model) sleeps until `not_before` (a `time.perf_counter()` value), then runs the
    `on_wait` callbacks. A failed collective raises `CollectiveError` (failure.py). The blocked time is
    added to `counters.wait_s[op]`.
    """

    def __init__(self, op: str, works: Sequence[dist.Work | None] = (), *, event: torch.Event | None = None,
                 not_before: float = 0.0, counters: CommCounters | None = None,
                 on_wait: Sequence[Callable[[], None]] = (), ranks: list[int] | None = None):
        self.op = op
        self.ranks = ranks
        self._works = [w for w in works if w is not None]
        self._event = event
        self.not_before = not_before
        self._counters = counters
        self._on_wait = list(on_wait)
        self.done = False

    def wait(self) -> None:
        """Block (or order the current stream) until the collectives are complete. Idempotent."""
        if self.done:
            return
        t0 = time.perf_counter()
        # Outside the Function that issued it, under torch.func the wait would be seen as an in-place
        # write to a captured tensor (gloo copies results at wait): run it below the transforms.
        try:
            with torch._C._DisableFuncTorch():
                for w in self._works:
                    w.wait()
        except Exception as e:  # a peer raised, died or timed out: say so, don't leave a raw gloo error
            raise describe_failure(self.op, self.ranks, e) from e
        if self._event is not None:
            torch.accelerator.current_stream(self._event.device).wait_event(self._event)
        delay = self.not_before - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        for cb in self._on_wait:
            cb()
        self.done = True
        if self._counters is not None:
            self._counters.add_wait(self.op, time.perf_counter() - t0)

    def is_completed(self) -> bool:
        """True when `wait()` would not block (the works are done and `not_before` has passed)."""
        return self.done or (all(w.is_completed() for w in self._works)
                             and time.perf_counter() >= self.not_before)

    @staticmethod
    def all(handles: Sequence[CommHandle], op: str = "group") -> CommHandle:
        """One handle whose `wait()` waits every handle in `handles`, in order."""
        return CommHandle(op, on_wait=[h.wait for h in handles])
