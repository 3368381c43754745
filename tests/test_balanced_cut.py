"""The balanced layer cut (issue 33): `fmoe.schedule.balance_layers` against an oracle that enumerates
every contiguous cut, against the old fixed-extra `place_layers`, and the runtime's cut of the `fmoe train`
presets; a pipeline step whose end chunks hold no layer equals the one-process loss."""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_utils import spawn
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe import GPTConfig, MoEConfig, gpt_loss, init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.flops import gpt_part_flops
from fmoe.pipeline import gpt_pipeline_step
from fmoe.pipeline.cut import balanced_cut, cut_gpt, cut_imbalance_pct
from fmoe.schedule import stages
from fmoe.train.config import TrainConfig

DT = torch.float64


def _brute(p: S.Placement, costs: list[float], first: float, last: float, min_layers: int | tuple) -> float:
    """The least costliest-rank cost over every contiguous cut (the oracle: enumeration, no search)."""
    L, n = len(costs), p.num_stages
    mins = (min_layers,) * n if isinstance(min_layers, int) else min_layers
    best = float("inf")
    for cuts in itertools.combinations_with_replacement(range(L + 1), n - 1):
        counts = tuple(b - a for a, b in zip((0, *cuts), (*cuts, L)))
        if all(c >= m for c, m in zip(counts, mins)):
            best = min(best, max(S.cost_rank_costs(p, costs, counts, first, last)))
    return best


def _placement(kind: str, pp: int) -> S.Placement:
    return {"loop": stages.loop(pp), "interleaved": stages.interleaved(pp, 2), "vshape": stages.vshape(pp),
            "dualpipe": stages.chunk_placement(stages.bidirectional(pp))}[kind]


PLACEMENTS = st.sampled_from(["loop", "interleaved", "vshape", "dualpipe"])


@settings(max_examples=60)
@given(kind=PLACEMENTS, pp=st.integers(1, 3), data=st.data(), min_layers=st.integers(0, 1),
       first=st.floats(0, 2), last=st.floats(0, 4))
@example(kind="loop", pp=1, data=None, min_layers=1, first=0.1, last=1.5)  # pp = 1: one chunk
@example(kind="loop", pp=3, data=None, min_layers=1, first=0.0, last=0.0)  # layers == chunks
@example(kind="vshape", pp=2, data=None, min_layers=1, first=0.1, last=3.0)  # both ends on rank 0
@example(kind="interleaved", pp=2, data=None, min_layers=0, first=0.0, last=4.0)  # a head-only chunk
def test_balanced_cut_is_the_optimum(kind: str, pp: int, data, min_layers: int, first: float,
                                     last: float) -> None:
    p = _placement(kind, pp)
    n = p.num_stages
    if data is None:  # the @example cases: one layer per chunk, dense layers first
        costs = [0.6] + [1.0] * (n - 1)
    else:
        costs = data.draw(st.lists(st.sampled_from([0.6, 1.0, 1.7]), min_size=max(1, n * min_layers),
                                   max_size=8))
    got = S.balance_layers(p, costs, first, last, min_layers)
    assert got.exact and sum(got.layers) == len(costs) and min(got.layers) >= min_layers
    assert max(got.rank_cost) == pytest.approx(_brute(p, costs, first, last, min_layers), abs=1e-9)
    assert got.rank_cost == pytest.approx(S.cost_rank_costs(p, costs, got.layers, first, last))
    if min_layers == 1 and len(costs) >= n:  # never worse than the old cut (layers of one cost each)
        old = S.place_layers(p, len(costs), first, last, min_layers=1).layers
        assert max(got.rank_cost) <= max(S.cost_rank_costs(p, costs, old, first, last)) + 1e-9


