"""Spawn helper for multi-process tests: fmoe.parallel.local_ranks (gloo ranks on localhost through a file
store, each run bounded by a timeout that kills stragglers), failing the test when a rank does.

    results = spawn(fn, world_size, *args)   # fn(rank, world_size, *args) -> picklable, in every rank

A hung collective fails the test instead of hanging it. `fn` must be a module-level function (pickled by
reference). Modules whose ranks run the same world sizes may share their starts across the session:
`share_ranks(name, worlds, fn, *args)` at import, then `shared_ranks(world, name)` in a fixture.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

from fmoe.parallel.local_ranks import RankResult, failures, run_ranks

__all__ = ["RankResult", "share_ranks", "shared_ranks", "spawn"]


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
          pg_timeout_s: float = 30.0, check: bool = True) -> list[RankResult]:
    """Run `fn(rank, world_size, *args)` in `world_size` gloo processes; return one RankResult per rank.

    With `check`, raise AssertionError when a rank raised, died or did not finish within `timeout_s`.
    """
    out = run_ranks(fn, world_size, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
    if check and failures(out):
        raise AssertionError(failures(out))
    return out


# name -> (module, worlds, fn, args) of the parts `shared_ranks` runs; (world, name) -> each rank's
# (status, answer); COLLECTED: the test modules this session collected (conftest's
# pytest_collection_modifyitems; None: every registered part runs)
_PARTS: dict[str, tuple[str, tuple[int, ...], Callable[..., Any], tuple]] = {}
_SHARED_RUNS: dict[tuple[int, str], list[RankResult]] = {}
COLLECTED: set[str] | None = None
SHARED_TIMEOUT_S = 600.0  # one start runs many modules' parts


def share_ranks(name: str, worlds: tuple[int, ...], fn: Callable[..., Any], *args: Any) -> None:
    """Registers part `name`: `fn(rank, world, *args)`, a module-level function run at each world size of
    `worlds` on the session's shared starts of the ranks, after other modules' parts (so it must leave no
    state behind that they would meet). Call it at the import of the test module."""
    _PARTS[name] = (fn.__module__, worlds, fn, args)


def _shared_parts(rank: int, world: int, parts: dict[str, tuple[Callable[..., Any], tuple]]) -> dict:
    """Each part's answer on this rank, one after the other; a part that raised answers its traceback (the
    other parts' tests go on)."""
    out: dict[str, Any] = {}
    for name, (fn, args) in parts.items():
        try:
            out[name] = ("ok", fn(rank, world, *args))
        except Exception:
            out[name] = ("raised", traceback.format_exc())
    return out


def shared_ranks(world: int, name: str, key: str | None = None,
                 timeout_s: float = SHARED_TIMEOUT_S) -> list[RankResult]:
    """Each rank's RankResult of part `name` (`share_ranks`) at `world` ranks, its value the part's answer
    (with `key`: the answer's [key]). The first call for a world size runs every part not run yet at that
    size, of the test modules this session collected, on one start of the ranks (a rank's start costs
    seconds), and keeps the answers; raises AssertionError with the tracebacks of the ranks where part
    `name` raised."""
    if (world, name) not in _SHARED_RUNS:
        parts = {n: (fn, args) for n, (module, worlds, fn, args) in _PARTS.items()
                 if world in worlds and (world, n) not in _SHARED_RUNS
                 and (COLLECTED is None or module in COLLECTED or n == name)}
        results = spawn(_shared_parts, world, parts, timeout_s=timeout_s)
        for n in parts:
            _SHARED_RUNS[(world, n)] = [dataclasses.replace(r, value=r.value[n]) for r in results]
    results = _SHARED_RUNS[(world, name)]
    raised = [f"--- rank {r.rank} ---\n{r.value[1]}" for r in results if r.value[0] == "raised"]
    if raised:
        raise AssertionError(f"part {name!r} raised:\n" + "\n".join(raised))
    return [dataclasses.replace(r, value=r.value[1] if key is None else r.value[1][key]) for r in results]
