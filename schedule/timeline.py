"""Pictures of a schedule, simulated or measured: a timeline PNG (matplotlib, optional) and Chrome /
Perfetto trace JSON, both drawn from one list of lane events.

Legend: one row group per rank: the compute lane on top, the communication lane (all-to-all spans from
issue to completion, P2P sends) below it, and receives posted early ("p2p recv", from posting to the
wait's end) on a "p2p" lane of their own, so that a rank's comm lane stays readable; colour by category.
A simulated Report becomes lane events with `report_events`; the executor records them directly
(`StepResult.events`). Trace format: pid = rank, one thread per lane ("compute" tid 0, "comm" tid 1,
"p2p" tid 2) named by thread_name metadata; spans that overlap on one lane (two microbatches' exchanges
in flight at once) go to further threads "comm 2", "comm 3", ... (tid lane + 3 k), since a Chrome thread
nests its slices; complete "X" events in microseconds; `meta` (e.g. whether a compute model was on) in
otherData and on every process_name. `hidden_shares` reads the hidden share of the all-to-all back from
a written trace alone.

Measured events carry their meaning in typed fields (`TraceEvent.kind`, stage, microbatch, layer, phase,
...); `name` is only what the pictures show. `summarize` reads a measured timeline's figures from them:

    kind        name (display)                 fields set besides kind
    F B I W     "F attention s0 L1 mb2"        stage, microbatch, layer, phase
    a2a         "a2a dispatch-F s0 L1 mb2"     stage, microbatch, layer, phase, direction  (comm lane)
    wait a2a    "wait a2a dispatch-F s0 ..."   the same as its a2a                         (compute lane)
    p2p send    "p2p send act s1 mb0 r0"       stage, microbatch, what, peer               (comm lane)
    p2p recv    "p2p recv grad s1 mb0"         stage, microbatch, what, peer               (comm/p2p lane)
    wait p2p    "wait p2p act s0 mb3"          stage, microbatch, what                     (compute lane)

(stage: the stage that ran the phase or produced the message; direction: "F" for a forward's exchange,
"B" for a backward's transpose, B or I; what: "act" or "grad".)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fmoe.schedule.ir import Overlap
from fmoe.schedule.simulate import Report

LANES = ("compute", "comm", "p2p")
COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868", "F&B": "#8172b3",
          "wait": "#e5ae38", "a2a": "#bbbbbb", "exposed": "#333333", "p2p": "#8c8c8c"}


@dataclass(frozen=True)
class TraceEvent:
    """One interval on `rank`'s `lane` ("compute" or "comm"): `name` (what the pictures show), category
    `cat` (a key of COLORS), `start` and `end` in the timeline's unit (simulator time units, or seconds
    when measured); `step` says whether it ran inside an F&B pair ("pair") or a single op ("lone"), when
    known. The executor's events also say what they are (the module docstring's table): `kind`, and of
    `stage`, `microbatch`, `layer`, `phase`, `direction`, `what` and `peer` those that apply (None
    otherwise); a simulated Report's events leave them unset."""

    rank: int
    lane: str
    name: str
    cat: str
    start: float
    end: float
    step: str = ""  # measured: "pair" inside an F&B pair, "lone" in a single op (warmup, cooldown)
    kind: str = ""  # F / B / I / W, "a2a", "wait a2a", "p2p send", "p2p recv", "wait p2p"; "" unknown
    stage: int | None = None
    microbatch: int | None = None
    layer: str | None = None  # a layer name ("L3", "embed"), or "L0-L3" for a whole stage's backward
    phase: str | None = None  # a compute phase's name ("stage": a whole stage), or an exchange's
    direction: str | None = None  # an exchange: "F" (a forward's) or "B" (a backward's transpose)
    what: str | None = None  # a P2P message: "act" or "grad"
    peer: int | None = None  # a P2P message: the pipeline rank it goes to or comes from

    @property
    def duration(self) -> float:
        return self.end - self.start


COMPUTE = ("F", "B", "I", "W")  # the kinds of compute events


@dataclass(frozen=True)
class Exchange:
    """One all-to-all of a measured timeline: `span` its comm-lane event (issue to completion), `wait` the
    compute-lane wait for it (None when none was recorded)."""

    span: TraceEvent
    wait: TraceEvent | None

    @property
    def key(self) -> tuple:
        """(stage, layer, microbatch, phase, direction): the same on every EP peer's side of the exchange."""
        return _exchange_key(self.span)[1:]

    @property
    def label(self) -> str:
        """The exchange and its direction, "dispatch-F", "combine-B", ..."""
        return f"{self.span.phase}-{self.span.direction}"

    @property
    def waited(self) -> float:
        """Seconds (timeline units) the compute lane waited for it."""
        return 0.0 if self.wait is None else self.wait.duration


