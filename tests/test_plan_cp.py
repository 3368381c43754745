"""The planner's context parallelism (fmoe/plan: layout, estimate, train_flags): offered where the sequence
is long, priced as the runtime's ring runs (key / value blocks of seq / cp positions, N - 1 steps each way,
each behind one step's core or its backward), activation memory per rank falling as 1 / cp, and every cp
layout it may rank one `fmoe train` accepts."""

from __future__ import annotations

import dataclasses

import pytest

from fmoe.calibrate.models import load_model
from fmoe.plan import estimate as E
from fmoe.plan import layout as L
from fmoe.plan.specs import CLUSTER_PRESETS, PlanError, load_cluster
from fmoe.plan.train_flags import train_overrides
from fmoe.train.config import TrainConfig


def test_cp_is_offered_where_the_sequence_is_long() -> None:
    model = load_model("small")
    assert L.cp_sizes(model.replace(seq=4096), 16) == (1,)
    assert L.cp_sizes(model.replace(seq=32768), 16) == (1, 2, 4, 8)  # 16 would leave 2048 positions
    lays = {lay.cp for lay, why in L.candidates(model.replace(seq=32768), CLUSTER_PRESETS["h100"], 16, 64)
            if why is None}
    assert lays == {1, 2, 4, 8}
    with pytest.raises(PlanError, match="--cp sizes must divide --devices 16"):
        list(L.candidates(model, CLUSTER_PRESETS["h100"], 16, 64, cps=(3,)))


def test_the_runtime_s_refusals_are_the_planner_s_rules() -> None:
    model = load_model("small").replace(seq=32768)
    base = L.Layout(tp=2, pp=1, ep=1, dp=2, vpp=1, schedule="1f1b", overlap=False, micro_batch=1, cp=4)
    cluster = CLUSTER_PRESETS["h100"]
    assert L.problem(model, cluster, 16, base, 64) is None
    assert "cp 4 cuts a sequence into 8 equal chunks: seq 32772" in L.problem(
        model.replace(seq=32772), cluster, 16, base, 64)
    assert "does not recompute core_attn under context parallelism" in L.problem(
        model, cluster, 16, dataclasses.replace(base, recompute="moe+core_attn"), 64)
    ctx = E.Context(model, cluster, 16, 64, recompute=("none", "core_attn", "full"))
    tight = dataclasses.replace(ctx, cluster=dataclasses.replace(cluster, mem_gib=1.0))
    assert E.fastest_fitting(tight, base, simulate=False).layout.recompute == "full"  # core_attn skipped


def test_ring_traffic_and_its_overlap_with_the_attention_core() -> None:
    """The bytes a ring step moves, counted by hand from the runtime's tensors (k and v of the rank's
    positions and tp heads, fp32), and the exposed waits from the link model's transfer time."""
    model = load_model("small").replace(seq=32768)
    cluster = CLUSTER_PRESETS["h100"]
    lay = L.Layout(tp=2, pp=1, ep=1, dp=1, vpp=1, schedule="1f1b", overlap=False, micro_batch=2, cp=4)
    s = 32768 // 4
    assert E.ring_step_bytes(model, lay) == 2 * s * (2 * model.kv_heads * model.head_dim) // 2 * 4
    mla = load_model("deepseek-v3")
    width = mla.heads * (mla.head_dim + mla.qk_rope_dim + mla.v_head_dim)
    assert E.ring_step_bytes(mla, lay) == 2 * (mla.seq // 4) * width // 2 * 4
    ctx = E.Context(model, cluster, 8, 64)
    xfer = E._collective_s(cluster, E.ring_step_bytes(model, lay), True)
    long_core = 4 * 2 * xfer  # every step's block (1/4 of it) takes twice the transfer: hidden
    assert E.ring_s(ctx, lay, long_core) == (0.0, 0.0)
    short_core = 4 * 0.25 * xfer  # a quarter of the transfer hidden per forward step, half per backward
    assert E.ring_s(ctx, lay, short_core) == pytest.approx((3 * 0.75 * xfer, 3 * 0.5 * xfer))
    assert E.ring_s(ctx, dataclasses.replace(lay, cp=1), long_core) == (0.0, 0.0)


def test_activation_memory_per_rank_falls_as_one_over_cp() -> None:
    model = load_model("small").replace(seq=16384)
    ctx = E.Context(model, CLUSTER_PRESETS["h100"], 8, 8)
    acts = {}
    for cp in (1, 2, 4):
        lay = L.Layout(tp=1, pp=1, ep=1, dp=8 // cp, vpp=1, schedule="1f1b", overlap=False, micro_batch=1,
                       cp=cp)
        acts[cp] = E.evaluate(ctx, lay, simulate=False).memory["activations"]
    for cp in (2, 4):  # the ring's received key / value blocks add a little on top of 1 / cp
        assert acts[1] / cp <= acts[cp] <= 1.1 * acts[1] / cp, (cp, acts)


def test_cp_layouts_the_planner_may_rank_are_ones_fmoe_train_accepts() -> None:
    """DeepSeek-V3 (MLA) at a 32k sequence on 256 H800s: an evenly spread sample of the cp layouts the
    planner's rules pass, each with `fmoe train`'s own pre-launch check."""
    model, spec, devices, gb = load_model("deepseek-v3").replace(seq=32768), load_cluster("h800"), 256, 1024
    ok = [lay for lay, why in L.candidates(model, spec, devices, gb) if why is None]
    sample = ok[::max(1, len(ok) // 24)]
    assert {lay.cp for lay in sample} == {1, 2, 4, 8} and {lay.tp for lay in sample} >= {1, 8}
    for i, lay in enumerate(sample):
        lay = dataclasses.replace(lay, recompute=L.RECOMPUTE[i % len(L.RECOMPUTE)])
        flags = train_overrides(lay, gb, spec, seq_length=model.seq)
        tc = TrainConfig.from_sources(preset="deepseek-v3", overrides=flags)
        assert tc.problem(devices) is None, (lay.label(), lay.schedule, tc.problem(devices))
        assert (tc.cp, tc.cp_comm_type, tc.world_size) == (lay.cp, "p2p", devices)
