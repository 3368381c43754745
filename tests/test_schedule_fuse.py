"""fuse_adjacent_iw: an I whose W comes next on its rank (only receives between) becomes one B, and nothing
else changes. Checked against the unfused schedule under the simulator (an independent replay): with a
B costing what its I and W cost, every rank finishes each action at the same time."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fmoe.schedule as S
from fmoe.schedule.ir import GRAD, B, F, I, Op, Overlap, Recv, Send, W, ops_of

SET = settings(max_examples=40, deadline=None)


def test_only_an_i_with_its_w_next_and_nothing_sent_between_is_fused() -> None:
    recv = Recv(GRAD, 1, 0, 1)
    send = Send(GRAD, 1, 0, 0)
    lists = {
        "receive between": ((Op(F, 1, 0), Op(I, 1, 0), recv, Op(W, 1, 0)), {(1, 0)}),
        "send between": ((Op(F, 1, 0), Op(I, 1, 0), send, Op(W, 1, 0)), set()),
        "compute between": ((Op(F, 1, 0), Op(F, 1, 1), Op(I, 1, 0), Op(F, 1, 2), Op(W, 1, 0)), set()),
        "another mb's W": ((Op(I, 1, 0), Op(W, 1, 1)), set()),
        "I in a pair": ((Overlap(Op(F, 1, 1), Op(I, 1, 0)), Op(W, 1, 0)), set()),
        "two pairs in a row": ((Op(I, 1, 0), Op(W, 1, 0), Op(I, 1, 1), Op(W, 1, 1)), {(1, 0), (1, 1)}),
    }
    for name, (acts, want) in lists.items():
        assert S.adjacent_iw(acts) == want, name


@pytest.mark.parametrize(("name", "fused"), [
    ("zb_h1", ({(0, mb) for mb in range(8)}, set())),  # the first stage sends no gradient
    ("zbv", ({(0, mb) for mb in range(8)}, {(2, mb) for mb in range(7)})),  # stage 2's goes to stage 1 here
    ("dualpipev+dw_detach", ({(0, 6), (0, 7)}, set())),
    ("1f1b", (set(), set())),  # no I at all
])
def test_which_backwards_fuse_on_two_ranks(name: str, fused: tuple[set, set]) -> None:
    s = S.fuse_adjacent_iw(S.build(name, 2, 8))
    for r in (0, 1):
        got = {(a.stage, a.mb) for a in s.ranks[r] if isinstance(a, Op) and a.kind == B}
        plain = {(a.stage, a.mb) for a in S.with_comms(S.build(name, 2, 8)).ranks[r]
                 if isinstance(a, Op) and a.kind == B}
        assert got - plain == fused[r], (name, r)


@SET
@given(st.sampled_from(S.registry.NAMES), st.integers(1, 4), st.integers(1, 12),
       st.lists(st.integers(1, 9), min_size=3, max_size=3), st.integers(0, 3))
@example("zb_h1", 2, 8, [2, 3, 1], 0)
@example("zbv", 2, 4, [1, 1, 1], 1)
@example("zb_h1", 1, 1, [1, 1, 1], 0)  # one rank, one microbatch
@example("dualpipev+dw_detach", 3, 6, [3, 2, 5], 0)  # odd ranks
def test_fusing_changes_no_finish_time_when_b_costs_i_plus_w(name: str, pp: int, m: int, fiw: list[int],
                                                             p2p: int) -> None:
    try:
        s = S.build(name, pp, m)
    except S.ScheduleError:
        return  # (pp, m) this generator does not take
    fused = S.fuse_adjacent_iw(s)
    S.verify(fused)  # a schedule like any other
    for r in range(pp):  # the same forwards in the same order; each fused pair's place taken by its B
        assert [a for a in fused.ranks[r] if isinstance(a, Op) and a.kind == F] == \
               [a for a in s.ranks[r] if isinstance(a, Op) and a.kind == F]
        assert [a for a in fused.ranks[r] if isinstance(a, (Send, Recv))] == \
               [a for a in S.with_comms(s).ranks[r] if isinstance(a, (Send, Recv))]  # messages kept
    f, i, w = fiw
    costs = S.Costs(f=f, i=i, w=w, p2p=p2p / 2)  # B costs i + w
    a, b = S.simulate(s, costs), S.simulate(fused, costs)
    assert b.makespan == pytest.approx(a.makespan, rel=1e-12)
    assert b.busy == pytest.approx(a.busy, rel=1e-12)
    assert b.peak_activations == a.peak_activations
    ends = {}
    for e in a.events:
        for op in ops_of(e.action):
            ends[(op.kind, op.stage, op.mb)] = e.end
    for e in b.events:
        for op in ops_of(e.action):
            # a fused B ends when its W did; everything else when it did
            key = (W, op.stage, op.mb) if op.kind == B and (W, op.stage, op.mb) in ends else (
                op.kind, op.stage, op.mb)
            assert e.end == pytest.approx(ends[key], rel=1e-12), (name, op)
