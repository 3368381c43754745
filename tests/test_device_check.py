"""benchmarks/device_check.py, dry-run on the CPU: its parts run and their checks pass here, so the script a
device session runs once has not rotted (what it measures on a GPU is in BENCHMARKS.md when one ran it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_device_check_parts_run_on_cpu(tmp_path) -> None:
    parts = "env,ops,optim,comm,syncs,bench,compile"
    script = os.path.join(ROOT, "benchmarks", "device_check.py")
    proc = subprocess.run([sys.executable, script, "--device", "cpu", "--parts", parts, "--out", tmp_path],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "device_check.json").read_text())
    for part in parts.split(","):
        assert report[part]["status"] == "ok", (part, report[part])
    assert len(report["ops"]["checks"]) == 8 and report["syncs"]["figures"]["fmoe_count_dx"] == 0


def test_the_moe_layer_parts_run_on_cpu(tmp_path) -> None:
    """benchmarks/device_parts.py's parts (issue 45's device check, both runs of its plan) through the
    driver: each finishes, its checks pass where they apply on the CPU (grouped's values and empty
    experts' exact-zero dw, the executor against the accumulate path, two ep ranks over gloo)."""
    parts = "grouped,exec1,gloo_ep2,profile,glue,ceiling,train_big"
    script = os.path.join(ROOT, "benchmarks", "device_check.py")
    proc = subprocess.run([sys.executable, script, "--device", "cpu", "--parts", parts, "--out", tmp_path,
                           "--budget-s", "400"], capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "device_check.json").read_text())
    for part in parts.split(","):
        assert report[part]["status"] == "ok", (part, report[part])
    assert len(report["grouped"]["checks"]) == 16  # 8 cases x (values, empty experts' dw exactly 0)
    assert report["exec1"]["checks"]["executor_equals_accumulate"]["ok"]
    assert set(report["glue"]["figures"]) == {"router_fwd", "layout", "permute_fwd_bwd", "unpermute_fwd_bwd",
                                              "swiglu_fwd_bwd"}
