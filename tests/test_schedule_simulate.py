"""The simulator against the published closed forms (independent formulas written out here), the
overlap model, memory counts, stage imbalance, pictures and the CLI."""

from __future__ import annotations

import argparse
import importlib
import json
import re
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fmoe.schedule as S
from fmoe.cli import simulate as cli_simulate
from fmoe.schedule import stages
from fmoe.schedule.imbalance import imbalance_pct, rank_costs
from fmoe.schedule.ir import ACT, Op, Send

SET = settings(max_examples=25, deadline=None)
UNIT = S.Costs(f=1, i=1, w=1)  # F = I = W = 1, B = I + W = 2, F&B = F + B = 3, no communication


def _frac(rep: S.Report) -> set[Fraction]:
    return {Fraction(b).limit_denominator(10**6) for b in rep.bubble_fraction}


@SET
@given(st.integers(1, 8), st.integers(1, 24), st.integers(1, 3), st.integers(1, 3))
@example(1, 1, 1, 2)
@example(5, 2, 2, 1)
def test_1f1b_and_gpipe_closed_form(pp: int, m: int, f: int, b: int) -> None:
    c = S.Costs(f=f, b=b)
    want = {Fraction(pp - 1, m + pp - 1)}
    assert _frac(S.simulate(S.one_f_one_b(pp, m), c)) == want
    assert _frac(S.simulate(S.gpipe(pp, m), c)) == want
    assert max(S.simulate(S.one_f_one_b(pp, m), c).peak_activations) == min(pp, m)


@SET
@given(st.integers(1, 6), st.integers(1, 4), st.integers(2, 4), st.integers(1, 3), st.integers(1, 3))
@example(3, 1, 2, 1, 2)
def test_interleaved_closed_form(pp: int, groups: int, v: int, f: int, b: int) -> None:
    m = pp * groups
    rep = S.simulate(S.interleaved_1f1b(pp, m, v), S.Costs(f=f, b=b))
    assert _frac(rep) == {Fraction(pp - 1, v * m + pp - 1)}


@SET
@given(st.integers(1, 8), st.integers(1, 24), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3))
@example(1, 1, 1, 1, 1)
@example(4, 2, 1, 1, 1)
def test_zb_h1_closed_form(pp: int, m: int, f: int, i: int, w: int) -> None:
    # Zero Bubble paper: (p-1)(F + B_input - W), exact when W <= min(F, I) and m >= pp; peak p activations
    w = min(w, f, i)
    m = max(m, pp)
    rep = S.simulate(S.zb_h1(pp, m), S.Costs(f=f, i=i, w=w))
    assert set(rep.bubble) == {(pp - 1) * (f + i - w)}
    assert max(rep.peak_activations) == pp


