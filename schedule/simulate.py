"""simulate: event-driven replay of a schedule over a cost model; returns a Report.

Legend: r rank, s stage, mb microbatch. Each rank runs its compute actions in order; an action starts
when the rank is free and its inputs are ready (producer finish + p2p latency across ranks). Sends do
not occupy compute (async P2P). Time 0 is the first forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from fmoe.schedule import deps
from fmoe.schedule.comms import without_comms
from fmoe.schedule.costs import Costs
from fmoe.schedule.ir import B, F, I, Op, Overlap, Schedule, ScheduleError, W, ops_of
from fmoe.schedule.verify import verify

# Schedules simulate has verified, by identity: a planner simulates one (cached) Schedule under many costs,
# and verifying costs 2-5x a simulation. Schedules are frozen, so a verification stays valid; the entry
# holds its schedule, so the id cannot be reused while it is cached.
_VERIFIED: dict[int, Schedule] = {}
_VERIFIED_MAX = 256


def _verify_once(s: Schedule) -> None:
    """Raise verify's ScheduleError for `s`, unless this very object passed before."""
    if _VERIFIED.get(id(s)) is s:
        return
    verify(s)
    if len(_VERIFIED) >= _VERIFIED_MAX:
        del _VERIFIED[next(iter(_VERIFIED))]  # the oldest
    _VERIFIED[id(s)] = s


@dataclass(frozen=True)
class Event:
    """One compute action as simulated: rank, action (Op or Overlap), start, end, compute time, its
    all-to-all time, the part of that left exposed, and the P2P latency the rank waited on before it."""

    rank: int
    action: Op | Overlap
    start: float
    end: float
    compute: float
    comm: float
    exposed: float
    p2p_wait: float
    phase: str


@dataclass(frozen=True)
class Report:
    """Simulation result. Tuples are per rank. `bubble` = makespan - busy (idle time; exposed comm
    counts as busy and is reported separately); `overlap_ratio[phase]` = hidden / total all-to-all over
    all ranks in warmup (before a rank's first backward), steady, cooldown (after its last forward),
    None where that phase has no all-to-all; `imbalance_pct` = (max busy / mean busy - 1) * 100."""

    name: str
    makespan: float
    busy: tuple[float, ...]
    bubble: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    peak_activations: tuple[int, ...]
    peak_memory: tuple[float, ...]
    exposed_comm: tuple[float, ...]
    overlap_ratio: dict[str, float | None]
    imbalance_pct: float
    events: tuple[Event, ...]


def _peaks(deltas: list[tuple[float, float]]) -> float:
    # releases before acquisitions at equal times (the next step starts when the previous one ended)
    cur = peak = 0.0
    for _, d in sorted(deltas, key=lambda x: (x[0], x[1])):
        cur += d
        peak = max(peak, cur)
    return peak


def simulate(s: Schedule, costs: Costs | None = None) -> Report:
    """Returns the Report of running `s` (sends/receives ignored, they follow from placement) under
    `costs` (default Costs()). Raises ScheduleError with verify's message if `s` fails `verify` (numbers
    for lists that cannot run would be meaningless; a Schedule object is verified once, then remembered),
    if `costs` is not a Costs, or if a per-stage cost tuple does not have one value per stage of `s`."""
    costs = Costs() if costs is None else costs
    if not isinstance(costs, Costs):
        raise ScheduleError(f"simulate: costs must be a Costs, got {type(costs).__name__} {costs!r}")
    _verify_once(s)
    costs.check_stages(s.placement.num_stages, f"schedule {s.name!r}")
    s = without_comms(s)
    done: dict[deps.Dep, float] = {}  # when each produced Dep became available on its producer
    free = [0.0] * s.pp
    ptr = [0] * s.pp
    events: list[Event] = []
    first_bwd = [next((k for k, a in enumerate(acts) if any(o.kind != F for o in ops_of(a))), len(acts))
                 for acts in s.ranks]
    last_fwd = [max((k for k, a in enumerate(acts) if any(o.kind == F for o in ops_of(a))), default=-1)
                for acts in s.ranks]
    while True:
        progress = False
        for r, acts in enumerate(s.ranks):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                ready = ready_nolat = 0.0
                needed = deps.needs(s, a)
                if any(d not in done for d in needed):
                    break
                for d in needed:
                    lat = costs.p2p if deps.producer_rank(s, d) != r else 0.0
                    ready, ready_nolat = max(ready, done[d] + lat), max(ready_nolat, done[d])
                ops = ops_of(a)
                start = max(free[r], ready)
                dur = costs.pair(*ops) if isinstance(a, Overlap) else costs.lone(ops[0])
                comp = sum(costs.compute(o) for o in ops)
                comm = sum(costs.comm(o) for o in ops)
                k = ptr[r]
                phase = "warmup" if k < first_bwd[r] else "cooldown" if k > last_fwd[r] else "steady"
                events.append(Event(r, a, start, start + dur, comp, comm, max(0.0, dur - comp),
                                    max(0.0, start - max(free[r], ready_nolat)), phase))
                free[r] = start + dur
                done.update(dict.fromkeys(deps.produces(s, a), start + dur))
                ptr[r] += 1
                progress = True
        if all(ptr[r] == len(acts) for r, acts in enumerate(s.ranks)):
            break
        if not progress:
            raise ScheduleError(f"{s.name}: simulation stuck at " + ", ".join(
                f"r{r}:{s.ranks[r][ptr[r]]}" for r in range(s.pp) if ptr[r] < len(s.ranks[r])))
    return _report(s, costs, events)


