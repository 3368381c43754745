"""The planner (fmoe/plan, `fmoe plan`) against independent oracles: parameter counts of the real model
(`fmoe.init_gpt`) and of the published configs, GEMM FLOPs counted by torch's FlopCounterMode on
`fmoe.gpt_loss`, memory and makespans from `fmoe.schedule.simulate`, the schedule generators' own
microbatch rules; monotonicity properties of small requests; clear errors; the CLI end to end; one big
request.

Legend: pp pipeline ranks, m microbatches per rank, v chunks per rank, S stages, T tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, note, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

import fmoe
import fmoe.schedule as S
from fmoe import _compat
from fmoe.calibrate.models import load_model
from fmoe.cli.main import main
from fmoe.plan import estimate as E
from fmoe.plan import layout as L
from fmoe.plan import search as Q
from fmoe.plan.layer_costs import LayerCost, block_cost, embed_cost, head_cost, totals
from fmoe.plan.memory import peak_bytes
from fmoe.plan.specs import (
    CLUSTER_PRESETS,
    DTYPE_BYTES,
    ClusterSpec,
    ModelSpec,
    PlanError,
    load_cluster,
)
from fmoe.schedule.registry import ALL_NAMES, NAMES, chunks_per_rank
from fmoe.train.config import TrainConfig

GIB = 2**30


# ---- helpers ------------------------------------------------------------------------------------------


def toy_model(experts: int = 8, top_k: int = 2, layers: int = 4, hidden: int = 64, seq: int = 64,
              expert_ffn: int = 64, dense_layers: int = 1, shared: int = 1, kv_heads: int = 4,
              dtype: str = "fp32") -> ModelSpec:
    """A small GQA MoE ModelSpec (4 heads of 16, vocabulary 256)."""
    return ModelSpec(name="toy", layers=layers, hidden=hidden, heads=4, kv_heads=kv_heads, head_dim=16,
                     vocab=256, seq=seq, routed_experts=experts, top_k=top_k, expert_ffn=expert_ffn,
                     dense_layers=dense_layers, shared_experts=shared, dtype=dtype)


def toy_cluster(mem_gib: float = 1.0, devices_per_node: int = 4, **changes: Any) -> ClusterSpec:
    """A small cluster of `devices_per_node`-device nodes, nothing held before the model (base 0 GiB)."""
    return ClusterSpec(name="toy", devices_per_node=devices_per_node, peak_flops={"fp32": 2e13, "bf16": 8e13},
                       mem_gib=mem_gib, intra_bytes_per_s=100e9, inter_bytes_per_s=12.5e9,
                       intra_latency_s=5e-6, inter_latency_s=15e-6, comm_overhead_s=5e-6, op_overhead_s=2e-6,
                       hbm_bytes_per_s=1e12, base_mem_gib=0.0).replace(**changes)


@dataclass(frozen=True)
class Request:
    """A planning request on `toy_cluster(mem_gib)`."""

    model: ModelSpec
    devices: int
    global_batch: int
    mem_gib: float

    def context(self, mem_gib: float | None = None, **cluster: Any) -> E.Context:
        """The planner's Context, optionally with another device memory or cluster fields."""
        return E.Context(self.model, toy_cluster(self.mem_gib if mem_gib is None else mem_gib, **cluster),
                         self.devices, self.global_batch)


SEARCH = {"micro_batches": (1, 2), "vpps": (2,)}  # few candidates: a few hundred per request


def valid_layouts(req: Request) -> list[L.Layout]:
    """The candidates of `req` that break no rule (recompute "none")."""
    ctx = req.context()
    cands = L.candidates(ctx.model, ctx.cluster, ctx.devices, ctx.global_batch, **SEARCH)
    return [lay for lay, why_not in cands if why_not is None]


