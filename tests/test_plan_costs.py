"""The planner's cost terms for the published runs (issue 33): FP8 GEMMs, selective recompute by the
runtime's parts, node-limited routing, an all-to-all latency per peer, the measured hidden shares of fb
overlap, and `fmoe plan --published`. Properties on small models (closed-form estimates only: fast)."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe.cli import plan as cli
from fmoe.plan import estimate as E
from fmoe.plan import layout as L
from fmoe.plan.specs import CLUSTER_PRESETS, FP8_GROUPS, MODEL_PRESETS, PUBLISHED, ModelSpec

H800 = CLUSTER_PRESETS["h800"]


def _model(**kw: object) -> ModelSpec:
    """A small DeepSeek-like MoE (MLA, shared expert, dense first layer): 64 experts, top-8."""
    base = dict(name="m", layers=4, hidden=512, heads=8, head_dim=64, qk_rope_dim=32, v_head_dim=64,
                q_lora_rank=128, kv_lora_rank=64, dense_layers=1, dense_ffn=1024, routed_experts=64,
                shared_experts=1, top_k=8, expert_ffn=256, vocab=4096, seq=1024, mtp=1)
    base.update(kw)
    return ModelSpec(**base)  # type: ignore[arg-type]


def _lay(ep: int, tp: int = 1, hier: bool = False, **kw: object) -> L.Layout:
    return L.Layout(tp=tp, pp=1, ep=ep, dp=1, vpp=1, schedule="1f1b", overlap=False, micro_batch=1,
                    hierarchical=hier, **kw)  # type: ignore[arg-type]


@settings(max_examples=30, deadline=None)
@given(lat=st.floats(1e-7, 1e-3), nbytes=st.floats(0, 1e9), p=st.integers(0, 512), more=st.integers(1, 512))
def test_more_peers_never_make_an_exchange_cheaper(lat: float, nbytes: float, p: int, more: int) -> None:
    c = H800.replace(inter_latency_s=lat, intra_latency_s=lat / 3)
    for intra in (True, False):
        assert E._exchange_s(c, intra, p + more, nbytes, 1.2) >= E._exchange_s(c, intra, p, nbytes, 1.2)


@settings(max_examples=10, deadline=None)
@given(hier=st.booleans(), limit=st.integers(0, 8))
def test_a_bigger_expert_group_never_makes_the_all_to_all_cheaper(hier: bool, limit: int) -> None:
    m = _model(max_nodes_per_token=limit)
    times = []
    for ep in (2, 4, 8, 16, 32, 64):
        ctx = E.Context(m, H800, ep, 64)
        times.append(E._a2a_s(ctx, _lay(ep, hier=hier and ep > 8))[0])
    assert times == sorted(times)


@settings(max_examples=20, deadline=None)
@given(nodes=st.sampled_from([1, 2, 4, 8, 16]), limit=st.integers(0, 16))
def test_more_nodes_touched_never_cheaper_and_the_limit_never_adds_bytes(nodes: int, limit: int) -> None:
    m = _model(routed_experts=128, max_nodes_per_token=limit)
    free = m.replace(max_nodes_per_token=0)
    # expected nodes touched grows with the nodes the group spans, and the cap only lowers it
    assert E._nodes_touched(m, nodes) <= E._nodes_touched(free, nodes) + 1e-12
    if nodes > 1:
        assert E._nodes_touched(free, nodes // 2) <= E._nodes_touched(free, nodes)
    P = 8 * nodes
    ctx, ctx_free = E.Context(m, H800, P, 64), E.Context(free, H800, P, 64)
    for hier in (True, False):
        t, nb = E._a2a_s(ctx, _lay(P, hier=hier))
        t_free, nb_free = E._a2a_s(ctx_free, _lay(P, hier=hier))
        assert nb["inter"] <= nb_free["inter"] + 1e-6 and t <= t_free + 1e-12
    if limit and nodes > 1:  # a looser cap touches more nodes: never cheaper
        looser = E.Context(m.replace(max_nodes_per_token=limit + 1), H800, P, 64)
        assert E._a2a_s(looser, _lay(P, hier=True))[0] >= E._a2a_s(ctx, _lay(P, hier=True))[0]


@settings(max_examples=12, deadline=None)
@given(ep=st.sampled_from([1, 2, 8]), tp=st.sampled_from([1, 2]), groups=st.sets(st.sampled_from(FP8_GROUPS)),
       fp8_peak=st.sampled_from([0.0, 1979e12]))
def test_fp8_never_slows_a_layout(ep: int, tp: int, groups: set[str], fp8_peak: float) -> None:
    c = H800.replace(fp8_flops=fp8_peak)
    off = E.Context(_model(), c, ep * tp, 64)
    on = replace(off, model=off.model.replace(fp8_gemms=tuple(groups)))
    lay = _lay(ep, tp)
    p_off, p_on = E.fastest_fitting(off, lay, simulate=False), E.fastest_fitting(on, lay, simulate=False)
    assert p_on.step_s <= p_off.step_s * (1 + 1e-12)
    assert p_on.mem_gib <= p_off.mem_gib + 1e-9  # FP8 inputs kept for the backward: never more memory
    if not fp8_peak:  # no FP8 on the device: the GEMMs run at the bf16 peak, the same time
        f_on, f_off = (E.evaluate(x, lay, False).times["f_chunk_max"] for x in (on, off))
        assert f_on == f_off


def test_selective_recompute_costs_between_none_and_full() -> None:
    ctx = E.Context(_model(), H800, 8, 64)
    ladder = L.recompute_ladder(ctx.model)
    assert ladder[0] == "none" and ladder[1] == "adaptive" and ladder[-1] == "full"
    assert all(L.recompute_parts(rc) is not None for rc in ladder)
    lay = _lay(8)
    preds = [E.evaluate(ctx, replace(lay, recompute=rc), simulate=False) for rc in ladder]
    extra = [p.times["recompute_per_layer"] for p in preds]
    mem = [p.memory["activations"] for p in preds]
    assert extra[0] == 0.0 and all(0 <= x <= extra[-1] for x in extra)
    assert extra == sorted(extra)  # each rung adds a part: more recompute, less memory
    # (full keeps the head and its MTP block whole, as the runtime does, while the parts recompute the MTP
    # block's too: on this toy model full may hold a little more than the heaviest set of parts)
    assert mem[:-1] == sorted(mem[:-1], reverse=True) and mem[-1] < mem[0]
    # a part the runtime does not have is refused by the rules
    assert L.recompute_parts("mla_up") is None and L.recompute_parts("moe+core_attn") == ("moe", "core_attn")
    why = L.problem(ctx.model, ctx.cluster, 8, replace(lay, recompute="norm"), 64)
    assert why is not None and "recompute must be" in why


def test_hidden_shares_are_cluster_inputs() -> None:
    ctx = E.Context(_model(), H800, 8, 64)
    lay = replace(_lay(8), overlap=True, schedule="combined_1f1b")
    full = E.evaluate(replace(ctx, cluster=H800.replace(pair_hide=1.0, lone_hide=0.5)), lay, False)
    part = E.evaluate(replace(ctx, cluster=H800.replace(pair_hide=0.5, lone_hide=0.25)), lay, False)
    assert part.step_s >= full.step_s


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_published_applies_its_table() -> None:
    for name, pub in PUBLISHED.items():
        ctx = cli.context(_args("--model", name, "--published"))
        assert ctx.model.fp8_gemms == tuple(pub.fp8_gemms)
        assert ctx.model.max_nodes_per_token == pub.max_nodes_per_token
        assert (ctx.model.seq, ctx.global_batch, ctx.devices) == (pub.seq, pub.global_batch, pub.devices)
        assert ctx.cluster.name == pub.cluster and ctx.recompute == (pub.recompute or None)
        assert L.problem(ctx.model, ctx.cluster, ctx.devices, cli._layout(
            ctx, {**cli.Q.parse_label(pub.layout), "schedule": pub.schedule}), ctx.global_batch) is None
    ds = cli.context(_args("--model", "deepseek-v3", "--published"))
    assert ds.model.fp8_gemms == FP8_GROUPS and "FP8 all linear" in cli._precision(ds)
    # explicit flags win; FP8 on a device without it is said
    ctx = cli.context(_args("--model", "deepseek-v3", "--published", "--cluster", "ascend-910b",
                            "--global-batch", "64"))
    assert ctx.global_batch == 64 and "has no FP8" in cli._precision(ctx)
    assert MODEL_PRESETS["deepseek-v3"].fp8_gemms == ()  # the preset itself stays bf16


@pytest.mark.parametrize("name", [
    "deepseek-v3",
    pytest.param("pangu-ultra-moe", marks=pytest.mark.xfail(strict=True, reason=(
        "with stages even (MTP alone, the loss beside one layer: 5.9% per chunk, as Pangu placed them) the "
        "planner predicts 1.77M tokens/s, +21%; its 1.48M (+1%) came from a last chunk 1.51x the mean "
        "stage. What else it misses on the 910B is not measurable here: docs/plan.md"))),
])
def test_the_published_layouts_are_predicted_within_15_percent_of_their_published_rate(name: str) -> None:
    """Issue 33's figure: under the published constraints each published layout's predicted tokens/s is
    within 15% of what was published (DeepSeek-V3 3.16M on 2,048 H800, Pangu about 1.46M on 6,144 910B).
    docs/plan.md gives their ranks and the measured reasons for them; Pangu's miss is an open gap (strict:
    the test says so when it closes)."""
    pub = PUBLISHED[name]
    ctx = cli.context(_args("--model", name, "--published"))
    lay = cli._layout(ctx, {**cli.Q.parse_label(pub.layout), "schedule": pub.schedule})
    pred = E.fastest_fitting(ctx, lay)
    assert pred.fits, (name, pred.reason)
    assert abs(pred.tokens_per_s / pub.tokens_per_s - 1) <= 0.15, (name, pred.tokens_per_s)
