"""The parser inverts printing; hand-written schedules from text verify or are rejected; the dependency
rule in fmoe.schedule.deps agrees with an oracle written out here from the schedules' definitions."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fmoe.schedule as S
from fmoe.schedule import deps, stages
from fmoe.schedule.ir import ACT, GRAD, ops_of
from fmoe.schedule.registry import NAMES

SET = settings(max_examples=8, deadline=None)


def _build(name: str, pp: int, k: int, extra: int, v: int) -> S.Schedule:
    # the generators' constraints differ; the first nearby (pp, m) a generator accepts is as good a sample
    for p, m in ((pp, 2 * pp * k + extra), (pp, 2 * pp * k), (pp + 1, 2 * (pp + 1) * k)):
        try:
            return S.build(name, p, m, v if name.startswith("interleaved") else None)  # only they take a v
        except S.ScheduleError:
            continue
    raise AssertionError(f"{name} accepts no arguments near pp={pp}")


def _parse(s: S.Schedule) -> S.Schedule:
    return S.parse_schedule(str(s), s.placement, name=s.name)


@pytest.mark.parametrize("name", NAMES)
@SET
@given(st.integers(1, 4), st.integers(1, 2), st.integers(0, 3), st.integers(1, 3))
def test_parse_inverts_printing_for_every_generator(name: str, pp: int, k: int, extra: int, v: int) -> None:
    s = _build(name, pp, k, extra, v)
    for x in (s, S.with_comms(s)):
        back = _parse(x)
        assert back == x, S.diff(back, x)
        assert str(back) == str(x)


_INTS = st.integers(0, 120)
_OPS = st.builds(S.Op, st.sampled_from("FBIW"), _INTS, _INTS)
_ACTIONS = st.one_of(
    _OPS,
    st.builds(S.Overlap, st.builds(S.Op, st.just("F"), _INTS, _INTS),
              st.builds(S.Op, st.sampled_from("BI"), _INTS, _INTS)),
    st.builds(S.Send, st.sampled_from((ACT, GRAD)), _INTS, _INTS, _INTS),
    st.builds(S.Recv, st.sampled_from((ACT, GRAD)), _INTS, _INTS, _INTS),
)


@settings(max_examples=200, deadline=None)
@given(_ACTIONS)
def test_parse_action_inverts_printing(a: S.Action) -> None:
    assert S.parse_action(str(a)) == a


@pytest.mark.parametrize("text", [
    "r0: F0.0 F0.1 B0.0 B0.1\nr1: F1.0 B1.0 F1.1 B1.1",
    "r0: F0.0 sa0.0>r1 F0.1 sa0.1>r1 rg1.0<r1 B0.0 rg1.1<r1 B0.1\n"
    "r1: ra0.0<r0 F1.0 B1.0 sg1.0>r0 ra0.1<r0 F1.1 B1.1 sg1.1>r0",
    "r0: \nr1: ",
])
def test_printing_inverts_parse(text: str) -> None:
    assert str(S.parse_schedule(text, stages.loop(2))) == text


def test_hand_written_1f1b_verifies_and_equals_the_generator() -> None:
    s = S.parse_schedule("""
        r0: F0.0 F0.1 B0.0 B0.1
        r1: F1.0 B1.0 F1.1 B1.1
    """, stages.loop(2), name="1f1b")
    assert s == S.one_f_one_b(2, 2)
    assert S.without_comms(S.verify(s)) == s


def test_hand_written_dualpipe_infers_each_microbatch_path() -> None:
    text = str(S.dualpipe(2, 4))
    s = S.parse_schedule(text, stages.bidirectional(2), name="dualpipe")
    assert s.m == 4 and s.mb_path == (0, 0, 1, 1)
    S.verify(s)


@pytest.mark.parametrize("text, msg", [
    ("r0: F0.0 F0.1 B0.0 B0.1\nr1: F1.0 B1.1 F1.1 B1.0", "r1 position 1 B1.1: F1.1 has not run before it"),
    ("r0: F0.0 F0.1 B0.0 B0.1\nr1: F1.0 B1.0 F1.1", "stage 1 microbatch 1 has 0 B, 0 I, 0 W"),
    ("r0: F0.0 B0.0 F0.1 B0.1\nr1: F1.0 F1.1 B1.0 B1.1", "deadlock"),
    ("r0: F0.0 F0.1&B0.0 B0.1\nr1: F1.0 F1.1&B1.1 B1.0", "F1.1&B1.1: an overlapped pair needs two"),
    ("r0: F0.0 I0.0 W0.0\nr1: F1.0 W1.0 I1.0", "r1 position 1 W1.0: its I1.0 has not run before it"),
    ("r0: F1.0 B1.0\nr1: F0.0 B0.0", "stage 1 is not placed on rank 0"),
    ("r0: F0.0 sa0.0>r0 rg1.0<r1 B0.0\nr1: ra0.0<r0 F1.0 B1.0 sg1.0>r0", "sa0.0>r0 on r0 has no matching"),
    # malformed text: the parser already rejects it, naming the token, line and column
    ("r0: F0.0", "expected 2 rank lines"),
    ("r0: F0.0\nr1: F1.0\nr2: F2.0", "expected 2 rank lines"),
    ("r0: F0.0\nr2: F1.0", "malformed rank label 'r2:' at line 2, column 1: expected 'r1:'"),
    ("r0 F0.0\nr1: F1.0", "malformed rank label 'r0' at line 1, column 1"),
    ("r0: F0.0\n\n  r1: F1.0   B1.q", "malformed action 'B1.q' at line 3, column 14"),
    ("r0: F0.0&F0.1\nr1:", "malformed action 'F0.0&F0.1' at line 1, column 5: an overlapped pair"),
])
def test_hand_written_schedules_rejected(text: str, msg: str) -> None:
    with pytest.raises(S.ScheduleError, match=re.escape(msg)):
        S.verify(S.parse_schedule(text, stages.loop(2)))


@pytest.mark.parametrize("text, msg", [
    ("F3.x", "'F3.x' at column 1"),
    ("X0.0", "'X0.0' at column 1: expected F|B|I|W"),
    ("F03.1", "'F03.1' at column 1"),  # one spelling per action, so printing inverts parsing
    ("F-1.0", "'F-1.0' at column 1"),
    ("F3.1&W4.0", "'F3.1&W4.0' at column 1: an overlapped pair is F&B or F&I"),
    ("F3.1&B4", "'B4' at column 6"),
    ("F3.1&&B1.0", "'&B1.0' at column 6"),
    ("sa3.1<r2", "'sa3.1<r2' at column 1: a send is s...>r<peer>"),
    ("rx3.1<r2", "'rx3.1<r2' at column 1"),
    ("F0.0 B0.0", "'F0.0 B0.0' at column 1"),
    ("", "'' at column 1"),
])
def test_malformed_action(text: str, msg: str) -> None:
    with pytest.raises(S.ScheduleError, match="malformed action " + re.escape(msg)):
        S.parse_action(text)


def _oracle_inputs(s: S.Schedule, op: S.Op) -> set[S.Op | tuple[str, int, int]]:
    # Written from the schedules' definitions, not from Schedule.prev/next_stage: a microbatch runs the
    # stages 0..S-1 in order (DualPipe: the first m/2 run 0..pp-1, the rest pp..2pp-1). F of stage s
    # takes F of stage s-1; a backward takes F of its own stage and the backward of stage s+1; W takes
    # its I. ("bwd", s, mb) stands for whichever of B or I the schedule runs.
    if s.placement.kind == "bidirectional":
        first, last = (0, s.pp - 1) if op.mb < s.m // 2 else (s.pp, 2 * s.pp - 1)
    else:
        first, last = 0, s.placement.num_stages - 1
    if op.kind == "F":
        return set() if op.stage == first else {S.Op("F", op.stage - 1, op.mb)}
    if op.kind == "W":
        return {S.Op("I", op.stage, op.mb)}
    return {S.Op("F", op.stage, op.mb)} | (set() if op.stage == last else {("bwd", op.stage + 1, op.mb)})


@pytest.mark.parametrize("s", [S.one_f_one_b(3, 4), S.gpipe(2, 3), S.zb_h1(3, 5), S.interleaved_1f1b(2, 4, 2),
                               S.zbv(2, 3), S.dualpipev(2, 5), S.dualpipe(4, 8),
                               S.interleaved_1f1b(2, 4, 2, extra_warmup=True)], ids=lambda s: s.name)
def test_deps_agree_with_oracle(s: S.Schedule) -> None:
    rank_of = {op: r for r, acts in enumerate(s.ranks) for a in acts for op in ops_of(a)}
    made_by = {d: op for op in rank_of for d in deps.produces(s, op)}
    for op, r in rank_of.items():
        inputs = set()
        for d in deps.needs(s, op):
            src = made_by[d]  # everything needed is produced by exactly one op of the schedule
            inputs.add(("bwd", src.stage, src.mb) if src.kind in "BI" and op.kind in "BI" else src)
            assert deps.producer_rank(s, d) == rank_of[src] and deps.consumer_rank(s, d) == r
            pair = deps.link(s, d)
            assert (pair is None) == (rank_of[src] == r)
            if pair:
                assert pair == (S.Send(d.kind.value, src.stage, src.mb, r),
                                S.Recv(d.kind.value, src.stage, src.mb, rank_of[src]))
                assert deps.carried(pair[0]) == deps.carried(pair[1]) == d
        assert inputs == _oracle_inputs(s, op), op
    # nothing is produced that nothing needs
    assert set(made_by) == {d for op in rank_of for d in deps.needs(s, op)}


def test_deps_of_messages_and_non_actions() -> None:
    s = S.one_f_one_b(2, 1)
    snd = S.Send(ACT, 0, 0, 1)
    want = deps.Dep(deps.Kind.ACT, 0, 0)
    assert deps.needs(s, snd) == (want,) and deps.produces(s, snd) == ()
    assert deps.needs(s, S.Recv(ACT, 0, 0, 0)) == () and deps.produces(s, S.Recv(ACT, 0, 0, 0)) == (want,)
    with pytest.raises(S.ScheduleError, match="carries 'act' or 'grad'"):
        deps.carried(S.Send("weights", 0, 0, 1))
    with pytest.raises(S.ScheduleError, match="is not an action"):
        deps.needs(s, "F0.0")
    with pytest.raises(S.ScheduleError, match="nothing needs act of stage 1"):
        deps.consumer_rank(s, deps.Dep(deps.Kind.ACT, 1, 0))
