"""End to end: the expert-parallel MoE layer equals the single-process layer, output and all gradients.

Legend: P ranks, T tokens per rank (T_P when they differ), D model width, E experts, L = E / P local
experts, K top-k.

One spawn per world size (2 ranks on 2 nodes of 1, 3 ranks on 3 nodes of 1, 4 ranks on 2 nodes of 2).
Each rank runs the layer on its tokens with its L experts and an expert-parallel dispatcher (split_vjp),
for alltoall, allgather, hierarchical (token level where `uses_token_dispatch`), and allgather /
hierarchical through the row-level seam only.
Checked: y, dx, the local experts' grads, and router / shared-expert grads summed over ranks.

Dropless configs are compared with the single-process layer `fmoe.model.moe` on the whole global batch
with all E experts: gate weights at combine; gate weights inside the expert with a shared expert; a
router biased so every token picks the last rank's experts (imbalanced, other ranks receive nothing); a
rank with no tokens whose experts nobody picks (it sends nothing and receives nothing).

Capacity configs (drop, drop-and-pad, dynamic capacity) go through the row-level seam. Capacity is
computed per rank from its local batch (C = ceil(cf * T_local * K / E), drops decided among the local
tokens), so the oracle is the single-process layer on each rank's own batch: y and dx of rank r equal
the layer on x_r alone, and the global weight gradients are the sum over ranks of those per-batch ones.

TP extends EP: with ParallelLayout(tp=2, ep=1) (world 2) and (tp=2, ep=2) (world 4) each rank of the
ep x tp expert group owns E / (tp * ep) whole experts and holds distinct tokens (sequence-parallel
input); the layer equals the single-process one on the global batch.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from dist_utils import spawn

from fmoe.config import MoEConfig
from fmoe.layer import init_moe, uses_token_dispatch
from fmoe.model import moe
from fmoe.parallel import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    CommGroup,
    HierarchicalDispatcher,
    ParallelLayout,
    Topology,
)
from fmoe.parallel.tp_extends_ep import local_expert_range
from fmoe.router import route
from fmoe.transforms.split_vjp import split_vjp
from fmoe.transforms.testing import assert_close

T, D, F = 5, 8, 6
DT = torch.float64


def _layer(params, x_TD, cfg, dispatcher=None):
    return moe(params, x_TD, cfg, dispatcher=dispatcher)[0]


class RowsOnly:
    """A dispatcher seen through the synchronous Dispatcher protocol only (no Exchange: the model runs
    its calls inline, fmoe.dispatch.sync.as_exchange)."""

    def __init__(self, inner):
        self.inner, self.num_local_experts = inner, inner.num_local_experts

    def dispatch(self, x_RD, counts_E, probs_R=None):
        return self.inner.dispatch(x_RD, counts_E, probs_R)

    def combine(self, y_MD, meta):
        return self.inner.combine(y_MD, meta)


def _cases(world: int) -> list[tuple[str, MoEConfig, str]]:
    """(name, config, routing): routing "global" (dropless, global oracle), "imbalanced", "empty" (rank
    1 has no tokens and no token picks its experts) or "per_rank" (capacity: per-rank oracle)."""
    E = 2 * world
    return [
        ("combine", MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=3), "global"),
        ("in_expert+shared", MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=2, probs_in_expert=True,
                                       num_shared_experts=1), "global"),
        ("imbalanced", MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=2), "imbalanced"),
        ("empty rank", MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=2), "empty"),
        ("drop", MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=2, capacity_factor=0.75), "per_rank"),
        ("drop+pad", MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=2, capacity_factor=1.0,
                               pad_to_capacity=True, drop_policy="position"), "per_rank"),
        ("dynamic", MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=2, dynamic_capacity_window=2),
         "per_rank"),
    ]


def _tokens_per_rank(world: int, routing: str) -> list[int]:
    return [0 if routing == "empty" and r == 1 else T for r in range(world)]


def _setup(cfg: MoEConfig, routing: str, world: int):
    """Global parameters, global batch x, cotangent, tokens per rank T_P (same seed on every rank)."""
    L = cfg.num_experts // world
    T_P = _tokens_per_rank(world, routing)
    g = torch.Generator().manual_seed(7)
    params = init_moe(cfg, g, DT)
    x = torch.randn(sum(T_P), D, generator=g, dtype=DT)
    if routing in ("imbalanced", "empty"):  # feature 0 is a large constant that steers the router
        x[:, 0] = 4.0
    if routing == "imbalanced":  # it votes for the last rank's experts only
        params["router"]["w"][0] = -5.0
        params["router"]["w"][0, (world - 1) * L:] = 5.0
    if routing == "empty":  # it votes against rank 1's experts
        params["router"]["w"][0, L:2 * L] = -5.0
    ct = torch.randn(sum(T_P), D, generator=g, dtype=DT)
    if routing == "imbalanced":
        assert (route(params["router"], x, cfg).ids_TK // L == world - 1).all()
    if routing == "empty":
        assert not (route(params["router"], x, cfg).ids_TK // L == 1).any()
    return params, x, ct, T_P


def _reference(cfg, params, x, ct, T_P, rank, routing):
    """(y, dx, dparams) of the single-process layer: rows of this rank, global weight gradients."""
    lo = sum(T_P[:rank])
    mine = slice(lo, lo + T_P[rank])
    if routing != "per_rank":
        y, vjp_dx = split_vjp(partial(_layer, cfg=cfg), params, x)
        (dx,), vjp_dw = vjp_dx(ct)
        return y[mine], dx[mine], vjp_dw()
    # capacity per rank: the layer on this rank's batch alone; weight grads summed over the ranks' batches
    y, vjp_dx = split_vjp(partial(_layer, cfg=cfg), params, x[mine])
    (dx,), vjp_dw = vjp_dx(ct[mine])
    dp = vjp_dw()
    for tree in dp.values():
        for v in tree.values():
            dist.all_reduce(v)  # oracle-side sum of the per-rank single-process grads (plain c10d)
    return y, dx, dp


def _dispatchers(cfg: MoEConfig, expert, inter, intra) -> dict:
    E = cfg.num_experts
    runs = {
        "alltoall": AllToAllDispatcher(expert, E),
        "allgather": AllGatherDispatcher(expert, E),
        "hierarchical": HierarchicalDispatcher(inter, intra, E),
    }
    if uses_token_dispatch(runs["hierarchical"], cfg):
        # moe() takes the token-level entry; check the row-level seam of the same dispatchers too
        for rows_name in ("allgather", "hierarchical"):
            runs[f"{rows_name}/rows"] = RowsOnly(runs[rows_name])
    return runs


def _compare(tag, cfg, local, x_mine, ct_mine, ref, experts_mine, dispatcher) -> None:
    y_ref, dx_ref, dp_ref = ref
    y, vjp_dx = split_vjp(partial(_layer, cfg=cfg, dispatcher=dispatcher), local, x_mine)
    (dx,), vjp_dw = vjp_dx(ct_mine)
    dp = vjp_dw()
    assert_close(y, y_ref, msg=tag)
    assert_close(dx, dx_ref, msg=tag)
    if dx_ref.numel():
        assert dx.abs().sum() > 0, tag
    for k, v in dp["experts"].items():
        assert_close(v, dp_ref["experts"][k][experts_mine], msg=f"{tag} experts.{k}")
        assert v.abs().sum() > 0 or dp_ref["experts"][k][experts_mine].abs().sum() == 0, tag
    for part in ("router", "shared"):  # replicated weights: per-rank grads sum to the global one
        for k, v in dp.get(part, {}).items():
            total = v.clone()
            dist.all_reduce(total)
            assert_close(total, dp_ref[part][k], msg=f"{tag} {part}.{k}")


def _check_rank(rank: int, world: int, ranks_per_node: int) -> dict:
    topo = Topology(world, ranks_per_node)
    layout = ParallelLayout(ep=world, topology=topo)

    def cg(name, lay=layout, top=topo):
        return CommGroup(lay.group(name), topology=top, counters=None)

    checked: dict[str, int] = {}
    for name, cfg, routing in _cases(world):
        L = cfg.num_experts // world
        params, x, ct, T_P = _setup(cfg, routing, world)
        ref = _reference(cfg, params, x, ct, T_P, rank, routing)
        lo = sum(T_P[:rank])
        mine = slice(lo, lo + T_P[rank])
        experts_mine = slice(rank * L, (rank + 1) * L)
        local = dict(params, experts={k: v[experts_mine].clone() for k, v in params["experts"].items()})
        for run_name, d in _dispatchers(cfg, cg("expert"), cg("expert_inter"), cg("expert_intra")).items():
            _compare(f"{name} {run_name}", cfg, local, x[mine], ct[mine], ref, experts_mine, d)
            checked[name] = checked.get(name, 0) + 1
    # TP extends EP: tp=2 (x ep=world/2); the tp ranks share a node; tokens distinct per rank.
    tp, ep = 2, world // 2
    if world % 2 == 0:
        ttopo = Topology(world, max(ranks_per_node, tp))
        tl = ParallelLayout(tp=tp, ep=ep, topology=ttopo)
        assert tl.size("tp") == tp and tl.size("expert") == world
        q = tl.local_rank("expert")
        cfg = MoEConfig(d_model=D, d_ff=F, num_experts=2 * world, top_k=3)
        params, x, ct, T_P = _setup(cfg, "global", world)
        ref = _reference(cfg, params, x, ct, T_P, rank, "global")
        owned = local_expert_range(cfg.num_experts, tp, ep, q)
        experts_mine = slice(owned.start, owned.stop)
        local = dict(params, experts={k: v[experts_mine].clone() for k, v in params["experts"].items()})
        mine = slice(rank * T, (rank + 1) * T)
        tcg = partial(cg, lay=tl, top=ttopo)
        for run_name, d in _dispatchers(cfg, tcg("expert"), tcg("expert_inter"), tcg("expert_intra")).items():
            _compare(f"tp{tp}xep{ep} {run_name}", cfg, local, x[mine], ct[mine], ref, experts_mine, d)
            checked["tp"] = checked.get("tp", 0) + 1
    return checked


@pytest.mark.parametrize("world,ranks_per_node", [(2, 1), (3, 1), (4, 2)])
def test_expert_parallel_layer_equals_single_process(world, ranks_per_node):
    results = spawn(_check_rank, world, ranks_per_node, timeout_s=240)
    # runs per case: 3 dispatchers (+2 row-level where moe() takes the token-level entry)
    expect = {"combine": 5, "in_expert+shared": 3, "imbalanced": 5, "empty rank": 5,
              "drop": 3, "drop+pad": 3, "dynamic": 3}
    if world % 2 == 0:
        expect["tp"] = 5
    assert all(r.value == expect for r in results), [r.value for r in results]


def test_uneven_nodes_are_refused():
    """3 ranks cannot be split into nodes of 2: a clear error instead of a wrong topology."""
    with pytest.raises(ValueError, match="not a multiple of ranks_per_node"):
        Topology(3, 2)
