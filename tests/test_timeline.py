"""The Chrome trace of a measured step: lanes (receives posted early on their own), metadata, and the
hidden share of the all-to-all recomputed from the written trace alone against the executor's events."""

from __future__ import annotations

import json
import time

import pytest
import torch

from fmoe import schedule as S
from fmoe.ops import linear
from fmoe.schedule.compute_model import ComputeModel
from fmoe.schedule.execute import execute
from fmoe.schedule.options import ExecOptions
from fmoe.schedule.timeline import TraceEvent, hidden_of, hidden_shares, summarize
from fmoe.transforms.program import Layer, Phase, StageProgram

D, T, M = 8, 4, 4


class _Delayed:
    """An exchange in flight that completes `delay` s after its issue (as a link model would)."""

    in_flight = True

    def __init__(self, value: object, delay: float):
        self.value, self.due = value, time.perf_counter() + delay
        self.completed_at: float | None = None

    def wait(self) -> object:
        time.sleep(max(0.0, self.due - time.perf_counter()))
        self.completed_at = self.due
        return self.value


def _program(delay: float) -> StageProgram:
    def body(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:  # p: {"w<k>": the layer's weight}
        (w,) = p.values()
        return {"h": torch.tanh(linear(meta["x"] if "h" not in acts else acts["h"], w))}, meta

    def loss(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        return {"mse": (acts["h"] ** 2).mean()}, meta

    move = Phase("dispatch", "comm", start=lambda a, m: _Delayed((dict(a), m), delay),
                 start_transpose=lambda ct, m: _Delayed(dict(ct), delay))
    layers = tuple(Layer(f"L{k}", (Phase("mlp", "compute", fn=body, param_paths=((f"w{k}",),)), move))
                   for k in range(2))
    params = {f"w{k}": torch.randn(D, D, generator=torch.Generator().manual_seed(k)) / D ** 0.5
              for k in range(2)}
    return StageProgram(0, (*layers, Layer("head", (Phase("loss", "compute", fn=loss, losses=("mse",)),))),
                        params, {})


def _step(delay: float, compute_model: ComputeModel | None = None):
    s = S.combined_1f1b(M)
    data = [{"x": torch.randn(T, D, generator=torch.Generator().manual_seed(10 + mb))} for mb in range(M)]
    return execute(s, 0, {0: _program(delay)}, lambda mb: data[mb],
                   options=ExecOptions(compute_model=compute_model))


def test_the_hidden_share_recomputed_from_the_trace_equals_the_executors(tmp_path) -> None:
    cm = ComputeModel({("F", "mlp"): 0.004, ("I", "mlp"): 0.004, ("W", "mlp"): 0.004, ("F", "loss"): 0.0,
                       ("I", "loss"): 0.0, ("W", "loss"): 0.0})
    res = _step(0.004, cm)
    own = hidden_of(res.events)
    assert set(own) == {"pair", "lone", "all"} and all(0.0 <= v <= 1.0 for v in own.values())
    path = S.write_trace(res.events, tmp_path / "t.json", us_per_unit=1e6, meta={"compute_model": "on"})
    assert hidden_shares(path) == pytest.approx(own, abs=1e-9)
    doc = json.loads(path.read_text())
    assert doc["otherData"]["compute_model"] == "on"
    assert all(e["args"]["compute_model"] == "on" for e in doc["traceEvents"] if e["name"] == "process_name")
    assert cm.stats.calls["F"] == M * 3 and cm.stats.modelled["F"] == pytest.approx(M * 2 * 0.004)
    # with the compute model on, the pairs hide most of each 4 ms exchange behind the other op's 4 ms mlp
    assert own["pair"] > own["lone"]


def test_spans_that_overlap_on_a_lane_get_threads_of_their_own_and_receives_the_p2p_lane(tmp_path) -> None:
    events = [TraceEvent(0, "compute", "F mlp s0 L0 mb0", "F", 0.0, 1.0),
              TraceEvent(0, "comm", "a2a dispatch-F s0 L0 mb0", "a2a", 0.5, 2.0, "pair"),
              TraceEvent(0, "comm", "a2a combine-B s0 L1 mb1", "a2a", 0.6, 1.5, "pair"),
              TraceEvent(0, "comm", "a2a combine-F s0 L0 mb0", "a2a", 2.0, 3.0, "pair"),
              TraceEvent(0, "comm", "p2p recv act s0 mb1", "p2p", 0.0, 3.0, kind="p2p recv"),
              TraceEvent(0, "comm", "p2p send act s0 mb0 r1", "p2p", 1.6, 1.7)]
    doc = json.loads(S.write_trace(events, tmp_path / "t.json", us_per_unit=1e6).read_text())
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "compute", 1: "comm", 2: "p2p", 4: "comm 2"}
    tid = {e["name"]: e["tid"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert tid["p2p recv act s0 mb1"] == 2 and tid["p2p send act s0 mb0 r1"] == 4
    assert tid["a2a dispatch-F s0 L0 mb0"] == 1 and tid["a2a combine-B s0 L1 mb1"] == 4
    assert tid["a2a combine-F s0 L0 mb0"] == 1  # free again once the dispatch completed


def _shown(e: TraceEvent) -> str:
    """The name of an executor event rebuilt from its typed fields (timeline.py's table)."""
    if e.kind in ("F", "B", "I", "W"):
        return f"{e.kind} {e.phase} s{e.stage} {e.layer} mb{e.microbatch}"
    if e.kind in ("a2a", "wait a2a"):
        return f"{e.kind} {e.phase}-{e.direction} s{e.stage} {e.layer} mb{e.microbatch}"
    return f"{e.kind} {e.what} s{e.stage} mb{e.microbatch}" + (f" r{e.peer}" if e.kind == "p2p send" else "")


def test_executor_events_say_what_they_are_and_summarize_reads_them() -> None:
    res = _step(0.001)
    assert all(_shown(e) == e.name for e in res.events), [e for e in res.events if _shown(e) != e.name][:2]
    sm = summarize(res.events)
    compute = [e for e in res.events if e.kind in ("F", "B", "I", "W")]
    assert {e.cat for e in compute} == {"F", "B", "W"} and all(e.lane == "compute" for e in compute)
    assert sm.busy == pytest.approx(sum(e.duration for e in compute))
    assert sm.wait == pytest.approx(sum(e.duration for e in res.events if e.cat == "wait"))
    assert sm.waits.keys() == {"wait a2a"} and sm.waits["wait a2a"] == pytest.approx(sm.wait)
    assert sum(sm.ops.values()) == pytest.approx(sm.busy) == pytest.approx(sum(sm.layers.values()))
    assert set(sm.compute) == {("F", "mlp"), ("B", "mlp"), ("W", "mlp"), ("F", "loss"), ("B", "loss")}
    assert len(sm.compute[("F", "mlp")]) == 2 * M and sm.total("F") == pytest.approx(
        sum(e.duration for e in compute if e.kind == "F"))
    assert {(k, st, mb) for k, st, mb in sm.ops} == {(k, 0, mb) for k in "FBW" for mb in range(M)}
    assert {ly for _, ly in sm.layers} == {"L0", "L1", "head"}
    # every exchange, both ways, with its wait, in order of issue; the hidden share is theirs
    assert len(sm.exchanges) == 2 * 2 * M and all(x.wait is not None for x in sm.exchanges)
    assert {x.label for x in sm.exchanges} == {"dispatch-F", "dispatch-B"}
    assert [x.span.start for x in sm.exchanges] == sorted(x.span.start for x in sm.exchanges)
    assert len({x.key for x in sm.exchanges}) == len(sm.exchanges)
    spans, waited = sum(x.span.duration for x in sm.exchanges), sum(x.waited for x in sm.exchanges)
    assert hidden_of(res.events)["all"] == pytest.approx(1.0 - waited / spans)
