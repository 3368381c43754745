"""One rule for every file a run owns: an exclusive `fcntl.flock` held by the process that outlives the
job's ranks (the launcher, or global rank 0 under torchrun), taken before anything is written there.

    handle = hold(path, what, keep_holder=True)   # the open file; closing it (or dying) releases the lock

`--save` locks DIR/.fmoe-train.lock and records its holder there (fmoe/train/save_dir.py); the metrics
file, the trace and the PNGs are locked themselves (fmoe/train/run_outputs.py: opened without truncating,
so a refused second run leaves the live run's file as it was). The kernel drops a lock when its holder
dies: a killed run leaves none behind.
"""

from __future__ import annotations

import fcntl
import os
import socket
from typing import TextIO


class Busy(RuntimeError):
    """`path` is locked by another live run; the message is one line naming `what` and the holder."""


def hold(path: str, what: str, *, keep_holder: bool) -> TextIO:
    """Takes the exclusive lock of `path` (created if absent, never truncated before the lock is ours);
    returns the open file. `keep_holder`: write "pid P on HOST" into it (a lock file of our own), else
    leave its contents alone (an output the run writes). Busy naming `what` when another run holds it;
    OSError (one line, the path named) when it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise OSError(f"{what}: cannot open {path}: {exc.strerror}") from None
    f = os.fdopen(fd, "r+")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = (f.read(200).strip() if keep_holder else "") or "pid unknown"
        f.close()
        raise Busy(f"{what} is in use by another fmoe train ({holder}): one run per file") from None
    if keep_holder:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
    return f
