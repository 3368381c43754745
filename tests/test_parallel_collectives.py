"""Differentiable collectives over real gloo groups: values, vjp gradients (not zero), async, counters.

Legend: P ranks, N rows sent by a rank, M rows received, D features; S_PP[r, j] rows rank r sends to j.

One spawn per world size checks every collective; the oracle rebuilds all ranks' inputs from seeds and
moves rows with plain indexing in one process.
"""

from __future__ import annotations

import gc
import weakref

import torch
from dist_utils import spawn

from fmoe.parallel.async_comm import CommHandle
from fmoe.parallel.collectives import (
    CommGroup,
    all_gather,
    all_gather_async,
    all_reduce,
    all_reduce_async,
    all_to_all,
    all_to_all_async,
    exchange_counts,
    reduce_scatter,
    reduce_scatter_async,
)
from fmoe.parallel.counters import CommCounters
from fmoe.parallel.link_model import LinkModel
from fmoe.parallel.topology import INTER, INTRA, Topology
from fmoe.transforms.split_vjp import split_vjp
from fmoe.transforms.testing import assert_close

D = 3


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _split_cases(P: int) -> list[torch.Tensor]:
    """Split matrices: random, all rows to rank 0 (imbalanced), a rank that sends and receives nothing."""
    g = torch.Generator().manual_seed(P)
    cases = [torch.randint(0, 4, (P, P), generator=g) for _ in range(3)]
    to0 = torch.zeros(P, P, dtype=torch.int64)
    to0[:, 0] = 3
    silent = torch.randint(1, 3, (P, P), generator=g)
    silent[P - 1, :] = 0
    silent[:, P - 1] = 0
    return cases + [to0, silent, torch.zeros(P, P, dtype=torch.int64)]


def _a2a_oracle(S_PP: torch.Tensor, xs: list[torch.Tensor], r: int) -> torch.Tensor:
    """Rows rank r receives: from each source j, the chunk of x_j addressed to r."""
    chunks = []
    for j, x in enumerate(xs):
        off = int(S_PP[j, :r].sum())
        chunks.append(x[off:off + int(S_PP[j, r])])
    return torch.cat(chunks)


