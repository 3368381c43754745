"""The `local` cluster's host-overhead calibration (fmoe/calibrate/machine.py): the executor's event
names are parsed into per-layer-kind forward times (checked against hand sums and against a real
executor step), and the fitted cluster predicts the calibration run it was fitted on (the planner's own
step time, an independent path from the fit's arithmetic).
"""

from __future__ import annotations

import tempfile
from unittest import mock

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fmoe.calibrate import machine as LC
from fmoe.calibrate.models import load_model
from fmoe.calibrate.samples import HostSample, sample_of
from fmoe.config import GPTConfig, MoEConfig
from fmoe.outline import outline
from fmoe.plan.estimate import Context, evaluate
from fmoe.plan.layout import Layout
from fmoe.plan.specs import LAYER_KINDS, ClusterSpec, PlanError
from fmoe.schedule.timeline import TraceEvent
from fmoe.train.config import TrainConfig


def _machine() -> ClusterSpec:
    """A machine with no host overhead (what measure_machine returns before fit_host), fast enough that
    the host times drawn below exceed the FLOP model's compute (as on this CPU)."""
    return ClusterSpec(name="local", devices_per_node=2, peak_flops={"fp32": 1e12}, mem_gib=8.0,
                       intra_bytes_per_s=3e9, inter_bytes_per_s=3e9, intra_latency_s=6e-5,
                       inter_latency_s=6e-5, gemm_eff=1.0, attn_eff=0.2, gemm_half_dim=90,
                       hbm_bytes_per_s=8e9, base_mem_gib=0.0)


def _calibration_layout() -> tuple[Context, Layout]:
    tc = LC.calibration_config()
    lay = Layout(tp=1, pp=1, ep=1, dp=tc.dp, vpp=1, schedule="1f1b", overlap=False,
                 micro_batch=tc.micro_batch_size)
    return Context(load_model("tiny"), _machine(), tc.world_size, tc.global_batch_size), lay


def _ev(name: str, cat: str, start: float, end: float, lane: str = "compute") -> TraceEvent:
    """An event as the executor records it, with its typed fields: "F mlp s0 L1 mb0" (compute) or
    "a2a dispatch-F s0 L1 mb0"."""
    kind, phase, stage, layer, mb = name.split()
    where = {"stage": int(stage[1:]), "microbatch": int(mb[2:]), "layer": layer}
    if kind == "a2a":
        phase, direction = phase.split("-")
        return TraceEvent(0, lane, name, cat, start, end, kind=kind, phase=phase, direction=direction,
                          **where)
    return TraceEvent(0, lane, name, cat, start, end, kind=kind, phase=phase, **where)


def test_sample_of_sums_phases_per_layer_and_kind() -> None:
    # two microbatches; L0 dense (first_dense 1), L1 and L2 MoE with two phases each
    events = []
    t = 0.0
    for mb in range(2):
        for name, d in ((f"F embed s0 embed mb{mb}", 1.0), (f"F dense s0 L0 mb{mb}", 4.0),
                        (f"F attention s0 L1 mb{mb}", 3.0), (f"F mlp s0 L1 mb{mb}", 2.0),
                        (f"F attention s0 L2 mb{mb}", 5.0), (f"F mlp s0 L2 mb{mb}", 4.0),
                        (f"F head s0 head mb{mb}", 2.0), (f"B stage s0 embed-head mb{mb}", 20.0),
                        (f"W stage s0 embed-head mb{mb}", 1.0)):
            events.append(_ev(name, name[0], t, t + d))
            t += d
    events.append(_ev("a2a dispatch-F s0 L1 mb0", "a2a", 0.5, 60.0, lane="comm"))  # not a compute event
    three = GPTConfig(vocab_size=8, d_model=8, n_layers=3, n_heads=2, num_dense_layers=1,
                      moe=MoEConfig(d_model=8, d_ff=8, num_experts=2, top_k=1))
    sample = sample_of([100.0], [events], outline(three), microbatches=2, peak_gib=0.5)
    assert sample.f_s == {"embed": 1.0, "dense": 4.0, "moe": 7.0, "head": 2.0}  # MoE: (5 + 9) / 2 layers
    assert (sample.b_s, sample.w_s) == (20.0, 1.0)
    assert sample.span_s == pytest.approx(t) and sample.wall_s == 100.0


