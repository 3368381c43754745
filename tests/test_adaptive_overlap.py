"""Adaptive pipe overlap, as the executor runs it: each MoE layer's modes (fmoe.overlap.LayerOverlap) in an
F&B pair ("pair" hands over to the other op, "self" moves row chunks without handing over, "none" whole
exchanges without handing over) and alone ("self" chunks, "none" whole), mixed layer by layer in one
model.

- Pipeline steps with mixed modes against the one-process oracle of tests/test_pipeline_ep.py (fp64).
- From the executor's own timeline: a layer that does not pair has no compute of the other microbatch
  between its exchanges' issue and wait; a pairing layer pairs as seed 000 with the other op's pairing
  layer; a layer moves chunks exactly where its mode says; a lone B still runs its dw while an exchange
  of a layer that does not pair travels.
- What is refused: chunks through a dispatcher with another route, modes for layers the model lacks.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import share_ranks
from test_fb_pairing import SEED, _a2a, _compute, _waits, check_pair_sends_follow_their_data
from test_pipeline_ep import (
    DT,
    EP,
    M,
    _batches,
    _cfg,
    _flat,
    _local,
    _state,
    assert_equal_to_oracles,
    runs_by_key,
)

from fmoe import init_gpt
from fmoe import schedule as S
from fmoe.dispatch.local import LocalDispatcher
from fmoe.outline import outline
from fmoe.overlap import LayerOverlap, layer_overlap
from fmoe.parallel import AllToAllDispatcher, CommGroup, ParallelLayout, Topology
from fmoe.parallel.context import ParallelContext
from fmoe.parallel.hierarchical import HierarchicalDispatcher
from fmoe.phases import gpt_layers, moe_layer, moe_layer_turns
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.pipeline.step import gpt_stage_turns
from fmoe.schedule.ir import Overlap
from fmoe.transforms.program import turns

# _cfg: 4 layers, L0 dense, L1-L3 MoE (+ MTP)
MODES = {"L1": LayerOverlap("pair", "none"), "L2": LayerOverlap("self", "self"),
         "L3": LayerOverlap("none", "self"), "MTP": LayerOverlap("pair", "self")}
CASES = [("combined_1f1b", 1, False), ("dualpipev", 2, True)]
# DualPipeV's cut: L0 | L1 L2 | L3 | MTP + head. Rank 1 holds the middle two stages, neither of which pairs
# here (both stages of its pairs hand over nowhere); rank 0's last stage pairs through MTP
MODES_OF = {CASES[0]: MODES, CASES[1]: {**MODES, "L1": LayerOverlap("none", "self")}}


def _run(rank: int, world: int, cases: list) -> dict:
    out = {}
    for name, pp, mtp in cases:
        if pp != world // EP:
            continue
        layout = ParallelLayout(pp=pp, ep=EP, topology=Topology(world, world))
        d = AllToAllDispatcher(CommGroup(layout.group("expert")), 4)
        cfg = _cfg(mtp, False)
        ep_rank = torch.distributed.get_rank(layout.group("expert"))
        pp_group = layout.group("pp") if pp > 1 else None
        pp_rank = torch.distributed.get_rank(pp_group) if pp > 1 else 0
        s = S.combined_1f1b(M) if name == "combined_1f1b" else S.build(name, pp, M)
        pairs = [(a.f.stage, a.f.mb, a.b.stage, a.b.mb) for a in s.ranks[pp_rank] if isinstance(a, Overlap)]
        modes = {k: v for k, v in MODES_OF[(name, pp, mtp)].items() if k != "MTP" or mtp}
        params = _local(init_gpt(cfg, torch.Generator().manual_seed(0), DT), cfg, ep_rank)
        step = gpt_pipeline_step(gpt_program(cfg, s, pp_rank, parallel=ParallelContext(dispatcher=d),
                                             overlap=modes),
                                 params, _state(cfg, False), _batches(cfg, ep_rank, M), group=pp_group)
        grads = {k: v.tolist() for k, v in _flat(step.grads).items()}
        out[(name, pp, mtp)] = (ep_rank, float(step.loss), grads, step.result.events, pairs)
    return out


# on the session's shared starts of the ranks (tests/dist_utils.py)
share_ranks("adaptive_overlap", (EP, 2 * EP), _run, CASES)


@pytest.fixture(scope="module")
def runs() -> dict:
    return runs_by_key("adaptive_overlap")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-pp{c[1]}")
def test_mixed_modes_equal_the_one_process_oracle(runs: dict, case: tuple) -> None:
    assert_equal_to_oracles(_cfg(case[2], False), False, runs[case], case)


def _hid(events: list, pairs: list) -> list[tuple]:
    """Per exchange of an F&B pair (counts excluded): (its op kind, phase, layer, the pair's F op, the
    compute phases {(kind, phase, layer)} of the other op that ran between its issue and its wait)."""
    events = sorted(events, key=lambda e: e.start)
    waits = _waits(events)
    partner, f_of = {}, {}
    for fs, fm, bs, bm in pairs:
        partner[("F", fs, fm)], partner[("B", bs, bm)] = ("B", bs, bm), ("F", fs, fm)
        f_of[("F", fs, fm)] = f_of[("B", bs, bm)] = (fs, fm)
    compute = [("F" if c[0] == "F" else "B", c[2], c[4], (c[0], c[1], c[3]), e.start)
               for e in events if e.lane == "compute" and (c := _compute(e))]
    out = []
    for e in events:
        m = _a2a(e)
        if e.lane != "comm" or not m or m[0] == "counts" or e.step != "pair":
            continue
        phase, kind, stage, layer, mb = m
        other = partner[(kind, stage, mb)]
        hid = {w for k, st, b, w, t in compute if (k, st, b) == other and e.start <= t < waits[m]}
        out.append((kind, phase, layer, f_of[(kind, stage, mb)], hid))
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-pp{c[1]}")
def test_a_layer_that_does_not_pair_hides_nothing_of_the_other_op(runs: dict, case: tuple) -> None:
    checked = 0
    for *_, events, pairs in runs[case]:
        for kind, phase, layer, _, hid in _hid(events, pairs):
            if MODES_OF[case][layer].paired != "pair":
                assert not hid, (kind, phase, layer, sorted(hid))
                checked += 1
    assert checked >= 16, checked


def test_pairing_layers_pair_as_seed_000(runs: dict) -> None:
    """combined 1F1B on one stage: L1 is the only layer that hands over, on both sides of every pair, so
    the F's L1 pairs with the B's L1: seed 000's four pairings, and no other layer's phase of that name."""
    checked = 0
    for *_, events, pairs in runs[("combined_1f1b", 1, False)]:
        for kind, phase, layer, _, hid in _hid(events, pairs):
            if layer != "L1":
                continue
            want_phase, want_kind = SEED[(phase, kind)]
            assert (want_kind, want_phase, "L1") in hid, (kind, phase, sorted(hid))
            assert all(w[2] == "L1" or w[1] != want_phase for w in hid), (kind, phase, sorted(hid))
            checked += 1
    assert checked >= 8, checked


def test_each_layer_moves_chunks_where_its_mode_says(runs: dict) -> None:
    """Forward expert phases: "mlp.0" / "mlp.1" where the layer's mode in that context (pair or lone) is
    "self", "mlp" where it is not; and every layer and context is met."""
    seen = set()
    for case in CASES:
        for *_, events, _ in runs[case]:
            for e in events:
                c = _compute(e)
                if not c or c[0] != "F" or c[1] not in ("mlp", "mlp.0", "mlp.1"):
                    continue
                modes = MODES_OF[case][c[3]]
                mode = modes.paired if e.step == "pair" else modes.lone
                assert (c[1] != "mlp") == (mode == "self"), (e.name, e.step, mode)
                seen.add((c[3], e.step))
    assert {(n, step) for n in MODES for step in ("pair", "lone")} <= seen, sorted(seen)


def test_a_lone_backward_runs_its_dw_while_a_non_pairing_layers_exchange_travels(runs: dict) -> None:
    """L3 does not pair, so its exchanges do not hand over; alone, a B still runs the routed experts' dw
    while its dispatch-B travels (work that must run anyway)."""
    checked = 0
    for *_, events, _ in runs[("combined_1f1b", 1, False)]:
        events = sorted(events, key=lambda e: e.start)
        waits = _waits(events)
        parsed = [(c, e.start) for e in events if e.lane == "compute" and (c := _compute(e))]
        for e in events:
            m = _a2a(e)
            if e.lane != "comm" or e.step != "lone" or not m or m[:2] != ("dispatch", "B") or m[3] != "L3":
                continue
            _, _, stage, layer, mb = m
            ran = {(g[0], g[1]) for g, t in parsed if e.start <= t < waits[m] and g[2:] == (stage, layer, mb)}
            assert {("W", "mlp"), ("W", "mlp.0"), ("W", "mlp.1")} & ran, (e.name, sorted(ran))
            checked += 1
    assert checked >= 1, checked


def test_turns_follow_the_modes() -> None:
    """A layer hands over at its dispatch and combine only where it pairs; the stage's turns are the sum
    over its MoE layers, the same whether counted on the built programs or from the modes."""
    cfg = _cfg(True, False)
    d = AllToAllDispatcher.__new__(AllToAllDispatcher)  # built without a group: the type is what is read
    for mode, want in ((LayerOverlap("pair", "self"), 2), (LayerOverlap("self", "self"), 0),
                       (LayerOverlap("none", "none"), 0), (LayerOverlap("pair", "none"), 2)):
        layer = moe_layer(cfg, outline(cfg).site("L1"), ParallelContext(dispatcher=d), overlap=mode)
        assert turns(layer.phases) == want == moe_layer_turns(cfg, d, mode)
        assert turns(layer.forward_phases(False)) == want
        names = [{ph.name for ph in layer.forward_phases(paired)} for paired in (True, False)]
        assert [("mlp.0" in n) for n in names] == [mode.paired == "self", mode.lone == "self"], mode
    s = S.build("dualpipev", 2, 4)
    from fmoe.pipeline.cut import cut_gpt
    chunks = cut_gpt(cfg, s.placement)
    turns_S = gpt_stage_turns(cfg, s, chunks, d, MODES)
    for st in range(s.placement.num_stages):
        chunk = chunks[s.placement.layer_chunk[st]]
        layers = gpt_layers(cfg, chunk.sites(cfg), ParallelContext(dispatcher=d), overlap=MODES)
        assert turns_S[st] == sum(turns(ly.phases) for ly in layers), st
    # a local dispatcher never hands over
    assert moe_layer_turns(cfg, LocalDispatcher(4), LayerOverlap("pair")) == 0


def test_what_is_refused() -> None:
    cfg = _cfg(False, False)
    with pytest.raises(ValueError, match="LayerOverlap.paired must be one of pair, self, none"):
        LayerOverlap("chunks")
    with pytest.raises(ValueError, match="LayerOverlap.lone must be one of self, none"):
        LayerOverlap("pair", "pair")
    with pytest.raises(ValueError, match="overlap names L0, MTP: not MoE layers of the model"):
        gpt_layers(cfg, outline(cfg).chunk(range(4), first=True, head=True, last=True),
                   overlap={"L0": LayerOverlap(), "MTP": LayerOverlap(), "L1": LayerOverlap()})
    hier = HierarchicalDispatcher.__new__(HierarchicalDispatcher)  # the type is what the rule reads
    with pytest.raises(ValueError, match="self-overlap .* splits an all-to-all's rows"):
        moe_layer(cfg, outline(cfg).site("L1"), ParallelContext(dispatcher=hier),
                  overlap=LayerOverlap("pair", "self"))
    with pytest.raises(ValueError, match="not also a2a_chunks"):
        moe_layer(cfg, outline(cfg).site("L1"), ParallelContext(), 2, overlap=LayerOverlap())
    with pytest.raises(TypeError, match="overlap must be a LayerOverlap"):
        layer_overlap("pair", "L1")
    assert layer_overlap({"L2": LayerOverlap("none")}, "L1") == LayerOverlap()


def test_sends_go_out_the_moment_their_data_exists_whatever_the_modes(runs: dict) -> None:
    """DualPipeV pp 2 x ep 2 where both stages of rank 1's pairs hand over nowhere (and on rank 0 one
    does): the executor runs such a pair forward first, as the wire order lists its messages, so a
    gradient's send follows its dx pass and an activation's its forward's last phase, with no compute in
    between (a pair started with its backward made the gradient first, and it waited behind the
    activation the wire order put ahead of it)."""
    checked = check_pair_sends_follow_their_data([events for *_, events, _ in runs[("dualpipev", 2, True)]])
    assert min(checked.values()) >= 2, checked
