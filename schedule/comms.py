"""Sends and receives follow from placement: insert them around the compute actions.

Legend: r rank, s stage, mb microbatch. For each compute action the receives it needs come right before
it and the sends of what it produced right after it, so a rank's list alternates compute and one run of
consecutive comm actions (a batch: the sends of the previous step with the receives of the next).
"""

from __future__ import annotations

from dataclasses import replace

from fmoe.schedule import deps
from fmoe.schedule.ir import Action, Overlap, Recv, Schedule, Send, ops_of


def recvs(s: Schedule, action: Action) -> tuple[Recv, ...]:
    """Returns the receives (from other ranks) a compute action needs right before it on its rank;
    none for a Send or Recv."""
    if not ops_of(action):
        return ()
    return tuple(pair[1] for d in deps.needs(s, action) if (pair := deps.link(s, d)))


def sends(s: Schedule, action: Action) -> tuple[Send, ...]:
    """Returns the sends (to other ranks) of what a compute action produced, right after it on its
    rank; none for a Send or Recv. An overlapped pair's backward's first: under fb overlap the pair
    starts and ends with its backward's phases, so its gradient exists first, and an executor that
    sends each message the moment it exists (in this order, the wire order) sends it without waiting
    for the forward."""
    ops = ops_of(action)
    if isinstance(action, Overlap):
        ops = ops[::-1]
    return tuple(pair[0] for op in ops for d in deps.produces(s, op) if (pair := deps.link(s, d)))


def has_comms(s: Schedule) -> bool:
    """Returns True when the schedule already lists explicit sends/receives."""
    return any(isinstance(a, (Send, Recv)) for acts in s.ranks for a in acts)


def with_comms(s: Schedule) -> Schedule:
    """Returns `s` with its sends and receives inserted (unchanged if it already has any)."""
    if has_comms(s):
        return s
    ranks = []
    for acts in s.ranks:
        out: list[Action] = []
        for a in acts:
            out.extend((*recvs(s, a), a, *sends(s, a)))
        ranks.append(tuple(out))
    return replace(s, ranks=tuple(ranks))


def without_comms(s: Schedule) -> Schedule:
    """Returns `s` with every send/receive removed (the compute order only)."""
    return replace(s, ranks=tuple(tuple(a for a in acts if ops_of(a)) for acts in s.ranks))
