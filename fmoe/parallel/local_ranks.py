"""Local gloo ranks: N spawned processes on this machine running one function, for tests, benchmarks and
the calibration (not training: `fmoe train` has its launcher, fmoe/train/launch.py, with signals and
torchrun).

    results = run_ranks(fn, world_size, *args, timeout_s=120)   # fn(rank, world_size, *args) in every rank
    values = [r.value for r in results]                        # or failures(results): the tracebacks

Processes start with torch.multiprocessing's "spawn" method, one thread each, and rendezvous through a
file store (no port races between concurrent runs). Each rank joins the gloo group, runs `fn` (a
module-level function, pickled by reference), reports its value or traceback on a queue, and leaves the
group. The parent collects the reports until `timeout_s` (with `stop_on_error`, until the first
traceback), then tears down in one way: ranks still running get what is left of the time, at most
GRACE_S, to exit; whatever is alive then is killed; the store file is removed.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fmoe.parallel.teardown import exit_process, thread_locks_for_bars

GRACE_S = 10.0  # how long reported ranks get to leave the group and exit before they are killed


@dataclass
class RankResult:
    """What one rank returned (`value`) or raised (`error`, a formatted traceback); `exitcode` at the end;
    `seconds` from its start to its report."""

    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None
    seconds: float = 0.0


def _rank_main(rank: int, world_size: int, store: str, pg_timeout_s: float, q: Any,
               fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """One spawned rank: joins the group, runs fn, reports (rank, value, traceback or None, seconds), leaves
    the group and ends with exit code 0 (a failure is in the report), skipping finalization."""
    torch.set_num_threads(1)
    thread_locks_for_bars()  # it ends with exit_process: no semaphore may be left to the tracker
    t0 = time.perf_counter()
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        value = fn(rank, world_size, *args)
        q.put((rank, value, None, time.perf_counter() - t0))
    except BaseException:  # everything, SystemExit of a rank that fails on purpose too
        q.put((rank, None, traceback.format_exc(), time.perf_counter() - t0))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # the group may be broken on purpose
                pass
        # the report is in the pipe (the queue's feeder thread has written it); then leave at once: the
        # interpreter's finalization with torch loaded took 1.5-3 s per rank on a loaded 2-core machine
        # and is where gloo's threads can abort a process (fmoe.parallel.teardown)
        q.close()
        q.join_thread()
        exit_process(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              pg_timeout_s: float = 30.0, stop_on_error: bool = False) -> list[RankResult]:
    """Runs `fn(rank, world_size, *args)` on `world_size` spawned gloo ranks; returns one RankResult per
    rank, in rank order (a rank without a report has an `error` saying so). Raises nothing for a rank's
    failure: see `failures`. `stop_on_error`: stop waiting at the first traceback and kill the other
    ranks at once, rather than letting them wait for the gloo timeout `pg_timeout_s`."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="fmoe_ranks_")
    os.close(fd)
    os.unlink(store)  # the file store creates it
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, store, pg_timeout_s, q, fn, args),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results = [RankResult(r) for r in range(world_size)]
    got: set[int] = set()
    stopped = False
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size and time.monotonic() < deadline and not stopped:
            try:
                rank, value, err, secs = q.get(timeout=0.2)
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and q.empty():
                    break
                continue
            results[rank].value, results[rank].error, results[rank].seconds = value, err, secs
            got.add(rank)
            stopped = stop_on_error and err is not None
    finally:  # the one teardown, also when the caller is interrupted
        grace_end = time.monotonic() if stopped else min(deadline, time.monotonic() + GRACE_S)
        for p in procs:
            p.join(timeout=max(0.0, grace_end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if os.path.exists(store):
            os.unlink(store)
    for r, p in enumerate(procs):
        results[r].exitcode = p.exitcode
        if r not in got:
            results[r].error = f"rank {r}: no result (exit code {p.exitcode}, timed out or died)"
    return results


def failures(results: list[RankResult]) -> str:
    """The tracebacks of the ranks that failed, each under a `--- rank r ---` line; "" when none did."""
    return "\n".join(f"--- rank {r.rank} ---\n{r.error}" for r in results if r.error is not None)
