"""The compute model holds each phase to its modelled duration: a fake clock, then real short sleeps."""

from __future__ import annotations

import time

import pytest

from fmoe.schedule.compute_model import ComputeModel, table_from_events, table_from_flops
from fmoe.schedule.timeline import TraceEvent

TABLE = {("F", "attention"): 2.0, ("I", "attention"): 3.0, ("W", "attention"): 1.0,
         ("F", "mlp"): 4.0, ("I", "mlp"): 5.0, ("W", "mlp"): 6.0}


class _Clock:
    """A fake perf_counter that sleeping advances."""

    def __init__(self, now: float = 100.0):
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def _model(clock: _Clock, **kw) -> ComputeModel:
    return ComputeModel(TABLE, clock=clock, sleep=clock.sleep, **kw)


def test_a_faster_phase_returns_at_start_plus_its_duration() -> None:
    clock = _Clock()
    cm = _model(clock)
    start = clock.now
    clock.now += 0.5  # the real computation took 0.5 s of the modelled 4
    cm("F", "mlp", 0, "L0", 0, start)
    assert clock.now == start + 4.0 and clock.slept == [3.5]
    assert cm.stats.modelled == {"F": 4.0} and cm.stats.real == {"F": 0.5} and cm.stats.overruns == {"F": 0}


def test_a_slower_phase_returns_at_once_and_counts_as_an_overrun() -> None:
    clock = _Clock()
    cm = _model(clock)
    start = clock.now
    clock.now += 7.0
    cm("F", "mlp", 0, "L0", 0, start)
    assert clock.slept == [] and clock.now == start + 7.0
    assert cm.stats.overruns == {"F": 1} and cm.stats.excess == {"F": 3.0}
    assert "1 overran" in cm.stats.line()


def test_the_device_runs_queued_phases_back_to_back_and_waits_for_its_inputs() -> None:
    """Within a step, the host's time between two phases costs the device nothing while the host is
    ahead (it slept: a device's host would have queued on), but a phase never starts on the device
    before the exchange it waited for completed, nor before the host would have queued it."""
    clock = _Clock()
    cm = _model(clock)
    cm.new_step(clock.now)                      # t = 100
    clock.now += 0.5
    cm("F", "attention", 0, "L0", 0, 100.0)     # device 100 -> 102; the host slept 1.5
    assert clock.now == 102.0
    clock.now += 1.0                            # host gap: 1 s of Python before the next phase
    start = clock.now
    clock.now += 0.5
    cm("F", "mlp", 0, "L0", 0, start)           # queued at 101.5: device 102 -> 106, the gap hidden
    assert clock.now == 106.0                   # the host is 4 s ahead now
    clock.now = 109.5
    cm.waited(109.0)                            # it blocked on an exchange that completed at 109
    start = clock.now
    clock.now += 0.5
    cm("F", "attention", 0, "L1", 0, start)     # device 109 -> 111, not 106 -> 108; lead 0.5 + 1
    assert clock.now == 111.0
    clock.now = 120.0                           # 9 s of host work: more than its 1.5 s lead
    start = clock.now
    cm("F", "mlp", 0, "L1", 0, start)           # queued at 118.5: device 118.5 -> 122.5
    assert clock.now == 122.5
    clock.now += 3.0                            # a phase whose real time exceeds the model ends late
    start = clock.now
    clock.now += 9.0
    cm("F", "mlp", 0, "L1", 0, start)
    assert clock.now == 134.5 and cm.stats.overruns["F"] == 1
    cm.new_step(200.0)                          # a new step: no lead, an idle device
    clock.now = 201.0
    cm("F", "attention", 0, "L0", 0, 201.0)
    assert clock.now == 203.0


def test_unknown_phases_raise_unless_there_is_a_default() -> None:
    clock = _Clock()
    with pytest.raises(KeyError, match="no duration for F 'head'"):
        _model(clock)("F", "head", 1, "L3", 0, clock.now)
    cm = _model(clock, default=0.25)
    start = clock.now
    cm("F", "head", 1, "L3", 0, start)
    assert clock.now == start + 0.25
    with pytest.raises(ValueError, match="kind 'X'"):
        cm.duration("X", "mlp")
    with pytest.raises(ValueError, match="kinds are F, I, W"):
        ComputeModel({("B", "mlp"): 1.0})


def test_b_is_dx_when_the_dw_is_deferred_and_dx_plus_dw_otherwise() -> None:
    cm = _model(_Clock())
    assert cm.duration("B", "mlp") == cm.duration("I", "mlp") == 5.0 and cm.duration("W", "mlp") == 6.0
    cm.deferred_dw = False  # fb overlap off: a B's dx pass computes its dw too
    assert cm.duration("B", "mlp") == 11.0


