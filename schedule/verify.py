"""verify: a schedule is complete, respects dependencies, its sends and receives match, and it cannot
deadlock when run with blocking point-to-point.

Legend: r rank, s stage, mb microbatch; a Dep (deps.py: kind, producing stage, mb) is what an action
needs or leaves on its rank, and the key of a message. The rule itself lives in deps.py.
Communication semantics checked: a Recv blocks its rank until the peer has issued the matching Send;
a Send never blocks (an executor issues it as isend and waits on it lazily, before reusing the buffer
or at the end of the step). Compute actions never wait: everything they need must already have run or
arrived on their rank, else it is an order error. A deadlock is a cycle of blocked receives.
"""

from __future__ import annotations

from collections import Counter

from fmoe.schedule import deps
from fmoe.schedule.comms import ForwardFirst, sends, with_comms
from fmoe.schedule.deps import Dep, Kind
from fmoe.schedule.ir import B, F, I, Op, Overlap, Recv, Schedule, ScheduleError, Send, W, ops_of

# what a missing Dep means, as the message names it; {r} is the rank that lacks it
_MISSING = {
    Kind.ACT: "its input (F{stage}.{mb}) has not run or arrived on r{r}",
    Kind.SAVED: "F{stage}.{mb} has not run before it",
    Kind.GRAD: "the output grad (backward of stage {stage} microbatch {mb}) has not run or arrived on r{r}",
    Kind.DEFERRED: "its I{stage}.{mb} has not run before it",
}


def _check_shape(s: Schedule) -> None:
    pl = s.placement
    if len(s.ranks) != pl.pp:
        raise ScheduleError(f"{s.name}: {len(s.ranks)} rank lists for pp={pl.pp}")
    if len(s.mb_path) != s.m:
        raise ScheduleError(f"{s.name}: mb_path has {len(s.mb_path)} entries for m={s.m}")
    for r, acts in enumerate(s.ranks):
        for k, a in enumerate(acts):
            if not isinstance(a, (Op, Overlap, Send, Recv)):  # ops_of would pass it over as a comm
                raise ScheduleError(f"{s.name}: r{r} position {k}: {a!r} is not an action (Op, Overlap, "
                                    "Send or Recv)")
            for op in ops_of(a):
                if not 0 <= op.mb < s.m:
                    raise ScheduleError(f"{s.name}: r{r} {op}: microbatch {op.mb} out of range 0..{s.m - 1}")
                if not 0 <= op.stage < pl.num_stages or pl.stage_rank[op.stage] != r:
                    raise ScheduleError(f"{s.name}: r{r} {op}: stage {op.stage} is not placed on rank {r}")
                if op.stage not in s.path(op.mb):
                    raise ScheduleError(f"{s.name}: r{r} {op}: microbatch {op.mb} does not visit stage "
                                        f"{op.stage}")
            if isinstance(a, Overlap) and a.f.mb == a.b.mb:
                raise ScheduleError(f"{s.name}: r{r} {a}: an overlapped pair needs two microbatches")


def _check_counts(s: Schedule) -> None:
    n = Counter(op for acts in s.ranks for a in acts for op in ops_of(a))
    for mb in range(s.m):
        for st in s.path(mb):
            f, b, i, w = (n[Op(k, st, mb)] for k in (F, B, I, W))
            name = f"{st}.{mb}"
            if f != 1:
                raise ScheduleError(f"{s.name}: F{name} appears {f} times, expected exactly once")
            if (b, i, w) not in ((1, 0, 0), (0, 1, 1)):
                raise ScheduleError(f"{s.name}: stage {st} microbatch {mb} has {b} B, {i} I, {w} W; expected "
                                    "exactly one B, or exactly one I and one W")


