"""Tensor and sequence parallelism (fmoe/parallel/tensor.py) on gloo ranks against one process in fp64.

Oracle: the same function with whole weights in one process (plain torch: x @ w, torch.nn.functional
embedding and cross_entropy), differentiated by torch.func.vjp. Each rank differentiates its own shard
function by torch.func.vjp (and the MLP once more by split_vjp, dw deferred) with the oracle's cotangent
(its sequence shard under sequence parallelism); its input gradient must equal the oracle's (or its
shard) and its weight-shard gradient the oracle's gradient sliced the same way. Odd group sizes (3),
zero tokens, and targets that are all ignored are among the cases.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as tnf
from dist_utils import RankResult, share_ranks, shared_ranks

from fmoe.parallel import CommGroup
from fmoe.parallel.context import ParallelContext
from fmoe.parallel.tensor import (
    IGNORE_INDEX,
    column_parallel_linear,
    row_parallel_linear,
    shard_range,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from fmoe.transforms import split_vjp

DT = torch.float64
# (tokens T, width D, hidden F, vocabulary V, seed): T and F multiples of 6 so that 2 and 3 ranks split them
CASES = [(12, 4, 6, 6, 0), (6, 3, 12, 12, 1), (0, 4, 6, 6, 2), (18, 5, 6, 18, 3)]


def _data(T: int, D: int, F: int, V: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=DT)

    targets = torch.randint(0, V, (T,), generator=g)
    targets[::4] = IGNORE_INDEX  # some take no loss
    return {"x": rnd(T, D), "w1": rnd(D, F) / D ** 0.5, "w2": rnd(F, D) / F ** 0.5, "ct": rnd(T, D),
            "ids": torch.randint(0, V, (T // 6, 6), generator=g), "table": rnd(V, D),
            "ct_emb": rnd(T // 6, 6, D), "logits": rnd(T, V), "targets": targets,
            "all_ignored": torch.full((T,), IGNORE_INDEX)}


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return tnf.silu(x @ w1) @ w2


def _oracle(case: tuple) -> dict[str, torch.Tensor]:
    d = _data(*case)
    out = {}
    y, vjp = torch.func.vjp(_mlp, d["x"], d["w1"], d["w2"])
    out["y"], (out["dx"], out["dw1"], out["dw2"]) = y, vjp(d["ct"])
    e, vjp = torch.func.vjp(lambda t: tnf.embedding(d["ids"], t), d["table"])
    out["emb"], (out["dtable"],) = e, vjp(d["ct_emb"])
    for key in ("targets", "all_ignored"):
        loss, vjp = torch.func.vjp(lambda z, k=key: tnf.cross_entropy(z, d[k], ignore_index=IGNORE_INDEX)
                                   if bool((d[k] != IGNORE_INDEX).any()) else z.sum() * 0, d["logits"])
        out[f"ce_{key}"], (out[f"dlogits_{key}"],) = loss, vjp(torch.ones((), dtype=DT))
    return out


def _rank(rank: int, world: int) -> dict:
    comm = CommGroup(torch.distributed.group.WORLD)
    results = {}
    for case in CASES:
        T, D, F, V, _ = case
        d = _data(*case)
        f0, f1 = shard_range(F, comm, "F")
        v0, v1 = shard_range(V, comm, "V")
        t0, t1 = shard_range(T, comm, "T")
        w1, w2, table = d["w1"][:, f0:f1], d["w2"][f0:f1], d["table"][v0:v1]
        got = {}
        for sp in (False, True):
            x = d["x"][t0:t1] if sp else d["x"]
            ct = d["ct"][t0:t1] if sp else d["ct"]

            def mlp(x_, a, b, sp=sp):
                h = tnf.silu(column_parallel_linear(x_, a, comm, sequence_parallel=sp))
                return row_parallel_linear(h, b, comm, sequence_parallel=sp)

            y, vjp = torch.func.vjp(mlp, x, w1, w2)
            got[f"y{sp}"], (got[f"dx{sp}"], got[f"dw1{sp}"], got[f"dw2{sp}"]) = y, vjp(ct)
            def embed(t, sp=sp, ids=d["ids"], V=V):
                return vocab_parallel_embedding(ids, t, comm, V, sequence_parallel=sp)

            e, vjp = torch.func.vjp(embed, table)
            p0, p1 = shard_range(6, comm, "positions")  # sequence parallel: this rank's positions
            ct_e = d["ct_emb"][:, p0:p1] if sp else d["ct_emb"]
            got[f"emb{sp}"], (got[f"dtable{sp}"],) = e, vjp(ct_e)
        # split_vjp: the same MLP, dw deferred to the second call
        y, vjp_dx = split_vjp(lambda p, x_: row_parallel_linear(
            tnf.silu(column_parallel_linear(x_, p["w1"], comm)), p["w2"], comm), {"w1": w1, "w2": w2}, d["x"])
        (dx,), vjp_dw = vjp_dx(d["ct"])
        got["split"] = (y, dx, vjp_dw())
        for key in ("targets", "all_ignored"):
            def ce(z, targets=d[key], V=V):
                return vocab_parallel_cross_entropy(z, targets, comm, V)

            loss, vjp = torch.func.vjp(ce, d["logits"][:, v0:v1])
            got[f"ce_{key}"], (got[f"dlogits_{key}"],) = loss, vjp(torch.ones((), dtype=DT))
        # tensors leave the rank as (shape, values): a shared-memory tensor dies with its process
        results[case] = torch.utils._pytree.tree_map(lambda v: (tuple(v.shape), v.flatten().tolist()), got)
    return results


def _back(x: tuple) -> torch.Tensor:
    return torch.tensor(x[1], dtype=DT).reshape(x[0])


def _is_packed(v: object) -> bool:
    """A tensor as a rank returns it: (shape, values)."""
    return isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], list)


def _all_parts(rank: int, world: int) -> dict:
    """This rank's answers for every multi-rank test of this file at `world` ranks, by part: one start of
    the ranks for them all (a rank's start costs seconds)."""
    out = {"functions": _rank(rank, world), "dense": _dense_rank(rank, world)}
    if world == 2:
        out["uneven"], out["counted"] = _uneven(rank, world), _counted(rank, world)
    else:
        out["property"] = _property(rank, world, 25)
    return out


# on the session's shared starts of the ranks (tests/dist_utils.py)
share_ranks("tensor_parallel", (2, 3), _all_parts)


@pytest.fixture(scope="module")
def ranks_at() -> Callable[[int], list[RankResult]]:
    """`ranks_at(world)`: each rank's RankResult of `_all_parts` at `world` ranks (2 or 3), spawned on first
    use and kept for the module."""
    return lambda world: shared_ranks(world, "tensor_parallel")


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_and_sequence_parallel_functions_equal_one_process(world: int, ranks_at: Callable) -> None:
    out = ranks_at(world)
    for case in CASES:
        T, D, F, V, _ = case
        want = _oracle(case)
        for r in out:
            got = torch.utils._pytree.tree_map(_back, r.value["functions"][case], is_leaf=_is_packed)
            f = slice(r.rank * F // world, (r.rank + 1) * F // world)
            v = slice(r.rank * V // world, (r.rank + 1) * V // world)
            t = slice(r.rank * T // world, (r.rank + 1) * T // world)
            for sp in (False, True):
                rows = t if sp else slice(None)
                msg = f"world {world} case {case} rank {r.rank} sp {sp}"
                torch.testing.assert_close(got[f"y{sp}"], want["y"][rows], msg=msg)
                torch.testing.assert_close(got[f"dx{sp}"], want["dx"][rows], msg=msg)
                torch.testing.assert_close(got[f"dw1{sp}"], want["dw1"][:, f], msg=msg)
                torch.testing.assert_close(got[f"dw2{sp}"], want["dw2"][f], msg=msg)
                pos = slice(r.rank * 6 // world, (r.rank + 1) * 6 // world)
                emb = want["emb"][:, pos] if sp else want["emb"]
                torch.testing.assert_close(got[f"emb{sp}"], emb, msg=msg)
                torch.testing.assert_close(got[f"dtable{sp}"], want["dtable"][v], msg=msg)
            y, dx, dw = got["split"]
            torch.testing.assert_close(y, want["y"])
            torch.testing.assert_close(dx, want["dx"])
            torch.testing.assert_close(dw["w1"], want["dw1"][:, f])
            torch.testing.assert_close(dw["w2"], want["dw2"][f])
            for key in ("targets", "all_ignored"):
                torch.testing.assert_close(got[f"ce_{key}"], want[f"ce_{key}"], msg=f"{case} {key}")
                torch.testing.assert_close(got[f"dlogits_{key}"], want[f"dlogits_{key}"][:, v],
                                           msg=f"{case} {key}")


def _uneven(rank: int, world: int) -> str:
    comm = CommGroup(torch.distributed.group.WORLD)
    try:
        vocab_parallel_cross_entropy(torch.zeros(2, 2), torch.zeros(2, dtype=torch.long), comm, 5)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_vocabulary_the_group_does_not_split_is_refused(ranks_at: Callable) -> None:
    for r in ranks_at(2):
        assert "5 does not split over 2" in r.value["uneven"], (r.rank, r.value["uneven"])


def _property(rank: int, world: int, n: int) -> int:
    """Runs a derandomized hypothesis search on every rank (the same draws everywhere, so the ranks'
    collectives pair up): the column -> row MLP with and without sequence parallelism and the
    vocab-parallel loss, each against the whole-weight function computed on this rank, fp64. Returns the
    examples checked."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    comm = CommGroup(torch.distributed.group.WORLD)
    seen = []

    @settings(derandomize=True, max_examples=n, deadline=None, database=None)
    @given(st.integers(0, 3), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.booleans(),
           st.integers(0, 2**16))
    @example(0, 1, 1, 1, True, 0)  # no token, one-wide everything
    @example(2, 1, 1, 1, False, 1)
    def check(t: int, D: int, f: int, v: int, sp: bool, seed: int) -> None:
        T, F, V = t * world, f * world, v * world  # sizes the group splits
        d = _data(T, D, F, V, seed)
        fs, vs, ts = (slice(*shard_range(n_, comm, "x")) for n_ in (F, V, T))
        rows = ts if sp else slice(None)

        def mlp(x_, a, b):
            return row_parallel_linear(tnf.silu(column_parallel_linear(x_, a, comm, sequence_parallel=sp)), b,
                                       comm, sequence_parallel=sp)

        y, vjp = torch.func.vjp(mlp, d["x"][rows], d["w1"][:, fs], d["w2"][fs])
        dx, dw1, dw2 = vjp(d["ct"][rows])
        y_, vjp_ = torch.func.vjp(_mlp, d["x"], d["w1"], d["w2"])
        dx_, dw1_, dw2_ = vjp_(d["ct"])
        for got, want in ((y, y_[rows]), (dx, dx_[rows]), (dw1, dw1_[:, fs]), (dw2, dw2_[fs])):
            torch.testing.assert_close(got, want)
        loss, vjp = torch.func.vjp(lambda z: vocab_parallel_cross_entropy(z, d["targets"], comm, V),
                                   d["logits"][:, vs])
        kept = bool((d["targets"] != IGNORE_INDEX).any())
        loss_, vjp_ = torch.func.vjp(lambda z: tnf.cross_entropy(z, d["targets"], ignore_index=IGNORE_INDEX)
                                     if kept else z.sum() * 0, d["logits"])
        torch.testing.assert_close(loss, loss_)
        torch.testing.assert_close(vjp(torch.ones((), dtype=DT))[0], vjp_(torch.ones((), dtype=DT))[0][:, vs])
        seen.append(1)

    check()
    return len(seen)


def test_tensor_parallel_properties_on_three_ranks(ranks_at: Callable) -> None:
    for r in ranks_at(3):
        assert r.value["property"] >= 25, r.rank


def _block_cfg(qk_norm: bool):
    from fmoe import GPTConfig, MoEConfig

    moe = MoEConfig(d_model=24, d_ff=8, num_experts=2, top_k=1)  # 12 query heads over 6 kv heads (GQA)
    return GPTConfig(vocab_size=16, d_model=24, n_layers=1, n_heads=12, n_kv_heads=6, moe=moe,
                     num_dense_layers=1, d_ff_dense=12, qk_norm=qk_norm)


def _dense_rank(rank: int, world: int) -> dict:
    """A dense block (GQA attention + SwiGLU MLP) on this rank's tp shard (fmoe/tp_layout.py), and its
    gradients, for qk_norm off and on."""
    from fmoe import init_gpt
    from fmoe.block import dense_block
    from fmoe.tp_layout import shard_block

    comm = CommGroup(torch.distributed.group.WORLD)
    out = {}
    for qk, sp in ((False, False), (True, False), (True, True)):
        cfg = _block_cfg(qk)
        full = init_gpt(cfg, torch.Generator().manual_seed(3), DT)["layers"][0]
        if qk:  # non-trivial scales, so their gradients mean something
            full = {**full, "q_norm": full["q_norm"] * 1.3, "k_norm": full["k_norm"] * 0.7}
        mine = shard_block(full, cfg, rank, world)
        g = torch.Generator().manual_seed(4)
        x = torch.randn(2, 2 * world, cfg.d_model, generator=g, dtype=DT)
        ct = torch.randn(2, 2 * world, cfg.d_model, generator=g, dtype=DT)
        if sp:  # this rank's positions
            x, ct = x[:, 2 * rank:2 * rank + 2], ct[:, 2 * rank:2 * rank + 2]
        y, vjp = torch.func.vjp(lambda p, x_, cfg=cfg,
                                sp=sp: dense_block(p, x_, cfg,
                                                   parallel=ParallelContext(tp=comm, sequence_parallel=sp)),
                                mine, x)
        dp, dx = vjp(ct)
        out[(qk, sp)] = torch.utils._pytree.tree_map(lambda v: (tuple(v.shape), v.flatten().tolist()),
                                                     (y, dx, dp))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_tensor_parallel_dense_block_equals_one_process(world: int, ranks_at: Callable) -> None:
    """Heads, kv heads (GQA) and the ffn split over 2 and 3 ranks, with and without sequence parallelism:
    the output and the input gradient equal one process's (their positions of it under SP), each split
    weight's gradient is the matching slice of the whole one's, and each replicated weight (the norms,
    q_norm and k_norm) gets the whole gradient on every rank."""
    from fmoe import init_gpt
    from fmoe.block import dense_block
    from fmoe.tp_layout import shard_block

    results = ranks_at(world)
    for qk, sp in ((False, False), (True, False), (True, True)):
        cfg = _block_cfg(qk)
        full = init_gpt(cfg, torch.Generator().manual_seed(3), DT)["layers"][0]
        if qk:
            full = {**full, "q_norm": full["q_norm"] * 1.3, "k_norm": full["k_norm"] * 0.7}
        g = torch.Generator().manual_seed(4)
        x = torch.randn(2, 2 * world, cfg.d_model, generator=g, dtype=DT)
        ct = torch.randn(2, 2 * world, cfg.d_model, generator=g, dtype=DT)
        y_, vjp_ = torch.func.vjp(lambda p, x_, cfg=cfg: dense_block(p, x_, cfg), full, x)
        dp_, dx_ = vjp_(ct)
        for r in results:
            y, dx, dp = torch.utils._pytree.tree_map(_back, r.value["dense"][(qk, sp)], is_leaf=_is_packed)
            mine = slice(2 * r.rank, 2 * r.rank + 2) if sp else slice(None)  # SP: its positions
            torch.testing.assert_close(y, y_[:, mine])
            torch.testing.assert_close(dx, dx_[:, mine])
            want = shard_block(dp_, cfg, r.rank, world)  # the whole gradient cut as the weights are
            for path, got in torch.utils._pytree.tree_flatten_with_path(dp)[0]:
                keys = [k.key for k in path]
                w = want
                for k in keys:
                    w = w[k]
                torch.testing.assert_close(got, w, msg=f"qk_norm {qk} sp {sp} rank {r.rank} {'.'.join(keys)}")


def test_a_shard_of_the_wrong_shape_or_an_unsplittable_layout_is_refused() -> None:
    from fmoe import init_gpt
    from fmoe.tp_layout import check_shard, check_tp, shard_block

    cfg = _block_cfg(False)
    full = init_gpt(cfg, torch.Generator().manual_seed(0), DT)["layers"][0]
    with pytest.raises(ValueError, match="6 kv heads do not split evenly"):
        check_tp(cfg, 4, dense=True)
    with pytest.raises(ValueError, match="w_q: the shard"):
        check_shard(full, cfg, 2, (("w_q",),))  # the whole weight where a half is due
    check_shard(shard_block(full, cfg, 1, 3), cfg, 3, (("w_q",), ("w_o",), ("mlp", "w_down")))


def _counted(rank: int, world: int) -> dict:
    from fmoe.parallel import CommCounters

    counters = CommCounters()
    comm = CommGroup(torch.distributed.group.WORLD, counters=counters)
    logits = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank), dtype=DT)
    vocab_parallel_cross_entropy(logits, torch.tensor([0, 1, 2, 3]), comm, 3 * world)
    return dict(counters.calls)


def test_the_vocab_parallel_loss_counts_every_collective_it_issues(ranks_at: Callable) -> None:
    """Its max, normaliser and target logit: three all-reduces, each in the counters (what the planner
    will charge for TP is what the counters see)."""
    for r in ranks_at(2):
        assert r.value["counted"] == {"tp.ce_max": 1, "tp.reduce": 2}, (r.rank, r.value["counted"])
