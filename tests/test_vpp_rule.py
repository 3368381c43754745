"""One rule for the chunks per rank a schedule runs (fmoe.schedule.registry): only the interleaved schedules
take a virtual pipeline size, so neither the planner nor `fmoe train` accepts vpp 4 for zb_h1 (issue 34).
"""

from __future__ import annotations

import pytest

from fmoe import schedule as S
from fmoe.calibrate.models import load_model
from fmoe.cli.main import main
from fmoe.plan import layout as L
from fmoe.plan.specs import CLUSTER_PRESETS
from fmoe.schedule.registry import ALL_NAMES, CHUNKS, chunks_per_rank
from fmoe.schedule.stages import chunk_placement
from fmoe.train.config import TrainConfig


@pytest.mark.parametrize("name", ALL_NAMES)
def test_only_the_interleaved_schedules_take_a_vpp(name: str) -> None:
    pp = 1 if name == "combined_1f1b" else 2
    s = S.build(name, pp, 8)
    held = chunk_placement(s.placement).num_stages // pp  # the model is cut into pp x vpp chunks
    assert chunks_per_rank(name) == held, name
    if CHUNKS[name] is None:
        assert chunk_placement(S.build(name, pp, 8, 4).placement).num_stages == 4 * pp
    else:
        assert S.build(name, pp, 8, held).placement == s.placement  # its own count is accepted
        with pytest.raises(S.ScheduleError, match="only interleaved, interleaved\\+extra take"):
            S.build(name, pp, 8, held + 2)


def test_plan_explain_refuses_a_vpp_its_schedule_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "tiny", "--cluster", "local", "--devices", "2", "--global-batch", "32",
            "--timeline", "", "--explain", "tp1 pp2 ep1 vpp4 dp1 mb4"]
    assert main([*args, "--schedule", "zb_h1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the search's progress lines, then the error
    errors = [line for line in err if "error:" in line]
    assert len(errors) == 1 and errors[0] == err[-1], err
    assert "zb_h1 holds 1 model chunk per rank, not vpp 4" in err[-1], err
    args[-1] = "tp1 pp2 ep1 vpp2 dp1 mb4"  # the tiny model's 4 layers fill 2 ranks x 2 chunks
    assert main([*args, "--schedule", "interleaved"]) == 0
    assert "schedule interleaved (vpp 2)" in capsys.readouterr().out


def test_every_layout_the_planner_prices_is_one_the_registry_builds() -> None:
    model, cluster = load_model("small"), CLUSTER_PRESETS["h100"]  # 8 layers: pp 2 x vpp 4 fits
    seen = set()
    for lay, why in L.candidates(model, cluster, 8, 64, vpps=(2, 4)):
        if why is None:
            S.build(lay.schedule, lay.pp, 8 * lay.pp, lay.vpp)  # raises for a vpp it cannot run
            seen.add((lay.schedule, lay.vpp))
    assert ("interleaved", 4) in seen and ("zb_h1", 1) in seen and ("zbv", 2) in seen
    bad = L.Layout(tp=1, pp=2, ep=1, dp=4, vpp=4, schedule="zb_h1", overlap=False, micro_batch=1)
    assert "not vpp 4" in (L.problem(model, cluster, 8, bad, 64) or "")


def test_fmoe_train_runs_the_vpp_the_planner_prices() -> None:
    flag = "num_virtual_stages_per_pipeline_rank"
    tc = TrainConfig(pp=2, ep=1, schedule="interleaved", **{flag: 2})
    assert tc.problem() is None
    problem = TrainConfig(pp=2, ep=1, schedule="zb_h1", **{flag: 4}).problem()
    assert problem is not None and "zb_h1 holds 1 model chunk per rank, not vpp 4" in problem
    problem = TrainConfig(pp=2, ep=1, num_layers=6, schedule="interleaved", **{flag: 4}).problem()
    assert problem is not None and "each of 8 stages" in problem  # 6 layers for 2 ranks x 4 chunks
