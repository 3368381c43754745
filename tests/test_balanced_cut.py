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
from test_pipeline_gpt import _flat

from fmoe import GPTConfig, MoEConfig, gpt_loss, init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.flops import gpt_part_flops, gpt_tail_part_flops
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.pipeline.cut import balanced_cut, cut_gpt, cut_imbalance_pct
from fmoe.schedule import imbalance, stages
from fmoe.train.config import TrainConfig

DT = torch.float64


def _brute(p: S.Placement, costs: list[float], first: float, last: float, min_layers: int | tuple,
           split_last: float = 0.0) -> float:
    """The least costliest-rank cost over every contiguous cut (the oracle: enumeration, no search); with
    `split_last` only cuts that leave the last stage no layer, priced with that part alone on it."""
    L, n = len(costs), p.num_stages
    mins = (min_layers,) * n if isinstance(min_layers, int) else min_layers
    best = float("inf")
    for cuts in itertools.combinations_with_replacement(range(L + 1), n - 1):
        counts = tuple(b - a for a, b in zip((0, *cuts), (*cuts, L)))
        if all(c >= m for c, m in zip(counts, mins)) and not (split_last and counts[-1]):
            best = min(best, max(S.cost_rank_costs(p, costs, counts, first, last, split_last)))
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


@settings(max_examples=60)
@given(kind=PLACEMENTS, pp=st.integers(1, 3), data=st.data(), min_layers=st.integers(0, 1),
       first=st.floats(0, 2), head=st.floats(0, 2), alone=st.floats(0, 3))
@example(kind="loop", pp=1, data=None, min_layers=1, first=0.1, head=1.0, alone=1.0)  # one chunk: refused
@example(kind="loop", pp=2, data=None, min_layers=1, first=0.0, head=0.5, alone=2.0)  # every layer on one
@example(kind="vshape", pp=2, data=None, min_layers=0, first=0.1, head=1.0, alone=3.0)  # MTP beside the embed
@example(kind="dualpipe", pp=2, data=None, min_layers=1, first=0.0, head=0.0, alone=0.5)  # a free head
def test_a_cut_with_the_last_extra_split_is_the_optimum(kind: str, pp: int, data, min_layers: int,
                                                        first: float, head: float, alone: float) -> None:
    """`split_last`: the last stage holds no layer and only that part of the last extra, the rest on the
    stage before; the least costliest rank of such cuts, as enumeration finds it."""
    p = _placement(kind, pp)
    n = p.num_stages
    costs = [0.6] + [1.0] * (n - 1) if data is None else data.draw(
        st.lists(st.sampled_from([0.6, 1.0, 1.7]), min_size=max(1, (n - 1) * min_layers), max_size=8))
    last = head + alone
    if n == 1 or not alone:
        if n == 1 and alone:
            with pytest.raises(S.ScheduleError, match="two stages"):
                S.balance_layers(p, costs, first, last, min_layers, split_last=alone)
        return
    got = S.balance_layers(p, costs, first, last, min_layers, split_last=alone)
    assert got.exact and got.layers[-1] == 0 and sum(got.layers) == len(costs) and got.split_last == alone
    assert min(got.layers[:-1]) >= min_layers
    mins = (min_layers,) * (n - 1) + (0,)
    assert max(got.rank_cost) == pytest.approx(_brute(p, costs, first, last, mins, alone), abs=1e-9)
    assert got.rank_cost == pytest.approx(S.cost_rank_costs(p, costs, got.layers, first, last, alone))
    # the rule that chooses (blind to stages: test_stage_cut checks that step): never worse than keeping the
    # whole last extra on the last stage
    chosen = kept = None
    if len(costs) >= n:
        chosen = S.balance_layers_or_empty(p, costs, first, last, split_last=alone, even_chunks=False)
        kept = S.balance_layers_or_empty(p, costs, first, last, even_chunks=False)
    if chosen is not None:
        assert chosen.imbalance_pct <= kept.imbalance_pct + 1e-9
        assert chosen.split_last in (0.0, alone) and (not chosen.split_last or chosen.layers[-1] == 0)


