"""verify: a schedule is complete, respects dependencies, its sends and receives match, and it cannot
deadlock when run with blocking point-to-point.

Legend: r rank, s stage, mb microbatch, key = (what, producing stage, mb) of a message.
Communication semantics checked: a Recv blocks its rank until the peer has issued the matching Send;
a Send never blocks (an executor issues it as isend and waits on it lazily, before reusing the buffer
or at the end of the step). Compute actions never wait: everything they need must already have run or
arrived on their rank, else it is an order error. A deadlock is a cycle of blocked receives.
"""

from __future__ import annotations

from collections import Counter

from fmoe.schedule.comms import produces, with_comms
from fmoe.schedule.ir import ACT, GRAD, B, F, I, Op, Overlap, Recv, Schedule, ScheduleError, Send, W, ops_of


def _check_shape(s: Schedule) -> None:
    pl = s.placement
    if len(s.ranks) != pl.pp:
        raise ScheduleError(f"{s.name}: {len(s.ranks)} rank lists for pp={pl.pp}")
    if len(s.mb_path) != s.m:
        raise ScheduleError(f"{s.name}: mb_path has {len(s.mb_path)} entries for m={s.m}")
    for r, acts in enumerate(s.ranks):
        for a in acts:
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
    sends, recvs = Counter(), Counter()
    for r, acts in enumerate(s.ranks):
        for a in acts:
            if isinstance(a, Send):
                sends[(r, a.peer, a.what, a.stage, a.mb)] += 1
            elif isinstance(a, Recv):
                recvs[(a.peer, r, a.what, a.stage, a.mb)] += 1
    for (src, dst, what, st, mb), k in (sends - recvs).items():
        raise ScheduleError(f"{s.name}: send {Send(what, st, mb, dst)} on r{src} has no matching receive "
                            f"on r{dst} ({k} unmatched)")
    for (src, dst, what, st, mb), k in (recvs - sends).items():
        raise ScheduleError(f"{s.name}: receive {Recv(what, st, mb, src)} on r{dst} has no matching send "
                            f"on r{src} ({k} unmatched)")
    want = Counter()
    for r, acts in enumerate(s.ranks):
        for a in acts:
            for op in ops_of(a):
                for snd in produces(s, op):
                    want[(r, snd.peer, snd.what, snd.stage, snd.mb)] += 1
    for key in (sends - want) + (want - sends):
        src, dst, what, st, mb = key
        raise ScheduleError(f"{s.name}: {what} of stage {st} microbatch {mb} must go r{src} -> r{dst} "
                            f"per the placement exactly once, found {sends[key]} sends")


def _deps_met(s: Schedule, r: int, op: Op, have: set) -> str | None:
    # `have`: ('F'|'G'|'W', stage, mb) computed on r, or ('act'|'grad', stage, mb) received on r.
    pl = s.placement
    if op.kind == F:
        prev = s.prev_stage(op.stage, op.mb)
        if prev is not None:
            key = ("F", prev, op.mb) if pl.stage_rank[prev] == r else (ACT, prev, op.mb)
            if key not in have:
                return f"its input (F{prev}.{op.mb}) has not run or arrived on r{r}"
    elif op.kind in (B, I):
        if ("F", op.stage, op.mb) not in have:
            return f"F{op.stage}.{op.mb} has not run before it"
        nxt = s.next_stage(op.stage, op.mb)
        if nxt is not None:
            key = ("G", nxt, op.mb) if pl.stage_rank[nxt] == r else (GRAD, nxt, op.mb)
            if key not in have:
                return (f"the output grad (backward of stage {nxt} microbatch {op.mb}) has not run or "
                        f"arrived on r{r}")
    elif op.kind == W and ("I", op.stage, op.mb) not in have:
        return f"its I{op.stage}.{op.mb} has not run before it"
    return None


def _check_local_order(s: Schedule) -> None:
    # same-rank dependencies, checked on the compute order alone so the message names the swapped pair
    for r, acts in enumerate(s.ranks):
        have: set = set()
        for k, a in enumerate(acts):
            for op in ops_of(a):
                why = None
                if op.kind in (B, I) and ("F", op.stage, op.mb) not in have:
                    why = f"F{op.stage}.{op.mb} has not run before it"
                elif op.kind == W and (I, op.stage, op.mb) not in have:
                    why = f"its I{op.stage}.{op.mb} has not run before it"
                if why:
                    raise ScheduleError(f"{s.name}: r{r} position {k} {a}: {why}")
            for op in ops_of(a):
                have.add(("F" if op.kind == F else op.kind, op.stage, op.mb))


def _run(s: Schedule) -> None:
    have = [set() for _ in s.ranks]
    ptr = [0] * len(s.ranks)
    posted: set[tuple] = set()  # (src, dst, what, stage, mb) of sends issued so far

    while True:
        progress = False
        for r, acts in enumerate(s.ranks):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if isinstance(a, Send):
                    if ("F" if a.what == ACT else "G", a.stage, a.mb) not in have[r]:
                        raise ScheduleError(f"{s.name}: r{r} position {ptr[r]} {a}: sends uncomputed data")
                    posted.add((r, a.peer, a.what, a.stage, a.mb))
                elif isinstance(a, Recv):
                    if (a.peer, r, a.what, a.stage, a.mb) not in posted:
                        break  # a blocking receive waits for its send
                    have[r].add((a.what, a.stage, a.mb))
                else:
                    for op in ops_of(a):  # both halves of a pair must be ready before the step
                        why = _deps_met(s, r, op, have[r])
                        if why:
                            raise ScheduleError(f"{s.name}: r{r} position {ptr[r]} {a}: {why}")
                    for op in ops_of(a):
                        have[r].add(("G" if op.kind in (B, I) else op.kind, op.stage, op.mb))
                        if op.kind == I:
                            have[r].add((I, op.stage, op.mb))
                ptr[r] += 1
                progress = True
        if all(ptr[r] == len(acts) for r, acts in enumerate(s.ranks)):
            return
        if not progress:
            stuck = "; ".join(f"r{r} blocks at position {ptr[r]} on {s.ranks[r][ptr[r]]}"
                              for r in range(len(s.ranks)) if ptr[r] < len(s.ranks[r]))
            raise ScheduleError(f"{s.name}: deadlock with blocking receives: {stuck}")


def verify(s: Schedule) -> Schedule:
    """Checks `s` and returns it with explicit sends/receives (derived from the placement when absent),
    i.e. the lists an executor runs. Raises ScheduleError with a message naming the first problem:
    a missing/duplicate F, B, I or W; an action on the wrong rank; a dependency violated (F of stage
    s+1 before F of s, a backward before the later stage's backward, W before its I); unmatched or
    misrouted sends/receives; or a deadlock under blocking batched point-to-point."""
    _check_shape(s)
    _check_counts(s)
    _check_local_order(s)
    full = with_comms(s)
    _check_messages(full)
    _run(full)
    return full
