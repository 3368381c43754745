"""benchmarks/pipeline.py --quick on one schedule: it runs fmoe's zbv next to torch's ScheduleZBVZeroBubble,
finds the same action lists, loss and gradients, and prints a bound that agrees with the simulated
makespan of the first table over torch's step of the second, to the whole milliseconds they are printed
in (about 10 s on 2 cores)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _row(text: str, header: str, name: str) -> dict[str, str]:
    """The row of `name` in the table whose header line starts with `header`, by column name."""
    lines = text.splitlines()
    at = next(k for k, ln in enumerate(lines) if ln.startswith(header))
    cols = lines[at].replace("step ms", "step_ms").replace("span ms", "span_ms").replace("sim ms", "sim_ms") \
        .replace("fmoe ms", "fmoe_ms").replace("torch ms", "torch_ms").replace("bubble meas", "bubble_meas") \
        .replace("bubble sim", "bubble_sim").replace("peak MiB", "peak_MiB").replace("fmoe MiB", "fmoe_MiB") \
        .replace("torch MiB", "torch_MiB").split()
    row = next(ln for ln in lines[at + 1:] if ln.split()[0] == name).split()
    return dict(zip(cols, row))


def test_the_quick_run_of_one_schedule_and_its_bound() -> None:
    out = subprocess.run([sys.executable, "benchmarks/pipeline.py", "--quick", "--only", "zbv", "--reps", "2",
                          "--no-memory", "--no-control"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    sim = _row(text, "schedule ", "zbv")
    pair = _row(text, f"{'fmoe':<20} torch", "zbv")
    assert pair["torch"] == "ScheduleZBVZeroBubble" and pair["order"] == "same"
    assert float(pair["|dloss|"]) < 1e-5 and float(pair["grad"]) < 1e-4
    # bound = simulated makespan on fmoe's op times / torch's step, each printed in whole ms: the ratio of
    # the printed values is off by at most what a half millisecond on each side moves it
    sim_ms, torch_ms, bound = float(sim["sim_ms"]), float(pair["torch_ms"]), float(pair["bound"])
    assert 0 < bound < 2
    assert (sim_ms - 0.5) / (torch_ms + 0.5) - 1e-3 <= bound <= (sim_ms + 0.5) / (torch_ms - 0.5) + 1e-3
