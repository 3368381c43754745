"""The end of a rank's process: close the default process group, then leave without finalization.

A gloo worker thread drops its reference to a finished collective (and so to the tensors it carried)
after the caller's `wait()` has returned. Dropping a tensor that has a Python object takes the GIL; if
the interpreter is finalizing by then, CPython ends the thread with `pthread_exit`, whose unwind through
gloo's loop calls `std::terminate`: the process aborts with "terminate called without an active
exception" after all its work is done. A core of the research script showed exactly that stack
(ProcessGroupGloo::runLoop, ~AsyncAllreduceWork, TensorImpl::decref_pyobject, take_gil,
PyThread_exit_thread) while the main thread was in Py_FinalizeEx, one run in four on this machine;
`destroy_process_group` had been called (torch 2.13 does not join gloo's threads there). So a rank that
finished closes the group and ends with `os._exit`, after flushing what it printed.

Leaving with `os._exit` skips multiprocessing's exit handlers too, so a named semaphore made in the rank
is never unlinked, and the resource tracker reports it when it shuts down ("There appear to be 4 leaked
semaphore objects", once per rank). tqdm makes one for its default write lock the first time a bar is
built, and torch's inductor builds a bar (disabled) in every compile: `thread_locks_for_bars` gives a
rank's bars a thread lock instead, before anything builds one.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import NoReturn

import torch.distributed as dist


def close_default_group(succeeded: bool) -> None:
    """Destroys the default process group (when one is up). After a success, waits first at a barrier so
    no rank tears its connections down while a peer still talks to it (gloo aborts that peer); after a
    failure it does not, since a peer may never arrive."""
    if not dist.is_initialized():
        return
    try:
        if succeeded and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def exit_process(code: int = 0) -> NoReturn:
    """Flushes stdout and stderr, then ends the process with `code` at once, skipping the interpreter's
    finalization (module docstring: why). Call it last, from the process's own main."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def thread_locks_for_bars() -> None:
    """Makes every tqdm bar of this process write under a thread lock, not tqdm's default (a thread lock
    and a multiprocessing RLock: a named semaphore, which a process ending with `exit_process` leaves to
    the resource tracker to report as leaked). For a rank's own process, whose bars are its own: call it
    first. A no-op without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())
