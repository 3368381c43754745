"""Adaptive pipe overlap in the planner (issue 33): for each layout, the ways of hiding the MoE all-to-all
that the runtime can run (fmoe.overlap: cross-microbatch pairing, self-overlap in row chunks, none; in an
F&B pair and alone) are priced through the simulator and the fastest kept, and `fmoe train` gets it.

Oracles: each choice forced one at a time (the step the simulator gives it), and the simulator's cost
model against its formula written out; directions that must hold whatever the numbers (chunking that
costs nothing and hides more is taken alone, chunking that hides less is not)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe import schedule as S
from fmoe.plan import estimate as E
from fmoe.plan import layout as L
from fmoe.plan.specs import CLUSTER_PRESETS, ModelSpec, PlanError
from fmoe.schedule.ir import B, F, I, Op, W

H800 = CLUSTER_PRESETS["h800"]


def _model() -> ModelSpec:
    """A small DeepSeek-like MoE: 64 experts, top-8, a shared expert, a dense first layer, MTP."""
    return ModelSpec(name="m", layers=4, hidden=512, heads=8, head_dim=64, dense_layers=1, dense_ffn=1024,
                     routed_experts=64, shared_experts=1, top_k=8, expert_ffn=256, vocab=4096, seq=1024,
                     mtp=1)


LAYOUTS = {  # (layout, devices): flat and hierarchical, with F&B pairs and without
    "combined_1f1b-ep8": (L.Layout(1, 1, 8, 1, 1, "combined_1f1b", True, 1), 8),
    "dualpipev-ep4": (L.Layout(1, 2, 4, 1, 2, "dualpipev", True, 1), 8),
    "1f1b-ep4": (L.Layout(1, 2, 4, 1, 1, "1f1b", True, 1), 8),
    "dualpipev-ep16-hier": (L.Layout(1, 2, 16, 1, 2, "dualpipev", True, 1, hierarchical=True), 32),
}


def _predict(name: str, cluster, overlap=None) -> E.Prediction:
    lay, devices = LAYOUTS[name]
    return E.evaluate(E.Context(_model(), cluster, devices, 16 * lay.dp * lay.ep), lay, overlap=overlap)


def test_the_choices_are_the_runtimes() -> None:
    """Self-overlap only through the all-to-all dispatcher (the hierarchical one's rows take another
    route: fmoe.phases refuses it), pairing choices only where the schedule pairs, nothing to choose
    where nothing is hidden."""
    flat_pairs, flat_lone, hier_pairs = (LAYOUTS[k][0] for k in ("dualpipev-ep4", "1f1b-ep4",
                                                                  "dualpipev-ep16-hier"))
    assert E.overlap_choices(flat_pairs, True) == [("pair", "none"), ("pair", "self"), ("none", "none"),
                                                   ("self", "self")]
    assert E.overlap_choices(flat_lone, True) == [("pair", "none"), ("pair", "self")]
    assert E.overlap_choices(hier_pairs, True) == [("pair", "none"), ("none", "none")]
    assert E.overlap_choices(flat_pairs, False) == [E.DEFAULT_MODES]
    with pytest.raises(PlanError, match="overlap modes must be"):
        _predict("1f1b-ep4", H800, ("chunks", "none"))


clusters = st.builds(
    lambda inter_lat, intra_bw, half, pair, lone, whole, hides: H800.replace(
        inter_latency_s=inter_lat, intra_latency_s=inter_lat / 4, intra_bytes_per_s=intra_bw,
        gemm_half_dim=half, pair_hide=pair, lone_hide=lone, lone_hide_whole=whole, comm_hides=hides),
    st.floats(0.0, 2e-3), st.floats(1e9, 4e11), st.sampled_from([0, 256, 4096]), st.floats(0, 1),
    st.floats(0, 1), st.floats(0, 1), st.booleans())


@settings(max_examples=12, deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted(LAYOUTS)), cluster=clusters)
@example(name="dualpipev-ep4", cluster=H800)
@example(name="dualpipev-ep16-hier", cluster=H800)
@example(name="1f1b-ep4", cluster=H800.replace(comm_hides=False))
def test_the_planner_keeps_the_fastest_of_the_runtimes_choices(name: str, cluster) -> None:
    """The adaptive prediction is the fastest of the choices priced one at a time, and each choice prices
    what it names: chunks cost their self-overlap time, pairing hides in pairs."""
    got = _predict(name, cluster)
    lay = LAYOUTS[name][0]
    hides = cluster.comm_hides and got.times["a2a_per_layer"] > 0
    forced = {modes: _predict(name, cluster, modes) for modes in E.overlap_choices(lay, hides)}
    best = min(forced, key=lambda m: forced[m].step_s)
    assert got.step_s == forced[best].step_s and forced[got.overlap_modes].step_s == got.step_s
    for modes, pred in forced.items():
        c = pred.costs
        assert (c.self_f > 0) == (modes[1] == "self" and hides), modes
        assert c.pair_overlap == (modes[0] == "pair" and hides), modes
        assert c.unpaired_hide == (cluster.pair_self_hide if modes[0] == "self" and hides else None), modes


def _cheap_chunks(**kw: object):
    # links 10x H800's: an exchange shorter than the compute that can hide it (where it is longer, every
    # choice waits the whole exchange and the step is the same: the default stays)
    return H800.replace(inter_latency_s=0.0, intra_latency_s=0.0, comm_overhead_s=0.0, gemm_half_dim=0,
                        intra_bytes_per_s=10 * H800.intra_bytes_per_s,
                        inter_bytes_per_s=10 * H800.inter_bytes_per_s, **kw)


@pytest.mark.parametrize("name", ["1f1b-ep4", "dualpipev-ep4", "combined_1f1b-ep8"])
def test_chunks_that_cost_nothing_and_hide_more_are_taken_alone(name: str) -> None:
    """No latency, no call cost, GEMMs as efficient at any size: chunking costs nothing, so where it
    hides more than whole exchanges every lone op takes it, and where it hides no more none does."""
    more = _predict(name, _cheap_chunks(lone_hide=0.72, lone_hide_whole=0.48))
    assert more.overlap_modes[1] == "self", more.times
    assert more.step_s < more.times["step overlap pair/none"]
    assert _predict(name, _cheap_chunks(lone_hide=0.48, lone_hide_whole=0.48)).overlap_modes[1] == "none"


def test_chunks_whose_latency_outweighs_what_they_hide_are_not_taken() -> None:
    """10 ms per peer: a chunked layer's two extra exchanges cost more than the share of its two whole
    exchanges chunks would hide beyond whole ones, so the lone ops move their rows whole."""
    slow = H800.replace(inter_latency_s=1e-2, intra_latency_s=1e-2)
    pred = _predict("1f1b-ep4", slow)
    self_f, _ = E._self_overlap_s(E.Context(_model(), slow, 8, 64), LAYOUTS["1f1b-ep4"][0],
                                  E.block_cost(_model(), True))
    more_hidden = (slow.lone_hide - slow.lone_hide_whole) * 2 * pred.times["a2a_per_layer"]
    assert self_f > more_hidden and pred.overlap_modes == ("pair", "none")
    assert pred.step_s < pred.times["step overlap pair/self"]


@settings(max_examples=40, deadline=None)
@given(f=st.floats(1e-3, 10), i=st.floats(1e-3, 10), w=st.floats(0, 10), a2a=st.floats(0, 5),
       n=st.integers(1, 4), h=st.floats(0, 1), sf=st.floats(0, 3), sb=st.floats(0, 3), pairs=st.booleans(),
       hu=st.none() | st.floats(0, 1))
@example(f=1.0, i=1.0, w=1.0, a2a=0.0, n=1, h=0.5, sf=2.0, sb=2.0, pairs=False, hu=0.3)  # nothing to hide
def test_the_simulators_lone_and_pair_durations_written_out(f: float, i: float, w: float, a2a: float,
                                                           n: int, h: float, sf: float, sb: float,
                                                           pairs: bool, hu: float | None) -> None:
    c = S.Costs(f=f, i=i, w=w, a2a=a2a, moe_layers=n, lone_hide=h, self_f=sf, self_b=sb, pair_overlap=pairs,
                unpaired_hide=hu)
    x = 2 * a2a * n

    def lone(comp: float, extra: float, share: float = h) -> float:
        return comp if x == 0 else max(comp + n * extra, share * x) + (1 - share) * x

    assert c.lone(Op(F, 0, 0)) == pytest.approx(lone(f, sf))
    assert c.lone(Op(I, 0, 0)) == pytest.approx(lone(i, sb))
    assert c.lone(Op(B, 0, 0)) == pytest.approx(lone(i + w, sb))
    assert c.lone(Op(W, 0, 0)) == pytest.approx(w)
    pair = c.pair(Op(F, 0, 1), Op(B, 0, 0))
    if pairs:  # the paired ops move their rows whole: no self-overlap cost
        assert pair == pytest.approx(replace(c, self_f=0.0, self_b=0.0).pair(Op(F, 0, 1), Op(B, 0, 0)))
    else:  # each op runs lone, hiding the unpaired share where one is given
        share = h if hu is None else hu
        assert pair == pytest.approx(lone(f, sf, share) + lone(i + w, sb, share))


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev", "1f1b"])
def test_the_screening_estimate_counts_each_microbatch_once(schedule: str) -> None:
    """The closed form that screens layouts before the simulator gives each rank the work of the
    microbatches through its stages: DualPipe's two directions carry half of them each (counting all m in
    both once screened DualPipe out at twice its simulated step)."""
    lay = L.Layout(1, 4, 2, 1, 2 if schedule == "dualpipev" else 1, schedule, True, 1)
    ctx = E.Context(_model().replace(layers=8), H800, 8, 64)
    sim, closed = E.evaluate(ctx, lay), E.evaluate(ctx, lay, simulate=False)
    assert closed.times["busy_mean"] == pytest.approx(sim.times["busy_mean"], rel=0.1)