def _report(s: Schedule, costs: Costs, events: list[Event]) -> Report:
    t0 = min((e.start for e in events), default=0.0)
    makespan = max((e.end for e in events), default=0.0) - t0
    busy, acts, mems, exposed = [], [], [], []
    for r in range(s.pp):
        ev = [e for e in events if e.rank == r]
        busy.append(sum(e.end - e.start for e in ev))
        exposed.append(sum(e.exposed + e.p2p_wait for e in ev))
        live: list[tuple[float, float]] = []
        mem: list[tuple[float, float]] = []
        for e in ev:
            for op in ops_of(e.action):
                if op.kind == F:
                    live.append((e.start, 1.0))
                    mem.append((e.start, costs.act_mem))
                elif op.kind in (B, I):
                    mem.append((e.end, -costs.act_mem))
                    if op.kind == B:
                        live.append((e.end, -1.0))
                    else:
                        mem.append((e.end, costs.wgrad_mem))
                elif op.kind == W:
                    live.append((e.end, -1.0))
                    mem.append((e.end, -costs.wgrad_mem))
        acts.append(int(round(_peaks(live))))
        mems.append(_peaks(mem))
    ratio: dict[str, float | None] = {}
    for ph in ("warmup", "steady", "cooldown"):
        tot = sum(e.comm for e in events if e.phase == ph)
        ratio[ph] = None if tot == 0 else 1.0 - sum(e.exposed for e in events if e.phase == ph) / tot
    mean = sum(busy) / len(busy) if busy else 0.0
    return Report(
        name=s.name, makespan=makespan, busy=tuple(busy),
        bubble=tuple(makespan - b for b in busy),
        bubble_fraction=tuple((makespan - b) / makespan if makespan else 0.0 for b in busy),
        peak_activations=tuple(acts), peak_memory=tuple(mems), exposed_comm=tuple(exposed),
        overlap_ratio=ratio, imbalance_pct=(max(busy) / mean - 1) * 100 if mean else 0.0,
        events=tuple(events))


def format_report(rep: Report) -> str:
    """Returns a printable summary table: one line per rank plus makespan and overlap ratios."""
    lines = [f"schedule {rep.name}: makespan {rep.makespan:.4g}, stage imbalance {rep.imbalance_pct:.2f}%",
             "rank   busy   bubble  bubble%  peak_act  peak_mem  exposed_comm"]
    for r in range(len(rep.busy)):
        lines.append(f"r{r:<4} {rep.busy[r]:6.4g} {rep.bubble[r]:8.4g} {100 * rep.bubble_fraction[r]:7.2f}% "
                     f"{rep.peak_activations[r]:9d} {rep.peak_memory[r]:9.4g} {rep.exposed_comm[r]:13.4g}")
    ov = ", ".join(f"{k} {'-' if v is None else f'{100 * v:.1f}%'}" for k, v in rep.overlap_ratio.items())
    lines.append(f"all-to-all hidden: {ov}")
    return "\n".join(lines)
