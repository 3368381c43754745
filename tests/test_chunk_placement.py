"""One rule for the model chunks of a placement (`fmoe.schedule.stages.chunk_placement`): the pipeline's
cut (fmoe/pipeline/cut.py), the planner's estimate (fmoe/plan/estimate.py) and its layout rules
(fmoe/plan/layout.py) each wrote it out before (issue 31); here all three agree with it on every schedule.
"""

from __future__ import annotations

import pytest

from fmoe import schedule as S
from fmoe.config import GPTConfig, MoEConfig
from fmoe.flops import gpt_part_flops
from fmoe.pipeline.cut import cut_gpt
from fmoe.plan import estimate as E
from fmoe.plan import layout as L
from fmoe.plan.specs import CLUSTER_PRESETS, ModelSpec
from fmoe.schedule.registry import ALL_NAMES, CHUNKS
from fmoe.schedule.stages import chunk_placement

CASES = [(name, pp) for name in ALL_NAMES for pp in ((1,) if name == "combined_1f1b" else (2, 4))]


def _former(placement: S.Placement, pp: int) -> S.Placement:
    """The rule as the three places wrote it: DualPipe's two copies are one copy's loop."""
    return S.stages.loop(pp) if placement.kind == "bidirectional" else placement


def _schedule(name: str, pp: int) -> S.Schedule:
    return S.build(name, pp, 4 * pp, 2 if CHUNKS[name] is None else None)


@pytest.mark.parametrize("name, pp", CASES)
def test_the_former_rule_is_chunk_placement(name: str, pp: int) -> None:
    placement = _schedule(name, pp).placement
    chunks = chunk_placement(placement)
    assert chunks == _former(placement, pp)
    assert chunks.num_stages == len(set(placement.layer_chunk))  # one stage of the chunk placement a chunk
    if placement.kind == "bidirectional":
        assert chunks.kind == "loop" and chunks.num_stages == pp
    else:
        assert chunks is placement


@pytest.mark.parametrize("name, pp", CASES)
def test_the_pipeline_cut_follows_chunk_placement(name: str, pp: int) -> None:
    placement = _schedule(name, pp).placement
    chunks = chunk_placement(placement)
    moe = MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2)
    cfg = GPTConfig(vocab_size=32, d_model=16, n_layers=2 * chunks.num_stages, n_heads=2, moe=moe)
    cut = cut_gpt(cfg, placement)
    assert len(cut) == chunks.num_stages
    balanced = S.balance_layers_or_empty(chunks, *gpt_part_flops(cfg)).layers  # cut_gpt's rule and costs
    assert tuple(len(c.layers) for c in cut) == balanced


@pytest.mark.parametrize("name, pp", [c for c in CASES if c[0] != "gpipe"])
def test_the_planner_follows_chunk_placement(name: str, pp: int) -> None:
    s = _schedule(name, pp)
    chunks = chunk_placement(s.placement)
    model = ModelSpec(name="toy", layers=2 * chunks.num_stages, hidden=64, heads=4, kv_heads=4, head_dim=16,
                      vocab=256, seq=64, routed_experts=4, top_k=2, expert_ffn=64, dtype="fp32")
    cluster = CLUSTER_PRESETS["h100"]
    vpp = chunks.num_stages // pp  # the chunks per rank
    lay = L.Layout(tp=1, pp=pp, ep=1, dp=1, vpp=vpp, schedule=name, overlap=False, micro_batch=1)
    ctx = E.Context(model, cluster, pp, 4 * pp)
    got, layers, _ = E._chunks(ctx, lay, s)
    assert got == chunks and len(layers) == chunks.num_stages and sum(layers) == model.layers
    assert L.problem(model, cluster, pp, lay, 4 * pp) is None  # the layout rule places layers on the same
    if chunks.num_stages > 1:  # a chunk without a layer: refused by the same rule
        few = model.replace(layers=chunks.num_stages - 1)
        with pytest.raises(S.ScheduleError):
            S.place_layers(chunks, few.layers, min_layers=1)
        assert L.problem(few, cluster, pp, lay, 4 * pp) is not None