def _train_cfg(preset: str) -> tuple[GPTConfig, int]:
    tc = TrainConfig.from_sources(preset=preset)
    cfg = tc.model()
    return GPTConfig(**{**cfg.__dict__, "mtp": True}), tc.seq_length


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("name, pp", [("1f1b", 2), ("1f1b", 4), ("interleaved", 2), ("dualpipev", 2)])
def test_runtime_cut_of_the_presets(preset: str, name: str, pp: int) -> None:
    """Under 5% modelled rank imbalance where the layer counts allow it, else the brute-force optimum;
    where a rank holds two chunks, a cut with a cheaper costliest chunk may cost RANK_SLACK_PCT more."""
    cfg, seq = _train_cfg(preset)
    s = S.build(name, pp, 2 * pp)
    chunks = cut_gpt(cfg, s.placement, seq=seq)
    pct = cut_imbalance_pct(cfg, s.placement, chunks, seq)
    layers, first, (head, mtp) = gpt_tail_part_flops(cfg, seq)
    last = head + mtp
    p = stages.chunk_placement(s.placement)
    n = p.num_stages
    counts = tuple(len(c.layers) for c in chunks)
    alone = not chunks[-1].head  # the MTP module on a chunk of its own, the loss on the one before
    # the rule blind to stages: the least costliest rank
    blind = S.balance_layers_or_empty(p, layers, first, last, split_last=mtp, even_chunks=False)
    top = max(blind.rank_cost)
    total = sum(layers) + first + last
    one = _brute(p, list(layers), first, last, 1)  # a layer per chunk
    ends = _brute(p, list(layers), first, last, (1,) * (n - 1) + (0,))  # a head-only last chunk
    # MTP alone; the chunk before with or without a layer (the rule's choice depends on the head's cost)
    loose = _brute(p, list(layers), first, last, (0,) * n, split_last=mtp)
    tight = _brute(p, list(layers), first, last, (1,) * (n - 1) + (0,), split_last=mtp)
    # each taken only where it pays EMPTY_STAGE_GAIN_PCT points: MTP alone over MTP with the loss, an empty
    # last chunk over a layer per chunk
    if blind.split_last:
        assert loose - 1e-9 <= top <= tight + 1e-9 and 100 * pp * (min(one, ends) - top) / total >= 1.0
    elif min(blind.layers) == 0:
        assert top == pytest.approx(ends, rel=1e-12) and 100 * pp * (one - ends) / total >= 1.0
    else:
        assert top == pytest.approx(one, rel=1e-12)
    # under 5% unless no cut gets under 4% (the margin of the rules that take empty chunks)
    assert blind.imbalance_pct < 5.0 or 100 * (pp * min(one, ends, loose) / total - 1) > 4.0
    cut = balanced_cut(cfg, s.placement, seq)
    assert (cut.layers, cut.split_last > 0) == (counts, alone) and cut.imbalance_pct == pytest.approx(pct)
    if (cut.layers, cut.split_last) != (blind.layers, blind.split_last):  # the stage step moved it
        assert len(set(p.stage_rank)) < n and max(cut.rank_cost) <= top * (1 + imbalance.RANK_SLACK_PCT / 100)
        assert cut.stage_imbalance_pct <= blind.stage_imbalance_pct - imbalance.STAGE_GAIN_PCT
    print(f"{preset} mtp {name} pp{pp}: cut {counts}{' + MTP alone' if alone else ''}, "
          f"modelled imbalance {pct:.1f}% per rank, {cut.stage_imbalance_pct:.1f}% per chunk")


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


# (schedule, layers per chunk, MTP alone): the last chunk only the head + MTP; the first only the
# embedding (a middle chunk needs a layer: the executor refuses a stage without phases, "stage 1 has no
# layers"); the last chunk only the MTP module, the loss on the chunk before (on another rank, or on a V
# the MTP beside the embedding on rank 0 and the head on rank 1: the head weight summed across ranks)
EMPTY_CUTS = [("1f1b", (3, 0), False), ("1f1b", (0, 3), False), ("interleaved", (1, 1, 1, 0), False),
              ("1f1b", (3, 0), True), ("interleaved", (1, 1, 1, 0), True), ("dualpipev", (1, 1, 1, 0), True),
              ("dualpipe", (3, 0), True)]


def _rank(rank: int, world: int, m: int) -> dict:
    cfg = _cfg()
    out = {}
    for name, counts, alone in EMPTY_CUTS:
        s = S.build(name, world, m)
        chunks = cut_gpt(cfg, s.placement, layers=counts, min_layers=0, mtp_alone=alone)
        params = init_gpt(cfg, torch.Generator().manual_seed(0), DT)
        step = gpt_pipeline_step(gpt_program(cfg, s, rank, chunks=chunks), params, init_gpt_state(cfg),
                                 _batches(cfg, m))
        out[(name, counts, alone)] = (float(step.loss), {k: v.tolist() for k, v in _flat(step.grads).items()})
    return out


def test_a_chunk_without_layers_runs() -> None:
    """Loss and every gradient equal the one-process run's (gpt_loss under torch.func.vjp)."""
    cfg, m = _cfg(), 4
    params, state = init_gpt(cfg, torch.Generator().manual_seed(0), DT), init_gpt_state(cfg)
    batches = _batches(cfg, m)
    want, vjp = torch.func.vjp(lambda p: sum(gpt_loss(p, ids, t, cfg, state)[0] for ids, t in batches) / m,
                               params)
    want_grads = _flat(vjp(torch.ones((), dtype=DT))[0])
    results = spawn(_rank, 2, m, timeout_s=300)
    for key in results[0].value:
        held: dict[str, torch.Tensor] = {}
        for r in results:
            loss, grads = r.value[key]
            assert loss == pytest.approx(float(want), rel=1e-12), key
            for k, v in grads.items():  # a weight on both ranks has one (summed) gradient
                v = torch.tensor(v, dtype=DT)
                assert k not in held or torch.equal(held[k], v), (key, k)
                held[k] = v
        assert held.keys() == want_grads.keys(), (key, set(held) ^ set(want_grads))
        for k, v in want_grads.items():
            torch.testing.assert_close(held[k], v, rtol=1e-9, atol=1e-12, msg=f"{key} {k}")


def test_an_mtp_only_chunk_is_refused_where_it_cannot_be() -> None:
    s = S.build("1f1b", 2, 2)
    with pytest.raises(S.ScheduleError, match="MTP-only last chunk"):
        cut_gpt(GPTConfig(**{**_cfg().__dict__, "mtp": False}), s.placement, layers=(3, 0), mtp_alone=True)
    with pytest.raises(S.ScheduleError, match="MTP-only last chunk"):
        cut_gpt(_cfg(), s.placement, layers=(2, 1), mtp_alone=True)
    with pytest.raises(S.ScheduleError, match="MTP-only last chunk"):
        cut_gpt(_cfg(), S.build("1f1b", 1, 2).placement, layers=(3,), mtp_alone=True)
