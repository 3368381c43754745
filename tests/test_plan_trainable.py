"""A layout `fmoe plan` may rank is one `fmoe train` accepts (issue 32): the planner's layout rules are
the runtime's. For the Pangu Ultra MoE and DeepSeek-V3 presets at their published device counts, layouts
the planner's rules pass (`fmoe.plan.layout.problem`) are turned into `fmoe train` options
(`fmoe.plan.train_flags.train_overrides`: sizes, schedule and vpp, fb overlap and each way the planner
may hide the all-to-all (`estimate.overlap_choices`), microbatch, recompute,
dispatcher, capacity, ZeRO-1, sequence parallelism) and checked by the runtime's own pre-launch check
(`TrainConfig.problem`, which builds no model). The whole space (16.6k layouts) passed by hand; the test
walks an evenly spread sample of it, every recompute choice included, to stay within CI's time.
"""

from __future__ import annotations

import dataclasses

import pytest

from fmoe.cli.plan import train_command
from fmoe.plan import estimate as E
from fmoe.plan import layout as L
from fmoe.plan.specs import PlanError, load_cluster, load_model
from fmoe.plan.train_flags import train_overrides
from fmoe.train.config import TrainConfig

PUBLISHED = [("pangu-ultra-moe", "ascend-910b", 6144, 3072), ("deepseek-v3", "h800", 2048, 15360)]


@pytest.mark.parametrize(("preset", "cluster", "devices", "global_batch"), PUBLISHED)
def test_layouts_the_planner_may_rank_are_ones_fmoe_train_accepts(preset: str, cluster: str, devices: int,
                                                                 global_batch: int) -> None:
    model, spec = load_model(preset), load_cluster(cluster)
    ok = [lay for lay, why in L.candidates(model, spec, devices, global_batch) if why is None]
    assert len(ok) > 1000
    sample = ok[::len(ok) // 150]
    # (no DualPipeV: its rule wants layers a multiple of 2 pp, and both models have 61)
    assert {lay.schedule for lay in sample} >= {"dualpipe", "interleaved", "zbv", "1f1b"}
    assert {lay.tp for lay in sample} >= {1, 2, 8} and any(lay.hierarchical for lay in sample)
    for i, lay in enumerate(sample):
        lay = dataclasses.replace(lay, recompute=L.RECOMPUTE[i % len(L.RECOMPUTE)])
        # every way of hiding the all-to-all the planner may pick for the layout (adaptive pipe overlap)
        for modes in E.overlap_choices(lay, hides=True):
            flags = train_overrides(lay, global_batch, spec, modes)
            tc = TrainConfig.from_sources(preset=preset, overrides=flags)
            assert tc.problem(devices) is None, (lay.label(), lay.schedule, modes, tc.problem(devices))
            assert (tc.pair_overlap, tc.a2a_chunks == 2) == (modes[0], modes[1] == "self")
        assert tc.tp * tc.pp * tc.ep * tc.dp == devices and tc.sequence_parallel == (lay.tp > 1)


def test_the_published_shapes_translate_and_what_train_cannot_run_is_named() -> None:
    spec = load_cluster("ascend-910b")
    pangu = L.Layout(tp=8, pp=16, ep=4, dp=12, vpp=2, schedule="interleaved", overlap=True, micro_batch=1)
    flags = train_overrides(pangu, 3072, spec)
    assert flags["num_virtual_stages_per_pipeline_rank"] == 2 and flags["sequence_parallel"]
    assert TrainConfig.from_sources(preset="pangu-ultra-moe", overrides=flags).problem(6144) is None
    command = train_command("pangu-ultra-moe", pangu, 3072, spec)
    assert command.startswith("fmoe train --preset pangu-ultra-moe --tp 8 --pp 16 --ep 4 --dp 12")
    assert "--num-virtual-stages-per-pipeline-rank 2" in command and "--sequence-parallel" in command
    selective = dataclasses.replace(pangu, recompute="moe+layernorm")  # several values: as the CLI takes them
    assert "--recompute-modules moe layernorm" in train_command("pangu-ultra-moe", selective, 3072, spec)
    with pytest.raises(PlanError, match="extending expert parallelism"):
        train_overrides(dataclasses.replace(pangu, tp_extends_ep=False), 3072, spec)
