"""Expert parallelism inside pipeline stages: pp 2 x ep 2 on 4 gloo ranks, alltoall and hierarchical
dispatchers (2 nodes of 1 rank, and 1 node of 2), balanced and imbalanced routing (an expert bias sends
every token to the second EP rank's experts, so the first rank's experts receive no token).

Oracle: each EP rank's microbatches run one after the other in one process through `gpt_loss` with all
experts local (torch.func.vjp). Each rank's loss equals its oracle's; a rank's expert gradients equal
the sum over EP ranks of the oracles' gradients of its experts; the other gradients, summed over the EP
ranks (what data parallelism would all-reduce), equal the oracles' sum.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import share_ranks, shared_ranks

from fmoe import GPTConfig, MoEConfig, gpt_loss, init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.parallel import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    CommGroup,
    HierarchicalDispatcher,
    ParallelLayout,
    Topology,
)
from fmoe.parallel.context import ParallelContext
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.schedule.options import ExecOptions

DT = torch.float64
E, L, EP = 4, 2, 2


def _cfg(mtp: bool, imbalanced: bool) -> GPTConfig:
    moe = MoEConfig(d_model=16, d_ff=8, num_experts=E, top_k=2, aux_loss_coef=1e-2, num_shared_experts=1,
                    bias_update_rate=1e-3 if imbalanced else 0.0)
    return GPTConfig(vocab_size=32, d_model=16, n_layers=4, n_heads=2, moe=moe, mtp=mtp, num_dense_layers=1)


def _state(cfg: GPTConfig, imbalanced: bool) -> dict:
    state = init_gpt_state(cfg)
    if imbalanced:  # every token picks experts 2 and 3 (EP rank 1): EP rank 0's experts get nothing
        for s in state["layers"][cfg.num_dense_layers:] + ([state["mtp"]] if cfg.mtp else []):
            s["expert_bias_E"] = torch.tensor([-100.0, -100.0, 0.0, 0.0])
    return state


def _batches(cfg: GPTConfig, ep_rank: int, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + ep_rank)
    seqs = [torch.randint(0, cfg.vocab_size, (2, 6), generator=g) for _ in range(m)]
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def _local(params: dict, cfg: GPTConfig, ep_rank: int) -> dict:
    """The params an EP rank holds: every expert tensor sliced to its L experts."""
    blocks = params["layers"][cfg.num_dense_layers:] + ([params["mtp"]["block"]] if cfg.mtp else [])
    for b in blocks:
        b["moe"]["experts"] = {k: v[ep_rank * L:(ep_rank + 1) * L].clone()
                               for k, v in b["moe"]["experts"].items()}
    return params


def _flat(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, dict):
        return {k2: v2 for k, v in tree.items() for k2, v2 in _flat(v, f"{prefix}{k}.").items()}
    if isinstance(tree, list):
        return {k2: v2 for i, v in enumerate(tree) for k2, v2 in _flat(v, f"{prefix}{i}.").items()}
    return {} if tree is None else {prefix[:-1]: tree}


def _oracle(cfg: GPTConfig, imbalanced: bool, ep_rank: int, m: int) -> tuple[float, dict[str, torch.Tensor]]:
    params = init_gpt(cfg, torch.Generator().manual_seed(0), DT)
    state = _state(cfg, imbalanced)
    batches = _batches(cfg, ep_rank, m)
    def mean_loss(p: dict) -> torch.Tensor:
        return sum(gpt_loss(p, ids, t, cfg, state)[0] for ids, t in batches) / m

    loss, vjp = torch.func.vjp(mean_loss, params)
    return float(loss), _flat(vjp(torch.ones((), dtype=DT))[0])


def runs_by_key(name: str) -> dict:
    """The answers of part `name` (registered by `share_ranks(name, worlds, rank_fn, cases)`, `rank_fn`
    answering {key: value} for the cases of its pp = world / EP) on pp x EP gloo ranks for pp 1 and 2, on
    the session's shared starts of those ranks (tests/dist_utils.py); returns {key: [each rank's value]}."""
    got: dict = {}
    for pp in (1, 2):
        for r in shared_ranks(pp * EP, name):
            for key, v in r.value.items():
                got.setdefault(key, []).append(v)
    return got


def assert_equal_to_oracles(cfg: GPTConfig, imbalanced: bool, results: list,
                            what: object) -> dict[str, torch.Tensor]:
    """Asserts the module docstring's rule: every EP rank's (ep_rank, loss, grads, ...) in `results` (grads
    flat lists by key, as `_flat` names them) against `_oracle` (fp64, rtol 1e-9); returns the oracles'
    gradients summed over the EP ranks."""
    oracles = [_oracle(cfg, imbalanced, e, M) for e in range(EP)]
    want_sum = {k: sum(o[1][k] for o in oracles) for k in oracles[0][1]}
    experts: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for ep_rank, loss, grads, *_ in results:
        assert loss == pytest.approx(oracles[ep_rank][0], rel=1e-12), what
        for k, v in grads.items():
            if ".experts." in k:
                experts[f"{k}@{ep_rank}"] = torch.tensor(v, dtype=DT)
            else:  # pp ranks of one EP rank hold disjoint stages; a shared weight's sum is on each holder
                dense.setdefault(f"{k}@{ep_rank}", torch.tensor(v, dtype=DT))
    for k, want in want_sum.items():
        if ".experts." in k:
            for e in range(EP):
                torch.testing.assert_close(experts[f"{k}@{e}"], want[e * L:(e + 1) * L], rtol=1e-9,
                                           atol=1e-12, msg=f"{what} {k} ep{e}")
        else:
            torch.testing.assert_close(sum(dense[f"{k}@{e}"] for e in range(EP)), want, rtol=1e-9, atol=1e-12,
                                       msg=f"{what} {k}")
    return want_sum


CASES = [("alltoall", 2, "1f1b", False, False), ("alltoall", 2, "dualpipev", True, True),
         ("alltoall", 2, "interleaved", False, True), ("allgather", 2, "zbv", True, True),
         ("hierarchical", 1, "1f1b", False, True),
         ("hierarchical", 1, "dualpipev", True, False), ("hierarchical", 2, "zb_h1", False, True)]
M = 4


def _dispatcher(kind: str, layout: ParallelLayout):
    if kind == "alltoall":
        return AllToAllDispatcher(CommGroup(layout.group("expert")), E)
    if kind == "allgather":
        return AllGatherDispatcher(CommGroup(layout.group("expert")), E)
    inter, intra = CommGroup(layout.group("expert_inter")), CommGroup(layout.group("expert_intra"))
    return HierarchicalDispatcher(inter, intra, E)


def _rank(rank: int, world: int, cases: list) -> dict:
    out, layouts = {}, {}
    for kind, rpn, name, mtp, imbalanced in cases:
        if rpn not in layouts:  # every rank builds the same layouts, in the same order
            layouts[rpn] = ParallelLayout(pp=2, ep=EP, topology=Topology(world, rpn))
        layout = layouts[rpn]
        d = _dispatcher(kind, layout)
        cfg = _cfg(mtp, imbalanced)
        pp_group = layout.group("pp")
        ep_rank = torch.distributed.get_rank(layout.group("expert"))
        stage_rank = torch.distributed.get_rank(pp_group)
        params = _local(init_gpt(cfg, torch.Generator().manual_seed(0), DT), cfg, ep_rank)
        s = S.build(name, 2, M)
        step = gpt_pipeline_step(gpt_program(cfg, s, stage_rank, parallel=ParallelContext(dispatcher=d)),
                                 params, _state(cfg, imbalanced), _batches(cfg, ep_rank, M), group=pp_group)
        grads = {k: v.tolist() for k, v in _flat(step.grads).items()}
        out[(kind, rpn, name)] = (ep_rank, float(step.loss), grads)
    return out


def _pp2_ranks(rank: int, world: int, cases: list, overlap_cases: list) -> dict:
    """One pp 2 x EP rank's answers for both tests below (`_rank`'s and `_overlap_rank`'s): one start of
    the 4 ranks rather than one per test."""
    return {"stages": _rank(rank, world, cases), "overlap": _overlap_rank(rank, world, overlap_cases, 2)}


@pytest.fixture(scope="module")
def pp2_runs() -> list[dict]:
    """Each pp 2 x EP rank's {"stages": {case: ...}, "overlap": {(case, overlap): ...}} (`_pp2_ranks`)."""
    return [r.value for r in shared_ranks(2 * EP, "pipeline_ep")]


