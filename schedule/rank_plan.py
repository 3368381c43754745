"""A rank's plan: every executor decision that depends on the schedule alone, made once per run.

Legend: r rank, Dep a message's key (deps.py), wire = the rank's P2P ops in wire order (wire.py).

    plan = rank_plan(full, wire[r], r, recv_ahead)      # once per (schedule, rank, options)
    plan.takes[(F, stage, mb)]                          # the Dep F(stage, mb) receives, or None

What the executor would otherwise work out op by op in every step: which Dep each op takes from and
gives to another stage (deps.needs / produces), at which compute action each receive is asked for
(`recv_ahead` compute actions before its consumer), which (stage, mb) have a B for their backward, and
each message's place on the rank's wire (a send may be released once a later message from its peer
arrived, execute.py's `_release_sends`). The step walks the plan; the data (shapes, tensors) stays in
the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from fmoe.schedule.deps import Dep, Kind, carried, needs, produces
from fmoe.schedule.ir import B, F, I, Op, Recv, Schedule, Send, ops_of

OpKey = tuple[str, int, int]  # (F or I, stage, mb): I stands for the backward (B or I) of (stage, mb)


@dataclass(frozen=True)
class RankPlan:
    """Rank `rank`'s part of a verified schedule, decided once (module docstring).

    actions: the rank's list (with comms); wire: its P2P ops in wire order; recv_before: compute action
    index -> the receives asked for right before it; backward_is_b: (stage, mb) whose backward is a B;
    takes / gives: (F | I, stage, mb) -> the Dep that op receives from / hands to another stage (None:
    none); wire_at: Dep -> its message's index in `wire`."""

    rank: int
    actions: tuple
    wire: tuple[Send | Recv, ...]
    recv_before: dict[int, tuple[Recv, ...]]
    backward_is_b: frozenset[tuple[int, int]]
    takes: dict[OpKey, Dep | None]
    gives: dict[OpKey, Dep | None]
    wire_at: dict[Dep, int]


def rank_plan(full: Schedule, wire: tuple[Send | Recv, ...], rank: int, recv_ahead: int) -> RankPlan:
    """Returns rank `rank`'s RankPlan of `full` (verify's result, the lists the executor runs) with its
    wire order `wire` (wire.wire_order(full)[rank]) and receives asked for `recv_ahead` compute actions
    before their consumer."""
    actions = full.ranks[rank]
    compute_at = [k for k, a in enumerate(actions) if ops_of(a)]
    recv_before: dict[int, list[Recv]] = {}
    for k, a in enumerate(actions):
        if isinstance(a, Recv):
            consumer = next(c for c in compute_at if c > k)
            post = compute_at[max(0, compute_at.index(consumer) - recv_ahead)]
            recv_before.setdefault(min(post, consumer), []).append(a)
    takes: dict[OpKey, Dep | None] = {}
    gives: dict[OpKey, Dep | None] = {}
    backward_is_b = set()
    for a in actions:
        for op in ops_of(a):
            if op.kind == B:
                backward_is_b.add((op.stage, op.mb))
            if op.kind in (F, B, I):
                kind, key = (Kind.ACT, F) if op.kind == F else (Kind.GRAD, I)
                probe = Op(key, op.stage, op.mb)  # a B needs and gives what its I does
                takes[(key, op.stage, op.mb)] = next((d for d in needs(full, probe) if d.kind is kind),
                                                     None)
                gives[(key, op.stage, op.mb)] = next((d for d in produces(full, probe) if d.kind is kind),
                                                     None)
    return RankPlan(rank, actions, wire, {k: tuple(v) for k, v in recv_before.items()},
                    frozenset(backward_is_b), takes, gives, {carried(m): k for k, m in enumerate(wire)})
