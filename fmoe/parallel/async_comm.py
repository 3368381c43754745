"""Wait handles for asynchronous collectives, and the communication stream they are issued on.

    out, handle = all_to_all_async(x, ...)   # issued now
    ...compute that does not need `out`...
    handle.wait()                            # now `out` may be read

On CUDA / NPU a collective is issued on a side `CommStream`, and the ordering is, step by step:
  1. issue: the comm stream waits on the current (compute) stream, so the collective sees every write
     to its input queued so far; the collective is launched with the comm stream current; an event is
     recorded on the comm stream after it; the compute stream is made current again.
  2. the handle keeps the collective's input and output tensors alive (they were allocated on the
     compute stream). No `record_stream`: like c10d's TORCH_NCCL_AVOID_RECORD_STREAMS, the references
     are stashed instead, so the caching allocator cannot hand their memory to compute-stream work that
     would run while the collective still reads or writes it.
  3. wait(): waits the c10d works (for NCCL / HCCL this orders the current stream after c10d's internal
     stream, without blocking the host), then makes the current stream and the issuing compute stream
     wait on the comm event, and only then drops the stashed tensors: from here on any reuse of their
     memory is queued after the collective.
  4. a handle dropped without wait(): its finaliser orders the issuing stream after the event before the
     tensors are released (the same guarantee for memory reuse; reading `out` is then a caller bug).
The stream calls go through torch's generic `torch.Stream` / `torch.Event` / `torch.accelerator` API, so
one code path serves CUDA and Ascend (torch_npu registers its device there). This path has been checked
only against fake streams on CPU (tests/test_parallel_units.py), never on a GPU or NPU.
On CPU there is no stream: gloo runs the work asynchronously on its own threads (it keeps its buffers
alive itself) and `wait()` blocks. A handle dropped without wait() neither hangs nor leaks.

A `LinkModel` (link_model.py) gives a handle a `not_before` time: `wait()` does not return before it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from fmoe._compat import disable_functorch
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
    def issue(self) -> Iterator[torch.Stream | None]:
        """Run the block with the comm stream current, ordered after the work queued so far on the current
        (compute) stream; yield that compute stream (None on CPU) and make it current again on exit."""
        if self.stream is None:
            yield None
            return
        compute = torch.accelerator.current_stream(self.device)
        self.stream.wait_stream(compute)  # the collective sees every write queued before it
        torch.accelerator.set_stream(self.stream)
        try:
            yield compute
        finally:
            torch.accelerator.set_stream(compute)

    def done_event(self) -> torch.Event | None:
        """An event recorded on the comm stream after the collectives issued so far (None on CPU)."""
        return None if self.stream is None else self.stream.record_event()


class CommHandle:
    """Completion of one or more collectives; `wait()` once before reading their outputs.

    `wait()` waits the c10d works, then (on a device) makes the current stream and the issuing stream
    wait on the comm event and releases the tensors kept alive for the collective (`keep`), then (with a
    link model) sleeps until `not_before` (a `time.perf_counter()` value), then runs the `on_wait`
    callbacks. A failed collective raises `CollectiveError` (failure.py), again at every further wait().
    The blocked time is added to `counters.wait_s[op]`. A second wait() after success is a no-op.
    """

    def __init__(self, op: str, works: Sequence[dist.Work | None] = (), *, event: torch.Event | None = None,
                 issue_stream: torch.Stream | None = None, keep: Sequence[torch.Tensor] = (),
                 not_before: float = 0.0, counters: CommCounters | None = None,
                 on_wait: Sequence[Callable[[], None]] = (), ranks: list[int] | None = None):
        self.op = op
        self.ranks = ranks
        self._works = [w for w in works if w is not None]
        self._event = event
        self._issue_stream = issue_stream
        self._keep = tuple(keep)  # input / output buffers of the collective, alive until the streams wait
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
            with disable_functorch():
                for w in self._works:
                    w.wait()
        except Exception as e:  # a peer raised, died or timed out: say so, don't leave a raw gloo error
            raise describe_failure(self.op, self.ranks, e) from e
        if self._event is not None:
            torch.accelerator.current_stream(self._event.device).wait_event(self._event)
            self._order_issue_stream()
        self._keep = ()  # every stream that may reuse these buffers is now queued after the collective
        delay = self.not_before - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        for cb in self._on_wait:
            cb()
        self.done = True
        if self._counters is not None:
            self._counters.add_wait(self.op, time.perf_counter() - t0)

    def _order_issue_stream(self) -> None:
        if self._issue_stream is not None and self._event is not None:
            self._issue_stream.wait_event(self._event)

    def __del__(self) -> None:
        # Dropped without wait(): before the kept buffers go back to the allocator, queue the issuing
        # stream (where they were allocated, hence where they are reused) after the collective.
        if not self.done and self._keep:
            with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to protect
                self._order_issue_stream()

    def is_completed(self) -> bool:
        """True when `wait()` would not block (the works are done and `not_before` has passed)."""
        return self.done or (all(w.is_completed() for w in self._works)
                             and time.perf_counter() >= self.not_before)

    @staticmethod
    def all(handles: Sequence[CommHandle], op: str = "group") -> CommHandle:
        """One handle whose `wait()` waits every handle in `handles`, in order."""
        return CommHandle(op, on_wait=[h.wait for h in handles])
