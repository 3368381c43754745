"""The all-to-all in two row chunks (`a2a_chunks=2`): what moves, gradients, and what hides what.

- `row_chunks` against a plain loop that plays every rank of an all-to-all in one process: the chunks
  partition each rank's rows, each chunk is an all-to-all of its own (what a rank sends a peer is what
  the peer expects), and permute-2 of every chunk groups the rows by local expert.
- Pipeline steps with chunks against the one-process oracle of tests/test_pipeline_ep.py (fp64, the
  balancing loss on: routing and losses stay the whole microbatch's), with zero-token experts, MTP, gate
  weights in the expert, and fb overlap on and off.
- The order, from the executor's own timeline: a lone F hides chunk 1's dispatch behind chunk 0's experts
  and chunk 0's combine behind chunk 1's, its backward mirrors it, a paired F moves its rows whole, and
  an F&B pair still pairs as seed 000.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import share_ranks
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_fb_pairing import SEED, _a2a, _compute, _waits
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

from fmoe import GPTConfig, init_gpt
from fmoe import schedule as S
from fmoe.dispatch.exchange import RowPlan
from fmoe.outline import outline
from fmoe.parallel import AllToAllDispatcher, CommGroup, ParallelLayout, Topology
from fmoe.parallel.alltoall import row_chunks
from fmoe.parallel.context import ParallelContext
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.schedule.ir import Overlap
from fmoe.schedule.options import ExecOptions
from fmoe.sync_count import count_syncs


def _plans(counts: list[list[list[int]]]) -> list[RowPlan]:
    """Each rank's RowPlan of an all-to-all where rank p sends counts[p][q][l] rows to local expert l of
    rank q (the fields row_chunks reads, made by hand)."""
    P = len(counts)
    plans = []
    for p in range(P):
        recv_PL = tuple(tuple(counts[s][p]) for s in range(P))
        plans.append(RowPlan(counts_L=None, send_P=[sum(counts[p][q]) for q in range(P)],
                             recv_P=[sum(r) for r in recv_PL], recv_PL=recv_PL))
    return plans


counts_strategy = st.integers(1, 3).flatmap(lambda P: st.integers(1, 3).flatmap(lambda L: st.lists(
    st.lists(st.lists(st.integers(0, 5), min_size=L, max_size=L), min_size=P, max_size=P),
    min_size=P, max_size=P)))


@settings(deadline=None, max_examples=60)
@given(counts_strategy)
@example([[[0]]])  # one rank, one expert, no token
@example([[[3, 0], [0, 0]], [[0, 0], [1, 0]]])  # zero-token experts and a peer that sends nothing
@example([[[1]]])  # one row: chunk 0 is empty
def test_row_chunks_are_whole_all_to_alls_that_partition_the_rows(counts: list) -> None:
    P, L = len(counts), len(counts[0][0])
    plans = _plans(counts)
    # every row labelled (source rank, destination rank, local expert, index in the sender's layout)
    layout = [[(p, q, lx, i) for q in range(P) for lx in range(L) for i in range(counts[p][q][lx])]
              for p in range(P)]
    layout = [[(*r, k) for k, r in enumerate(rows)] for rows in layout]
    with count_syncs() as c:  # host ints in, one upload out (a non-blocking one on a device)
        for p in range(P):
            row_chunks(plans[p], 2, torch.device("cpu"))
    assert c.total == 0, c.by_caller()
    got: list[list[tuple]] = [[] for _ in range(P)]  # rows each rank's experts see, over both chunks
    for c in range(2):
        chunks = [row_chunks(plans[p], 2, torch.device("cpu"))[c] for p in range(P)]
        for p in range(P):
            assert chunks[p].num_rows == len(layout[p])
            sent = [layout[p][i] for i in chunks[p].rows_R.tolist()]
            assert sum(chunks[p].plan.send_P) == len(sent)
        for q in range(P):  # what q receives: from each source its chunk-c block, in source order
            received = []
            for p in range(P):
                start = sum(chunks[p].plan.send_P[:q])
                sent = [layout[p][i] for i in chunks[p].rows_R.tolist()]
                block = sent[start:start + chunks[p].plan.send_P[q]]
                assert len(block) == chunks[q].plan.recv_P[p]  # what p sends q is what q expects
                assert all(r[1] == q for r in block)
                received += block
            grouped = [received[i] for i in chunks[q].plan.idx_M.tolist()]
            want = sorted(received, key=lambda r: (r[2], r[0]))  # by local expert, then source (permute-2)
            assert grouped == want
            per_expert = [sum(r[2] == lx for r in received) for lx in range(L)]
            assert list(chunks[q].plan.counts_L.host) == per_expert
            got[q] += received
    for q in range(P):  # both chunks together: every row sent to q exactly once
        assert sorted(got[q]) == sorted(r for p in range(P) for r in layout[p] if r[1] == q)


def _probs_in_expert(cfg: GPTConfig) -> GPTConfig:
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, probs_in_expert=True))


# (name, pp, mtp, imbalanced, gate weights in the expert)
CASES = [("dualpipev", 2, True, True, False), ("dualpipev", 2, True, False, True),
         ("combined_1f1b", 1, False, False, False)]


def _run(rank: int, world: int, cases: list) -> dict:
    out, layouts = {}, {}
    for name, pp, mtp, imbalanced, pie in cases:
        if pp != world // EP:
            continue
        if pp not in layouts:
            layouts[pp] = ParallelLayout(pp=pp, ep=EP, topology=Topology(world, world))
        layout = layouts[pp]
        d = AllToAllDispatcher(CommGroup(layout.group("expert")), 4)
        cfg = _cfg(mtp, imbalanced)
        cfg = _probs_in_expert(cfg) if pie else cfg
        ep_rank = torch.distributed.get_rank(layout.group("expert"))
        pp_group = layout.group("pp") if pp > 1 else None
        pp_rank = torch.distributed.get_rank(pp_group) if pp > 1 else 0
        s = S.combined_1f1b(M) if name == "combined_1f1b" else S.build(name, pp, M)
        pairs = [(a.f.stage, a.f.mb, a.b.stage, a.b.mb) for a in s.ranks[pp_rank] if isinstance(a, Overlap)]
        for overlap in (True, False):
            params = _local(init_gpt(cfg, torch.Generator().manual_seed(0), DT), cfg, ep_rank)
            step = gpt_pipeline_step(gpt_program(cfg, s, pp_rank, parallel=ParallelContext(dispatcher=d),
                                                 a2a_chunks=2),
                                     params, _state(cfg, imbalanced), _batches(cfg, ep_rank, M),
                                     group=pp_group, options=ExecOptions(overlap=overlap))
            grads = {k: v.tolist() for k, v in _flat(step.grads).items()}
            out[(name, pp, mtp, imbalanced, pie, overlap)] = (ep_rank, float(step.loss), grads,
                                                               step.result.events, pairs)
    return out


# on the session's shared starts of the ranks (tests/dist_utils.py)
share_ranks("a2a_chunks", (EP, 2 * EP), _run, CASES)


@pytest.fixture(scope="module")
def runs() -> dict:
    return runs_by_key("a2a_chunks")


def _case_id(c: tuple) -> str:
    return f"{c[0]}-pp{c[1]}-mtp{int(c[2])}-zero{int(c[3])}-pie{int(c[4])}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_chunked_steps_equal_the_one_process_oracle(runs: dict, case: tuple) -> None:
    name, pp, mtp, imbalanced, pie = case
    cfg = _cfg(mtp, imbalanced)
    cfg = _probs_in_expert(cfg) if pie else cfg
    for overlap in (True, False):
        assert_equal_to_oracles(cfg, imbalanced, runs[(*case, overlap)], (case, f"overlap={overlap}"))


# a chunk's exchange, and the compute phase of its own op that must run while it travels
SELF = {("dispatch.1", "F"): ("F", "mlp.0"), ("combine.0", "F"): ("F", "mlp.1"),
        ("combine.0", "B"): ("B", "mlp.1"), ("dispatch.1", "B"): ("B", "mlp.0")}


@pytest.mark.parametrize("case", [c for c in CASES if not c[3]], ids=lambda c: f"{c[0]}-pp{c[1]}")
def test_each_chunk_travels_while_the_other_chunks_experts_run(runs: dict, case: tuple) -> None:
    """Chunks move only in forwards that run alone (and their backwards, lone or paired), with overlap on
    or off: chunk 1's dispatch hides behind chunk 0's experts and chunk 0's combine behind chunk 1's,
    forward and backward (I or B)."""
    checked = 0
    for overlap in (True, False):
        for _, _, _, events, _ in runs[(*case, overlap)]:
            events = sorted(events, key=lambda e: e.start)
            waits = _waits(events)
            parsed = [(c, e.start) for e in events if e.lane == "compute" and (c := _compute(e))]
            for e in events:
                m = _a2a(e)
                if e.lane != "comm" or not m or m[:2] not in SELF:
                    continue
                phase, kind, stage, layer, mb = m
                if kind == "F" and overlap:  # a paired forward moves its rows whole: its pair hides them
                    assert e.step == "lone", (e.name, e.step)
                ran = {("B" if g[0] in ("B", "I") else g[0], g[1]) for g, t in parsed
                       if e.start <= t < waits[m] and g[2:] == (stage, layer, mb)}
                assert SELF[m[:2]] in ran, (e.name, e.step, sorted(ran))
                checked += 1
    assert checked >= 16, checked


def test_pairs_still_pair_as_seed_000_with_chunks(runs: dict) -> None:
    """The pair hands over at chunk 0's dispatch and chunk 1's combine only: seed 000's four pairings hold
    for every layer pair (the chunk exchanges between them are the op's own)."""
    checked = 0
    for case in CASES:
        for _, _, _, events, pairs in runs[(*case, True)]:
            events = sorted(events, key=lambda e: e.start)
            waits = _waits(events)
            partner = {}
            for fs, fm, bs, bm in pairs:
                partner[("F", fs, fm)], partner[("B", bs, bm)] = ("B", bs, bm), ("F", fs, fm)
            # the chunks' experts, mlp.0 and mlp.1, stand where the layer's mlp stands
            compute = [(("F" if c[0] == "F" else "B"), c[2], c[4], (c[0], c[1].split(".")[0], c[3]), e.start)
                       for e in events if e.lane == "compute" and (c := _compute(e))]
            by_pair: dict[tuple, list] = {}
            for e in events:
                m = _a2a(e)
                if e.lane != "comm" or not m or (m[0], m[1]) not in SEED:
                    continue
                phase, kind, stage, layer, mb = m
                other = partner.get((kind, stage, mb))
                if other is None:
                    continue
                hid = {w for k, s_, b, w, t in compute if (k, s_, b) == other and e.start <= t < waits[m]}
                f_op = (kind, stage, mb) if kind == "F" else other
                by_pair.setdefault(f_op, []).append((phase, kind, layer, hid))
            for xs in by_pair.values():
                f_layers = list(dict.fromkeys(x[2] for x in xs if x[1] == "F"))
                b_layers = list(dict.fromkeys(x[2] for x in xs if x[1] == "B"))
                for k in range(min(len(f_layers), len(b_layers))):
                    mine = {"F": f_layers[k], "B": b_layers[k]}
                    for phase, kind, layer, hid in xs:
                        if layer != mine[kind]:
                            continue
                        want_phase, want_kind = SEED[(phase, kind)]
                        kinds = ("B", "I") if want_kind == "B" else ("F",)
                        assert any((k2, want_phase, mine[want_kind]) in hid for k2 in kinds), (phase, kind,
                                                                                                 hid)
                        checked += 1
    assert checked >= 8, checked


def test_chunks_need_an_all_to_all() -> None:
    from fmoe.parallel import AllGatherDispatcher
    from fmoe.phases import moe_layer

    cfg = _cfg(False, False)

    class _Group:  # an all-gather dispatcher is never asked to move anything here
        size, rank = 2, 0

    with pytest.raises(ValueError, match="AllToAllDispatcher"):
        moe_layer(cfg, outline(cfg).site("L1"), ParallelContext(dispatcher=AllGatherDispatcher(_Group(), 4)),
                  a2a_chunks=2)
    with pytest.raises(ValueError, match="1 or 2"):
        moe_layer(cfg, outline(cfg).site("L1"), a2a_chunks=3)


def test_fmoe_train_takes_two_chunks_with_the_all_to_all_only() -> None:
    from fmoe.train.config import TrainConfig

    assert TrainConfig(a2a_chunks=2).problem() is None
    assert "1 or 2" in TrainConfig(a2a_chunks=3).problem()
    assert "--dispatcher alltoall" in TrainConfig(a2a_chunks=2, dispatcher="allgather").problem()
