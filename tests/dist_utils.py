"""Spawn helpers for multi-process tests: gloo groups on localhost, each run bounded by a timeout.

    results = spawn(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable, in every rank

Processes start with torch.multiprocessing's "spawn" method and rendezvous through a file store (no
port races between concurrent test runs). The parent collects each rank's result or traceback from a
queue until `timeout_s`, then kills any straggler, so a hung collective fails the test instead of
hanging it. `fn` must be a module-level function (pickled by reference).
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


@dataclass
class RankResult:
    """What one rank returned (`value`) or raised (`error`, a formatted traceback); `exitcode` at the end."""

    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None
    seconds: float = 0.0


def _worker(rank: int, world_size: int, store_path: str, pg_timeout_s: float, q: Any,
            fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        value = fn(rank, world_size, *args)
        q.put((rank, value, None, time.perf_counter() - t0))
    except BaseException:  # report everything, including SystemExit from a deliberately failing rank
        q.put((rank, None, traceback.format_exc(), time.perf_counter() - t0))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # the group may be broken on purpose
                pass


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
          pg_timeout_s: float = 30.0, check: bool = True) -> list[RankResult]:
    """Run `fn(rank, world_size, *args)` in `world_size` gloo processes; return one RankResult per rank.

    With `check`, raise AssertionError when a rank raised, died or did not finish within `timeout_s`.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="fmoe_store_")
    os.close(fd)
    os.unlink(store_path)  # the file store creates it
    procs = [ctx.Process(target=_worker, args=(r, world_size, store_path, pg_timeout_s, q, fn, args),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {r: RankResult(r) for r in range(world_size)}
    got: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(got) < world_size and time.monotonic() < deadline:
        try:
            rank, value, err, secs = q.get(timeout=0.2)
            results[rank].value, results[rank].error, results[rank].seconds = value, err, secs
            got.add(rank)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if p.is_alive():
            p.kill()
            p.join(5)
    for r, p in enumerate(procs):
        results[r].exitcode = p.exitcode
        if r not in got and results[r].error is None:
            results[r].error = f"rank {r}: no result (exit code {p.exitcode}, timed out or died)"
    if os.path.exists(store_path):
        os.unlink(store_path)
    out = [results[r] for r in range(world_size)]
    if check:
        bad = [r for r in out if r.error is not None]
        if bad:
            raise AssertionError("\n".join(f"--- rank {r.rank} ---\n{r.error}" for r in bad))
    return out
