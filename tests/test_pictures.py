"""What `fmoe plan` and the timeline pictures show (issue 48): the plan writes no PNG unless asked and
says where; its table explains the overlap and rc columns; the search and the first calibration of
`--cluster local` show progress; the timeline fits a screen, names its x axis' unit, and its labels sit
inside their boxes without overlapping; the plan timeline's title carries the table's figures and names
the layout."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

from fmoe.cli.main import main
from fmoe.schedule.timeline import DPI, MAX_WIDTH_IN, TraceEvent, timeline_figure

TINY_PLAN = ["plan", "--model", "tiny", "--cluster", "h100", "--devices", "8", "--global-batch", "32",
             "--top", "2"]


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plan_writes_no_picture_unless_asked_and_explains_its_columns(tmp_path: Path, monkeypatch,
                                                                       capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(TINY_PLAN) == 0
    out, err = capsys.readouterr()
    assert list(tmp_path.iterdir()) == []  # no plan-timeline.png in the current folder
    assert "overlap: how the MoE all-to-all is hidden" in out and "rc: what is recomputed" in out, out
    assert "layouts fit; simulating the best" in err and "simulated " in err, err
    png = tmp_path / "pics" / "t.png"
    png.parent.mkdir()
    assert main([*TINY_PLAN, "--timeline", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"timeline of the best: {png}" in out
    width, height = _png_size(png)
    assert width <= MAX_WIDTH_IN * DPI and height <= 1200, (width, height)


def test_the_plan_timeline_title_carries_the_tables_figures() -> None:
    from fmoe.calibrate.models import load_model
    from fmoe.cli.plan import timeline_title
    from fmoe.plan import estimate as E
    from fmoe.plan import layout as L
    from fmoe.plan import search as Q
    from fmoe.plan.specs import load_cluster

    ctx = E.Context(load_model("tiny"), load_cluster("h100"), 8, 32)
    pred = E.evaluate(ctx, L.Layout(tp=1, pp=2, ep=1, dp=4, vpp=1, schedule="1f1b", overlap=True,
                                    micro_batch=1))
    row = Q.format_row(1, pred).split()
    title = timeline_title(pred, E.timeline(pred).makespan)
    assert title.startswith(f"{pred.layout.label()} 1f1b"), title
    # the table's bubble column, to its rounding, and the step to 4 figures
    assert f"bubble {row[-2]}" in title and f"step {pred.step_s:.4g} s" in title, (row, title)
    assert "microbatches" in title


def _measured_step(ranks: int = 4, ops: int = 80) -> list[list[TraceEvent]]:
    """A measured step's shape: per rank, compute boxes from 20 us to 8 ms long, and all-to-alls."""
    out = []
    for r in range(ranks):
        t, evs = 0.001 * r, []
        for k in range(ops):
            d = (2e-5, 3e-4, 8e-3, 1e-4)[k % 4]
            kind = "FBWI"[k % 4]
            evs.append(TraceEvent(r, "compute", f"{kind} attention s{r} L1 mb{k % 7}", kind, t, t + d))
            evs.append(TraceEvent(r, "comm", f"a2a dispatch-F s{r} L1 mb{k % 7}", "a2a", t, t + d / 2))
            t += d + 5e-5
        out.append(evs)
    return out


def test_a_measured_timeline_fits_a_screen_with_labels_in_their_boxes_and_a_unit() -> None:
    import matplotlib.pyplot as plt

    events = [e for evs in _measured_step() for e in evs]
    fig = timeline_figure(events, title="one measured step", unit="s")
    try:
        width, height = fig.get_size_inches() * DPI
        assert width <= 1650 and height <= 1000, (width, height)
        ax = fig.axes[0]
        assert ax.get_xlabel() == "time (ms)", ax.get_xlabel()  # a 0.17 s step reads in ms
        renderer = fig.canvas.get_renderer()
        labels = [t for t in ax.texts if t.get_text()]
        assert labels, "no box was wide enough for its name"
        boxes = [t.get_window_extent(renderer) for t in labels]
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), (a, b)
        bars = [p.get_window_extent(renderer) for p in ax.patches]
        for text, box in zip(labels, boxes, strict=True):  # each name inside one box of its row
            assert any(bar.x0 <= box.x0 and box.x1 <= bar.x1 and bar.y0 <= box.y0 + 1 and box.y1 <= bar.y1 + 1
                       for bar in bars), text.get_text()
    finally:
        plt.close(fig)


def test_the_first_local_calibration_says_what_it_does(tmp_path: Path, monkeypatch, capsys) -> None:
    from fmoe.calibrate import machine
    from fmoe.plan.specs import load_cluster

    calls: list[tuple[int, int]] = []

    def fake_step_live(configs, steps, events, each_round):  # the rounds, without the jobs
        for _ in range(steps):
            each_round()
        return {}

    monkeypatch.setattr(machine, "step_live", fake_step_live)
    monkeypatch.setattr(machine, "measure_rates", lambda: {})
    assert machine.measure_runs(3, progress=lambda done, total: calls.append((done, total))) == ({}, [{}] * 3)
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]

    def fake_calibrate(progress):  # what calibrate reports, then a cluster
        for done in range(3):
            progress(done, 2) if done <= 2 else None
        return load_cluster("h100")

    spec = tmp_path / "local.toml"
    monkeypatch.setenv("FMOE_LOCAL_CLUSTER", str(spec))
    monkeypatch.setattr(machine, "calibrate", fake_calibrate)
    assert main(["plan", "--model", "tiny", "--cluster", "local", "--devices", "2", "--top", "1"]) == 0
    err = capsys.readouterr().err
    assert f"measuring this machine once (about 5 minutes; kept in {spec})" in err, err
    assert "calibration round 2/2" in err and spec.is_file(), err
