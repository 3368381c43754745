"""benchmarks/pipeline.py --quick on one schedule: it runs fmoe's zbv next to torch's ScheduleZBVZeroBubble,
finds the same action lists, loss and gradients, and prints its bound, torch sim, t-eff and ops columns
consistently (about 10 s on 2 cores)."""

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
        .replace("torch MiB", "torch_MiB").replace("torch sim", "torch_sim").split()
    row = next(ln for ln in lines[at + 1:] if ln.split()[0] == name).split()
    return dict(zip(cols, row))


def test_the_quick_run_of_one_schedule_and_its_bound() -> None:
    out = subprocess.run([sys.executable, "benchmarks/pipeline.py", "--quick", "--only", "zbv", "--reps", "2",
                          "--no-memory", "--no-control"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    pair = _row(text, f"{'fmoe':<20} torch", "zbv")
    assert pair["torch"] == "ScheduleZBVZeroBubble" and pair["order"] == "same"
    assert float(pair["|dloss|"]) < 1e-5 and float(pair["grad"]) < 1e-4
    # bound = fmoe's replayed makespan / torch's step, ops = it / torch's replayed makespan ("torch sim"),
    # t-eff = torch sim / torch's step: bound = ops * t-eff up to the printed digits, and t-eff is the ratio
    # of the two printed times up to the half millisecond each is rounded by
    torch_sim, torch_ms = float(pair["torch_sim"]), float(pair["torch_ms"])
    bound, ops, t_eff = float(pair["bound"]), float(pair["ops"]), float(pair["t-eff"])
    assert 0 < bound < 2 and 0 < ops < 2
    assert abs(bound - ops * t_eff) <= 2e-3
    assert (torch_sim - 0.5) / (torch_ms + 0.5) - 1e-3 <= t_eff <= (torch_sim + 0.5) / (torch_ms - 0.5) + 1e-3
