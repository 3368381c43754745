"""Expert-parallel dispatchers against a single-process oracle of the same MoE expert computation.

Legend: P ranks, T tokens (per rank; Tg global), K top-k, E global experts, L = E / P local experts,
D width, F expert output width, R = T*K expert-sorted rows of this rank (dropless), M rows this rank's
experts receive (legend of docs/moe.md).

Oracle (one process, whole global batch): y_t = sum_k probs[t, k] * tanh(x_t @ w[ids[t, k]]), with its
`torch.func.vjp` for dx, dprobs and dw. Every rank runs the expert-parallel version on its own tokens
and local experts, in each use of an exchange: "sync" (the layer's dispatch / combine through
`split_vjp`; grouped_linear defers dw on the tape) and "phased" (the pipeline's issue / wait exchanges
and their transposes, the compute between them under torch.func.vjp); for each dispatcher (hierarchical
on 2 simulated nodes), each entry point (token level; row level with probs applied after combine; row
level with probs_M applied before combine) and each routing case (random; every token to the last
rank's experts; a rank with no tokens and a rank that receives none; top-k = E; one rank that neither
sends nor receives a row).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from dist_utils import RankResult, share_ranks, shared_ranks

from fmoe.ops import grouped_linear
from fmoe.parallel import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    CommCounters,
    CommGroup,
    HierarchicalDispatcher,
    ParallelLayout,
    Topology,
    experts_per_rank,
)
from fmoe.parallel.phased import phased
from fmoe.parallel.topology import INTER
from fmoe.transforms.split_vjp import split_vjp
from fmoe.transforms.testing import assert_close

D, F, L = 4, 3, 2
DT = torch.float64
DISPATCHERS = ("alltoall", "allgather", "hierarchical")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_case(case: int, P: int) -> dict:
    """Global batch for routing case `case` on P ranks: tokens per rank, x, ids, probs, w, cotangent."""
    E = L * P
    g = _gen(1000 * case + P)
    K = E if case == 3 else 2
    T_P = [int(t) for t in torch.randint(1, 6, (P,), generator=g)]
    if case == 2:
        T_P[0] = 0  # a rank with no tokens
    if case == 4:
        T_P[1] = 0  # rank 1 sends nothing (and, below, receives nothing)
    Tg = sum(T_P)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(Tg)]) if Tg else \
        torch.zeros(0, K, dtype=torch.int64)
    if case == 1:  # every token to the last rank's experts
        ids = torch.stack([torch.randperm(L, generator=g)[:K] + (P - 1) * L for _ in range(Tg)])
    if case in (2, 4):  # nothing routed to rank 1's experts
        allowed = torch.tensor([e for e in range(E) if e // L != 1])
        ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(Tg)])
    return {
        "T_P": T_P, "K": K, "E": E,
        "x": torch.randn(Tg, D, generator=g, dtype=DT),
        "ids": ids,
        "probs": torch.rand(Tg, K, generator=g, dtype=DT),
        "w": torch.randn(E, D, F, generator=g, dtype=DT) * 0.5,
        "ct": torch.randn(Tg, F, generator=g, dtype=DT),
    }


def oracle(w_EDF: torch.Tensor, x_TD: torch.Tensor, probs_TK: torch.Tensor,
           ids_TK: torch.Tensor) -> torch.Tensor:
    """y_TF = sum_k probs[t, k] * tanh(x_t @ w[ids[t, k]]): a plain loop over top-k slots."""
    y = x_TD.new_zeros(x_TD.shape[0], w_EDF.shape[2])
    for k in range(ids_TK.shape[1]):
        y = y + probs_TK[:, k:k + 1] * torch.tanh(torch.einsum("td,tdf->tf", x_TD, w_EDF[ids_TK[:, k]]))
    return y


def ep_forward(d, entry: str, w_LDF: torch.Tensor, x_TD: torch.Tensor, probs_TK: torch.Tensor,
               ids_TK: torch.Tensor, E: int) -> torch.Tensor:
    """The expert-parallel computation of `oracle` for this rank's tokens, through dispatcher `d`."""
    def experts(x_MD, counts_L):
        return torch.tanh(grouped_linear(x_MD, w_LDF, counts_L))

    if entry == "tokens":
        x_MD, counts_L, meta = d.dispatch_tokens(x_TD, ids_TK, probs_TK)
        return d.combine_tokens(experts(x_MD, counts_L), meta)
    K = ids_TK.shape[1]
    order_R = torch.argsort(ids_TK.reshape(-1), stable=True)  # permute-1
    token_R = order_R // K
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E)
    probs_R = probs_TK.reshape(-1).index_select(0, order_R)
    x_RD = x_TD.index_select(0, token_R)
    if entry == "rows":
        x_MD, counts_L, probs_M, meta = d.dispatch(x_RD, counts_E)
        assert probs_M is None
        y_RD = d.combine(experts(x_MD, counts_L), meta) * probs_R[:, None]
    else:  # "rows_probs": weight before combine with the probabilities moved by dispatch
        x_MD, counts_L, probs_M, meta = d.dispatch(x_RD, counts_E, probs_R)
        y_RD = d.combine(experts(x_MD, counts_L) * probs_M[:, None], meta)
    return y_RD.new_zeros(x_TD.shape[0], y_RD.shape[1]).index_add(0, token_R, y_RD)


