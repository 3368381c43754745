"""Pictures of a simulated schedule: a timeline PNG (matplotlib, optional) and Chrome/Perfetto trace JSON.

Legend: one row per rank, compute lane on top and communication lane (all-to-all of each step, exposed
part darker; P2P transfers) below it; colour by action kind.
"""

from __future__ import annotations

import json
from pathlib import Path

from fmoe.schedule.ir import Overlap
from fmoe.schedule.simulate import Report

COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868", "F&B": "#8172b3"}


def _kind(action: object) -> str:
    return "F&B" if isinstance(action, Overlap) else action.kind


def write_trace(rep: Report, path: str | Path, us_per_unit: float = 1000.0) -> Path:
    """Writes Chrome/Perfetto trace JSON ("X" events; pid = rank, tid 0 compute, tid 1 comm; one time
    unit = `us_per_unit` microseconds) to `path`; returns the path."""
    ev: list[dict] = []
    for r in range(len(rep.busy)):
        ev.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
        ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "comm"}})
    for e in rep.events:
        ev.append({"ph": "X", "name": str(e.action), "cat": _kind(e.action), "pid": e.rank, "tid": 0,
                   "ts": e.start * us_per_unit, "dur": (e.end - e.start) * us_per_unit,
                   "args": {"phase": e.phase, "compute": e.compute, "comm": e.comm, "exposed": e.exposed}})
        if e.comm:
            ev.append({"ph": "X", "name": f"a2a {e.action}", "cat": "all-to-all", "pid": e.rank, "tid": 1,
                       "ts": e.start * us_per_unit, "dur": e.comm * us_per_unit,
                       "args": {"exposed": e.exposed}})
        if e.p2p_wait:
            ev.append({"ph": "X", "name": f"p2p wait {e.action}", "cat": "p2p", "pid": e.rank, "tid": 1,
                       "ts": (e.start - e.p2p_wait) * us_per_unit, "dur": e.p2p_wait * us_per_unit})
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ms",
                                "otherData": {"schedule": rep.name, "makespan": rep.makespan}}))
    return path


def write_png(rep: Report, path: str | Path, labels: bool | None = None) -> Path:
    """Draws the timeline (needs matplotlib: pip install 'fmoe[viz]') to `path`; returns the path.
    `labels` writes the action name in each box (default: when there are at most 400 actions)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # optional dependency
        raise ImportError("fmoe.schedule.timeline.write_png needs matplotlib; install it with "
                          "pip install 'fmoe[viz]'") from exc
    pp = len(rep.busy)
    labels = len(rep.events) <= 400 if labels is None else labels
    fig, ax = plt.subplots(figsize=(max(8.0, min(40.0, rep.makespan / 3)), 1.0 + 0.9 * pp))
    for e in rep.events:
        y = 3 * (pp - 1 - e.rank) + 1
        ax.barh(y, e.end - e.start, left=e.start, height=0.9, color=COLORS[_kind(e.action)],
                edgecolor="black", linewidth=0.3)
        if labels:
            ax.text((e.start + e.end) / 2, y, str(e.action).replace("&", "\n"), ha="center", va="center",
                    fontsize=5)
        if e.comm:
            ax.barh(y - 1, e.comm, left=e.start, height=0.6, color="#bbbbbb", linewidth=0)
            if e.exposed:
                ax.barh(y - 1, e.exposed, left=e.end - e.exposed, height=0.6, color="#333333", linewidth=0)
        if e.p2p_wait:
            ax.barh(y - 1, e.p2p_wait, left=e.start - e.p2p_wait, height=0.6, color="#e5ae38", linewidth=0)
    ax.set_yticks([3 * (pp - 1 - r) + d for r in range(pp) for d in (1, 0)])
    ax.set_yticklabels([f"r{r} {lane}" for r in range(pp) for lane in ("compute", "comm")], fontsize=7)
    ax.set_xlabel("time")
    ax.set_title(f"{rep.name}: makespan {rep.makespan:.4g}, bubble {100 * max(rep.bubble_fraction):.2f}%")
    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    handles += [Patch(color="#bbbbbb", label="all-to-all hidden"), Patch(color="#333333", label="exposed"),
                Patch(color="#e5ae38", label="p2p wait")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=8, fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