def test_sample_of_reads_a_real_executor_step() -> None:
    """The names the executor gives its events are the ones sample_of parses: every layer kind of the
    tiny preset shows up, and the per-microbatch times add up to the events' own total."""
    from fmoe.train.launch import _world
    from fmoe.train.loop import Trainer

    tc = TrainConfig.from_sources("tiny", None, {**LC.CALIBRATION_RUN, "dp": 1, "global_batch_size": 8})
    trainer = Trainer(tc, _world(tc, 0, f"file://{tempfile.mktemp()}", 0, 1), timeline=True)
    try:
        wall = trainer.step()["step_s"]
        events = trainer.last_result.events
    finally:
        torch.distributed.destroy_process_group()
    sample = sample_of([wall], [events], outline(trainer.cfg), tc.microbatches, 0.0)
    assert set(sample.f_s) == set(LAYER_KINDS)
    m, dense = tc.microbatches, tc.first_k_dense
    f_total = sum(e.end - e.start for e in events if e.cat == "F" and e.lane == "compute")
    counted = m * (sample.f_s["embed"] + sample.f_s["head"] + dense * sample.f_s["dense"]
                   + (tc.num_layers - dense) * sample.f_s["moe"])
    assert counted == pytest.approx(f_total, rel=1e-9)
    assert sample.b_s > 0 and sample.span_s <= wall


def _stage_sums(f: dict[str, float], layers: int, dense: int) -> float:
    return f["embed"] + f["head"] + dense * f["dense"] + (layers - dense) * f["moe"]


@given(f=st.fixed_dictionaries({k: st.floats(5e-4, 5e-3) for k in LAYER_KINDS}),
       ratio=st.floats(0.5, 3.0), per_stage=st.floats(0.0, 5e-3), w_share=st.floats(0.0, 0.5),
       gap=st.floats(0.0, 2e-3), outside=st.floats(0.0, 0.05), i_ratio=st.floats(0.5, 3.0),
       w_ratio=st.floats(0.0, 2.0))
@example(f={k: 1e-3 for k in LAYER_KINDS}, ratio=1.0, per_stage=0.0, w_share=0.0, gap=0.0, outside=0.0,
         i_ratio=1.0, w_ratio=0.0)
def test_fit_host_recovers_a_host_model(f: dict[str, float], ratio: float, per_stage: float,
                                        w_share: float, gap: float, outside: float, i_ratio: float,
                                        w_ratio: float) -> None:
    """Calibration runs generated from known host costs (a machine so fast that compute is nothing):
    under 1f1b, B = ratio x the stage's forward + per_stage and a W event of w_share x the forward, with
    `gap` between events per microbatch; under zb_h1, I = i_ratio x the forward + per_stage and W =
    w_ratio x the forward. The fit recovers them, predicts the full 1f1b run it was fitted on, and
    predicts the short run (a model it did not see whole) from them."""
    ctx, lay = _calibration_layout()
    fast = _machine().replace(peak_flops={"fp32": 1e18})
    ctx = Context(ctx.model, fast, ctx.devices, ctx.global_batch)
    model, m = ctx.model, LC.CALIBRATION_MICROBATCHES

    def run(layers: int) -> HostSample:
        fs = _stage_sums(f, layers, model.dense_layers)
        b, w = ratio * fs + per_stage, w_share * fs
        span = m * (fs + b + w + gap)
        return HostSample(span + outside, span, f, b, w, 0.5)

    full, short = run(model.layers), run(LC.SHORT_LAYERS)
    fs = _stage_sums(f, model.layers, model.dense_layers)
    split = HostSample(0.0, 0.0, f, 0.0, w_ratio * fs, 0.5, i_ratio * fs + per_stage)
    fitted = LC.fit_host(fast, full, short, split)
    # 1f1b's W event is part of its backward
    assert fitted.b_overhead_ratio == pytest.approx(ratio + w_share, rel=1e-6, abs=1e-6)
    assert fitted.i_overhead_ratio == pytest.approx(i_ratio, rel=1e-6, abs=1e-6)
    assert fitted.w_overhead_ratio == pytest.approx(w_ratio, rel=1e-6, abs=1e-6)
    assert fitted.stage_overhead_s == pytest.approx(per_stage + gap, rel=1e-6, abs=1e-8)
    assert fitted.layer_overhead_s == pytest.approx(f, rel=1e-6)
    pred = evaluate(Context(model, fitted, ctx.devices, ctx.global_batch), lay)
    assert pred.times["pipeline"] == pytest.approx(full.span_s, rel=1e-6)
    # the optimizer's memory traffic and the gradient reduce are modelled apart: the fit adds only the
    # outside time beyond them
    bare = evaluate(ctx, lay)
    assert pred.step_s == pytest.approx(full.span_s + max(outside, bare.step_s - bare.times["pipeline"]),
                                        rel=1e-6)
    short_model = model.replace(layers=LC.SHORT_LAYERS)
    pred_short = evaluate(Context(short_model, fitted, ctx.devices, ctx.global_batch), lay)
    assert pred_short.times["pipeline"] == pytest.approx(short.span_s, rel=1e-6)


