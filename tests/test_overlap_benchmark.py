"""benchmarks/overlap.py --quick with the compute model and the lone forwards' all-to-all in two chunks: it
runs, reports the model, the four modes and the targets, and its Chrome trace gives back the hidden share
from the trace alone (about 20 s on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_quick_run_with_the_compute_model(tmp_path) -> None:
    trace = tmp_path / "t.json"
    out = subprocess.run([sys.executable, "benchmarks/overlap.py", "--quick", "--no-memory", "--configs",
                          "combined_1f1b", "--compute-model", "on", "--a2a-chunks", "2",
                          "--trace", str(trace)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "combined_1f1b +cm a2a/2 on " in text and "combined_1f1b +cm a2a/2 on1 " in text
    assert "combined_1f1b +cm a2a/2 self " in text  # no pairing: each layer hides itself in chunks
    assert "compute model, overlap on:" in text and "compute model, overlap on1:" in text
    assert "targets combined_1f1b +cm a2a/2:" in text and "loss on" in text
    assert "dispatch.1-F" in text and "combine.0-F" in text  # the lone forward's chunks ran
    doc = json.loads(trace.read_text())
    assert doc["otherData"]["compute_model"].startswith("on")
    line = next(ln for ln in text.splitlines() if "from the trace alone" in ln)
    for part in line.split(": ", 1)[1].split(", "):  # "pair 78.1% / 78.1%": the events' = the trace's
        own, back = (float(part.split()[i].rstrip("%")) for i in (1, 3))
        # the trace keeps whole microseconds, so a share may round across a last digit (84.5 / 84.4)
        assert abs(own - back) <= 0.15, line