def test_ep_inside_pipeline_stages_matches_per_rank_oracles(pp2_runs: list[dict]) -> None:
    for kind, rpn, name, mtp, imbalanced in CASES:
        cfg = _cfg(mtp, imbalanced)
        got = [r["stages"][(kind, rpn, name)] for r in pp2_runs]
        want_sum = assert_equal_to_oracles(cfg, imbalanced, got, (kind, name))
        if imbalanced:  # the first EP rank's experts received no token: only their zero gradient flows
            w = want_sum[f"layers.{cfg.num_dense_layers}.moe.experts.w_gate_up"]
            assert torch.count_nonzero(w[:L]) == 0 and torch.count_nonzero(w[L:]) > 0


OVERLAP_CASES = [("alltoall", 2, "dualpipev", True), ("alltoall", 2, "interleaved+extra", False),
                 ("allgather", 2, "dualpipev+dw_detach", True), ("hierarchical", 1, "dualpipe", False),
                 ("hierarchical", 2, "dualpipev", True)]


def _overlap_rank(rank: int, world: int, cases: list, pp: int) -> dict:
    """Each case with fb overlap on and off; returns {(case, overlap): (loss, grads)}."""
    out, layouts = {}, {}
    for kind, rpn, name, imbalanced in cases:
        if rpn not in layouts:
            layouts[rpn] = ParallelLayout(pp=pp, ep=EP, topology=Topology(world, rpn))
        layout = layouts[rpn]
        d = _dispatcher(kind, layout)
        cfg = _cfg(True, imbalanced)
        ep_rank = torch.distributed.get_rank(layout.group("expert"))
        pp_group = layout.group("pp")
        s = S.build(name, pp, M)
        for overlap in (True, False):
            params = _local(init_gpt(cfg, torch.Generator().manual_seed(0), DT), cfg, ep_rank)
            step = gpt_pipeline_step(gpt_program(cfg, s, torch.distributed.get_rank(pp_group),
                                                 parallel=ParallelContext(dispatcher=d)),
                                     params, _state(cfg, imbalanced), _batches(cfg, ep_rank, M),
                                     group=pp_group, options=ExecOptions(overlap=overlap))
            grads = {k: v.tolist() for k, v in _flat(step.grads).items()}
            out[(kind, rpn, name, overlap)] = (ep_rank, float(step.loss), grads)
    return out


