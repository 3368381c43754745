"""fmoe plan, core contracts against independent oracles: parameter counts against init_gpt, the peak
memory walk against the simulator, the reduced microbatch rule against the generators, one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from fmoe import init_gpt
from fmoe import schedule as S
from fmoe.calibrate.models import load_model
from fmoe.cli.main import main
from fmoe.plan import layout as L
from fmoe.plan.layer_costs import totals
from fmoe.plan.memory import peak_bytes
from fmoe.plan.specs import CLUSTER_PRESETS, PlanError
from fmoe.train.config import TrainConfig


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_param_count_equals_init_gpt(preset: str) -> None:
    params = init_gpt(TrainConfig.from_sources(preset=preset).model(), torch.Generator().manual_seed(0))
    assert totals(load_model(preset)).params == sum(t.numel() for t in pytree.tree_leaves(params))


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb_h1", "zbv", "dualpipev", "dualpipe"])
@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8), (4, 12)])
def test_peak_bytes_equals_simulator(name: str, pp: int, m: int) -> None:
    try:
        s = S.build(name, pp, m)
    except S.ScheduleError:
        return  # not a valid input for this generator
    rep = S.simulate(s, S.Costs(act_mem=3.0, wgrad_mem=1.0))
    got = peak_bytes(s, [3.0] * s.placement.num_stages, [1.0] * s.placement.num_stages)
    assert got == pytest.approx(rep.peak_memory)


def _accepts(name: str, pp: int, m: int) -> bool:
    try:
        S.build(name, pp, m)
        return True
    except S.ScheduleError:
        return False


def test_rule_microbatches_keeps_every_generator_rule() -> None:
    for name in S.registry.NAMES:
        for pp in (1, 2, 3, 4):
            for m in range(1, 50):
                assert _accepts(name, pp, m) == _accepts(name, pp, L.rule_microbatches(m, pp)), (name, pp, m)


def test_experts_fewer_than_ep_is_a_reason() -> None:
    model, cluster = load_model("tiny"), CLUSTER_PRESETS["h100"]
    lay = L.Layout(tp=1, pp=1, ep=16, dp=1, vpp=1, schedule="1f1b", overlap=True, micro_batch=2)
    assert "experts" in (L.problem(model, cluster, 16, lay, 32) or "")


def test_devices_not_a_node_multiple_fails_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PlanError, match="multiple"):
        list(L.candidates(load_model("tiny"), CLUSTER_PRESETS["h100"], 12, 32))
    assert main(["plan", "--model", "tiny", "--cluster", "h100", "--devices", "12"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fmoe plan: error:")