@dataclass(frozen=True)
class Summary:
    """A measured timeline's figures (`summarize`), in its time unit.

    compute: (kind, phase) -> the durations of its compute events, in start order; ops: (kind, stage,
    microbatch) -> their compute time; layers: (kind, layer) -> their compute time; exchanges: the
    all-to-alls in order of issue, each with its wait; busy: compute time in all; wait: compute-lane
    waits in all (a2a and p2p); waits: the same per kind ("wait a2a", "wait p2p"); gap: compute-lane time
    with no event (before the first and between events: the executor's own work); end: the last
    compute-lane end. busy, wait, gap and end are one rank's figures (summarize one rank's events)."""

    compute: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    ops: dict[tuple[str, int, int], float] = field(default_factory=dict)
    layers: dict[tuple[str, str], float] = field(default_factory=dict)
    exchanges: list[Exchange] = field(default_factory=list)
    busy: float = 0.0
    wait: float = 0.0
    waits: dict[str, float] = field(default_factory=dict)
    gap: float = 0.0
    end: float = 0.0

    def total(self, kind: str) -> float:
        """Returns the compute time of `kind` (F, B, I or W) in all."""
        return sum(d for (k, _, _), d in self.ops.items() if k == kind)


def summarize(events: Iterable[TraceEvent]) -> Summary:
    """Returns the Summary of measured lane events (`StepResult.events`, or events built with the same
    typed fields), from their typed fields alone."""
    events = list(events)
    compute: dict[tuple[str, str], list[float]] = {}
    ops: dict[tuple[str, int, int], float] = {}
    layers: dict[tuple[str, str], float] = {}
    waits: dict[str, float] = {}
    waited: dict[tuple, TraceEvent] = {}  # the a2a waits by their exchange's key
    busy = wait = gap = end = 0.0
    for e in sorted((e for e in events if e.lane == "compute"), key=lambda e: e.start):
        gap += max(0.0, e.start - end)
        end = max(end, e.end)
        d = e.duration
        if e.kind in COMPUTE:
            busy += d
            compute.setdefault((e.kind, e.phase), []).append(d)
            ops[(e.kind, e.stage, e.microbatch)] = ops.get((e.kind, e.stage, e.microbatch), 0.0) + d
            layers[(e.kind, e.layer)] = layers.get((e.kind, e.layer), 0.0) + d
        elif e.kind in ("wait a2a", "wait p2p"):
            wait += d
            waits[e.kind] = waits.get(e.kind, 0.0) + d
            if e.kind == "wait a2a":
                waited[_exchange_key(e)] = e
    spans = sorted((e for e in events if e.lane == "comm" and e.kind == "a2a"), key=lambda e: e.start)
    exchanges = [Exchange(e, waited.get(_exchange_key(e))) for e in spans]
    return Summary(compute, ops, layers, exchanges, busy, wait, waits, gap, end)


def _exchange_key(e: TraceEvent) -> tuple:
    return (e.rank, e.stage, e.layer, e.microbatch, e.phase, e.direction)


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


def lane_of(e: TraceEvent) -> str:
    """Returns the lane `e` is drawn on: its own, except a receive posted early, which gets "p2p"."""
    return "p2p" if e.kind == "p2p recv" else e.lane


def _rows(events: Sequence[TraceEvent]) -> list[int]:
    """Returns each event's row on its rank's lane: the first row free at its start (greedy packing), so
    that spans on one row never overlap."""
    rows = [0] * len(events)
    ends: dict[tuple[int, str], list[float]] = {}
    for k in sorted(range(len(events)), key=lambda k: (events[k].start, events[k].end)):
        e = events[k]
        free = ends.setdefault((e.rank, lane_of(e)), [])
        j = next((j for j, end in enumerate(free) if end <= e.start), len(free))
        if j == len(free):
            free.append(e.end)
        free[j] = e.end
        rows[k] = j
    return rows


