"""The MoE block under tensor and sequence parallelism, TP extending EP, on gloo ranks against one process.

Oracle: `fmoe.model.block` with whole weights in one process (itself checked against attention + the loop
oracle in tests/test_moe_block.py), differentiated by torch.func.vjp in fp64. Each rank holds its tp
shard of the attention (fmoe.tp_layout.shard_block), the replicated norms, router and shared expert, and
L = E / (tp x ep) whole experts (TP extends EP: the expert group is every rank here). Without sequence
parallelism x and y are replicated and every rank gets the whole cotangent; with it each rank holds its
positions of every sequence. Each rank's output, balancing loss, input gradient and weight gradients
must equal the oracle's (or its shard of them), and so must the next expert bias (the load summed over
the group).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from dist_utils import RankResult, share_ranks, shared_ranks

from fmoe.block import init_block
from fmoe.config import GPTConfig, MoEConfig
from fmoe.layer import init_moe_state
from fmoe.model import block
from fmoe.parallel import AllGatherDispatcher, CommGroup, HierarchicalDispatcher
from fmoe.parallel.alltoall import AllToAllDispatcher
from fmoe.parallel.context import ParallelContext
from fmoe.tp_layout import shard_block
from fmoe.transforms import split_vjp
from fmoe.transforms.testing import assert_close

DT = torch.float64
B, S, E = 2, 4, 4


def _cfg(**moe_kw) -> GPTConfig:
    moe_kw = {"top_k": 2, "num_shared_experts": 1, **moe_kw}
    moe = MoEConfig(d_model=8, d_ff=6, num_experts=E, aux_loss_coef=0.01, seq_aux_loss_coef=0.02,
                    z_loss_coef=0.001, bias_update_rate=0.1, **moe_kw)
    return GPTConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, moe=moe, qk_norm=True)


def _data(cfg: GPTConfig, seed: int, batch: int = 0) -> dict:
    """The block's params and state (the same for every batch) and batch `batch`'s input and cotangent."""
    g = torch.Generator().manual_seed(seed)
    params = init_block(cfg, g, DT)
    state = init_moe_state(cfg.moe)
    state["expert_bias_E"] = torch.tensor([0.02, -0.01, 0.0, 0.01])
    g.manual_seed(seed + 1000 * (batch + 1))
    return {"params": params, "state": state, "x": torch.randn(B, S, 8, generator=g, dtype=DT),
            "ct": torch.randn(B, S, 8, generator=g, dtype=DT)}


def _oracle(cfg: GPTConfig, d: dict) -> dict:
    def f(p, x):
        y, aux = block(p, x, cfg, d["state"])
        return y, aux.loss

    (y, loss), vjp = torch.func.vjp(f, d["params"], d["x"])
    dp, dx = vjp((d["ct"], torch.ones((), dtype=DT)))
    _, aux = block(d["params"], d["x"], cfg, d["state"])
    return {"y": y, "loss": loss, "dx": dx, "dp": dp, "bias": aux.new_state["expert_bias_E"]}


def _local(params: dict, cfg: GPTConfig, tp_rank: int, tp: int, expert_rank: int, experts: int) -> dict:
    """The params of a rank: its attention shard (tp rank of tp), the replicated rest, and its
    L = E / experts whole experts (expert rank of the ep x tp expert group)."""
    mine = shard_block(params, cfg, tp_rank, tp)
    L = E // experts
    mine["moe"] = {**mine["moe"], "experts": {k: v[expert_rank * L:(expert_rank + 1) * L]
                                              for k, v in params["moe"]["experts"].items()}}
    return mine


def _positions(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[1] // size
    return t[:, rank * n:(rank + 1) * n]


def _rank(rank: int, world: int, tp: int, seed: int, sequence_parallel: bool, engine: str,
          kind: str = "alltoall") -> dict:
    """Rank `rank` of ep x tp (ep = world / tp): ep rank e = rank // tp runs batch e with the
    tp ranks e*tp .. e*tp+tp-1; the expert group is every rank."""
    torch.manual_seed(0)
    groups = [torch.distributed.new_group(list(range(e * tp, (e + 1) * tp))) for e in range(world // tp)]
    e, t = divmod(rank, tp)
    comm = CommGroup(groups[e])
    cfg = _cfg()
    d = _data(cfg, seed, e)
    params = _local(d["params"], cfg, t, tp, rank, world)
    x, ct = d["x"], d["ct"]
    if sequence_parallel:
        x, ct = _positions(x, t, tp), _positions(ct, t, tp)
    expert = CommGroup(torch.distributed.group.WORLD)
    if kind == "alltoall":
        dispatcher = AllToAllDispatcher(expert, E)
    elif kind == "allgather":
        dispatcher = AllGatherDispatcher(expert, E)
    else:  # nodes of tp ranks: intra {0, 1}, {2, 3}; inter {0, 2}, {1, 3} (every rank builds every group)
        intra = [torch.distributed.new_group([2 * a, 2 * a + 1]) for a in range(world // 2)]
        inter = [torch.distributed.new_group([i, i + 2]) for i in range(2)]
        dispatcher = HierarchicalDispatcher(CommGroup(inter[rank % 2]), CommGroup(intra[rank // 2]), E)

    def f(p, x_):
        y, aux = block(p, x_, cfg, d["state"],
                       parallel=ParallelContext(tp=comm, sequence_parallel=sequence_parallel,
                                                dispatcher=dispatcher))
        return y, aux.loss

    if engine == "vjp":
        (y, loss), vjp = torch.func.vjp(f, params, x)
        dp, dx = vjp((ct, torch.ones((), dtype=DT)))
    else:  # split_vjp: weight gradients deferred to a second call
        (y, loss), vjp_dx = split_vjp(f, params, x)
        (dx,), vjp_dw = vjp_dx((ct, torch.ones((), dtype=DT)))
        dp = vjp_dw()
    _, aux = block(params, x, cfg, d["state"],
                   parallel=ParallelContext(tp=comm, sequence_parallel=sequence_parallel,
                                            dispatcher=dispatcher))
    got = {"y": y, "loss": loss, "dx": dx, "dp": dp, "bias": aux.new_state["expert_bias_E"]}
    return torch.utils._pytree.tree_map(lambda v: (tuple(v.shape), v.flatten().tolist()), got)


def _is_packed(v: object) -> bool:
    """A tensor as a rank returns it: (shape, values)."""
    return isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], list)


def _back(v: tuple) -> torch.Tensor:
    return torch.tensor(v[1], dtype=DT).reshape(v[0])


# per world size, the block cases (tp, seed, sequence parallel, engine, dispatcher) its tests check
TP_CASES = [(2, 3, sp, engine, "alltoall") for sp in (False, True) for engine in ("vjp", "split")]
TP_EP_CASES = [(2, 5, sp, "split", kind) for sp, kind in ((False, "alltoall"), (True, "alltoall"),
                                                           (False, "hierarchical"), (True, "allgather"))]
BLOCK_CASES = {2: TP_CASES, 4: TP_EP_CASES}
PROPERTY_EXAMPLES = 12


def _all_parts(rank: int, world: int) -> dict:
    """This rank's answers for every spawned test of this file at `world` ranks (2 or 4): each block case
    of BLOCK_CASES (its own seed and groups), and at 2 ranks the property search, one after the other on
    one start of the ranks (a rank's start costs seconds)."""
    out = {case: _rank(rank, world, *case) for case in BLOCK_CASES[world]}
    if world == 2:
        out["property"] = _property(rank, world, PROPERTY_EXAMPLES)
    return out


# on the session's shared starts of the ranks (tests/dist_utils.py)
share_ranks("tensor_parallel_moe", (2, 4), _all_parts)


@pytest.fixture(scope="module")
def ranks_at() -> Callable[[int], list[RankResult]]:
    """`ranks_at(world)`: each rank's RankResult of `_all_parts` at `world` ranks, spawned on first use and
    kept for the module."""
    return lambda world: shared_ranks(world, "tensor_parallel_moe")


def _check(ranks_at: Callable, world: int, tp: int, seed: int, sequence_parallel: bool, engine: str,
           kind: str = "alltoall") -> None:
    cfg = _cfg()
    wants = [_oracle(cfg, _data(cfg, seed, e)) for e in range(world // tp)]
    # an expert's gradient sums the tokens of every batch routed to it
    expert_grads = {k: sum(w["dp"]["moe"]["experts"][k] for w in wants)
                    for k in wants[0]["dp"]["moe"]["experts"]}
    out = ranks_at(world)
    for rank, r in enumerate(out):
        e, t = divmod(rank, tp)
        want = wants[e]
        got = torch.utils._pytree.tree_map(_back, r.value[(tp, seed, sequence_parallel, engine, kind)],
                                           is_leaf=_is_packed)
        cut = (lambda x, t=t: _positions(x, t, tp)) if sequence_parallel else (lambda x: x)
        assert_close(got["y"], cut(want["y"]))
        assert_close(got["loss"], want["loss"])
        assert_close(got["dx"], cut(want["dx"]))
        assert_close(got["bias"], want["bias"])
        dp = {**want["dp"], "moe": {**want["dp"]["moe"], "experts": expert_grads}}
        assert_close(got["dp"], _local(dp, cfg, t, tp, rank, world))


@pytest.mark.parametrize("case", TP_CASES, ids=lambda c: f"sp{int(c[2])}-{c[3]}")
def test_moe_block_under_tp_equals_one_process(case: tuple, ranks_at: Callable) -> None:
    _check(ranks_at, 2, *case)


@pytest.mark.parametrize("case", TP_EP_CASES, ids=lambda c: f"sp{int(c[2])}-{c[4]}")
def test_tp_extends_ep_experts_whole_over_the_ep_x_tp_group(case: tuple, ranks_at: Callable) -> None:
    """tp 2 x ep 2 on 4 ranks: two batches, each on a tp pair; every rank owns one whole expert and
    dispatches its own tokens to all four, by each dispatcher (hierarchical: nodes of two ranks)."""
    _check(ranks_at, 4, *case)


def _property(rank: int, world: int, n: int) -> int:
    """A derandomized hypothesis search on every rank (the same draws everywhere, so the collectives pair
    up): the tp MoE block against the one-process block computed on this rank, fp64. Returns the
    examples checked."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    comm = CommGroup(torch.distributed.group.WORLD)
    dispatcher = AllToAllDispatcher(comm, E)
    seen = []

    @settings(derandomize=True, max_examples=n, deadline=None, database=None)
    @given(st.integers(0, 2**16), st.integers(1, E), st.integers(0, 1), st.booleans(), st.booleans(),
           st.integers(1, 2), st.integers(1, 2))
    @example(0, E, 1, False, True, 1, 1)  # top-k = E; one position per rank; one sequence
    @example(1, 1, 0, True, False, 2, 1)  # one slot, gate weights in the expert: experts with no token
    def check(seed: int, top_k: int, shared: int, in_expert: bool, sp: bool, b: int, s: int) -> None:
        cfg = _cfg(top_k=top_k, num_shared_experts=shared, probs_in_expert=in_expert)
        g = torch.Generator().manual_seed(seed)
        full = init_block(cfg, g, DT)
        state = {"expert_bias_E": torch.randn(E, generator=g, dtype=torch.float32) * 0.01}
        x = torch.randn(b, s * world, 8, generator=g, dtype=DT)
        ct = torch.randn(b, s * world, 8, generator=g, dtype=DT)

        def one(p, x_):
            y, aux = block(p, x_, cfg, state)
            return y, aux.loss

        (y_, loss_), vjp_ = torch.func.vjp(one, full, x)
        dp_, dx_ = vjp_((ct, torch.ones((), dtype=DT)))
        cut = (lambda v: _positions(v, rank, world)) if sp else (lambda v: v)

        def mine(p, x_):
            y, aux = block(p, x_, cfg, state,
                           parallel=ParallelContext(tp=comm, sequence_parallel=sp, dispatcher=dispatcher))
            return y, aux.loss

        (y, loss), vjp = torch.func.vjp(mine, _local(full, cfg, rank, world, rank, world), cut(x))
        dp, dx = vjp((cut(ct), torch.ones((), dtype=DT)))
        assert_close((y, loss, dx), (cut(y_), loss_, cut(dx_)))
        assert_close(dp, _local(dp_, cfg, rank, world, rank, world))
        seen.append(1)

    check()
    return len(seen)


def test_tp_moe_block_properties_on_two_ranks(ranks_at: Callable) -> None:
    for r in ranks_at(2):
        assert r.value["property"] >= PROPERTY_EXAMPLES