@pytest.mark.parametrize("change, field", [
    ({"layer_overhead_s": {"mlp": 1e-3}}, "layer_overhead_s"), ({"layer_overhead_s": {"moe": -1.0}}, "moe"),
    ({"step_overhead_s": -1e-3}, "step_overhead_s"),
    ({"i_overhead_ratio": float("nan")}, "i_overhead_ratio"),
    ({"token_overhead_s": {"moe": float("inf")}}, "token_overhead_s"),
    ({"token_overhead_s": [1e-6]}, "token_overhead_s"), ({"p2p_overhead_s": -1e-6}, "p2p_overhead_s")])
def test_bad_overhead_fields(change: dict, field: str) -> None:
    with pytest.raises(PlanError, match=field):
        _machine().replace(**change)


def _first_cut(real_cut):
    """The planner's `_cut`, returning for each (layout, placement) the cut of its first call."""
    seen: dict = {}

    def cut(ctx, lay, chunks):
        return seen.setdefault((lay, chunks), real_cut(ctx, lay, chunks))

    return cut


@given(step_oh=st.floats(0.0, 1e-2), extra=st.floats(1e-6, 1e-2), kind=st.sampled_from(LAYER_KINDS),
       per_token=st.floats(0.0, 1e-5), micro_batch=st.sampled_from([1, 2, 4, 8, 16]))
@example(step_oh=0.0, extra=1e-6, kind="moe", per_token=0.0, micro_batch=1)
@example(step_oh=0.0, extra=6.103515625e-05, kind="embed", per_token=3.0716575418984036e-06, micro_batch=4)
def test_more_host_overhead_never_speeds_a_layout(step_oh: float, extra: float, kind: str,
                                                  per_token: float, micro_batch: int) -> None:
    """On one layer cut: the runtime's cut (`balance_layers_or_empty`) follows the costs, and where two
    cuts even the ranks alike more overhead may tip it to one the simulator finds faster (the second
    example: interleaved, (1, 1, 1, 1) -> (0, 2, 2, 0), 6% faster on either machine; BENCHMARKS.md), so
    both machines are priced on the base machine's cut."""
    import fmoe.plan.estimate as estimate

    ctx, _ = _calibration_layout()
    base = _machine().replace(step_overhead_s=step_oh, layer_overhead_s={k: 1e-3 for k in LAYER_KINDS},
                              token_overhead_s={k: per_token for k in LAYER_KINDS})
    more = base.replace(layer_overhead_s={**base.layer_overhead_s, kind: 1e-3 + extra},
                        token_overhead_s={**base.token_overhead_s, kind: per_token + extra / 64},
                        step_overhead_s=step_oh + extra)
    for sched, pp, v in (("1f1b", 2, 1), ("zb_h1", 2, 1), ("interleaved", 2, 2), ("dualpipev", 2, 2)):
        if sched == "dualpipev" and 32 // micro_batch < 4:
            continue  # dualpipev needs 2 x pp microbatches
        lay = Layout(tp=1, pp=pp, ep=1, dp=1, vpp=v, schedule=sched, overlap=False, micro_batch=micro_batch)
        with mock.patch.object(estimate, "_cut", _first_cut(estimate._cut)):
            t0 = evaluate(Context(ctx.model, base, 2, 32), lay).step_s
            t1 = evaluate(Context(ctx.model, more, 2, 32), lay).step_s
        assert t1 >= t0 * (1 - 1e-9), (sched, kind)


