"""Sends and receives follow from placement: insert them around the compute actions.

Legend: r rank, s stage, mb microbatch. For each compute action the receives it needs come right before
it and the sends of what it produced right after it, so a rank's list alternates compute and one run of
consecutive comm actions (a batch: the sends of the previous step with the receives of the next).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from fmoe.schedule import deps
from fmoe.schedule.ir import Action, Overlap, Recv, Schedule, Send, ops_of


def recvs(s: Schedule, action: Action) -> tuple[Recv, ...]:
    """Returns the receives (from other ranks) a compute action needs right before it on its rank;
    none for a Send or Recv."""
    if not ops_of(action):
        return ()
    return tuple(pair[1] for d in deps.needs(s, action) if (pair := deps.link(s, d)))


# Which half of an overlapped pair produces its result first, as the executor runs the pair: True for the
# forward. None: the backward (fb overlap with as many exchanges on both sides: the pair starts and ends
# with its backward's phases).
ForwardFirst = Callable[[Overlap], bool] | None


def sends(s: Schedule, action: Action, forward_first: ForwardFirst = None) -> tuple[Send, ...]:
    """Returns the sends (to other ranks) of what a compute action produced, right after it on its
    rank; none for a Send or Recv. An overlapped pair's sends in the order its two results exist
    (`forward_first`), so that an executor that sends each message the moment it exists (in this order,
    the wire order) never holds one back behind the other."""
    ops = ops_of(action)
    if isinstance(action, Overlap) and not (forward_first is not None and forward_first(action)):
        ops = ops[::-1]
    return tuple(pair[0] for op in ops for d in deps.produces(s, op) if (pair := deps.link(s, d)))


def forward_first_by_turns(turns: Mapping[int, int] | None, overlap: bool = True) -> ForwardFirst:
    """Returns the `forward_first` of an executor that runs an overlapped pair by turns (fmoe.schedule.
    execute), from `turns` (stage -> the exchanges in flight at which an op of that stage hands over:
    the same for its forward and its backward's dx pass; 0 for a stage run whole). Overlap off, the
    forward runs first and whole: True. The backward starts (when its stage has turns) and the two
    alternate, so the forward ends first when it has fewer turns; a backward without turns runs whole
    at the forward's first turn (the forward ends first only without one). None (`turns` None, overlap
    on): the backward first, whatever the stages hold."""
    if not overlap:
        return lambda pair: True
    if turns is None:
        return None

    def first(pair: Overlap) -> bool:
        tf, tb = turns[pair.f.stage], turns[pair.b.stage]
        return tf == 0 if tb == 0 else tf < tb

    return first


def has_comms(s: Schedule) -> bool:
    """Returns True when the schedule already lists explicit sends/receives."""
    return any(isinstance(a, (Send, Recv)) for acts in s.ranks for a in acts)


def with_comms(s: Schedule, forward_first: ForwardFirst = None) -> Schedule:
    """Returns `s` with its sends and receives inserted (unchanged if it already has any); an overlapped
    pair's sends in the order of `forward_first` (`sends`)."""
    if has_comms(s):
        return s
    ranks = []
    for acts in s.ranks:
        out: list[Action] = []
        for a in acts:
            out.extend((*recvs(s, a), a, *sends(s, a, forward_first)))
        ranks.append(tuple(out))
    return replace(s, ranks=tuple(ranks))


def without_comms(s: Schedule) -> Schedule:
    """Returns `s` with every send/receive removed (the compute order only)."""
    return replace(s, ranks=tuple(tuple(a for a in acts if ops_of(a)) for acts in s.ranks))
