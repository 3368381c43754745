"""The one dependency rule: what each action needs before it runs and what it leaves behind.

Legend: s stage, mb microbatch; prev / next = the neighbouring stages on mb's path. For one mb:
  F(s)   needs ACT(prev)            produces ACT(s) (if next exists), SAVED(s)
  B(s)   needs SAVED(s), GRAD(next) produces GRAD(s) (if prev exists)
  I(s)   needs SAVED(s), GRAD(next) produces GRAD(s) (if prev exists), DEFERRED(s)
  W(s)   needs DEFERRED(s)          produces nothing another action needs
An Overlap needs and produces what its two halves do; a Send needs the Dep it carries, a Recv
produces it. Only ACT and GRAD ever cross ranks; they are the keys of Send/Recv (`carried`, `link`).
Everything is per action, so an executor can walk one rank's list and keep a set of the Deps it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from fmoe.schedule.ir import ACT, GRAD, Action, F, I, Op, Overlap, Recv, Schedule, ScheduleError, Send, W


class Kind(Enum):
    """What a Dep is; ACT and GRAD have the values of `Send.what` / `Recv.what`."""

    ACT = ACT  # output activation of F(stage, mb): the input of the next stage's F
    GRAD = GRAD  # input grad from B/I(stage, mb): the output grad the previous stage's backward needs
    SAVED = "saved"  # what F(stage, mb) keeps for its own B or I; never leaves the rank
    DEFERRED = "deferred"  # what I(stage, mb) leaves for its W; never leaves the rank


@dataclass(frozen=True)
class Dep:
    """One piece of data of microbatch `mb`, made by an action of stage `stage` (see the legend)."""

    kind: Kind
    stage: int
    mb: int


def _op_needs(s: Schedule, op: Op) -> tuple[Dep, ...]:
    if op.kind == F:
        prev = s.prev_stage(op.stage, op.mb)
        return () if prev is None else (Dep(Kind.ACT, prev, op.mb),)
    if op.kind == W:
        return (Dep(Kind.DEFERRED, op.stage, op.mb),)
    nxt = s.next_stage(op.stage, op.mb)  # B or I
    grad = () if nxt is None else (Dep(Kind.GRAD, nxt, op.mb),)
    return (Dep(Kind.SAVED, op.stage, op.mb), *grad)


def _op_produces(s: Schedule, op: Op) -> tuple[Dep, ...]:
    # only what some action needs: the last stage's F output is the loss, the first stage's input
    # grad goes nowhere, and W's weight grads stay in the parameters
    if op.kind == F:
        act = () if s.next_stage(op.stage, op.mb) is None else (Dep(Kind.ACT, op.stage, op.mb),)
        return (*act, Dep(Kind.SAVED, op.stage, op.mb))
    if op.kind == W:
        return ()
    grad = () if s.prev_stage(op.stage, op.mb) is None else (Dep(Kind.GRAD, op.stage, op.mb),)  # B or I
    return (*grad, Dep(Kind.DEFERRED, op.stage, op.mb)) if op.kind == I else grad


def carried(msg: Send | Recv) -> Dep:
    """Returns the Dep a Send or Recv carries (its comm key); ScheduleError for an unknown `what`."""
    if msg.what not in (ACT, GRAD):
        raise ScheduleError(f"{msg}: a message carries {ACT!r} or {GRAD!r}, got {msg.what!r}")
    return Dep(Kind(msg.what), msg.stage, msg.mb)


def needs(s: Schedule, action: Action) -> tuple[Dep, ...]:
    """Returns the Deps that must be on the action's rank before it runs, in check order (an
    Overlap: its forward's, then its backward's; a Send: what it carries; a Recv: none)."""
    if isinstance(action, Send):
        return (carried(action),)
    if isinstance(action, Recv):
        return ()
    return tuple(d for op in _ops(action) for d in _op_needs(s, op))


def produces(s: Schedule, action: Action) -> tuple[Dep, ...]:
    """Returns the Deps that are on the action's rank after it ran and that some action needs
    (a Recv: what it carries; a Send: none, the data was already there)."""
    if isinstance(action, Recv):
        return (carried(action),)
    if isinstance(action, Send):
        return ()
    return tuple(d for op in _ops(action) for d in _op_produces(s, op))


def producer_rank(s: Schedule, dep: Dep) -> int:
    """Returns the rank that computes `dep` (the rank of its stage)."""
    return s.placement.stage_rank[dep.stage]


def consumer_rank(s: Schedule, dep: Dep) -> int:
    """Returns the rank whose action needs `dep`; ScheduleError for a Dep nothing needs (the ACT of
    a path's last stage, the GRAD of its first)."""
    if dep.kind == Kind.ACT:
        user = s.next_stage(dep.stage, dep.mb)
    elif dep.kind == Kind.GRAD:
        user = s.prev_stage(dep.stage, dep.mb)
    else:
        user = dep.stage
    if user is None:
        raise ScheduleError(f"nothing needs {dep.kind.value} of stage {dep.stage} microbatch {dep.mb}")
    return s.placement.stage_rank[user]


def link(s: Schedule, dep: Dep) -> tuple[Send, Recv] | None:
    """Returns (the Send on the producer rank, the matching Recv on the consumer rank) for a Dep that
    crosses ranks, None when producer and consumer are the same rank."""
    src, dst = producer_rank(s, dep), consumer_rank(s, dep)
    if src == dst:
        return None
    return Send(dep.kind.value, dep.stage, dep.mb, dst), Recv(dep.kind.value, dep.stage, dep.mb, src)


def _ops(action: Action) -> tuple[Op, ...]:
    # unlike ir.ops_of, anything that is not an action is an error here rather than "no ops"
    if isinstance(action, Overlap):
        return action.ops
    if not isinstance(action, Op):
        raise ScheduleError(f"{action!r} is not an action (Op, Overlap, Send or Recv)")
    return (action,)
