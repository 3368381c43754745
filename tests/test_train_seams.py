"""`fmoe train --router MODULE:FUNCTION` as a user runs it (the command's main, its spawned gloo ranks; in
a subprocess where a user's module is on its PYTHONPATH): the example routers of fmoe/examples/routers.py
train on two ranks and match the one-process run, and a path that does not load stops the command before
any rank starts (docs/research.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN_TIMEOUT_S = 240
NUMERIC = ("step", "loss", "main_loss", "balance_loss", "grad_norm", "max_over_mean_load")
SMALL = ("--steps", "3", "--no-progress")  # the tiny preset


def _train(tmp: Path, name: str, *flags: str, env: dict | None = None) -> tuple[list[dict], str]:
    """Runs `fmoe train` with `flags` (and --metrics); returns its metric lines and its stdout. In a
    subprocess with `env` (a user's module on its PYTHONPATH); else the command's main in this process,
    its ranks spawned (tests/test_train.py's `_in_process`: the command's start saved)."""
    from test_train import _in_process

    metrics = tmp / f"{name}.jsonl"
    argv = ["train", *SMALL, "--metrics", str(metrics), *flags]
    if env is None:
        code, out, err = _in_process(tmp, argv)
    else:
        done = subprocess.run([sys.executable, "-m", "fmoe.cli.main", *argv], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        code, out, err = done.returncode, done.stdout, done.stderr
    assert code == 0, f"{name}: {out}\n{err}"
    return [json.loads(line) for line in metrics.read_text().splitlines()], out


USER_ROUTER = """
import os
from pathlib import Path

from fmoe.examples.routers import expert_choice

def counted(params, x_TD, cfg, state=None, seq_len=None):
    # one file per process that routed: the test counts the ranks that loaded this module
    Path(os.environ["SEAMS_MARKS"], str(os.getpid())).touch()
    return expert_choice(params, x_TD, cfg, state, seq_len)
"""


def _numbers(metrics: list[dict]) -> list[list[float]]:
    return [[m[k] for k in NUMERIC] for m in metrics]


def _user_module(tmp: Path) -> tuple[dict, Path]:
    """A user's package mypkg (USER_ROUTER) under `tmp`: the environment that puts it on the path, and the
    directory where each process that routes with it leaves a mark."""
    (tmp / "mypkg").mkdir()
    (tmp / "mypkg" / "__init__.py").write_text("")
    (tmp / "mypkg" / "routers.py").write_text(USER_ROUTER)
    marks = tmp / "marks"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]),
           "SEAMS_MARKS": str(marks)}
    return env, marks


@pytest.mark.parametrize("router,layout", [
    ("expert_choice", ("--pp", "1", "--ep", "2")),
    ("temperature", ("--pp", "2", "--ep", "1")),
])
def test_example_router_trains_on_two_ranks_like_one_process(tmp_path: Path, router: str, layout) -> None:
    """The two-rank run equals the one-process run of the example router. In the expert-choice case the
    two ranks route through a user's own module (mypkg.routers:counted, on PYTHONPATH, calling the example):
    a user's module is loaded on every rank, and the run's summary line names it. One two-rank run checks
    both (each rank start-up costs seconds)."""
    path = f"fmoe.examples.routers:{router}"
    user = router == "expert_choice"
    env, marks = _user_module(tmp_path) if user else (None, None)
    two, stdout = _train(tmp_path, "two", "--router", "mypkg.routers:counted" if user else path, *layout,
                         env=env)
    one, _ = _train(tmp_path, "one", "--router", path, "--pp", "1", "--ep", "1")
    assert len(two) == 3
    for a, b in zip(_numbers(two), _numbers(one)):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    balance = [m["balance_loss"] for m in two]
    if router == "expert_choice":  # no aux loss: the ranks routed with the example, not the default
        assert balance == [0.0] * 3
    else:
        assert all(b > 0 for b in balance)
    if user:
        assert "router mypkg.routers:counted" in stdout, stdout  # the run's summary line names it
        assert len(list(marks.iterdir())) == 2, "a user's module was not loaded on both ranks"


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
