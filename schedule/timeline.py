"""Pictures of a schedule, simulated or measured: a timeline PNG (matplotlib, optional) and Chrome /
Perfetto trace JSON, both drawn from one list of lane events.

Legend: one row pair per rank, the compute lane on top and the communication lane (all-to-all, P2P)
below it; colour by category. A simulated Report becomes lane events with `report_events`; the executor
records them directly (`StepResult.events`). Trace format: pid = rank, a "compute" (tid 0) and a "comm"
(tid 1) thread named by thread_name metadata, complete "X" events in microseconds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fmoe.schedule.ir import Overlap
from fmoe.schedule.simulate import Report

LANES = ("compute", "comm")
COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868", "F&B": "#8172b3",
          "wait": "#e5ae38", "a2a": "#bbbbbb", "exposed": "#333333", "p2p": "#8c8c8c"}


@dataclass(frozen=True)
class TraceEvent:
    """One interval on `rank`'s `lane` ("compute" or "comm"): `name`, category `cat` (a key of COLORS),
    `start` and `end` in the timeline's unit (simulator time units, or seconds when measured); `step`
    says whether it ran inside an F&B pair ("pair") or a single op ("lone"), when known."""

    rank: int
    lane: str
    name: str
    cat: str
    start: float
    end: float
    step: str = ""  # measured: "pair" inside an F&B pair, "lone" in a single op (warmup, cooldown)


def _kind(action: object) -> str:
    return "F&B" if isinstance(action, Overlap) else action.kind


def report_events(rep: Report) -> list[TraceEvent]:
    """Returns the simulated Report as lane events: each action on the compute lane; its all-to-all
    (hidden part "a2a", exposed tail "exposed") and the P2P latency it waited on ("p2p") on the comm lane."""
    out = []
    for e in rep.events:
        out.append(TraceEvent(e.rank, "compute", str(e.action), _kind(e.action), e.start, e.end))
        if e.comm:
            out.append(TraceEvent(e.rank, "comm", f"a2a {e.action}", "a2a", e.start, e.start + e.comm))
        if e.exposed:
            out.append(TraceEvent(e.rank, "comm", f"exposed {e.action}", "exposed", e.end - e.exposed, e.end))
        if e.p2p_wait:
            out.append(TraceEvent(e.rank, "comm", f"p2p wait {e.action}", "p2p", e.start - e.p2p_wait,
                                  e.start))
    return out


def _events(source: Report | Sequence[TraceEvent]) -> tuple[list[TraceEvent], str]:
    if isinstance(source, Report):
        return report_events(source), source.name
    return list(source), "measured"


def write_trace(source: Report | Sequence[TraceEvent], path: str | Path, us_per_unit: float = 1000.0,
                name: str | None = None) -> Path:
    """Writes Chrome/Perfetto trace JSON of a simulated Report or of measured lane events (one time unit
    = `us_per_unit` microseconds: 1e6 for measured seconds) to `path`; returns the path."""
    events, default_name = _events(source)
    ranks = sorted({e.rank for e in events})
    ev: list[dict] = []
    for r in ranks:
        ev.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        for tid, lane in enumerate(LANES):
            ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": lane}})
    for e in events:
        x = {"ph": "X", "name": e.name, "cat": e.cat, "pid": e.rank, "tid": LANES.index(e.lane),
             "ts": e.start * us_per_unit, "dur": (e.end - e.start) * us_per_unit}
        if e.step:
            x["args"] = {"step": e.step}
        ev.append(x)
    makespan = max((e.end for e in events), default=0.0) - min((e.start for e in events), default=0.0)
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ms",
                                "otherData": {"schedule": name or default_name, "makespan": makespan}}))
    return path


def write_png(source: Report | Sequence[TraceEvent], path: str | Path, labels: bool | None = None,
              title: str | None = None) -> Path:
    """Draws the timeline of a simulated Report or of measured lane events (needs matplotlib:
    pip install 'fmoe[viz]') to `path`; returns the path. `labels` writes each compute event's name in its
    box (default: when there are at most 400 compute events)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # optional dependency
        raise ImportError("fmoe.schedule.timeline.write_png needs matplotlib; install it with "
                          "pip install 'fmoe[viz]'") from exc
    events, default_name = _events(source)
    if title is None:
        title = (f"{source.name}: makespan {source.makespan:.4g}, bubble "
                 f"{100 * max(source.bubble_fraction):.2f}%") if isinstance(source, Report) else default_name
    ranks = sorted({e.rank for e in events}) or [0]
    t0 = min((e.start for e in events), default=0.0)
    span = max((e.end for e in events), default=1.0) - t0
    compute = [e for e in events if e.lane == "compute"]
    labels = len(compute) <= 400 if labels is None else labels
    fig, ax = plt.subplots(figsize=(max(8.0, min(40.0, 3 * len(compute) ** 0.5)), 1.0 + 0.9 * len(ranks)))
    row = {r: 3 * (len(ranks) - 1 - k) + 1 for k, r in enumerate(ranks)}
    for e in events:
        y = row[e.rank] - (0 if e.lane == "compute" else 1)
        ax.barh(y, e.end - e.start, left=e.start - t0, height=0.9 if e.lane == "compute" else 0.6,
                color=COLORS.get(e.cat, "#999999"), edgecolor="black" if e.lane == "compute" else None,
                linewidth=0.3 if e.lane == "compute" else 0)
        if labels and e.lane == "compute" and e.cat != "wait":
            ax.text((e.start + e.end) / 2 - t0, y, e.name.replace("&", "\n"), ha="center", va="center",
                    fontsize=5)
    ax.set_yticks([row[r] - d for r in ranks for d in (0, 1)])
    ax.set_yticklabels([f"r{r} {lane}" for r in ranks for lane in LANES], fontsize=7)
    ax.set_xlim(0, span if span > 0 else 1.0)
    ax.set_xlabel("time")
    ax.set_title(title)
    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=9, fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