def _train_cfg(preset: str) -> tuple[GPTConfig, int]:
    tc = TrainConfig.from_sources(preset=preset)
    cfg = tc.model()
    return GPTConfig(**{**cfg.__dict__, "mtp": True}), tc.seq_length


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("name, pp", [("1f1b", 2), ("1f1b", 4), ("interleaved", 2), ("dualpipev", 2)])
def test_runtime_cut_of_the_presets(preset: str, name: str, pp: int) -> None:
    """Under 5% modelled imbalance where the layer counts allow it, else the brute-force optimum."""
    cfg, seq = _train_cfg(preset)
    s = S.build(name, pp, 2 * pp)
    chunks = cut_gpt(cfg, s.placement, seq=seq)
    pct = cut_imbalance_pct(cfg, s.placement, chunks, seq)
    layers, first, last = gpt_part_flops(cfg, seq)
    p = stages.chunk_placement(s.placement)
    counts = tuple(len(c.layers) for c in chunks)
    top = max(S.cost_rank_costs(p, layers, counts, first, last))
    total = sum(layers) + first + last
    one = _brute(p, list(layers), first, last, 1)  # a layer per chunk
    ends = _brute(p, list(layers), first, last, (1,) * (p.num_stages - 1) + (0,))  # a head-only last chunk
    if min(counts) == 0:  # taken only where it pays EMPTY_STAGE_GAIN_PCT points over a layer per chunk
        assert top == pytest.approx(ends, rel=1e-12) and 100 * pp * (one - ends) / total >= 1.0
    else:
        assert top == pytest.approx(one, rel=1e-12)
    # under 5% unless no cut gets under 4% (the margin of the rule that takes empty end chunks)
    assert pct < 5.0 or 100 * (pp * min(one, ends) / total - 1) > 4.0
    assert balanced_cut(cfg, s.placement, seq).imbalance_pct == pytest.approx(pct)
    print(f"{preset} mtp {name} pp{pp}: cut {counts}, modelled imbalance {pct:.1f}%")


def test_flop_model_is_the_planners() -> None:
    """fmoe.flops and the planner's LayerCost agree on the blocks and the head (GEMMs, no loss)."""
    from fmoe.flops import CE_FLOPS_PER_LOGIT
    from fmoe.plan.layer_costs import block_cost, head_cost
    from fmoe.plan.specs import ModelSpec

    moe = MoEConfig(d_model=32, d_ff=16, num_experts=8, top_k=2, num_shared_experts=1)
    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, moe=moe,
                    num_dense_layers=1, d_ff_dense=48, mtp=True)
    m = ModelSpec(name="t", layers=3, hidden=32, heads=4, kv_heads=2, head_dim=8, vocab=64, seq=16,
                  routed_experts=8, top_k=2, expert_ffn=16, dense_layers=1, dense_ffn=48, shared_experts=1,
                  mtp=1)
    layers, _, last = gpt_part_flops(cfg, 16)
    assert layers[0] == pytest.approx(block_cost(m, False).fwd_flops)
    assert layers[1] == pytest.approx(block_cost(m, True).fwd_flops)
    assert last - 2 * CE_FLOPS_PER_LOGIT * 64 == pytest.approx(head_cost(m).fwd_flops)


# ---- a chunk without layers, through the executor ---------------------------------------------------

def _cfg() -> GPTConfig:
    moe = MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2, num_shared_experts=1)
    return GPTConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, moe=moe, mtp=True,
                     num_dense_layers=1)


def _batches(cfg: GPTConfig, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, cfg.vocab_size, (2, 6), generator=g) for _ in range(m)]
    return [(x[:, :-1], x[:, 1:]) for x in seqs]


# (schedule, layers per chunk): the last chunk only the head + MTP; the first only the embedding (a
# middle chunk needs a layer: the executor refuses a stage without phases, "stage 1 has no layers")
EMPTY_CUTS = [("1f1b", (3, 0)), ("1f1b", (0, 3)), ("interleaved", (1, 1, 1, 0))]


def _rank(rank: int, world: int, m: int) -> dict:
    cfg = _cfg()
    out = {}
    for name, counts in EMPTY_CUTS:
        s = S.build(name, world, m)
        chunks = cut_gpt(cfg, s.placement, layers=counts, min_layers=0)
        params = init_gpt(cfg, torch.Generator().manual_seed(0), DT)
        step = gpt_pipeline_step(cfg, s, rank, params, init_gpt_state(cfg), _batches(cfg, m), chunks=chunks)
        out[(name, counts)] = float(step.loss)
    return out


def test_a_chunk_without_layers_runs() -> None:
    cfg, m = _cfg(), 4
    params, state = init_gpt(cfg, torch.Generator().manual_seed(0), DT), init_gpt_state(cfg)
    want = float(sum(gpt_loss(params, ids, t, cfg, state)[0] for ids, t in _batches(cfg, m)) / m)
    for r in spawn(_rank, 2, m, timeout_s=200):
        for key, loss in r.value.items():
            assert loss == pytest.approx(want, rel=1e-12), key