def _dense_samples(ctx: Context, f: dict[str, float]) -> tuple[HostSample, ...]:
    """The full, short and split data-parallel calibration samples of a host where every layer's forward
    takes f[kind], its B twice that, its split I and W 1.5 and 0.5 times."""
    fs = _stage_sums(f, ctx.model.layers, ctx.model.dense_layers)
    m = LC.CALIBRATION_MICROBATCHES
    full = HostSample(m * 3 * fs + 0.01, m * 3 * fs, f, 2 * fs, 0.0, 0.5)
    short_fs = _stage_sums(f, LC.SHORT_LAYERS, ctx.model.dense_layers)
    short = HostSample(m * 3 * short_fs, m * 3 * short_fs, f, 2 * short_fs, 0.0, 0.5)
    split = HostSample(0.0, 0.0, f, 0.0, 0.5 * fs, 0.5, 1.5 * fs)
    return full, short, split


@given(slower=st.floats(1.0, 3.0))
@example(slower=1.0)
def test_fit_host_prices_the_expert_parallel_run(slower: float) -> None:
    """An expert-parallel calibration run `slower` x what the planner predicts from the data-parallel
    runs alone: the fitted "moe_ep" overhead makes the planner predict that run's span, and moves no
    layout without expert parallelism."""
    ctx, lay = _calibration_layout()
    f = {k: 1e-3 for k in LAYER_KINDS}
    full, short, split = _dense_samples(ctx, f)
    dense_only = LC.fit_host(_machine(), full, short, split)
    tc = LC.calibration_config(ep=True)
    ep_lay = Layout(tp=1, pp=1, ep=tc.ep, dp=1, vpp=1, schedule="1f1b", overlap=False,
                    micro_batch=tc.micro_batch_size)
    ep_ctx = Context(ctx.model, dense_only, tc.world_size, tc.global_batch_size)
    span = slower * evaluate(ep_ctx, ep_lay).times["pipeline"]
    fitted = LC.fit_host(_machine(), full, short, split, HostSample(span, span, f, 0.0, 0.0, 0.5))
    got = evaluate(Context(ctx.model, fitted, tc.world_size, tc.global_batch_size), ep_lay)
    assert got.times["pipeline"] == pytest.approx(span, rel=1e-6)
    assert fitted.overhead_s("moe", True) >= dense_only.overhead_s("moe", True) * (1 - 1e-9)
    no_ep = [evaluate(Context(ctx.model, c, ctx.devices, ctx.global_batch), lay).step_s
             for c in (fitted, dense_only)]
    assert no_ep[0] == pytest.approx(no_ep[1])


@given(fixed=st.floats(1e-4, 2e-2), per_token=st.floats(0.0, 2e-5))
@example(fixed=1e-4, per_token=0.0)
@example(fixed=2e-2, per_token=2e-5)
def test_fit_host_splits_the_expert_parallel_layer_per_token(fixed: float, per_token: float) -> None:
    """Expert-parallel calibration runs at the preset's microbatch and at LARGE_MICRO_BATCH whose spans
    come from a known "moe_ep" host cost (`fixed` + T x `per_token`): the fit recovers both parts and so
    predicts an expert-parallel run at a microbatch size neither used."""
    ctx, _ = _calibration_layout()
    f = {k: 1e-3 for k in LAYER_KINDS}
    dense_only = LC.fit_host(_machine(), *_dense_samples(ctx, f))
    truth = dense_only.replace(layer_overhead_s={**dense_only.layer_overhead_s, "moe_ep": fixed},
                               token_overhead_s={**dense_only.token_overhead_s, "moe_ep": per_token})

    def span(cluster: ClusterSpec, micro_batch: int | None) -> float:
        tc = LC.calibration_config(ep=True, micro_batch=micro_batch)
        ep_lay = Layout(tp=1, pp=1, ep=tc.ep, dp=1, vpp=1, schedule="1f1b", overlap=False,
                        micro_batch=tc.micro_batch_size)
        return evaluate(Context(ctx.model, cluster, tc.world_size, tc.global_batch_size), ep_lay).times[
            "pipeline"]

    def sample(micro_batch: int | None) -> HostSample:
        t = span(truth, micro_batch)
        return HostSample(t, t, f, 0.0, 0.0, 0.5)

    fitted = LC.fit_host(_machine(), *_dense_samples(ctx, f), expert=sample(None),
                         expert_large=sample(LC.LARGE_MICRO_BATCH))
    assert fitted.layer_overhead_s["moe_ep"] == pytest.approx(fixed, rel=1e-6, abs=1e-9)
    assert fitted.token_overhead_s["moe_ep"] == pytest.approx(per_token, rel=1e-6, abs=1e-12)
    assert span(fitted, 8) == pytest.approx(span(truth, 8), rel=1e-6)


