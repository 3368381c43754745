"""Live `fmoe train` jobs stepped in turn (fmoe/calibrate/jobs.py): every job answers each step with its
ranks' times, the jobs asked for events with a HostSample whose parts fit inside its step, idle ranks are
stopped (they take no CPU between their steps), sessions of fresh processes join their steps, and a rank's
failure raises with the job and rank named instead of hanging the caller.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from fmoe.calibrate.jobs import LiveJobs, step_live
from fmoe.train.config import TrainConfig

# two ranks a job, two blocks, 8 sequences a step in microbatches of 2: a step of a few tens of milliseconds
_SMALL = {"progress": False, "ep": 1, "steps": 10**6, "num_layers": 2, "micro_batch_size": 2,
          "global_batch_size": 8, "schedule": "1f1b", "timeout": 120}


def _config(**over: object) -> TrainConfig:
    return TrainConfig.from_sources("tiny", None, {**_SMALL, **over})


def _state(pid: int) -> str:
    """The process state letter of `pid` ("T": stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return text[text.rindex(")") + 2]


def test_jobs_step_in_turn_and_return_their_samples() -> None:
    configs = {"dp": _config(pp=1, dp=2), "pp": _config(pp=2, dp=1)}
    with LiveJobs(configs, events={"dp"}, timeout_s=120) as jobs:
        # between steps every rank is stopped: an idle job takes no CPU from the one that steps
        procs = [p for ps in jobs._procs.values() for p in ps]
        assert len(procs) == 4 and {_state(p.pid) for p in procs} == {"T"}
        # the caller's measurement once per timed round, with every rank stopped
        seen: list[set[str]] = []
        runs = jobs.step_in_turn(steps=3, warm=1,
                                 each_round=lambda: seen.append({_state(p.pid) for p in procs}))
    assert seen == [{"T"}] * 3
    assert set(runs) == {"dp", "pp"}
    for run in runs.values():
        assert len(run.step_s) == 3 and all(t > 0 for t in run.step_s)
        assert 0 < run.peak_gib < 8
    assert not any(p.is_alive() for p in procs)
    assert runs["pp"].samples == [[], []]  # no events asked of it
    per_rank = runs["dp"].samples
    assert [len(steps) for steps in per_rank] == [3, 3]
    for steps in per_rank:
        for sample in steps:
            assert 0 < sample.span_s <= sample.wall_s
            assert set(sample.f_s) == {"embed", "dense", "moe", "head"}
            assert 0 < sample.b_s and 0 < sample.f_s["moe"] < sample.span_s
    sample = runs["dp"].host_sample()
    assert sample.peak_gib == runs["dp"].peak_gib
    assert sample.span_s <= sample.wall_s


def test_a_failing_rank_raises_with_its_job_named() -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("some text " * 400)
    tc = _config(pp=1, dp=2, data=f.name, data_kind="text", vocab_size=256)
    os.unlink(f.name)  # valid when the config was built, gone when the ranks read it
    with pytest.raises(RuntimeError, match=r"job 'gone', rank \d failed"):
        with LiveJobs({"gone": tc}, timeout_s=120) as jobs:
            jobs.step_in_turn(steps=1)
    with pytest.raises(ValueError, match="events asked of jobs not given"):
        LiveJobs({"a": tc}, events={"b"})
    with pytest.raises(ValueError, match="steps=0"):
        LiveJobs({}).step_in_turn(steps=0)


def test_step_live_joins_sessions_of_fresh_processes() -> None:
    rounds: list[int] = []
    runs = step_live({"dp": _config(pp=1, dp=2)}, steps=3, sessions=2, warm=1, events={"dp"},
                     each_round=lambda: rounds.append(1), timeout_s=120)
    run = runs["dp"]
    assert len(run.step_s) == 3 and len(rounds) == 3  # 2 steps in the first session, 1 in the second
    assert [len(steps) for steps in run.samples] == [3, 3] and run.peak_gib > 0
    with pytest.raises(ValueError, match="sessions=4"):
        step_live({}, steps=3, sessions=4)

