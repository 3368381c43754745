"""Shared helpers for the schedule generators: argument checks and assembling a Schedule.

Legend: pp ranks, m microbatches, v chunks per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from fmoe.schedule.ir import Action, Placement, Schedule, ScheduleError


def require(ok: bool, name: str, why: str) -> None:
    """Raises ScheduleError(`name`: `why`) unless `ok`; returns None."""
    if not ok:
        raise ScheduleError(f"{name}: {why}")


def positive(name: str, **kw: object) -> None:
    """Raises ScheduleError unless every keyword is a positive int; returns None."""
    for k, x in kw.items():
        require(isinstance(x, int) and not isinstance(x, bool) and x >= 1, name,
                f"{k} must be a positive integer, got {x!r}")


def build(name: str, placement: Placement, m: int, ranks: Sequence[Sequence[Action]],
          mb_path: Sequence[int] | None = None) -> Schedule:
    """Returns the immutable Schedule (every microbatch on path 0 unless `mb_path` is given)."""
    path = tuple(mb_path) if mb_path is not None else (0,) * m
    return Schedule(name, placement, m, path, tuple(tuple(r) for r in ranks))