@given(b_ratio=st.floats(0.0, 3.0), i_ratio=st.floats(0.0, 3.0), w_ratio=st.floats(0.0, 1.0))
def test_b_and_split_backwards_are_priced_apart(b_ratio: float, i_ratio: float, w_ratio: float) -> None:
    """1f1b runs every backward as one B, zb_h1's last stage as I then W (its first stage's W follow their I
    and run with it as one B, fmoe.schedule.fuse_adjacent_iw): the I and W ratios never move 1f1b, and
    move zb_h1 the way they go; b_overhead_ratio moves 1f1b the way it goes."""
    ctx, _ = _calibration_layout()
    base = _machine().replace(layer_overhead_s={k: 1e-3 for k in LAYER_KINDS}, b_overhead_ratio=1.0,
                              i_overhead_ratio=1.0, w_overhead_ratio=0.2)

    def step(c: ClusterSpec, sched: str) -> float:
        lay = Layout(tp=1, pp=2, ep=1, dp=1, vpp=1, schedule=sched, overlap=False, micro_batch=4)
        return evaluate(Context(ctx.model, c, 2, 32), lay).step_s

    b_moved = base.replace(b_overhead_ratio=b_ratio)
    split_moved = base.replace(i_overhead_ratio=i_ratio, w_overhead_ratio=w_ratio)
    assert step(split_moved, "1f1b") == pytest.approx(step(base, "1f1b"), rel=1e-12)
    if i_ratio >= 1.0 and w_ratio >= 0.2:
        assert step(split_moved, "zb_h1") >= step(base, "zb_h1") * (1 - 1e-12)
    if i_ratio <= 1.0 and w_ratio <= 0.2:
        assert step(split_moved, "zb_h1") <= step(base, "zb_h1") * (1 + 1e-12)
    if abs(b_ratio - 1.0) > 1e-6:  # a dearer B makes 1f1b slower, a cheaper one faster
        assert (step(b_moved, "1f1b") > step(base, "1f1b")) == (b_ratio > 1.0)


@given(fixed=st.fixed_dictionaries({k: st.floats(2e-4, 3e-3) for k in LAYER_KINDS}),
       per_token=st.fixed_dictionaries({k: st.floats(0.0, 3e-6) for k in LAYER_KINDS}),
       ratio=st.floats(0.5, 3.0), per_stage=st.floats(0.0, 3e-3), probe=st.sampled_from([2, 8]),
       steeper=st.fixed_dictionaries({k: st.floats(0.0, 0.9) for k in LAYER_KINDS}))
@example(fixed={k: 1e-3 for k in LAYER_KINDS}, per_token={k: 0.0 for k in LAYER_KINDS}, ratio=1.0,
         per_stage=0.0, probe=8, steeper={k: 0.0 for k in LAYER_KINDS})
@example(fixed={k: 1e-3 for k in LAYER_KINDS}, per_token={k: 1e-6 for k in LAYER_KINDS}, ratio=1.0,
         per_stage=0.0, probe=2, steeper={k: 0.9 for k in LAYER_KINDS})
