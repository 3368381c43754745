"""Spawned gloo ranks for the benchmarks: one launcher, so every script fails the same bounded way.

    results = spawn(worker, world, worker_args, timeout_s, label)

`worker(rank, *worker_args, store, q)` runs in each process (module-level, pickled by reference): it
rendezvouses through the file store `store` and puts `(rank, value, error_or_None)` on `q`.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def spawn(worker: Callable[..., None], world: int, worker_args: tuple, timeout_s: float,
          label: str) -> list[Any]:
    """Runs `worker` on `world` spawned ranks; returns each rank's value in rank order. Raises
    RuntimeError with the tracebacks when a rank fails (stopping the others at once, rather than letting
    them wait for the gloo timeout), and kills the ranks after `timeout_s`."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="fmoe_bench_")
    os.close(fd)
    os.unlink(store)
    procs = [ctx.Process(target=worker, args=(r, *worker_args, store, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout_s
    while len(got) + len(errors) < world and time.monotonic() < deadline:
        try:
            rank, value, err = q.get(timeout=0.5)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and q.empty():
                break
            continue
        if err is None:
            got[rank] = value
        else:
            errors.append(f"--- rank {rank} ---\n{err}")
            break
    for p in procs:
        p.join(timeout=0 if errors else 10)
        if p.is_alive():
            p.kill()
            p.join(5)
    if os.path.exists(store):
        os.unlink(store)
    if errors or len(got) < world:
        missing = sorted(set(range(world)) - set(got))
        raise RuntimeError(f"{label} failed (ranks without a result: {missing}, limit {timeout_s:.0f} s)\n"
                           + "\n".join(errors))
    return [got[r] for r in range(world)]
