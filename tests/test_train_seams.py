"""`fmoe train --router MODULE:FUNCTION` as a user runs it (the command in a subprocess, its spawned gloo
ranks): the example routers of fmoe/examples/routers.py train on two ranks and match the one-process run,
and a path that does not load stops the command before any rank starts (docs/research.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUN_TIMEOUT_S = 240
NUMERIC = ("step", "loss", "main_loss", "balance_loss", "grad_norm", "max_over_mean_load")
SMALL = ("--steps", "3", "--no-progress")  # the tiny preset


def _train(tmp: Path, name: str, *flags: str) -> list[dict]:
    """Runs `fmoe train` with `flags` (and --metrics); returns its metric lines."""
    metrics = tmp / f"{name}.jsonl"
    done = subprocess.run([sys.executable, "-m", "fmoe.cli.main", "train", *SMALL, "--metrics", str(metrics),
                           *flags], cwd=tmp, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{name}: {done.stdout}\n{done.stderr}"
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _numbers(metrics: list[dict]) -> list[list[float]]:
    return [[m[k] for k in NUMERIC] for m in metrics]


@pytest.mark.parametrize("router,layout", [
    ("expert_choice", ("--pp", "1", "--ep", "2")),
    ("temperature", ("--pp", "2", "--ep", "1")),
])
def test_example_router_trains_on_two_ranks_like_one_process(tmp_path: Path, router: str, layout) -> None:
    path = f"fmoe.examples.routers:{router}"
    two = _train(tmp_path, "two", "--router", path, *layout)
    one = _train(tmp_path, "one", "--router", path, "--pp", "1", "--ep", "1")
    assert len(two) == 3
    for a, b in zip(_numbers(two), _numbers(one)):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    balance = [m["balance_loss"] for m in two]
    if router == "expert_choice":  # no aux loss: the ranks routed with the example, not the default
        assert balance == [0.0] * 3
    else:
        assert all(b > 0 for b in balance)


@pytest.mark.parametrize("flag,path,words", [
    ("--router", "no_such_module_31.routers:expert_choice", "ModuleNotFoundError"),
    ("--attention", "fmoe.config:SCORE_FUNCS", "is a tuple, not a callable"),
])
def test_a_path_that_does_not_load_fails_before_launch(tmp_path: Path, flag: str, path: str,
                                                       words: str) -> None:
    done = subprocess.run([sys.executable, "-m", "fmoe.cli.main", "train", flag, path], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 2
    assert out.startswith(f"fmoe train: error: {flag}: ") and words in out, out
    assert len(out.splitlines()) == 1  # one line, and no rank was started
