"""Sends and receives follow from placement: insert them around the compute actions.

Legend: r rank, s stage, mb microbatch. For each compute action the receives it needs come right before
it and the sends of what it produced right after it, so a rank's list alternates compute and one run of
consecutive comm actions (a batch: the sends of the previous step with the receives of the next).
"""

from __future__ import annotations

from dataclasses import replace

from fmoe.schedule.ir import ACT, GRAD, Action, B, F, I, Op, Recv, Schedule, Send, ops_of


def needs(s: Schedule, op: Op) -> list[Recv]:
    """Returns the receives (from other ranks) that compute `op` needs on its rank."""
    here = s.placement.stage_rank[op.stage]
    if op.kind == F:
        prev = s.prev_stage(op.stage, op.mb)
        if prev is not None and s.placement.stage_rank[prev] != here:
            return [Recv(ACT, prev, op.mb, s.placement.stage_rank[prev])]
    elif op.kind in (B, I):
        nxt = s.next_stage(op.stage, op.mb)
        if nxt is not None and s.placement.stage_rank[nxt] != here:
            return [Recv(GRAD, nxt, op.mb, s.placement.stage_rank[nxt])]
    return []


def produces(s: Schedule, op: Op) -> list[Send]:
    """Returns the sends (to other ranks) of what compute `op` produced."""
    here = s.placement.stage_rank[op.stage]
    if op.kind == F:
        nxt = s.next_stage(op.stage, op.mb)
        if nxt is not None and s.placement.stage_rank[nxt] != here:
            return [Send(ACT, op.stage, op.mb, s.placement.stage_rank[nxt])]
    elif op.kind in (B, I):
        prev = s.prev_stage(op.stage, op.mb)
        if prev is not None and s.placement.stage_rank[prev] != here:
            return [Send(GRAD, op.stage, op.mb, s.placement.stage_rank[prev])]
    return []


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
            for op in ops_of(a):
                out.extend(needs(s, op))
            out.append(a)
            for op in ops_of(a):
                out.extend(produces(s, op))
        ranks.append(tuple(out))
    return replace(s, ranks=tuple(ranks))


def without_comms(s: Schedule) -> Schedule:
    """Returns `s` with every send/receive removed (the compute order only)."""
    return replace(s, ranks=tuple(tuple(a for a in acts if ops_of(a)) for acts in s.ranks))