def write_trace(source: Report | Sequence[TraceEvent], path: str | Path, us_per_unit: float = 1000.0,
                name: str | None = None, meta: Mapping[str, Any] | None = None) -> Path:
    """Writes Chrome/Perfetto trace JSON of a simulated Report or of measured lane events (one time unit
    = `us_per_unit` microseconds: 1e6 for measured seconds) to `path`; returns the path. `meta` (JSON
    values) goes into otherData and onto every process_name event."""
    events, default_name = _events(source)
    rows = _rows(events)
    ranks = sorted({e.rank for e in events})
    used = sorted({(e.rank, LANES.index(lane_of(e)), j) for e, j in zip(events, rows)} |
                  {(r, k, 0) for r in ranks for k in (0, 1)})
    ev: list[dict] = []
    for r in ranks:
        ev.append({"ph": "M", "name": "process_name", "pid": r,
                   "args": {"name": f"rank {r}", **(meta or {})}})
    for r, k, j in used:
        ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": k + len(LANES) * j,
                   "args": {"name": LANES[k] + (f" {j + 1}" if j else "")}})
    for e, j in zip(events, rows):
        x = {"ph": "X", "name": e.name, "cat": e.cat, "pid": e.rank,
             "tid": LANES.index(lane_of(e)) + len(LANES) * j,
             "ts": e.start * us_per_unit, "dur": (e.end - e.start) * us_per_unit}
        if e.step:
            x["args"] = {"step": e.step}
        ev.append(x)
    makespan = max((e.end for e in events), default=0.0) - min((e.start for e in events), default=0.0)
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ms",
                                "otherData": {"schedule": name or default_name, "makespan": makespan,
                                              **(meta or {})}}))
    return path


def _shares(spans: Iterable[tuple[Any, str, Any, str, float]]) -> dict[str, float | None]:
    """(rank, "a2a" or "wait", the exchange's key, step, seconds) of a2a spans and their waits -> 1 - waits
    / spans per step kind ("pair", "lone", and "all"), over the exchanges that have both a span and a
    wait."""
    span: dict[tuple[Any, Any], tuple[str, float]] = {}
    wait: dict[tuple[Any, Any], float] = {}
    for rank, kind, label, step, d in spans:
        if kind == "a2a":
            span[(rank, label)] = (step, d)
        else:
            wait[(rank, label)] = wait.get((rank, label), 0.0) + d
    sums: dict[str, list[float]] = {}
    for key, (step, d) in span.items():
        if key in wait:
            for k in (step or "none", "all"):
                acc = sums.setdefault(k, [0.0, 0.0])
                acc[0] += d
                acc[1] += wait[key]
    return {k: None if s == 0 else 1.0 - w / s for k, (s, w) in sums.items()}


def hidden_of(events: Iterable[TraceEvent]) -> dict[str, float | None]:
    """Returns the hidden share of the all-to-all, 1 - (sum of the "wait a2a" compute-lane waits) / (sum
    of the "a2a" comm-lane spans, issue to completion), per step kind ("pair", "lone") and "all", from
    measured lane events (None where a kind has no exchange)."""
    return _shares((e.rank, "a2a" if e.kind == "a2a" else "wait", _exchange_key(e), e.step, e.duration)
                   for e in events if (e.kind == "a2a" and e.lane == "comm") or e.kind == "wait a2a")


def hidden_shares(trace: str | Path | Mapping[str, Any]) -> dict[str, float | None]:
    """Returns `hidden_of` recomputed from a Chrome trace written by `write_trace` (a path or the loaded
    JSON) alone: its "a2a" X events against its "wait a2a" X events, matched by rank and name."""
    doc = trace if isinstance(trace, Mapping) else json.loads(Path(trace).read_text())
    xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    return _shares((e["pid"], "a2a" if e.get("cat") == "a2a" else "wait",
                    e["name"][len("a2a "):] if e.get("cat") == "a2a" else e["name"][len("wait a2a "):],
                    e.get("args", {}).get("step", ""), e["dur"])  # a ratio: the time unit cancels
                   for e in xs if e.get("cat") == "a2a"
                   or (e.get("cat") == "wait" and e["name"].startswith("wait a2a ")))


# the picture fits a screen: at most MAX_WIDTH_IN x DPI pixels wide, whatever the step's length
MAX_WIDTH_IN, DPI = 15.0, 110
# seconds -> (scale, unit) for the x axis, the first whose span reads above 1
_SCALES = ((1.0, "s"), (1e3, "ms"), (1e6, "µs"))