@SET
@given(st.integers(1, 4), st.integers(0, 8))
@example(1, 0)
def test_dualpipe_closed_form_unit_costs(half: int, more: int) -> None:
    # DeepSeek-V3: (PP/2-1)(F&B + B - 3W) with PP+1 activations; exact at F = I = W, F&B = F + B
    pp = 2 * half
    rep = S.simulate(S.dualpipe(pp, 2 * pp + 2 * more), UNIT)
    assert set(rep.bubble) == {(pp // 2 - 1) * (3 + 2 - 3)}
    assert max(rep.peak_activations) == pp + 1


@SET
@given(st.integers(2, 8), st.integers(0, 10))
@example(2, 0)
@example(3, 1)
def test_dualpipev_closed_form_unit_costs(pp: int, more: int) -> None:
    # DualPipeV on pp devices = DualPipe with PP = 2pp stages: (pp-1)(F&B + B - 3W), 2pp+1 chunk activations
    m = 2 * pp + more
    rep = S.simulate(S.dualpipev(pp, m, dw_detach=True), UNIT)
    assert set(rep.bubble) == {(pp - 1) * (3 + 2 - 3)}
    assert max(rep.peak_activations) == 2 * pp + 1
    # dw detach off (default): measured (pp-1)(F&B + B - W), one F more than MindSpeed's stated form
    rep = S.simulate(S.dualpipev(pp, m), UNIT)
    assert set(rep.bubble) == {(pp - 1) * (3 + 2 - 1)}


def test_overlap_model_hides_all_to_all() -> None:
    # 1:1 compute to all-to-all: pairs hide 100%; lone steps hide lone_hide = 50%
    c = S.Costs(f=1, i=1, w=1, a2a=0.5, lone_hide=0.5)
    rep = S.simulate(S.dualpipev(4, 16), c)
    assert rep.overlap_ratio["warmup"] == pytest.approx(0.5)
    assert rep.overlap_ratio["cooldown"] == pytest.approx(0.5)
    assert rep.overlap_ratio["steady"] > 0.9
    f, b = S.Op("F", 0, 1), S.Op("B", 1, 0)
    assert c.pair(f, b) == 3.0  # max(0.5, 0.5) + max(1, 0.5) + max(0.5, 0.5) + max(1, 0.5)
    assert c.lone(f) == 1.0 + 0.5
    assert S.Costs(a2a=2.0).pair(f, b) == 2.0 + 2.0 + 2.0 + 2.0
    assert S.Costs(a2a=0.5, pair_overlap=False).pair(f, b) == 1 + 1 + 2 + 1


def test_p2p_latency_and_memory() -> None:
    rep = S.simulate(S.one_f_one_b(2, 2), S.Costs(f=1, b=2, p2p=0.5, wgrad_mem=0.25))
    assert rep.makespan == 2 * 3 + 1 * 3 + 2 * 0.5
    assert rep.exposed_comm[1] == pytest.approx(0.5)
    zb = S.simulate(S.zb_h1(2, 4), S.Costs(act_mem=1.0, wgrad_mem=0.25))
    assert zb.peak_memory[1] == pytest.approx(1.25)  # one activation live + one deferred weight grad


def test_stage_imbalance_helper() -> None:
    p = stages.loop(4)
    naive = imbalance_pct(rank_costs(p, (4, 4, 4, 4), 1.5, 2.5))
    placed = S.place_layers(p, 16, first_extra=1.5, last_extra=2.5)
    assert naive == pytest.approx(30.0) and placed.imbalance_pct < 10.01 and sum(placed.layers) == 16
    v = S.place_layers(stages.vshape(4), 32, first_extra=1.5, last_extra=2.5)
    assert v.imbalance_pct < 5.0 and sum(v.layers) == 32
    rep = S.simulate(S.one_f_one_b(2, 4), S.Costs(f=(2.0, 1.0), i=(2.0, 1.0), w=(2.0, 1.0)))
    assert rep.imbalance_pct == pytest.approx(100 * (12 * 2 / 18 - 1))


def test_png_and_trace(tmp_path) -> None:
    rep = S.simulate(S.dualpipev(2, 4), S.Costs(a2a=0.25, lone_hide=0.5, p2p=0.1))
    png = S.write_png(rep, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads(S.write_trace(rep, tmp_path / "t.json").read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len([e for e in xs if e["tid"] == 0]) == sum(len(r) for r in S.dualpipev(2, 4).ranks)
    assert all(e["dur"] >= 0 and {"name", "pid", "tid", "ts"} <= e.keys() for e in xs)


def test_cli(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    cli_simulate.add_arguments(parser)
    out = tmp_path / "timeline.png"
    args = parser.parse_args(["--schedule", "dualpipev", "--pp", "4", "--microbatches", "16", "--a2a", "0.5",
                              "--lone-hide", "0.5", "--out", str(out), "--trace", str(tmp_path / "t.json")])
    assert cli_simulate.run(args) == 0
    text = capsys.readouterr().out
    assert "makespan" in text and "r3" in text and out.exists()
    assert cli_simulate.run(parser.parse_args(["--schedule", "dualpipev", "--pp", "1"])) == 2
    from fmoe.cli.main import main

    assert main(["simulate", "--schedule", "zb_h1", "--pp", "2", "-m", "4"]) == 0


def test_cli_layer_placement_evens_rank_cost(capsys) -> None:
    from fmoe.cli.main import main

    # 16 layers on 4 stages, embedding worth 1 layer on stage 0, loss + MTP worth 2 on stage 3:
    # even split costs 5, 4, 4, 6 (imbalance 6 / 4.75 - 1 = 26.3%); the balanced one 5, 5, 4, 5 (5.3%).
    argv = ["simulate", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--layers", "16",
            "--first-extra", "1", "--last-extra", "2"]
    assert main([*argv, "--placement", "even"]) == 0
    even = capsys.readouterr().out
    assert "4 4 4 4; rank cost imbalance 26.32%" in even
    assert main(argv) == 0
    balanced = capsys.readouterr().out
    assert "rank cost imbalance 5.26%" in balanced

    def makespan(text: str) -> float:
        return float(text.split("makespan ")[1].split(",")[0])

    assert makespan(balanced) < makespan(even)
    assert main(["simulate", "--schedule", "1f1b", "--pp", "4", "--layers", "3"]) == 2


@pytest.mark.parametrize("argv, msg", [
    (["--schedule", "dualpipev", "--pp", "2", "-m", "4", "--a2a", "0.5", "--moe-layers", "0"],
     "error: Costs.moe_layers must be an int >= 1, got 0"),
    (["--f", "nan"], "error: Costs.f must be a finite number > 0, got nan"),
    (["--i", "-1"], "error: Costs.i must be > 0, got -1.0"),
    (["--w", "inf"], "error: Costs.w must be a finite number >= 0, got inf"),
    (["--p2p", "nan"], "error: Costs.p2p must be a finite number >= 0, got nan"),
    (["--a2a", "-0.5"], "error: Costs.a2a must be >= 0, got -0.5"),
    (["--lone-hide", "2", "--a2a", "1"], "error: Costs.lone_hide must be in [0, 1], got 2.0"),
    (["--layers", "16", "--f", "-1"], "error: Costs.f must be > 0, got -1.0"),
    (["--layers", "16", "--last-extra", "nan"], "error: --last-extra must be a finite number >= 0, got nan"),
])
def test_cli_bad_cost_is_one_error_line(capsys, argv: list[str], msg: str) -> None:
    from fmoe.cli.main import main

    assert main(["simulate", *argv]) == 2
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == msg and out.count("error:") == 1 and "makespan" not in out


def test_cli_zero_w_is_valid(capsys) -> None:
    from fmoe.cli.main import main

    assert main(["simulate", "--schedule", "zb_h1", "--pp", "4", "-m", "8", "--w", "0"]) == 0
    assert "makespan 22," in capsys.readouterr().out  # (m + pp - 1)(F + I) with W free: 11 x 2


def _without(s: S.Schedule, r: int, action: object) -> S.Schedule:
    return replace(s, ranks=s.ranks[:r] + (tuple(a for a in s.ranks[r] if a != action),) + s.ranks[r + 1:])


def _swapped(s: S.Schedule, r: int, a: int, b: int) -> S.Schedule:
    acts = list(s.ranks[r])
    acts[a], acts[b] = acts[b], acts[a]
    return replace(s, ranks=s.ranks[:r] + (tuple(acts),) + s.ranks[r + 1:])


def _deadlocked() -> S.Schedule:
    full = S.with_comms(S.one_f_one_b(2, 2))  # r0 receives mb 1's grad before sending its activation
    r0 = list(full.ranks[0])
    i_send = r0.index(Send(ACT, 0, 1, 1))
    r0.insert(i_send, r0.pop(next(k for k, a in enumerate(r0) if str(a) == "rg1.1<r1")))
    return replace(full, ranks=(tuple(r0),) + full.ranks[1:])


@pytest.mark.parametrize("broken, msg", [
    (lambda: _without(S.one_f_one_b(2, 2), 0, Op("B", 0, 1)), "0 B, 0 I, 0 W; expected"),
    (lambda: _swapped(S.one_f_one_b(2, 2), 1, 0, 1), "r1 position 0 B1.0: F1.0 has not run before it"),
    (_deadlocked, "deadlock with blocking receives"),
])
def test_simulate_refuses_what_verify_refuses(broken, msg: str) -> None:
    """Numbers for a schedule that cannot run would be silently wrong: simulate raises verify's error."""
    with pytest.raises(S.ScheduleError, match=msg):
        S.simulate(broken(), UNIT)


def test_simulate_verifies_a_schedule_object_once(monkeypatch) -> None:
    sim = importlib.import_module("fmoe.schedule.simulate")  # the module (the package exports the function)
    calls = []
    monkeypatch.setattr(sim, "verify", lambda s: calls.append(s))
    s = S.one_f_one_b(2, 3)
    sim.simulate(s, UNIT)
    sim.simulate(s, S.Costs(f=2, i=1, w=1))
    assert calls == [s]


@pytest.mark.parametrize("kw, msg", [
    (dict(first_extra=float("nan")), "first_extra must be a finite number >= 0, got nan"),
    (dict(first_extra=float("inf")), "first_extra must be a finite number >= 0, got inf"),
    (dict(first_extra=-1.0), "first_extra must be >= 0, got -1.0"),
    (dict(last_extra=float("-inf")), "last_extra must be a finite number >= 0, got -inf"),
    (dict(last_extra="1"), "last_extra must be a finite number >= 0, got '1'"),
    (dict(num_layers=-4, min_layers=0), "num_layers must be an int >= 0, got -4"),
    (dict(num_layers=8.5), "num_layers must be an int >= 0, got 8.5"),
    (dict(min_layers=-1), "min_layers must be an int >= 0, got -1"),
])
def test_place_layers_refuses_bad_numbers(kw: dict, msg: str) -> None:
    """nan / inf / negative extras gave a placement with nan or inf costs, or one biased towards stage 0."""
    args = dict(num_layers=8, first_extra=0.5, last_extra=0.5, min_layers=1) | kw
    with pytest.raises(S.ScheduleError, match=re.escape(msg)):
        S.place_layers(stages.vshape(2), **args)
