"""Stopping the spawned ranks of `fmoe train` with their launcher.

SIGINT or SIGTERM sent to the launcher alone (a `kill PID`, a scheduler's SIGTERM) used to leave the ranks
training to --steps. `forward_stop_signals` makes the launcher record such a signal; `stop_ranks` then
ends every rank: SIGTERM (a rank waiting inside a gloo collective runs no Python signal handler, so it is
not asked to stop but ended), SIGKILL after GRACE_S. The launcher exits 128 + the signal (130 for SIGINT).
A launcher that dies without a word (SIGKILL) takes its ranks along: each rank asks Linux for SIGKILL when
its parent exits (`die_with_parent`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

GRACE_S = 3.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


@contextmanager
def forward_stop_signals() -> Iterator[Callable[[], int | None]]:
    """Within: SIGINT / SIGTERM are recorded instead of raising; yields a function returning the first
    signal received (None before one). The previous handlers come back on exit."""
    got: list[int] = []

    def record(signum: int, frame: Any) -> None:
        got.append(signum)

    previous = {s: signal.signal(s, record) for s in STOP_SIGNALS}
    try:
        yield lambda: got[0] if got else None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def stop_ranks(processes: list[Any]) -> None:
    """Ends the ranks still alive (multiprocessing.Process): SIGTERM, then SIGKILL after GRACE_S."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(GRACE_S)


def die_with_parent(parent_pid: int) -> None:
    """Linux: this process gets SIGKILL when its parent exits (elsewhere: nothing done); exits at once if
    the parent `parent_pid` is already gone."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent exited before prctl: no signal will come
        os._exit(1)