def _axis_scale(span: float, unit: str | None) -> tuple[float, str]:
    """How the x axis shows times of `unit` ("s", or None for a simulation's cost units): seconds in
    s / ms / µs, whichever reads the span as a number above 1; cost units as they are."""
    if unit != "s":
        return 1.0, unit or "cost units"
    return next(((k, u) for k, u in _SCALES if span * k >= 1.0), _SCALES[-1])


def write_png(source: Report | Sequence[TraceEvent], path: str | Path, labels: bool | None = None,
              title: str | None = None, unit: str | None = None) -> Path:
    """Draws the timeline of a simulated Report or of measured lane events (needs matplotlib:
    pip install 'fmoe[viz]') to `path` (`timeline_figure`); returns the path."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(source, labels=labels, title=title, unit=unit)
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def timeline_figure(source: Report | Sequence[TraceEvent], labels: bool | None = None,
                    title: str | None = None, unit: str | None = None) -> Any:
    """The matplotlib Figure of a timeline, sized for a screen (at most MAX_WIDTH_IN x DPI pixels wide).
    `labels` writes each compute event's name in its box where it fits (default on; a name wider or
    taller than its box is left out, so no two overlap); `unit`: the unit of the events' times ("s": drawn
    in s, ms or µs; None: a simulation's cost units), named on the x axis."""
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
    scale, shown = _axis_scale(span, unit)
    compute = [e for e in events if e.lane == "compute"]
    fig, ax = plt.subplots(figsize=(min(MAX_WIDTH_IN, max(8.0, 3 * len(compute) ** 0.5)),
                                    1.4 + 1.1 * len(ranks)), dpi=DPI)
    row = {r: 4 * (len(ranks) - 1 - k) + 2 for k, r in enumerate(ranks)}
    for e in events:
        y = row[e.rank] - LANES.index(lane_of(e))
        ax.barh(y, (e.end - e.start) * scale, left=(e.start - t0) * scale,
                height=0.9 if e.lane == "compute" else 0.6,
                color=COLORS.get(e.cat, "#999999"), edgecolor="black" if e.lane == "compute" else None,
                linewidth=0.3 if e.lane == "compute" else 0)
    ax.set_yticks([row[r] - d for r in ranks for d in range(len(LANES))])
    ax.set_yticklabels([f"rank {r} {lane}" for r in ranks for lane in LANES], fontsize=8)
    ax.set_xlim(0, span * scale if span > 0 else 1.0)
    ax.set_ylim(min(row.values()) - len(LANES), max(row.values()) + 1)
    ax.set_xlabel(f"time ({shown})", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title(title, fontsize=10)
    cats = {e.cat for e in events}
    handles = [Patch(color=c, label=k) for k, c in COLORS.items() if k in cats]
    fig.legend(handles=handles, loc="lower center", ncol=9, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))  # the legend's strip at the bottom
    if labels is None or labels:
        _label_boxes(fig, ax, [e for e in compute if e.cat != "wait"], row, t0, scale)
    return fig


def _label_boxes(fig: Any, ax: Any, events: list[TraceEvent], row: dict[int, int], t0: float,
                 scale: float) -> None:
    """Writes each event's name in its compute box where the text fits inside the box (measured by the
    renderer at the saved DPI); a name that does not fit is left out, so labels never overlap."""
    renderer = fig.canvas.get_renderer()
    to_px = ax.transData.transform
    for e in events:
        y = row[e.rank] - LANES.index("compute")
        (x0, y0) = to_px(((e.start - t0) * scale, y - 0.45))
        (x1, y1) = to_px(((e.end - t0) * scale, y + 0.45))
        if x1 - x0 < 6:  # no name fits a sliver
            continue
        for name in _shorter(e.name):  # the longest that fits
            text = ax.text((e.start + e.end) / 2 * scale - t0 * scale, y, name, ha="center", va="center",
                           fontsize=6, clip_on=True)
            box = text.get_window_extent(renderer)
            if box.width <= (x1 - x0) - 2 and box.height <= abs(y1 - y0):
                break
            text.remove()


def _shorter(name: str) -> list[str]:
    """A compute event's name as its box may show it, longest first: the phase and microbatch ("F mb2",
    then "F2"), not the stage and layer (the row and its neighbours say those); a simulated op's name
    ("F3", "F3&B2") as it is."""
    head = name.split()
    mb = next((w[2:] for w in head if w.startswith("mb")), None)
    if not head or mb is None:
        return [name]
    return [f"{head[0]} mb{mb}", f"{head[0]}{mb}"]