def test_a_whole_stage_sums_the_phases_its_forward_reported() -> None:
    clock = _Clock()
    cm = _model(clock)
    for layer in ("L0", "L1"):  # the executor reports a whole stage's forward phase by phase
        for phase in ("attention", "mlp"):
            cm("F", phase, 3, layer, 0, clock.now)
    assert cm.duration("I", "stage", 3) == 2 * (3.0 + 5.0)
    assert cm.duration("W", "stage", 3) == 2 * (1.0 + 6.0)
    assert cm.duration("B", "stage", 3) == 2 * (3.0 + 5.0 + 1.0 + 6.0)  # never deferred
    start = clock.now
    cm("B", "stage", 3, "L0-L1", 1, start)
    assert clock.now == start + 30.0
    assert cm.stats.per_op[("B", 3, 1)] == cm.stats.per_phase[("B", "stage")] == 30.0
    with pytest.raises(KeyError):  # a stage whose forward it never saw
        cm.duration("I", "stage", 4)
    assert cm.reset().calls == {"F": 4, "B": 1} and cm.stats.calls == {}


def test_real_sleeps_hold_a_phase_to_its_duration() -> None:
    cm = ComputeModel({("F", "mlp"): 0.03})
    start = time.perf_counter()
    cm("F", "mlp", 0, "L0", 0, start)
    assert time.perf_counter() - start >= 0.03
    late = time.perf_counter() - 0.05  # it ran 0.05 s already: no sleep
    t = time.perf_counter()
    cm("F", "mlp", 0, "L0", 0, late)
    assert time.perf_counter() - t < 0.01 and cm.stats.overruns == {"F": 1}


def _ev(name: str, cat: str, d: float) -> TraceEvent:
    """A compute event as the executor records it: "F mlp s0 L0 mb1" with its typed fields."""
    kind, phase, stage, layer, mb = name.split()
    return TraceEvent(0, "compute", name, cat, 1.0, 1.0 + d, kind=kind, stage=int(stage[1:]),
                      microbatch=int(mb[2:]), layer=layer, phase=phase)


def test_tables_from_measured_events_and_from_flops() -> None:
    exchange = {"stage": 0, "microbatch": 0, "layer": "L0", "phase": "dispatch", "direction": "F"}
    events = [_ev("F mlp s0 L0 mb0", "F", 1.0), _ev("F mlp s0 L0 mb1", "F", 3.0),
              _ev("F mlp s0 L0 mb2", "F", 2.0),
              _ev("B mlp s0 L0 mb0", "B", 4.0), _ev("W mlp s0 L0 mb0", "W", 5.0),
              _ev("F unpermute s0 L0 mb0", "F", 1.0), _ev("B unpermute s0 L0 mb0", "B", 1.0),
              _ev("F embed s0 L0 mb0", "F", 0.5), _ev("B stage s1 L2-L3 mb0", "B", 9.0),
              TraceEvent(0, "compute", "wait a2a dispatch-F s0 L0 mb0", "wait", 1.0, 8.0, kind="wait a2a",
                         **exchange),
              TraceEvent(0, "comm", "a2a dispatch-F s0 L0 mb0", "a2a", 0.0, 8.0, kind="a2a", **exchange)]
    table = table_from_events(events, scale=2.0)
    assert table == {("F", "mlp"): 4.0, ("I", "mlp"): 8.0, ("W", "mlp"): 10.0,
                     ("F", "unpermute"): 2.0, ("I", "unpermute"): 2.0, ("W", "unpermute"): 0.0,
                     ("F", "embed"): 1.0, ("I", "embed"): 1.0, ("W", "embed"): 1.0}
    with pytest.raises(ValueError, match="dx and dw together"):
        table_from_events(events, b_is_dx=False)
    assert table_from_flops({("F", "mlp"): 2e9}, 1e12) == {("F", "mlp"): 2e-3}


def test_fmoe_train_takes_the_compute_model_and_its_trace_says_so(tmp_path) -> None:
    """`fmoe train --compute-model SCALE` (pp 1 x ep 2, combined 1F1B): step 1 calibrates, later steps run
    under the model, and the step's Chrome trace records it; the accumulate path refuses the flag."""
    import json

    from test_train import _in_process

    from fmoe.train.config import TrainConfig

    assert "accumulate path" in TrainConfig(pp=1, ep=1, compute_model=2.0).problem()
    assert "finite scale" in TrainConfig(pp=2, ep=1, compute_model=-1.0).problem()
    trace = tmp_path / "t.json"
    flags = ["--pp", "1", "--ep", "2", "--steps", "3", "--compute-model", "1.5", "--trace", str(trace),
             "--trace-step", "3", "--no-progress", "--device", "cpu", "--global-batch-size", "8"]
    code, _, err = _in_process(tmp_path, ["train", *flags])  # the command's main here, its ranks spawned
    assert code == 0, err[-2000:]
    assert json.loads(trace.read_text())["otherData"]["compute_model"] == 1.5
