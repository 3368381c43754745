"""Every generator's output passes verify; broken schedules and bad arguments are rejected clearly."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fmoe.schedule as S
from fmoe.schedule.ir import ACT, Op, Send

SET = settings(max_examples=30, deadline=None)


def _ok(s: S.Schedule) -> None:
    full = S.verify(s)
    assert S.without_comms(full) == s  # verify only adds sends/receives
    assert len(str(s).splitlines()) == s.pp


@SET
@given(st.integers(1, 6), st.integers(1, 20))
@example(1, 1)
@example(3, 1)
@example(5, 2)
def test_loop_generators_verify(pp: int, m: int) -> None:
    for gen in (S.gpipe, S.one_f_one_b, S.zb_h1):
        _ok(gen(pp, m))


@SET
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4), st.booleans())
@example(1, 1, 3, False)
@example(3, 1, 2, True)
@example(5, 2, 3, False)
def test_interleaved_verifies(pp: int, groups: int, v: int, extra: bool) -> None:
    _ok(S.interleaved_1f1b(pp, pp * groups, v, extra_warmup=extra))


@SET
@given(st.integers(1, 5), st.integers(0, 12))
@example(1, 0)
@example(3, 0)
def test_zbv_verifies(pp: int, more: int) -> None:
    _ok(S.zbv(pp, 2 * pp - 1 + more))


@SET
@given(st.integers(2, 6), st.integers(0, 12), st.booleans())
@example(2, 0, False)
@example(3, 1, True)
def test_dualpipev_verifies(pp: int, more: int, detach: bool) -> None:
    _ok(S.dualpipev(pp, 2 * pp + more, dw_detach=detach))


@SET
@given(st.integers(1, 3), st.integers(0, 6))
@example(1, 0)
def test_dualpipe_verifies(half: int, more: int) -> None:
    pp = 2 * half
    _ok(S.dualpipe(pp, 2 * pp + 2 * more))


def test_printing_and_comparison() -> None:
    s = S.dualpipev(2, 4)
    assert str(s).splitlines()[0].startswith("r0: F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 F0.3&B3.1")
    assert s == S.dualpipev(2, 4) and s != S.dualpipev(2, 4, dw_detach=True)
    assert S.diff(s, S.dualpipev(2, 4, dw_detach=True))
    assert "sa0.0>r1" in str(S.with_comms(S.one_f_one_b(2, 2)))


@pytest.mark.parametrize("call, msg", [
    (lambda: S.dualpipev(1, 4), "pp > 1"),
    (lambda: S.dualpipev(4, 7), "microbatches >= 2*pp"),
    (lambda: S.dualpipev(4, 8, layers=12), "multiple of 2*pp"),
    (lambda: S.dualpipev(4, 8, layers=4), "layers >= 2*pp"),
    (lambda: S.dualpipev(4, 8, v=2), "interleaving"),
    (lambda: S.dualpipe(3, 12), "even pp"),
    (lambda: S.dualpipe(4, 9), "even m >= 2*pp"),
    (lambda: S.zbv(4, 6), "2*pp-1"),
    (lambda: S.interleaved_1f1b(4, 6, 2), "multiple of pp"),
    (lambda: S.interleaved_1f1b(4, 8, 2, overlap=True), "extra_warmup"),
    (lambda: S.one_f_one_b(0, 4), "positive integer"),
    (lambda: S.gpipe(2, 0), "positive integer"),
    (lambda: S.zb_h1(2, 1.5), "positive integer"),
])
def test_validation_errors(call, msg: str) -> None:
    with pytest.raises(S.ScheduleError, match=msg.replace("*", r"\*")):
        call()


def _swap(s: S.Schedule, r: int, a: int, b: int) -> S.Schedule:
    acts = list(s.ranks[r])
    acts[a], acts[b] = acts[b], acts[a]
    return replace(s, ranks=s.ranks[:r] + (tuple(acts),) + s.ranks[r + 1:])


def test_rejects_swapped_actions() -> None:
    s = S.one_f_one_b(2, 2)  # r1: F1.0 B1.0 F1.1 B1.1
    with pytest.raises(S.ScheduleError, match="F1.0 has not run before it"):
        S.verify(_swap(s, 1, 0, 1))
    with pytest.raises(S.ScheduleError, match="r0 position 0 B0.0: F0.0 has not run before it"):
        S.verify(_swap(s, 0, 0, 2))
    full = S.with_comms(S.one_f_one_b(2, 1))  # r1: ra0.0<r0 F1.0 B1.0 sg1.0>r0
    with pytest.raises(S.ScheduleError, match=r"F1.0: its input \(F0.0\) has not run or arrived on r1"):
        S.verify(_swap(full, 1, 0, 1))


def test_rejects_missing_w() -> None:
    s = S.zb_h1(2, 2)
    acts = tuple(a for a in s.ranks[0] if a != Op("W", 0, 1))
    with pytest.raises(S.ScheduleError, match="0 W; expected"):
        S.verify(replace(s, ranks=(acts,) + s.ranks[1:]))


def test_rejects_w_before_i() -> None:
    s = S.zb_h1(1, 1)  # r0: F0.0 I0.0 W0.0
    with pytest.raises(S.ScheduleError, match="I0.0 has not run"):
        S.verify(_swap(s, 0, 1, 2))


def test_rejects_mismatched_send() -> None:
    full = S.with_comms(S.one_f_one_b(3, 2))
    acts = tuple(Send(ACT, 0, 0, 2) if a == Send(ACT, 0, 0, 1) else a for a in full.ranks[0])
    with pytest.raises(S.ScheduleError, match="sa0.0>r2 on r0 has no matching receive on r2"):
        S.verify(replace(full, ranks=(acts,) + full.ranks[1:]))


def test_rejects_deadlock() -> None:
    full = S.with_comms(S.one_f_one_b(2, 2))
    # r1 waits for the grad of stage 1 ... make r0 receive the grad of mb 1 before sending mb 1's activation
    r0 = list(full.ranks[0])
    i_send = r0.index(Send(ACT, 0, 1, 1))
    i_recv = next(k for k, a in enumerate(r0) if str(a) == "rg1.1<r1")
    r0.insert(i_send, r0.pop(i_recv))
    with pytest.raises(S.ScheduleError, match="deadlock"):
        S.verify(replace(full, ranks=(tuple(r0),) + full.ranks[1:]))


def test_rejects_wrong_rank() -> None:
    s = S.one_f_one_b(2, 1)
    with pytest.raises(S.ScheduleError, match="not placed on rank 0"):
        S.verify(replace(s, ranks=(s.ranks[1], s.ranks[0])))


@pytest.mark.parametrize("junk", ["F1.0", None, 3, ("F", 1, 0)])
@pytest.mark.parametrize("with_comms", [False, True])
def test_rejects_non_actions(junk: object, with_comms: bool) -> None:
    s = S.one_f_one_b(2, 2)
    s = S.with_comms(s) if with_comms else s
    acts = s.ranks[1][:1] + (junk,) + s.ranks[1][1:]
    with pytest.raises(S.ScheduleError, match=rf"r1 position 1: {re.escape(repr(junk))} is not an action"):
        S.verify(replace(s, ranks=(s.ranks[0], acts)))