def test_fit_host_splits_host_time_per_token(fixed: dict[str, float], per_token: dict[str, float],
                                             ratio: float, per_stage: float, probe: int,
                                             steeper: dict[str, float]) -> None:
    """Calibration runs generated from host costs piecewise linear in the microbatch's tokens T (a forward
    of kind k costs fixed[k] + T x per_token[k] from the preset's T0 tokens up, and below T0 falls by
    below[k] = per_token[k] + steeper[k] x fixed[k] / T0 per token short of it; B = ratio x the stage's
    forward + per_stage; compute is nothing): with the runs at LARGE_MICRO_BATCH and SMALL_MICRO_BATCH the
    fit recovers every part, and the planner predicts the span of a run at a microbatch size no
    calibration run used (`probe` sequences: 2 is below the knee, 8 above)."""
    ctx, lay = _calibration_layout()
    fast = _machine().replace(peak_flops={"fp32": 1e18})
    model, m = ctx.model, LC.CALIBRATION_MICROBATCHES
    t0 = lay.micro_batch * model.seq
    below = {k: per_token[k] + steeper[k] * fixed[k] / t0 for k in LAYER_KINDS}

    def run(layers: int, micro_batch: int) -> HostSample:
        T = micro_batch * model.seq
        f = {k: fixed[k] + max(T, t0) * per_token[k] - max(0, t0 - T) * below[k] for k in LAYER_KINDS}
        fs = _stage_sums(f, layers, model.dense_layers)
        b = ratio * fs + per_stage
        return HostSample(m * (fs + b), m * (fs + b), f, b, 0.0, 0.5)

    mbs = lay.micro_batch
    full, short = run(model.layers, mbs), run(LC.SHORT_LAYERS, mbs)
    large = run(model.layers, LC.LARGE_MICRO_BATCH)
    f0 = full.f_s
    split = HostSample(0.0, 0.0, f0, 0.0, 0.2 * _stage_sums(f0, model.layers, model.dense_layers), 0.5,
                          _stage_sums(f0, model.layers, model.dense_layers))
    fitted = LC.fit_host(fast, full, short, split, large=large, small=run(model.layers, LC.SMALL_MICRO_BATCH))
    assert fitted.layer_overhead_s == pytest.approx(fixed, rel=1e-6, abs=1e-12)
    assert fitted.token_overhead_s == pytest.approx(per_token, rel=1e-6, abs=1e-12)  # compute: ~1e-11 s
    assert fitted.small_token_overhead_s == pytest.approx(below, rel=1e-6, abs=1e-12)
    assert fitted.token_knee == t0
    tc = LC.calibration_config(micro_batch=probe)
    probe_lay = Layout(tp=1, pp=1, ep=1, dp=tc.dp, vpp=1, schedule="1f1b", overlap=False, micro_batch=probe)
    got = evaluate(Context(model, fitted, tc.world_size, tc.global_batch_size), probe_lay)
    assert got.times["pipeline"] == pytest.approx(run(model.layers, probe).span_s, rel=1e-6)
    # without the large run all of the host time counts as fixed; without the small one there is no knee
    flat = LC.fit_host(fast, full, short, split)
    assert flat.token_overhead_s == {k: 0.0 for k in LAYER_KINDS}
    assert (flat.small_token_overhead_s, flat.token_knee) == ({}, 0.0)


def test_remote_neighbours_follow_the_placement() -> None:
    """The messages a stage sends and receives per microbatch each way: one per neighbour on another rank
    (the turn of a V hands over in memory)."""
    from fmoe import schedule as S
    from fmoe.plan.estimate import _remote_neighbours

    want = {"1f1b": (1, 1), "interleaved": (1, 2, 2, 1), "dualpipev": (1, 1, 1, 1), "zbv": (1, 1, 1, 1)}
    for name, counts in want.items():
        s = S.build(name, 2, 8)
        assert tuple(_remote_neighbours(s, st) for st in range(len(counts))) == counts, name


@given(h=st.floats(1e-6, 1e-2))
@example(h=1e-6)
def test_message_cost_is_charged_per_remote_neighbour(h: float) -> None:
    """p2p_overhead_s adds h to each stage's forward and backward per remote neighbour: pp 1 is unmoved,
    a pipeline never gets faster, and interleaved (two neighbours for its middle stages) grows more than
    1f1b."""
    ctx, lay = _calibration_layout()
    base = _machine().replace(layer_overhead_s={k: 1e-3 for k in LAYER_KINDS})
    more = base.replace(p2p_overhead_s=h)

    def step(c: ClusterSpec, layout: Layout) -> float:
        return evaluate(Context(ctx.model, c, 2, 32), layout).step_s

    assert step(more, lay) == pytest.approx(step(base, lay))  # the calibration layout: pp 1, no messages
    grown = {}
    for sched, v in (("1f1b", 1), ("interleaved", 2)):
        pp2 = Layout(tp=1, pp=2, ep=1, dp=1, vpp=v, schedule=sched, overlap=False, micro_batch=4)
        grown[sched] = step(more, pp2) - step(base, pp2)
        assert grown[sched] > 0
    assert grown["interleaved"] > grown["1f1b"]