PP1_OVERLAP_CASES = [("alltoall", 2, "combined_1f1b", True), ("allgather", 2, "combined_1f1b", False),
                     ("hierarchical", 1, "combined_1f1b", False)]


def _pp1_ranks(rank: int, world: int) -> dict:
    """One pp 1 x EP rank's answers for the tests below that run on 2 ranks (`_overlap_rank`'s at pp 1,
    `_chain_completion`'s and `_donated_rank`'s): one start of the 2 ranks rather than one per test."""
    return {"overlap": _overlap_rank(rank, world, PP1_OVERLAP_CASES, 1),
            "chain": _chain_completion(rank, world), "donated": _donated_rank(rank, world)}


def _donated_rank(rank: int, world: int) -> dict:
    """`_overlap_rank`'s first pp 1 case with the CPU's buffer paths at every size (fmoe/ops/_donate.py's
    rule taken down to these shapes): without fb overlap each phase's backward is plain autograd, so the
    experts write dx over the rows the all-to-all delivered and run SwiGLU + down by expert block; with it
    the weight gradients wait for the dw pass and nothing is donated. Returns {overlap: (ep_rank, loss,
    grads, times the rows took their gradient)}."""
    import fmoe.ops._donate as donate
    import fmoe.ops._grouped_linear as grouped

    calls = [0]
    over = grouped._dx_over

    def counted(*a, **k):
        calls[0] += 1
        return over(*a, **k)

    size, donate.ALWAYS_MAPPED_BYTES, grouped._dx_over = donate.ALWAYS_MAPPED_BYTES, 0, counted
    try:
        kind, rpn, name, imbalanced = PP1_OVERLAP_CASES[0]
        layout = ParallelLayout(pp=1, ep=EP, topology=Topology(world, rpn))
        d = _dispatcher(kind, layout)
        cfg = _cfg(True, imbalanced)
        ep_rank = torch.distributed.get_rank(layout.group("expert"))
        out = {}
        for overlap in (True, False):
            calls[0] = 0
            params = _local(init_gpt(cfg, torch.Generator().manual_seed(0), DT), cfg, ep_rank)
            step = gpt_pipeline_step(gpt_program(cfg, S.build(name, 1, M), 0,
                                                 parallel=ParallelContext(dispatcher=d)),
                                     params, _state(cfg, imbalanced), _batches(cfg, ep_rank, M),
                                     group=layout.group("pp"), options=ExecOptions(overlap=overlap))
            grads = {k: v.tolist() for k, v in _flat(step.grads).items()}
            out[overlap] = (ep_rank, float(step.loss), grads, calls[0])
        return out
    finally:
        donate.ALWAYS_MAPPED_BYTES, grouped._dx_over = size, over