@st.composite
def requests(draw: st.DrawFn) -> Request:
    """Small requests: 8 or 16 experts, 2-6 layers, 4 or 8 devices on 4-device nodes, 1/1024-1/8 GiB."""
    experts = draw(st.sampled_from((8, 16)))
    layers = draw(st.integers(2, 6))
    model = toy_model(experts=experts, top_k=draw(st.integers(1, experts)), layers=layers,
                      hidden=draw(st.sampled_from((64, 128))), seq=draw(st.sampled_from((32, 64))),
                      expert_ffn=draw(st.sampled_from((32, 64, 128))), dense_layers=draw(st.integers(0, 1)),
                      shared=draw(st.integers(0, 1)), kv_heads=draw(st.sampled_from((1, 2, 4))),
                      dtype=draw(st.sampled_from(("fp32", "bf16"))))
    return Request(model, draw(st.sampled_from((4, 8))), draw(st.sampled_from((8, 16, 32))),
                   2.0 ** draw(st.integers(-10, -3)))


# the edge cases every property below also runs
ONE_EXPERT_PER_RANK = Request(toy_model(experts=8), 8, 16, 2**-8)  # ep 8 = 8 experts (and ep 4 x tp 2)
TOP_K_ALL = Request(toy_model(experts=8, top_k=8), 8, 16, 2**-8)  # every token to every expert
ONE_MICROBATCH = Request(toy_model(), 8, 8, 2**-8)  # pp 1, micro batch 1 x 8 data ranks = global batch
ODD_PP = Request(toy_model(layers=3, dense_layers=0), 12, 24, 2**-8)  # 3 nodes: pp 3
EDGES = (ONE_EXPERT_PER_RANK, TOP_K_ALL, ONE_MICROBATCH, ODD_PP)


def with_edges(**others: Any) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Returns a decorator adding every request of EDGES as an @example (`others`: the other arguments)."""

    def add(test: Callable[..., None]) -> Callable[..., None]:
        for req in reversed(EDGES):
            test = example(req=req, **others)(test)
        return test

    return add


def gemm_flops(m: ModelSpec, parts: Callable[[LayerCost], float]) -> float:
    """Sum over the whole model (per token) of `parts` of each layer's LayerCost."""
    return (parts(block_cost(m, False)) * m.dense_layers + parts(block_cost(m, True)) * m.moe_layers
            + parts(embed_cost(m)) + parts(head_cost(m)))


def _gemm(c: LayerCost) -> float:
    return c.dense_flops + c.expert_flops


def _count(tree: Any) -> int:
    return sum(x.numel() for x in tree_leaves(tree))


# ---- 1. parameter counts ------------------------------------------------------------------------------


@pytest.mark.parametrize("preset, mtp", [("tiny", False), ("small", False), ("small", True)])
def test_params_match_the_real_model(preset: str, mtp: bool) -> None:
    cfg = TrainConfig.from_sources(preset=preset).model()
    spec = load_model(preset)
    if mtp:  # the MTP module: two norms, the 2h -> h projection, one MoE block, its norm
        cfg, spec = dataclasses.replace(cfg, mtp=True), spec.replace(mtp=1)
    params = fmoe.init_gpt(cfg, torch.Generator().manual_seed(0))
    assert totals(spec).params == _count(params)
    # active: the routed experts count at K / E, everything else fully
    experts = sum(_count(p["moe"]["experts"]) for p in params["layers"][cfg.num_dense_layers:])
    experts += _count(params["mtp"]["block"]["moe"]["experts"]) if mtp else 0
    want_active = _count(params) - experts * (1 - cfg.moe.top_k / cfg.moe.num_experts)
    assert totals(spec).active_params == pytest.approx(want_active, abs=1)


@pytest.mark.parametrize("name, total, active", [
    ("deepseek-v3", 671e9, 37e9),  # main model; the MTP module adds ~14B on top (published separately)
    ("pangu-ultra-moe", 718e9, None),  # the preset's comment: DeepSeek-V3's MLA sizes assumed
    ("mixtral-8x7b", 46.7e9, 12.9e9),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),
])
def test_params_match_the_published_totals(name: str, total: float, active: float | None) -> None:
    m = load_model(name).replace(mtp=0)
    assert totals(m).params == pytest.approx(total, rel=0.025)
    if active is not None:
        assert totals(m).active_params == pytest.approx(active, rel=0.025)
    if name == "deepseek-v3":  # MTP: one more MoE block and the 2h -> h projection; the published 14B
        extra = totals(load_model(name)).params - totals(m).params  # also counts its own copy of the
        assert 10e9 < extra < 14e9  # embedding and head (2 x 0.93B), which fmoe shares with the main model