def _check_messages(s: Schedule) -> None:
    sent, received = Counter(), Counter()  # (src rank, dst rank, Dep) of every Send / Recv listed
    for r, acts in enumerate(s.ranks):
        for a in acts:
            if isinstance(a, Send):
                sent[(r, a.peer, deps.carried(a))] += 1
            elif isinstance(a, Recv):
                received[(a.peer, r, deps.carried(a))] += 1
    for (src, dst, d), k in (sent - received).items():
        raise ScheduleError(f"{s.name}: send {Send(d.kind.value, d.stage, d.mb, dst)} on r{src} has no "
                            f"matching receive on r{dst} ({k} unmatched)")
    for (src, dst, d), k in (received - sent).items():
        raise ScheduleError(f"{s.name}: receive {Recv(d.kind.value, d.stage, d.mb, src)} on r{dst} has no "
                            f"matching send on r{src} ({k} unmatched)")
    want = Counter((r, snd.peer, deps.carried(snd)) for r, acts in enumerate(s.ranks)
                   for a in acts for snd in sends(s, a))
    for key in (sent - want) + (want - sent):
        src, dst, d = key
        raise ScheduleError(f"{s.name}: {d.kind.value} of stage {d.stage} microbatch {d.mb} must go "
                            f"r{src} -> r{dst} per the placement exactly once, found {sent[key]} sends")


def _missing(s: Schedule, r: int, a: Op | Overlap, have: set[Dep], kinds: tuple[Kind, ...]) -> str | None:
    # the first Dep of `kinds` that `a` needs and rank r does not hold, as a message; None if all held
    for d in deps.needs(s, a):
        if d.kind in kinds and d not in have:
            return _MISSING[d.kind].format(stage=d.stage, mb=d.mb, r=r)
    return None


def _check_local_order(s: Schedule) -> None:
    # same-rank dependencies, checked on the compute order alone so the message names the swapped pair
    for r, acts in enumerate(s.ranks):
        have: set[Dep] = set()
        for k, a in enumerate(acts):
            if not ops_of(a):
                continue
            why = _missing(s, r, a, have, (Kind.SAVED, Kind.DEFERRED))
            if why:
                raise ScheduleError(f"{s.name}: r{r} position {k} {a}: {why}")
            have.update(deps.produces(s, a))


def replay(s: Schedule) -> tuple[tuple[int, int, Dep], ...]:
    """Runs `s` (with explicit comms) with blocking receives, every rank as far as it can in turn; returns
    (src rank, dst rank, Dep) of every message in the order the replay sent them: one order all ranks can
    agree on, in which each rank's own sends come in its list order and each message comes after
    everything it depends on. Raises ScheduleError on an order error or a deadlock."""
    have: list[set[Dep]] = [set() for _ in s.ranks]
    ptr = [0] * len(s.ranks)
    posted: dict[tuple[int, int, Dep], None] = {}  # (src, dst, Dep) of sends issued so far, in order

    while True:
        progress = False
        for r, acts in enumerate(s.ranks):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if isinstance(a, Send):
                    if not have[r].issuperset(deps.needs(s, a)):
                        raise ScheduleError(f"{s.name}: r{r} position {ptr[r]} {a}: sends uncomputed data")
                    posted[(r, a.peer, deps.carried(a))] = None
                elif isinstance(a, Recv):
                    if (a.peer, r, deps.carried(a)) not in posted:
                        break  # a blocking receive waits for its send
                else:  # both halves of a pair must be ready before the step
                    why = _missing(s, r, a, have[r], tuple(Kind))
                    if why:
                        raise ScheduleError(f"{s.name}: r{r} position {ptr[r]} {a}: {why}")
                have[r].update(deps.produces(s, a))
                ptr[r] += 1
                progress = True
        if all(ptr[r] == len(acts) for r, acts in enumerate(s.ranks)):
            return tuple(posted)
        if not progress:
            stuck = "; ".join(f"r{r} blocks at position {ptr[r]} on {s.ranks[r][ptr[r]]}"
                              for r in range(len(s.ranks)) if ptr[r] < len(s.ranks[r]))
            raise ScheduleError(f"{s.name}: deadlock with blocking receives: {stuck}")


def verify(s: Schedule, forward_first: ForwardFirst = None) -> Schedule:
    """Checks `s` and returns it with explicit sends/receives (derived from the placement when absent),
    i.e. the lists an executor runs. Raises ScheduleError with a message naming the first problem:
    something in a list that is not an action; a missing/duplicate F, B, I or W; an action on the wrong
    rank; a dependency violated (F of stage s+1 before F of s, a backward before the later stage's
    backward, W before its I); unmatched or misrouted sends/receives; or a deadlock under blocking
    batched point-to-point. `forward_first`: the order of an overlapped pair's derived sends
    (comms.sends)."""
    _check_shape(s)
    _check_counts(s)
    _check_local_order(s)
    full = with_comms(s, forward_first)
    _check_messages(full)
    replay(full)
    return full