def _stage(params: dict, x_TD: torch.Tensor, probs_TK: torch.Tensor, *, d, entry: str,
           ids_TK: torch.Tensor, E: int) -> torch.Tensor:
    return ep_forward(d, entry, params["w"], x_TD, probs_TK, ids_TK, E)


def _sync(d, entry: str, c: dict, mine: slice, rank: int, E: int) -> tuple:
    """(y, dx, dprobs, dw) through the synchronous dispatch / combine, differentiated by split_vjp."""
    params = {"w": c["w"][rank * L:(rank + 1) * L].clone()}
    f = partial(_stage, d=d, entry=entry, ids_TK=c["ids"][mine], E=E)
    y, vjp_dx = split_vjp(f, params, c["x"][mine], c["probs"][mine])
    (dx, dp), vjp_dw = vjp_dx(c["ct"][mine])
    return y, dx, dp, vjp_dw()["w"]


def _phased(d, entry: str, c: dict, mine: slice, rank: int, E: int) -> tuple:
    """(y, dx, dprobs, dw) as the pipeline runs an exchange: the compute between them under torch.func.vjp,
    the exchanges and their transposes issued and waited (fmoe.parallel.phased)."""
    ids_TK, w_LDF = c["ids"][mine], c["w"][rank * L:(rank + 1) * L].clone()
    K = ids_TK.shape[1]
    order_R = torch.argsort(ids_TK.reshape(-1), stable=True)  # permute-1
    ex = phased(d, token_level=entry == "tokens")
    if entry == "tokens":
        plan = ex.start_plan(SimpleNamespace(ids_TK=ids_TK)).wait()
    else:
        counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E)
        layout = SimpleNamespace(counts_E=counts_E, num_rows=len(order_R))
        plan = ex.start_plan(SimpleNamespace(layout=layout)).wait()

    def pre(x_TD, probs_TK):
        if entry == "tokens":
            return {"normed_TD": x_TD, "probs_TK": probs_TK}
        rows = {"rows_RD": x_TD.index_select(0, order_R // K)}
        if entry == "rows_probs":
            rows["probs_R"] = probs_TK.reshape(-1).index_select(0, order_R)
        return rows

    def mid(w, moved):
        y_MD = torch.tanh(grouped_linear(plan.to_experts(moved["rows_MD"]), w, plan.counts_L))
        if "probs_M" in moved:  # gate weights applied at the experts
            y_MD = y_MD * plan.to_experts(moved["probs_M"])[:, None]
        return {"rows_MD": plan.from_experts(y_MD)}

    def post(back, probs_TK):
        if entry == "tokens":
            return back["y_TD"]
        y_RD = back["rows_RD"]
        if entry == "rows":
            y_RD = y_RD * probs_TK.reshape(-1).index_select(0, order_R)[:, None]
        return y_RD.new_zeros(len(ids_TK), y_RD.shape[1]).index_add(0, order_R // K, y_RD)

    acts, vjp_pre = torch.func.vjp(pre, c["x"][mine], c["probs"][mine])
    moved = ex.start_dispatch(plan, acts).wait()
    y_M, vjp_mid = torch.func.vjp(mid, w_LDF, moved)
    back = ex.start_combine(plan, y_M).wait()
    y, vjp_post = torch.func.vjp(post, back, c["probs"][mine])
    ct_back, dp_post = vjp_post(c["ct"][mine])
    dw, ct_moved = vjp_mid(ex.start_combine_transpose(plan, ct_back).wait())
    dx, dp = vjp_pre(ex.start_dispatch_transpose(plan, ct_moved).wait())
    return y, dx, dp + dp_post, dw


USES = {"sync": _sync, "phased": _phased}


def _entries(name: str, use: str) -> tuple[str, ...]:
    """The entry points of dispatcher `name` in `use`: the pipeline has a token-level exchange for the
    hierarchical dispatcher only."""
    if use == "phased" and name != "hierarchical":
        return ("rows", "rows_probs")
    return ("tokens", "rows", "rows_probs")


def _check_rank(rank: int, world: int, ranks_per_node: int, use: str) -> dict:
    topo = Topology(world, ranks_per_node)
    layout = ParallelLayout(ep=world, topology=topo)
    counters = CommCounters()

    def cg(name: str) -> CommGroup:
        return CommGroup(layout.group(name), topology=topo, counters=counters)

    E = L * world
    dispatchers = {
        "alltoall": AllToAllDispatcher(cg("expert"), E),
        "allgather": AllGatherDispatcher(cg("expert"), E),
        "hierarchical": HierarchicalDispatcher(cg("expert_inter"), cg("expert_intra"), E),
    }
    report: dict = {"checked": 0}
    for case in range(5):
        c = make_case(case, world)
        lo = sum(c["T_P"][:rank])
        mine = slice(lo, lo + c["T_P"][rank])
        y_ref, vjp_ref = torch.func.vjp(partial(oracle, ids_TK=c["ids"]), c["w"], c["x"], c["probs"])
        dw_ref, dx_ref, dp_ref = vjp_ref(c["ct"])
        for name, d in dispatchers.items():
            for entry in _entries(name, use):
                counters.reset()
                y, dx, dp, dw = USES[use](d, entry, c, mine, rank, E)
                tag = f"case {case} {name} {entry} {use}"
                assert_close(y, y_ref[mine], msg=tag)
                assert_close(dx, dx_ref[mine], msg=tag)
                assert_close(dp, dp_ref[mine], msg=tag)
                assert_close(dw, dw_ref[rank * L:(rank + 1) * L], msg=tag)
                if dx.numel() and dx_ref[mine].abs().sum() > 0:
                    assert dx.abs().sum() > 0, f"{tag}: zero input gradient"
                if name == "hierarchical" and entry == "tokens":
                    # dedup: one crossing per (token, remote node that owns one of its experts).
                    node_TK = c["ids"][mine] // (L * ranks_per_node)
                    me_node = topo.node_of(rank)
                    pairs = sum(len(set(row.tolist()) - {me_node}) for row in node_TK)
                    assert counters.sent.get(("hier.inter.dispatch", INTER), 0) == pairs * D * 8, tag
                report["checked"] += 1
    if world == 4:  # TP extends EP: ep 2 x tp 2, the expert group is all 4 ranks, each owns E/4 experts
        tl = ParallelLayout(ep=2, tp=2, topology=topo)
        assert tl.size("expert") == 4 and tl.size("tp") == 2 and tl.size("ep") == 2
        assert experts_per_rank(E, 2, 2) == L
        report["tp_groups"] = (torch.distributed.get_process_group_ranks(tl.group("tp")),
                               torch.distributed.get_process_group_ranks(tl.group("ep")))
    return report


RANKS_PER_NODE = {2: 1, 4: 2}  # world -> ranks per node


def _every_use(rank: int, world: int) -> dict:
    """`_check_rank` in each use, one after the other on the same ranks (a rank's start costs seconds)."""
    return {use: _check_rank(rank, world, RANKS_PER_NODE[world], use) for use in USES}


# on the session's shared starts of the ranks (tests/dist_utils.py)
share_ranks("parallel_dispatch", tuple(RANKS_PER_NODE), _every_use)


@pytest.fixture(scope="module")
def dispatch_at() -> Callable[[int], list[RankResult]]:
    """`dispatch_at(world)`: each rank's RankResult of `_every_use` at `world` ranks, spawned on first use
    and kept for the module."""
    return lambda world: shared_ranks(world, "parallel_dispatch")


@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("world,ranks_per_node", list(RANKS_PER_NODE.items()))
def test_dispatchers_match_single_process_oracle(world, ranks_per_node, use, dispatch_at):
    """Each exchange in both uses: the layer's synchronous dispatch / combine and the pipeline's issue /
    wait form, against the same oracle."""
    results = [dataclasses.replace(r, value=r.value[use]) for r in dispatch_at(world)]
    assert all(r.value["checked"] == 5 * sum(len(_entries(n, use)) for n in DISPATCHERS) for r in results)
    if world == 4:
        assert results[0].value["tp_groups"] == ([0, 1], [0, 2])
        assert results[3].value["tp_groups"] == ([2, 3], [1, 3])


def test_tp_extends_ep_needs_divisible_experts():
    assert experts_per_rank(16, 2, 4) == 2
    with pytest.raises(ValueError, match="divisible by tp x ep"):
        experts_per_rank(12, 2, 4)


def test_oracle_case_shapes():
    """The routing cases are what they claim: imbalanced, an empty rank, a rank receiving nothing, a rank
    that neither sends nor receives."""
    for P in (2, 4):
        c1, c2, c3, c4 = (make_case(i, P) for i in (1, 2, 3, 4))
        assert (c1["ids"] // L == P - 1).all()
        assert c2["T_P"][0] == 0 and not (c2["ids"] // L == 1).any()
        assert c3["K"] == c3["E"]
        assert c4["T_P"][1] == 0 and not (c4["ids"] // L == 1).any() and sum(c4["T_P"]) > 0