@given(h=st.floats(0.0, 2e-3))
@example(h=0.0)
def test_fit_host_prices_a_pipeline_message_from_the_pipelined_run(h: float) -> None:
    """A pipelined calibration run as slow as the planner predicts with a message cost of h: the fit finds h
    back, from the run's span alone; pp 1 layouts are unmoved, and a run faster than the planner predicts
    without messages gives no negative cost. On a 2-core machine (the pipelined run needs an even count)."""
    with mock.patch.object(LC.os, "cpu_count", return_value=2):
        _check_message_fit(h)


def _check_message_fit(h: float) -> None:
    ctx, lay = _calibration_layout()
    f = {k: 1e-3 for k in LAYER_KINDS}
    full, short, split = _dense_samples(ctx, f)
    base = LC.fit_host(_machine(), full, short, split)
    tc = LC.calibration_config(None, LC.PIPELINE_SCHEDULE, pp=LC.PIPELINE_STAGES,
                               microbatches=LC.PIPELINE_MICROBATCHES)
    pp_lay = Layout(tp=1, pp=tc.pp, ep=1, dp=tc.dp, vpp=2, schedule=LC.PIPELINE_SCHEDULE, overlap=tc.overlap,
                    micro_batch=tc.micro_batch_size)
    pp_ctx = Context(ctx.model, base.replace(p2p_overhead_s=h), tc.world_size, tc.global_batch_size)
    span = evaluate(pp_ctx, pp_lay).times["pipeline"]
    fitted = LC.fit_host(_machine(), full, short, split, pipeline=HostSample(span, span, f, 0.0, 0.0, 0.5))
    assert fitted.p2p_overhead_s == pytest.approx(h, rel=1e-6, abs=1e-12)
    assert evaluate(Context(ctx.model, fitted, ctx.devices, ctx.global_batch), lay).step_s == pytest.approx(
        evaluate(Context(ctx.model, base, ctx.devices, ctx.global_batch), lay).step_s)
    fast = LC.fit_host(_machine(), full, short, split, pipeline=HostSample(0.5 * span, 0.5 * span, f, 0.0,
                                                                                0.0, 0.5))
    assert fast.p2p_overhead_s == 0.0


def test_calibration_config_refuses_stages_that_do_not_divide_the_cores() -> None:
    import os

    with pytest.raises(ValueError, match="does not divide"):
        LC.calibration_config(pp=(os.cpu_count() or 1) + 1)


@given(a2a_s=st.floats(1e-5, 5e-3), schedule=st.sampled_from(["combined_1f1b", "1f1b"]))
@example(a2a_s=5e-3, schedule="combined_1f1b")
def test_a_cluster_whose_exchanges_do_not_progress_gains_nothing_from_overlap(a2a_s: float,
                                                                              schedule: str) -> None:
    """comm_hides=False (the local cluster): fb overlap hides no all-to-all, so an expert-parallel layout
    with overlap takes as long as without it; with comm_hides it is never slower than that."""
    model = load_model("tiny")
    base = _machine().replace(layer_overhead_s={k: 1e-3 for k in LAYER_KINDS}, comm_overhead_s=a2a_s)
    steps = {}
    for hides in (True, False):
        for overlap in (True, False):
            lay = Layout(tp=1, pp=1, ep=2, dp=1, vpp=1, schedule=schedule, overlap=overlap, micro_batch=4)
            ctx = Context(model, base.replace(comm_hides=hides), 2, 32)
            steps[hides, overlap] = evaluate(ctx, lay).step_s
    assert steps[False, True] == pytest.approx(steps[False, False])
    assert steps[True, True] <= steps[True, False] * (1 + 1e-9)
    assert steps[True, False] == pytest.approx(steps[False, False])
    with pytest.raises(PlanError, match="comm_hides must be a bool"):
        base.replace(comm_hides=1)