@pytest.fixture(scope="module")
def pp1_runs() -> list[dict]:
    """Each pp 1 x EP rank's {"overlap": {(case, overlap): ...}, "chain": ...} (`_pp1_ranks`)."""
    return [r.value for r in shared_ranks(EP, "pipeline_ep")]


@pytest.mark.parametrize("pp,cases", [(2, OVERLAP_CASES), (1, PP1_OVERLAP_CASES)], ids=["pp2xep2", "pp1xep2"])
def test_fb_overlap_equals_pairs_in_order_and_the_oracle(pp: int, cases: list,
                                                         request: pytest.FixtureRequest) -> None:
    # each on the ranks of its fixture, started once for the tests that share them
    values = [r["overlap"] for r in request.getfixturevalue("pp2_runs" if pp == 2 else "pp1_runs")]
    for kind, rpn, name, imbalanced in cases:
        oracles = [_oracle(_cfg(True, imbalanced), imbalanced, e, M) for e in range(EP)]
        for v in values:
            ep_rank, loss_on, grads_on = v[(kind, rpn, name, True)]
            _, loss_off, grads_off = v[(kind, rpn, name, False)]
            assert loss_on == pytest.approx(loss_off, rel=1e-13) == oracles[ep_rank][0], (kind, name)
            assert grads_on.keys() == grads_off.keys()
            for k in grads_on:
                torch.testing.assert_close(torch.tensor(grads_on[k]), torch.tensor(grads_off[k]), rtol=1e-12,
                                           atol=1e-14, msg=f"{kind} {name} {k}")


def _chain_completion(rank: int, world: int) -> tuple[float, float]:
    import time

    from fmoe.parallel import LinkModel, all_to_all_async
    from fmoe.parallel.phased import Chain

    comm = CommGroup(torch.distributed.group.WORLD, link_model=LinkModel(intra_latency_s=0.05))
    t0 = time.perf_counter()
    out, h = all_to_all_async(torch.ones(2, 3), comm)
    chain = Chain((out, [h]), lambda r: (r, []))  # a last step that issues nothing, as every exchange has
    time.sleep(0.2)
    chain.wait()
    return h.not_before - t0, chain.completed_at - t0


def test_the_cpu_buffer_paths_inside_an_ep_step_give_the_oracle_gradients(pp1_runs: list[dict]) -> None:
    kind, rpn, name, imbalanced = PP1_OVERLAP_CASES[0]
    for overlap in (True, False):
        got = [r["donated"][overlap] for r in pp1_runs]
        assert_equal_to_oracles(_cfg(True, imbalanced), imbalanced, got, (kind, name, overlap))
        donated = [n for *_, n in got]
        assert all(n > 0 for n in donated) if not overlap else donated == [0] * EP, (overlap, donated)


def test_an_exchange_completes_when_the_link_model_says_not_when_waited(pp1_runs: list[dict]) -> None:
    for r in pp1_runs:
        modelled, completed = r["chain"]
        assert completed == pytest.approx(modelled) and completed < 0.15, r.value


def _ep_parts(rank: int, world: int) -> dict:
    """This module's answers on the session's shared starts of the ranks: `_pp2_ranks`' at pp 2 x EP,
    `_pp1_ranks`' at pp 1 x EP."""
    return _pp2_ranks(rank, world, CASES, OVERLAP_CASES) if world == 2 * EP else _pp1_ranks(rank, world)


share_ranks("pipeline_ep", (EP, 2 * EP), _ep_parts)