def _check_all(rank: int, world: int) -> dict:
    counters = CommCounters()
    topo = Topology(world, max(1, world // 2))
    comm = CommGroup(torch.distributed.group.WORLD, topology=topo, counters=counters)
    report = {}
    # ---- variable all-to-all: forward, torch.func.vjp and split_vjp gradients --------------------
    for case, S_PP in enumerate(_split_cases(world)):
        xs = [_rand(100 * case + j, int(S_PP[j].sum()), D) for j in range(world)]
        cts = [_rand(1000 + 100 * case + j, int(S_PP[:, j].sum()), D) for j in range(world)]
        out_s, in_s = S_PP[:, rank].tolist(), S_PP[rank].tolist()
        recv = exchange_counts(S_PP[rank].reshape(world, 1), comm).reshape(-1)
        assert recv.tolist() == out_s, (recv, out_s)
        counters.reset()
        out, vjp_fn = torch.func.vjp(lambda x, o=out_s, i=in_s: all_to_all(x, comm, o, i), xs[rank])
        assert_close(out, _a2a_oracle(S_PP, xs, rank))
        (dx,) = vjp_fn(cts[rank])
        # bytes by hand: forward sends S[rank, j] rows to each peer j, backward S[j, rank]; D float64 each
        hand = {}
        for j in range(world):
            if j != rank:
                link = INTRA if j // topo.ranks_per_node == rank // topo.ranks_per_node else INTER
                for op, rows in (("all_to_all", int(S_PP[rank, j])), ("all_to_all.bwd", int(S_PP[j, rank]))):
                    if rows:
                        hand[(op, link)] = hand.get((op, link), 0) + rows * D * 8
        assert dict(counters.sent) == hand, (case, dict(counters.sent), hand)
        assert dict(counters.calls) == {"all_to_all": 1, "all_to_all.bwd": 1}
        # d x_r = rows of the cotangents that came from r: the all-to-all with S transposed.
        expect = _a2a_oracle(S_PP.t(), cts, rank)
        assert_close(dx, expect)
        if expect.numel():
            assert dx.abs().sum() > 0, "all_to_all vjp gave zero gradients"

        def f(params, x, o=out_s, i=in_s):
            out, h = all_to_all_async(x * params["s"], comm, o, i)
            h.wait()
            return out * params["t"]

        params = {"s": torch.tensor(1.5, dtype=torch.float64), "t": torch.tensor(-2.0, dtype=torch.float64)}
        out2, vjp_dx = split_vjp(f, params, xs[rank])
        (dx2,), vjp_dw = vjp_dx(cts[rank])
        dparams = vjp_dw()
        assert_close(out2, -3.0 * _a2a_oracle(S_PP, xs, rank))
        assert_close(dx2, -3.0 * expect)
        assert_close(dparams["t"], (cts[rank] * 1.5 * _a2a_oracle(S_PP, xs, rank)).sum())
        # ds sums over this rank's rows x_r * d(x_r s) (its own gradient, no reduction).
        assert_close(dparams["s"], (xs[rank] * -2.0 * expect).sum())
    # ---- all-gather / reduce-scatter / all-reduce ------------------------------------------------
    xs = [_rand(7 + j, 2, D) for j in range(world)]
    cts = [_rand(70 + j, 2 * world, D) for j in range(world)]
    out, vjp_fn = torch.func.vjp(lambda x: all_gather(x, comm), xs[rank])
    assert_close(out, torch.cat(xs))
    (dx,) = vjp_fn(cts[rank])
    assert_close(dx, sum(c[2 * rank:2 * rank + 2] for c in cts))
    ys = [_rand(17 + j, 2 * world, D) for j in range(world)]
    cts = [_rand(170 + j, 2, D) for j in range(world)]
    out, vjp_fn = torch.func.vjp(lambda y: reduce_scatter(y, comm), ys[rank])
    assert_close(out, sum(y[2 * rank:2 * rank + 2] for y in ys))
    (dy,) = vjp_fn(cts[rank])
    assert_close(dy, torch.cat(cts))
    out, vjp_fn = torch.func.vjp(lambda y: all_reduce(y, comm), xs[rank])
    assert_close(out, sum(xs))
    (dy,) = vjp_fn(cts[rank])
    assert_close(dy, sum(cts))
    # ---- async forms, with a link model: values equal the synchronous ones ----------------------
    slow = CommGroup(torch.distributed.group.WORLD, topology=topo, counters=CommCounters(),
                     link_model=LinkModel(intra_latency_s=0.01, inter_latency_s=0.03))

    def both(x, y):
        g_out, hg = all_gather_async(x, slow)
        r_out, hr = reduce_scatter_async(y, slow)  # in flight together
        hg.wait()
        hr.wait()
        return g_out, r_out

    (g_out, r_out), vjp_fn = torch.func.vjp(both, xs[rank], ys[rank])
    assert_close(g_out, torch.cat(xs))
    assert_close(r_out, sum(y[2 * rank:2 * rank + 2] for y in ys))
    cg = [_rand(300 + j, 2 * world, D) for j in range(world)]
    cr = [_rand(400 + j, 2, D) for j in range(world)]
    dx, dy = vjp_fn((cg[rank], cr[rank]))
    assert_close(dx, sum(c[2 * rank:2 * rank + 2] for c in cg))
    assert_close(dy, torch.cat(cr))
    report["slow_wait_s"] = slow.counters.total_wait_s()
    # ---- handles: waiting twice is a no-op; a dropped, never-waited handle neither hangs nor leaks --
    hc = CommCounters()
    hcomm = CommGroup(torch.distributed.group.WORLD, topology=topo, counters=hc)
    out, h = all_to_all_async(torch.full((world, D), float(rank), dtype=torch.float64), hcomm)
    h.wait()
    waited = hc.wait_s["all_to_all"]
    h.wait()
    assert h.done and h.is_completed() and hc.wait_s["all_to_all"] == waited
    assert out[:, 0].tolist() == [float(j) for j in range(world)]
    refs = []
    for i in range(8):  # issued and dropped without wait (gloo keeps its buffers until the work ends)
        o, dropped = all_gather_async(torch.full((64, D), float(i)), hcomm)
        refs.append(weakref.ref(dropped))
        del o, dropped
    gc.collect()
    assert all(r() is None for r in refs), "a dropped CommHandle is kept alive"
    both = CommHandle.all([all_reduce_async(torch.ones(2), hcomm)[1],
                           all_reduce_async(torch.ones(3), hcomm)[1]])
    both.wait()  # the group still works after the dropped handles: no hang, results in order
    assert both.done
    out = all_reduce(torch.full((2,), float(rank)), hcomm)
    assert out.tolist() == [float(sum(range(world)))] * 2
    # ---- counters: an equal all-to-all of 1 row (D float64) to every rank --------------------------
    counters.reset()
    all_to_all(torch.zeros(world, D, dtype=torch.float64), comm)
    by_link = counters.bytes_by_link()
    n_intra = sum(1 for j in range(world) if j != rank and topo.link_class(rank, j) == INTRA)
    assert by_link[INTRA] == n_intra * D * 8, by_link
    assert by_link[INTER] == (world - 1 - n_intra) * D * 8, by_link
    return report


def test_collectives_world2_and_4():
    for world in (2, 4):
        results = spawn(_check_all, world, timeout_s=120)
        # 2 collectives whose modelled time is >= 10 ms each were waited for.
        assert all(r.value["slow_wait_s"] > 0 for r in results)
