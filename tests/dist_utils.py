"""Spawn helper for multi-process tests: fmoe.parallel.local_ranks (gloo ranks on localhost through a file
store, each run bounded by a timeout that kills stragglers), failing the test when a rank does.

    results = spawn(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable, in every rank

A hung collective fails the test instead of hanging it. `fn` must be a module-level function (pickled by
reference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fmoe.parallel.local_ranks import RankResult, failures, run_ranks

__all__ = ["RankResult", "spawn", "spawned_per_world"]


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
          pg_timeout_s: float = 30.0, check: bool = True) -> list[RankResult]:
    """Run `fn(rank, world_size, *args)` in `world_size` gloo processes; return one RankResult per rank.

    With `check`, raise AssertionError when a rank raised, died or did not finish within `timeout_s`.
    """
    out = run_ranks(fn, world_size, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
    if check and failures(out):
        raise AssertionError(failures(out))
    return out


def spawned_per_world(fn: Callable[..., Any], timeout_s: float = 400.0) -> Callable[[int], list[RankResult]]:
    """Returns `at(world)`: `spawn(fn, world)`'s results, spawned on the first call for each world size
    and kept. For a module fixture whose tests share one start of the ranks per world size (each rank's
    start costs seconds); `fn` answers every test's part."""
    runs: dict[int, list[RankResult]] = {}

    def at(world: int) -> list[RankResult]:
        if world not in runs:
            runs[world] = spawn(fn, world, timeout_s=timeout_s)
        return runs[world]

    return at