# ---- 2. forward FLOPs against torch's flop counter ----------------------------------------------------


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of x [N, K] @ w [E, K, F] grouped by rows: each row meets one group, 2 N K F."""
    (n, k), f = a_shape, b_shape[-1]
    return 2 * n * k * f


@pytest.mark.parametrize("preset, mtp, backend", [
    ("tiny", False, "loop"), ("tiny", False, "grouped_mm"), ("small", True, "loop")])
def test_forward_gemm_flops_match_the_flop_counter(preset: str, mtp: bool, backend: str) -> None:
    # The attention core is left out: the planner counts it causally (s / 2 keys on average), torch's
    # counter would count sdpa at s x s (on CPU it counts nothing for it). FlopCounterMode has no formula
    # for aten._grouped_mm: the "grouped_mm" case gives it one (2 N K F), the "loop" case runs one mm
    # per expert. Dropless top-k routes exactly K rows per token, so the counts match exactly.
    tc = TrainConfig.from_sources(preset=preset)
    cfg = tc.model()
    cfg = dataclasses.replace(cfg, mtp=mtp, moe=cfg.moe.replace(backend=backend))
    spec = load_model(preset).replace(mtp=int(mtp))
    B, seq = 1, 64
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, seq), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, seq), generator=g)
    params = fmoe.init_gpt(cfg, torch.Generator().manual_seed(0))
    with torch.no_grad():  # once uncounted: the backend probe runs a tiny _grouped_mm on first use
        fmoe.gpt_loss(params, ids, targets, cfg)
    with torch.no_grad(), FlopCounterMode(display=False,
                                          custom_mapping={_compat.grouped_mm_op(): _grouped_mm_flops}) as fc:
        fmoe.gpt_loss(params, ids, targets, cfg)
    counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    # The combine's gate-weighted sum of the K expert outputs is a multiply and a sum (no bmm): every
    # counted FLOP is a GEMM the planner counts.
    assert set(counts) <= {"aten.mm", "aten.addmm", "aten._grouped_mm"}, counts
    gemms = sum(counts.values())
    if backend == "grouped_mm":
        assert counts.get("aten._grouped_mm", 0) > 0  # the experts really ran as grouped GEMMs
    main_model = gemm_flops(spec.replace(mtp=0), _gemm)
    mtp_part = gemm_flops(spec, _gemm) - main_model  # the MTP module sees all seq positions (Megatron's)
    assert gemms == main_model * B * seq + mtp_part * B * seq


# ---- 3. activation memory against the simulator --------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_peak_bytes_match_the_simulator(name: str) -> None:
    rng = random.Random(name)
    checked = 0
    for pp in (2, 3, 4):
        for m in (1, 2, 3, 4, 6, 8, 9, 12):
            for v in ((2, 3) if name.startswith("interleaved") else (None,)):  # only they take a v
                try:
                    s = S.build(name, pp, m, v)
                except S.ScheduleError:
                    continue  # (pp, m, v) this generator does not accept: not an input
                n = s.placement.num_stages
                for act, wgrad in ((1.0, 0.0), (1.0, 0.4), (3.5, 1.25), (1.0, 1.5)):
                    # the peak depends on each rank's order alone: any positive times give it
                    times = {k: tuple(rng.uniform(0.2, 2.0) for _ in range(n)) for k in "fiw"}
                    rep = S.simulate(s, S.Costs(**times, act_mem=act, wgrad_mem=wgrad))
                    got = peak_bytes(s, (act,) * n, (wgrad,) * n)
                    assert got == pytest.approx(rep.peak_memory, rel=1e-12), (pp, m, v, act, wgrad)
                    checked += 1
    assert checked >= 8


# ---- 4. the microbatch rule --------------------------------------------------------------------------


def _accepts(name: str, pp: int, m: int, v: int | None) -> bool:
    try:
        S.build(name, pp, m, v)
    except S.ScheduleError:
        return False
    return True


@pytest.mark.parametrize("name", ALL_NAMES)
def test_rule_microbatches_keeps_acceptance(name: str) -> None:
    accepted = 0
    for pp in range(1, 6):
        for v in ((2, 4) if name.startswith("interleaved") else (None,)):  # only they take a v
            for m in range(1, 61):
                r = L.rule_microbatches(m, pp)
                assert 1 <= r <= 6 * pp and (r - m) % (2 * pp) == 0 and (r == m or r >= 4 * pp)
                ok = _accepts(name, pp, m, v)
                assert ok == _accepts(name, pp, r, v), (pp, v, m, r)
                accepted += ok
    assert accepted > 0


# ---- 5. the simulator's linear extrapolation beyond SIM_CAP x pp microbatches ---------------------------


def _random_costs(n: int, rng: random.Random, a2a: float) -> S.Costs:
    f = tuple(rng.uniform(0.5, 1.5) for _ in range(n))
    return S.Costs(f=f, i=tuple(x * rng.uniform(0.9, 1.3) for x in f),
                   w=tuple(x * rng.uniform(0.5, 1.0) for x in f), p2p=0.05, a2a=a2a, moe_layers=2,
                   attn_frac=0.4, lone_hide=0.5)


EXTRAPOLATED = ("1f1b", "zb_h1", "interleaved", "dualpipev", "interleaved+extra", "dualpipe")


@pytest.mark.parametrize("name, pp", [(n, pp) for n in EXTRAPOLATED for pp in (2, 3, 4)
                                      if not (n == "dualpipe" and pp % 2)])  # DualPipe: pp even
def test_extrapolated_makespan_matches_the_full_simulation(name: str, pp: int) -> None:
    rng = random.Random(f"{name}-{pp}")
    v = chunks_per_rank(name)  # the interleaved ones at their default 2, the others their own count
    first = E.SIM_CAP * pp + pp + 1  # the first m _simulated extrapolates
    ms = [m for m in range(first, 41) if _accepts(name, pp, m, v)]  # the m this generator accepts
    assert len(ms) >= 3
    checked = 0
    for m in sorted({ms[0], ms[1], ms[len(ms) // 2], ms[-1]}):
        full = L.executed_schedule(name, pp, m, v)  # what the executor runs, as the planner simulates
        lay = L.Layout(tp=1, pp=pp, ep=2, dp=1, vpp=v, schedule=name, overlap=True, micro_batch=1)
        # the planner's own per-stage costs for this layout (embedding and head make the ends uneven) ...
        # 24 layers: a multiple of 2pp for every pp here (DualPipeV's layer rule)
        ctx = E.Context(toy_model(layers=24), toy_cluster(devices_per_node=8), 2 * pp, 2 * m)
        assert L.problem(ctx.model, ctx.cluster, ctx.devices, lay, ctx.global_batch) is None
        planner = E.evaluate(ctx, lay).costs
        assert planner is not None
        # ... and random uneven ones, with and without all-to-all
        n = full.placement.num_stages
        for costs in (planner, _random_costs(n, rng, 0.0), _random_costs(n, rng, 0.1)):
            makespan, busy, _, _ = E._simulated(lay, m, costs)
            rep = S.simulate(full, costs)
            assert makespan == pytest.approx(rep.makespan, rel=0.01), (m, costs)
            assert sum(busy) == pytest.approx(sum(rep.busy), rel=0.01), m
            checked += 1
    assert checked >= 3


# ---- 6. properties of small requests ------------------------------------------------------------------


def test_edge_requests_reach_their_edges() -> None:
    # the @example requests below really contain the layouts they are named after
    lays = valid_layouts(ONE_EXPERT_PER_RANK)
    assert any(lay.ep == 8 for lay in lays) and any(lay.expert_group == 8 and lay.tp == 2 for lay in lays)
    assert valid_layouts(TOP_K_ALL) and TOP_K_ALL.model.top_k == TOP_K_ALL.model.routed_experts
    assert any(lay.pp == 1 and lay.microbatches(ONE_MICROBATCH.global_batch) == 1
               for lay in valid_layouts(ONE_MICROBATCH))
    assert any(lay.pp == 3 for lay in valid_layouts(ODD_PP))
    # the default memory lets some layouts fit and not others (the memory properties have work to do)
    fits = [E.fastest_fitting(ONE_EXPERT_PER_RANK.context(), lay, simulate=False).fits for lay in lays]
    assert any(fits) and not all(fits)


def _fitting(req: Request, mem_gib: float) -> dict[L.Layout, str]:
    """Layout (recompute "none") -> the recompute the planner picks, of every layout that fits in mem_gib."""
    ctx = req.context(mem_gib)
    out = {}
    for lay in valid_layouts(req):
        pred = E.fastest_fitting(ctx, lay, simulate=False)
        if pred.fits:
            out[lay] = pred.layout.recompute
    return out


@settings(max_examples=6, deadline=None)
@given(req=requests())
@with_edges()
def test_more_memory_never_removes_a_layout(req: Request) -> None:
    small, big = _fitting(req, req.mem_gib), _fitting(req, 2 * req.mem_gib)
    note(f"{len(small)} fit in {req.mem_gib} GiB, {len(big)} in twice that")
    assert set(small) <= set(big)
    # and never needs heavier recompute (the ladder the search climbs, selective parts included)
    ladder = L.recompute_ladder(req.context(req.mem_gib).model)
    for lay, rc in small.items():
        assert ladder.index(big[lay]) <= ladder.index(rc), lay


@settings(max_examples=8, deadline=None)
@given(req=requests(), factor=st.floats(1.0, 16.0),
       picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=5))
@with_edges(factor=4.0, picks=[0, 7, 13, 101, 997])
def test_faster_links_never_slow_a_layout(req: Request, factor: float, picks: list[int]) -> None:
    lays = valid_layouts(req)
    c = toy_cluster()
    slow = req.context()
    fast = req.context(intra_bytes_per_s=c.intra_bytes_per_s * factor,
                       inter_bytes_per_s=c.inter_bytes_per_s * factor,
                       intra_latency_s=c.intra_latency_s / factor, inter_latency_s=c.inter_latency_s / factor)
    for k in picks:
        lay = lays[k % len(lays)]
        t_slow, t_fast = E.evaluate(slow, lay).step_s, E.evaluate(fast, lay).step_s
        assert t_fast <= t_slow * (1 + 1e-9), (lay, t_fast, t_slow)


@settings(max_examples=10, deadline=None)
@given(layers=st.integers(4, 6), pp=st.sampled_from((2, 3, 4)), dp=st.sampled_from((1, 2)),
       ms=st.sets(st.integers(1, 40), min_size=2, max_size=5), overlap=st.booleans())
@example(layers=4, pp=2, dp=1, ms={1, 2, 10, 11, 40}, overlap=True)  # across the extrapolation threshold
@example(layers=6, pp=3, dp=2, ms={1, 3, 15, 16}, overlap=False)
@example(layers=4, pp=3, dp=2, ms={3, 4}, overlap=False)  # the step's share rose here; the pipeline's not
def test_more_microbatches_never_raise_the_1f1b_bubble(layers: int, pp: int, dp: int, ms: set[int],
                                                        overlap: bool) -> None:
    model = toy_model(layers=layers, dense_layers=1)
    lay = L.Layout(tp=1, pp=pp, ep=1, dp=dp, vpp=1, schedule="1f1b", overlap=overlap, micro_batch=1)
    cluster = toy_cluster(devices_per_node=8)
    bubbles, fractions = [], []
    for m in sorted(ms):
        ctx = E.Context(model, cluster, pp * dp, m * dp)
        assert L.problem(model, cluster, ctx.devices, lay, ctx.global_batch) is None
        pred = E.evaluate(ctx, lay)
        assert pred.microbatches == m and pred.costs is not None
        # the pipeline's idle share: the step's (pred.bubble) also divides by the exposed DP reduce, a
        # constant that lets the share of a longer pipeline come out higher (a 4-layer cut 2+1+1, dp 2)
        bubbles.append(pred.times["bubble"] / pred.times["pipeline"])
        # the simulator itself, every rank's idle share, without P2P latency: with it the 1F1B steady
        # state alternates between two step lengths (odd m can idle a rank for longer; see the report)
        fractions.append(S.simulate(S.build("1f1b", pp, m), replace(pred.costs, p2p=0.0)).bubble_fraction)
    note(f"bubbles {bubbles}")
    for a, b in zip(bubbles, bubbles[1:]):
        assert b <= a + 1e-12
    for a, b in zip(fractions, fractions[1:]):
        assert all(y <= x + 1e-12 for x, y in zip(a, b))


@settings(max_examples=6, deadline=None)
@given(req=requests())
@with_edges()
def test_a_fitting_layout_fits_the_device(req: Request) -> None:
    ctx = req.context()
    try:
        result = Q.plan(ctx, simulate_top=8, **SEARCH)
    except PlanError:  # then truly nothing fits, even with full recompute
        assert not any(E.fastest_fitting(ctx, lay, simulate=False).fits for lay in valid_layouts(req))
        return
    assert result.best and all(p.fits and p.simulated for p in result.best)
    w_bytes = 4 if req.model.dtype == "fp32" else DTYPE_BYTES[req.model.dtype] + 4  # + fp32 master weights
    for p in result.best:
        assert p.mem_gib <= ctx.cluster.mem_gib
        assert sum(p.memory.values()) == pytest.approx(p.mem_gib)
        lay = p.layout
        # the fullest rank holds at least the mean share of weights and fp32 gradients of a rank
        share = totals(req.model).params * (w_bytes + 4) / (lay.tp * lay.ep * lay.pp)
        assert p.mem_gib * GIB >= share * 0.999, lay
    assert [p.step_s for p in result.best] == sorted(p.step_s for p in result.best)


# ---- 7. clear errors and the CLI ----------------------------------------------------------------------


def test_devices_not_a_multiple_of_a_node() -> None:
    with pytest.raises(PlanError, match="--devices 12 is not a multiple of the 8 devices"):
        list(L.candidates(toy_model(), CLUSTER_PRESETS["h100"], 12, 32))


def test_experts_fewer_than_ep() -> None:
    model, cluster = toy_model(experts=4, top_k=2), toy_cluster(devices_per_node=8)
    lay = L.Layout(tp=1, pp=1, ep=8, dp=1, vpp=1, schedule="1f1b", overlap=False, micro_batch=1)
    why_not = L.problem(model, cluster, 8, lay, 32)
    assert why_not is not None and "experts" in why_not
    assert all(lay.ep <= 4 for lay, p in L.candidates(model, cluster, 8, 32) if p is None)


@pytest.mark.parametrize("change, field", [
    ({"top_k": 9}, "top_k"), ({"kv_heads": 3}, "kv_heads"), ({"dtype": "int8"}, "dtype"),
    ({"layers": 0}, "layers"), ({"dense_layers": 5}, "dense_layers"), ({"hidden": 2.5}, "hidden")])
def test_bad_model_fields(change: dict[str, Any], field: str) -> None:
    with pytest.raises(PlanError, match=field):
        toy_model().replace(**change)


@pytest.mark.parametrize("change, field", [
    ({"gemm_eff": 1.5}, "gemm_eff"), ({"mem_gib": 0}, "mem_gib"), ({"peak_flops": {}}, "peak_flops"),
    ({"devices_per_node": 0}, "devices_per_node"), ({"inter_latency_s": -1e-6}, "inter_latency_s")])
def test_bad_cluster_fields(change: dict[str, Any], field: str) -> None:
    with pytest.raises(PlanError, match=field):
        toy_cluster(**change)


def _toml(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return str(path)


def test_bad_specs_from_files(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="no preset or file 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(PlanError, match="unknown field.*bogus"):
        load_model(_toml(tmp_path, "m1", "layers = 2\nbogus = 3\n"))
    with pytest.raises(PlanError, match="unknown field.*bogus"):  # also on top of a preset
        load_model(_toml(tmp_path, "m2", 'base = "tiny"\nbogus = 3\n'))
    with pytest.raises(PlanError, match="top_k"):
        load_model(_toml(tmp_path, "m3", 'base = "tiny"\ntop_k = 99\n'))
    with pytest.raises(PlanError, match="missing"):
        load_model(_toml(tmp_path, "m4", "layers = 2\n"))
    with pytest.raises(PlanError, match="unknown field.*mem_gb"):
        load_cluster(_toml(tmp_path, "c1", 'base = "h100"\nmem_gb = 3\n'))
    assert load_cluster(_toml(tmp_path, "c2", 'base = "h100"\nmem_gib = 40\n')).mem_gib == 40


def test_a_cluster_file_may_build_on_this_machines_calibration(tmp_path: Path) -> None:
    """`base = "local"` resolves as `--cluster local` does: through the file the caller names for it (the
    machine's calibration; here a stand-in), not as a path called "local"."""
    local = _toml(tmp_path, "local-cluster", 'base = "h100"\nmem_gib = 12\n')
    mine = _toml(tmp_path, "mine", 'base = "local"\ndevices_per_node = 2\n')
    files = {"local": lambda: local}
    spec = load_cluster(mine, files=files)
    assert spec.mem_gib == 12 and spec.devices_per_node == 2
    assert load_cluster("local", files=files).mem_gib == 12
    with pytest.raises(PlanError, match="local"):  # without the caller's file: an error naming it
        load_cluster(mine)


def _plan_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv", [
    ["--model", "tiny", "--cluster", "h100", "--devices", "12", "--global-batch", "32"],
    ["--model", "no-such-model", "--cluster", "h100", "--devices", "8"],
    ["--model", "BAD_TOML", "--cluster", "h100", "--devices", "8"],
])
def test_cli_errors_are_one_line(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [_toml(tmp_path, "bad", 'base = "tiny"\nbogus = 1\n') if a == "BAD_TOML" else a for a in argv]
    rc, out, err = _plan_cli(argv, capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fmoe plan: error: ")


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = _toml(tmp_path, "my-h100", 'base = "h100"\n')
    common = ["--model", "tiny", "--cluster", cluster, "--devices", "8", "--global-batch", "32", "--top", "3"]
    rc, out, _ = _plan_cli([*common, "--json", "--timeline", ""], capsys)
    assert rc == 0
    rows = json.loads(out)
    assert isinstance(rows, list) and len(rows) == 3
    for row in rows:
        assert {"tp", "pp", "ep", "vpp", "dp", "schedule", "overlap", "step_s", "mfu", "mem_gib"} <= set(row)
        assert row["fits"] and row["mem_gib"] <= 80 and 0 < row["mfu"] < 1
        assert row["tp"] * row["pp"] * row["ep"] * row["dp"] == 8
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    png = tmp_path / "best.png"
    rc, out, _ = _plan_cli([*common, "--timeline", str(png)], capsys)
    assert rc == 0
    assert "on 8 x my-h100" in out
    assert any(line.startswith("why: ") for line in out.splitlines())
    train = [line for line in out.splitlines() if line.startswith("train it: ")]
    assert len(train) == 1 and train[0].startswith("train it: fmoe train --preset tiny ")  # a training preset
    assert "--global-batch-size" not in train[0]  # the preset's own 32: only flags that differ are given
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_why_names_what_tells_two_layouts_apart() -> None:
    """Two candidates that differ only in fb overlap: the line says which has it, and a step-time
    difference under Q.TIE is a tie, not a win."""
    ctx = E.Context(toy_model(), toy_cluster(mem_gib=80.0), 2, 32)
    on, off = (E.evaluate(ctx, L.Layout(tp=1, pp=2, ep=1, dp=1, vpp=2, schedule="dualpipev", overlap=ov,
                                        micro_batch=4)) for ov in (True, False))
    line = Q.why(on, off)
    assert "dualpipev with fb overlap" in line and "dualpipev without fb overlap" in line
    tie = dataclasses.replace(off, step_s=on.step_s * (1 + Q.TIE / 2))
    assert " ties with " in Q.why(on, tie) and " beats " not in Q.why(on, tie)
    far = dataclasses.replace(off, step_s=on.step_s * (1 + 4 * Q.TIE))
    assert " beats " in Q.why(on, far)


# ---- 8. a big request ---------------------------------------------------------------------------------


def test_big_request_is_sane_and_fast() -> None:
    # DeepSeek-V3 on 256 H800 at global batch 512, shrunk to 31 of its 61 layers (the full depth also
    # searches pp 32, whose memory walk takes the planner ~25 s on two shared cores)
    model = load_model("deepseek-v3").replace(layers=31)
    ctx = E.Context(model, load_cluster("h800"), 256, 512)
    t0 = time.perf_counter()
    result = Q.plan(ctx, micro_batches=(1,), vpps=(2,), simulate_top=8)
    seconds = time.perf_counter() - t0
    assert len(result.best) >= 2
    assert all(p.simulated and p.fits for p in result.best)
    best = result.best[0]
    assert 0.05 < best.mfu < 0.8
    assert best.mem_gib <= 80 and best.layout.world == 256
    assert best.tokens_per_s == pytest.approx(512 * model.seq / best.step_s)
    assert seconds < 60  # generous: a loaded two-core machine


@pytest.mark.parametrize("layers, pp", [(9, 2), (6, 2), (12, 3), (2, 2)])
def test_the_planner_applies_dualpipevs_layer_rule_as_fmoe_train_does(layers: int, pp: int) -> None:
    """A layout `fmoe plan` may rank is one `fmoe train` accepts: DualPipeV needs layers >= 2pp and a
    multiple of 2pp (fmoe.schedule.registry.check_layers, the rule `build(..., layers=)` applies)."""
    from fmoe.train.config import TrainConfig

    lay = L.Layout(tp=1, pp=pp, ep=1, dp=1, vpp=2, schedule="dualpipev", overlap=True, micro_batch=1)
    why = L.problem(toy_model(layers=layers), toy_cluster(devices_per_node=8), pp, lay, 8 * pp)
    train = TrainConfig(pp=pp, ep=1, schedule="dualpipev", num_layers=layers, global_batch_size=8 * pp,
                        micro_batch_size=1).problem()
    ok = layers >= 2 * pp and layers % (2 * pp) == 0
    assert (why is None) == ok == (train is None), (why, train)
    if not ok:
        assert "2*pp" in why and "2*pp" in train


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(["1f1b", "interleaved", "interleaved+extra", "zb_h1", "zbv", "dualpipev", "dualpipe"]),
       st.sampled_from([2, 3, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.integers(2, 12),
       st.sampled_from([8, 16, 24, 32]), st.sampled_from([1, 2, 4]), st.sampled_from([2, 3]))
@example("dualpipev", 2, 1, 1, 6, 16, 1, 2)  # layers not a multiple of 2pp: both refuse
@example("dualpipe", 3, 1, 1, 6, 16, 1, 2)  # DualPipe needs pp even: both refuse
@example("interleaved", 4, 2, 2, 8, 8, 1, 2)  # too few microbatches for the interleaving: both refuse
def test_a_tp1_layout_the_planner_accepts_is_one_fmoe_train_accepts(schedule: str, pp: int, ep: int, dp: int,
                                                                      layers: int, gb: int, mb: int,
                                                                      v: int) -> None:
    """The planner's layout rules are the runtime's (issue 32): for tensor-parallel size 1, `fmoe plan`'s
    `problem` and `fmoe train`'s config check accept exactly the same layouts of the tiny preset
    (schedule, its chunks per rank, microbatches, layers)."""
    from fmoe.calibrate.models import train_preset_model
    from fmoe.schedule.registry import CHUNKS
    from fmoe.train.config import TrainConfig

    vpp = v if CHUNKS[schedule] is None else CHUNKS[schedule]
    model = train_preset_model("tiny").replace(layers=layers)
    lay = L.Layout(tp=1, pp=pp, ep=ep, dp=dp, vpp=vpp, schedule=schedule, overlap=True, micro_batch=mb)
    world = pp * ep * dp  # one node of that many devices, as `fmoe train` on one machine
    plan = L.problem(model, toy_cluster(devices_per_node=world), world, lay, gb)
    kw = {"num_virtual_stages_per_pipeline_rank": vpp} if CHUNKS[schedule] is None else {}
    train = TrainConfig(pp=pp, ep=ep, dp=dp, schedule=schedule, num_layers=layers, global_batch_size=gb,
                        micro_batch_size=mb, **kw).problem()
    note(f"plan: {plan}; train: {train}")
    assert (plan is None) == (train is None), (plan, train)
