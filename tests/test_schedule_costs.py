"""`fmoe.schedule.Costs` validation: a bad cost is a ScheduleError naming the field and the value, and
every cost the simulator accepts gives a report that respects the dependency lower bound.

Legend: S stages, r rank. The lower bound of a makespan, independent of the simulator's ordering:
max(per-rank sum of step durations, critical path through the dependency rule, P2P latency included
on every cross-rank edge).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fmoe.schedule as S
from fmoe.schedule import deps
from fmoe.schedule.ir import Overlap, ScheduleError, ops_of

SCHEDULES = {
    "1f1b": S.one_f_one_b(3, 4),
    "gpipe": S.gpipe(2, 3),
    "zb_h1": S.zb_h1(2, 4),
    "interleaved": S.interleaved_1f1b(2, 4, 2),
    "zbv": S.zbv(2, 4),
    "dualpipe": S.dualpipe(2, 4),
    "dualpipev": S.dualpipev(2, 4),
}
REL = 1e-9


def _duration(c: S.Costs, a: S.Action) -> float:
    return c.pair(*ops_of(a)) if isinstance(a, Overlap) else c.lone(ops_of(a)[0])


def lower_bound(s: S.Schedule, c: S.Costs) -> float:
    """Returns max(per-rank sum of durations, longest dependency chain incl. P2P latency)."""
    s = S.without_comms(s)
    per_rank = max(sum(_duration(c, a) for a in acts) for acts in s.ranks)
    producer = {d: a for acts in s.ranks for a in acts for d in deps.produces(s, a)}
    rank_of = {a: r for r, acts in enumerate(s.ranks) for a in acts}
    end: dict[S.Action, float] = {}

    def finish(a: S.Action) -> float:  # the dependency graph is a DAG (verify), depth <= 2 S per mb
        if a not in end:
            ready = 0.0
            for d in deps.needs(s, a):
                p = producer[d]
                ready = max(ready, finish(p) + (c.p2p if rank_of[p] != rank_of[a] else 0.0))
            end[a] = ready + _duration(c, a)
        return end[a]

    return max(per_rank, max(finish(a) for acts in s.ranks for a in acts))


def check_report(s: S.Schedule, c: S.Costs, rep: S.Report) -> None:
    """Asserts the report is finite, internally consistent and no faster than the lower bound."""
    floats = [rep.makespan, rep.imbalance_pct, *rep.busy, *rep.bubble, *rep.bubble_fraction,
              *rep.peak_memory, *rep.exposed_comm, *(v for v in rep.overlap_ratio.values() if v is not None)]
    assert all(math.isfinite(x) for x in floats), rep
    for name in ("f", "i", "w", "b"):
        x = getattr(c, name)
        assert not isinstance(x, list)
        if isinstance(x, tuple):
            assert len(x) == s.placement.num_stages, (name, x)
    assert all(e.end >= e.start for e in rep.events)
    assert all(b >= -REL * rep.makespan for b in rep.bubble)
    assert all(-REL <= v <= 1.0 + REL for v in rep.overlap_ratio.values() if v is not None)  # rounding
    assert rep.makespan >= lower_bound(s, c) * (1 - REL)


# ---- anything: a clear error or a sound report ------------------------------------------------------

def _mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """`good` 11 times in 12, else `bad`: with a dozen fields, about a third of the draws are all valid."""
    return st.integers(0, 11).flatmap(lambda k: bad if k == 0 else good)


SPECIAL = st.sampled_from([0.0, -0.0, -1.0, -1e-9, math.nan, math.inf, -math.inf, True, "1", None])
NUM = _mostly(st.one_of(st.floats(0.01, 4.0), st.integers(1, 3)), st.one_of(SPECIAL, st.integers(-1, 0)))
SHARE = _mostly(st.floats(0.0, 1.0), st.one_of(st.floats(-0.5, 1.5), SPECIAL))


@st.composite
def per_stage(draw: st.DrawFn, n: int) -> object:
    """A scalar, or a list / tuple of per-stage values of a length around `n`."""
    if draw(st.booleans()):
        return draw(NUM)
    size = draw(_mostly(st.just(n), st.integers(0, n + 1)))
    vals = draw(st.lists(NUM, min_size=size, max_size=size))
    return vals if draw(st.booleans()) else tuple(vals)


@st.composite
def any_costs(draw: st.DrawFn, n: int) -> dict:
    """Keyword arguments of Costs, each possibly invalid."""
    kw = {k: draw(per_stage(n)) for k in ("f", "i", "w")}
    kw["b"] = draw(st.one_of(st.none(), per_stage(n)))
    kw.update({k: draw(NUM) for k in ("p2p", "a2a", "act_mem", "wgrad_mem")})
    kw.update({k: draw(SHARE) for k in ("attn_frac", "lone_hide")})
    kw["moe_layers"] = draw(_mostly(st.integers(1, 3), st.sampled_from([-1, 0, 1.5, True])))
    kw["pair_overlap"] = draw(_mostly(st.booleans(), st.just(1)))
    return kw


def _ok(**kw: object) -> dict:
    base = {"f": 1.0, "i": 1.0, "w": 1.0, "b": None, "p2p": 0.0, "a2a": 0.5, "act_mem": 1.0, "wgrad_mem": 0.0,
            "attn_frac": 0.5, "lone_hide": 0.5, "moe_layers": 1, "pair_overlap": True}
    return {**base, **kw}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(SCHEDULES)), st.data())
@example("1f1b", _ok(f=-1.0))
@example("1f1b", _ok(f=0.0))
@example("1f1b", _ok(f=math.nan))
@example("1f1b", _ok(i=math.inf))
@example("1f1b", _ok(p2p=math.nan))  # was: latency ignored, makespan below the dependency bound
@example("1f1b", _ok(p2p=-1.0))
@example("1f1b", _ok(a2a=-0.5))
@example("1f1b", _ok(f=[1.0, 2.0, 1.0]))  # a list: was TypeError deep in simulate
@example("1f1b", _ok(f=(1.0, 2.0)))  # too short: was IndexError
@example("1f1b", _ok(f=(1.0, 2.0, 3.0, 4.0)))  # too long: was silently ignored
@example("1f1b", _ok(lone_hide=1.5))
@example("1f1b", _ok(attn_frac=-1.0))
@example("dualpipev", _ok(moe_layers=0))  # was ZeroDivisionError in Costs.pair
@example("1f1b", _ok(act_mem=math.nan))
@example("zb_h1", _ok(w=0.0))  # valid: weight grads free
def test_costs_error_or_sound_report(name: str, data: st.DataObject | dict) -> None:
    s = SCHEDULES[name]
    kw = data if isinstance(data, dict) else data.draw(any_costs(s.placement.num_stages))
    try:
        c = S.Costs(**kw)
        rep = S.simulate(s, c)
    except ScheduleError as e:
        assert str(e).startswith("Costs."), e  # names the field (and the value)
        return
    check_report(s, c, rep)


# ---- valid costs: always a sound report ---------------------------------------------------------

POS = st.floats(1e-3, 8.0)
NONNEG = st.one_of(st.just(0.0), st.floats(1e-3, 8.0))


@st.composite
def valid_costs(draw: st.DrawFn, n: int) -> S.Costs:
    def stage(elem: st.SearchStrategy[float]) -> object:
        return draw(elem) if draw(st.booleans()) else tuple(draw(st.lists(elem, min_size=n, max_size=n)))

    return S.Costs(f=stage(POS), i=stage(POS), w=stage(NONNEG),
                   b=None if draw(st.booleans()) else stage(POS),
                   p2p=draw(NONNEG), a2a=draw(NONNEG), moe_layers=draw(st.integers(1, 4)),
                   attn_frac=draw(st.floats(0.0, 1.0)), lone_hide=draw(st.floats(0.0, 1.0)),
                   pair_overlap=draw(st.booleans()), act_mem=draw(NONNEG), wgrad_mem=draw(NONNEG))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(SCHEDULES)), st.data())
def test_valid_costs_give_sound_reports(name: str, data: st.DataObject) -> None:
    s = SCHEDULES[name]
    c = data.draw(valid_costs(s.placement.num_stages))
    check_report(s, c, S.simulate(s, c))


# ---- the exact messages -------------------------------------------------------------------------

@pytest.mark.parametrize("kw, msg", [
    ({"f": -1.0}, "Costs.f must be > 0, got -1.0"),
    ({"i": 0}, "Costs.i must be > 0, got 0"),
    ({"b": 0.0}, "Costs.b must be > 0, got 0.0"),
    ({"w": -0.5}, "Costs.w must be >= 0, got -0.5"),
    ({"f": math.nan}, "Costs.f must be a finite number > 0, got nan"),
    ({"f": (1.0, math.inf)}, "Costs.f[1] must be a finite number > 0, got inf"),
    ({"f": ()}, "Costs.f is an empty per-stage tuple; give one value per stage"),
    ({"f": "1"}, "Costs.f must be a number or a tuple of per-stage numbers, got '1'"),
    ({"f": True}, "Costs.f must be a number or a tuple of per-stage numbers, got True"),
    ({"p2p": math.nan}, "Costs.p2p must be a finite number >= 0, got nan"),
    ({"p2p": (0.1, 0.2)}, "Costs.p2p must be a finite number >= 0, got (0.1, 0.2)"),
    ({"a2a": -0.5}, "Costs.a2a must be >= 0, got -0.5"),
    ({"lone_hide": 1.5}, "Costs.lone_hide must be in [0, 1], got 1.5"),
    ({"attn_frac": -0.1}, "Costs.attn_frac must be in [0, 1], got -0.1"),
    ({"moe_layers": 0}, "Costs.moe_layers must be an int >= 1, got 0"),
    ({"moe_layers": 2.0}, "Costs.moe_layers must be an int >= 1, got 2.0"),
    ({"act_mem": -1.0}, "Costs.act_mem must be >= 0, got -1.0"),
    ({"wgrad_mem": math.nan}, "Costs.wgrad_mem must be a finite number >= 0, got nan"),
    ({"pair_overlap": "no"}, "Costs.pair_overlap must be a bool, got 'no'"),
])
def test_bad_field_is_named(kw: dict, msg: str) -> None:
    with pytest.raises(ScheduleError) as e:
        S.Costs(**kw)
    assert str(e.value) == msg
    assert isinstance(e.value, ValueError)


def test_zero_w_and_zero_comm_are_meaningful() -> None:
    rep = S.simulate(S.zb_h1(4, 8), S.Costs(f=1, i=1, w=0))
    assert set(rep.bubble) == {(4 - 1) * (1 + 1 - 0)}  # the ZB-H1 closed form at W = 0
    assert S.simulate(S.one_f_one_b(2, 2), S.Costs(p2p=0, a2a=0, act_mem=0, attn_frac=0, lone_hide=1))


def test_lists_become_tuples() -> None:
    c = S.Costs(f=[2.0, 1.0], i=[2, 1], w=[2.0, 1.0])
    assert c == S.Costs(f=(2.0, 1.0), i=(2, 1), w=(2.0, 1.0)) and isinstance(c.f, tuple)
    hash(c)
    rep = S.simulate(S.one_f_one_b(2, 4), c)
    assert rep.imbalance_pct == pytest.approx(100 * (12 * 2 / 18 - 1))


def test_per_stage_length_checked_against_the_schedule() -> None:
    for f in ((1.0,), (1.0, 1.0, 1.0)):
        with pytest.raises(ScheduleError, match=rf"Costs.f has {len(f)} per-stage values, schedule '1f1b' "
                                                r"has 2"):
            S.simulate(S.one_f_one_b(2, 2), S.Costs(f=f))
    # DualPipeV on 2 ranks has 4 stages: per-stage tuples are per stage, not per rank
    with pytest.raises(ScheduleError, match="Costs.w has 2 per-stage values, schedule 'dualpipev' has 4"):
        S.simulate(S.dualpipev(2, 4), S.Costs(w=(1.0, 1.0)))
    assert S.simulate(S.dualpipev(2, 4), S.Costs(w=(1.0, 1.0, 0.5, 0.5))).makespan > 0
    with pytest.raises(ScheduleError, match="simulate: costs must be a Costs, got dict"):
        S.simulate(S.one_f_one_b(2, 2), {"f": 1.0})


def test_from_flops_checks_its_arguments() -> None:
    assert S.Costs.from_flops(64, 16).f > 0
    with pytest.raises(ScheduleError, match="Costs.from_flops: hidden must be a positive integer, got 0"):
        S.Costs.from_flops(0, 16)
    with pytest.raises(ScheduleError, match=r"Costs.from_flops: flops_per_unit must be > 0, got -1.0"):
        S.Costs.from_flops(64, 16, flops_per_unit=-1.0)
