"""What a calibration run measured (`HostSample`), read from its steps' wall times and executor events
(`sample_of`, on every rank of a live job: fmoe.calibrate.jobs) and joined over ranks and rounds
(`median_sample`); the calibration (fmoe.calibrate.machine) fits the planner's host overheads to them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from fmoe.outline import Outline
from fmoe.schedule.timeline import summarize


@dataclass(frozen=True)
class HostSample:
    """What the calibration run (calibration_config) measured, in seconds: `wall_s` one
    whole step, `span_s` the executor's part of it (first event start to last event end); `f_s` per layer
    kind the forward of one layer of one microbatch (the sum of its phases' events; averaged over the
    layers of that kind); `b_s`, `w_s` and `i_s` the B, W and I of one microbatch (the whole stage);
    `peak_gib` the process's peak resident memory."""

    wall_s: float
    span_s: float
    f_s: dict[str, float]
    b_s: float
    w_s: float
    peak_gib: float
    i_s: float = 0.0


def _layer_kind(token: str, o: Outline) -> str:
    """The sample's kind of the layer an event names: a model layer's (dense, moe), the embedding's, or
    "head" for the rest (norm, head, loss, MTP)."""
    site = next((s for s in o.sites if s.name == token), None)
    if site is not None and site.layer is not None:
        return site.kind
    return "embed" if token == "embed" else "head"


def sample_of(walls: list[float], steps_events: list[list[Any]], model: Outline, microbatches: int,
              peak_gib: float) -> HostSample:
    """Returns the HostSample of measured steps: per step its wall seconds and executor events (medians
    over the steps); `model` the outline of the model that ran (fmoe.outline: which layer is which)."""
    spans, bs, is_, ws, fs = [], [], [], [], {}
    for events in steps_events:
        spans.append(max(e.end for e in events) - min(e.start for e in events))
        summary = summarize(events)
        per: dict[str, dict[str, float]] = {}
        for (op, layer), d in summary.layers.items():
            if op == "F":
                per.setdefault(_layer_kind(layer, model), {})[layer] = d
        bs.append(summary.total("B") / microbatches)
        is_.append(summary.total("I") / microbatches)
        ws.append(summary.total("W") / microbatches)
        for kind, layers in per.items():
            fs.setdefault(kind, []).append(sum(layers.values()) / len(layers) / microbatches)
    med = statistics.median
    return HostSample(med(walls), med(spans), {k: med(v) for k, v in fs.items()}, med(bs), med(ws), peak_gib,
                      med(is_))


def median_sample(samples: list[HostSample]) -> HostSample:
    """Returns the field-by-field median of `samples` (one per calibration copy or round)."""
    med = statistics.median
    kinds = set.intersection(*(set(s.f_s) for s in samples))
    return HostSample(med(s.wall_s for s in samples), med(s.span_s for s in samples),
                      {k: med(s.f_s[k] for s in samples) for k in kinds}, med(s.b_s for s in samples),
                      med(s.w_s for s in samples), max(s.peak_gib for s in samples),
                      med(s.i_s for s in samples))
