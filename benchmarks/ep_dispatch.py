"""Expert-parallel dispatch + combine on 4 gloo ranks (2 simulated nodes x 2): time and bytes per link.

    .venv/bin/python benchmarks/ep_dispatch.py [--tokens 512] [--dim 512] [--experts 16] [--iters 10]

Legend: T tokens per rank, D width, E experts, K top-k.

For each top-k and each dispatcher (alltoall, allgather, hierarchical; all through the token-level entry
point so they do the same work: permute-1, dispatch, combine, unpermute) it times dispatch + combine
(forward, identity experts; median over iterations, max over ranks) and counts the bytes all ranks send
per iteration by link class (payload and metadata, forward only). The last line is the inter-node bytes
of hierarchical over flat alltoall at top-k 4 and 8; the line before it shows a LinkModel's delay being
hidden behind compute (exposed wait of an async all-to-all). With --link-model, each collective also waits as
long as the default LinkModel (intra 150 GB/s, inter 25 GB/s) says.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fmoe.parallel import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    CommCounters,
    CommGroup,
    HierarchicalDispatcher,
    LinkModel,
    ParallelLayout,
    Topology,
    all_to_all_async,
)
from fmoe.parallel.local_ranks import failures, run_ranks
from fmoe.parallel.topology import INTER, INTRA

WORLD, RANKS_PER_NODE = 4, 2


def _bench(rank: int, world: int, args: argparse.Namespace) -> tuple[list, tuple[float, float, float]]:
    """Rank `rank`'s rows (every rank's are the same: all-reduced) and link-model overlap times."""
    topo = Topology(WORLD, RANKS_PER_NODE)
    layout = ParallelLayout(ep=WORLD, topology=topo)
    link = LinkModel() if args.link_model else None
    E, T, D = args.experts, args.tokens, args.dim
    rows = []
    for k in args.top_k:
        g = torch.Generator().manual_seed(1000 * rank + k)
        x_TD = torch.randn(T, D, generator=g)
        ids_TK = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        probs_TK = torch.rand(T, k, generator=g)
        for name in ("alltoall", "allgather", "hierarchical"):
            counters = CommCounters()

            def cg(group: str, counters=counters) -> CommGroup:
                return CommGroup(layout.group(group), topology=topo, counters=counters, link_model=link)

            d = {"alltoall": lambda: AllToAllDispatcher(cg("expert"), E),
                 "allgather": lambda: AllGatherDispatcher(cg("expert"), E),
                 "hierarchical": lambda: HierarchicalDispatcher(cg("expert_inter"), cg("expert_intra"), E),
                 }[name]()
            times = []
            for it in range(args.warmup + args.iters):
                if it == args.warmup:
                    counters.reset()
                dist.barrier()
                t0 = time.perf_counter()
                with torch.no_grad():
                    x_MD, counts_L, meta = d.dispatch_tokens(x_TD, ids_TK, probs_TK)
                    y_TD = d.combine_tokens(x_MD, meta)
                if it >= args.warmup:
                    times.append(time.perf_counter() - t0)
            ref = (x_TD * probs_TK.sum(1, keepdim=True))  # identity experts: y = sum_k p_k x
            assert torch.allclose(y_TD, ref, rtol=1e-4, atol=1e-4), name
            by_link = counters.bytes_by_link()
            stats = torch.tensor([statistics.median(times), by_link[INTRA] / args.iters,
                                  by_link[INTER] / args.iters], dtype=torch.float64)
            tmax, tsum = stats.clone(), stats.clone()
            dist.all_reduce(tmax, op=dist.ReduceOp.MAX)
            dist.all_reduce(tsum)
            rows.append((k, name, float(tmax[0]) * 1e3, float(tsum[1]), float(tsum[2])))
    return rows, _overlap(layout, topo)


def _overlap(layout: ParallelLayout, topo: Topology) -> tuple[float, float, float]:
    """Exposed wait of an async all-to-all under a slow LinkModel: waited at once vs after compute.

    Returns (wait ms with nothing to hide it, wait ms after the compute, compute ms), medians.
    """
    slow = LinkModel(intra_bytes_per_s=4e9, inter_bytes_per_s=1e9)
    counters = CommCounters()
    comm = CommGroup(layout.group("expert"), topology=topo, counters=counters, link_model=slow)
    x = torch.randn(4096, 512)
    a = torch.randn(384, 384)
    bare, hidden, compute = [], [], []
    for _ in range(5):
        for hide in (False, True):
            dist.barrier()
            counters.reset()
            with torch.no_grad():
                _, h = all_to_all_async(x, comm)
                if hide:
                    t0 = time.perf_counter()
                    for _ in range(4):
                        a = torch.tanh(a @ a) * 0.1
                    compute.append(time.perf_counter() - t0)
                h.wait()
            (hidden if hide else bare).append(counters.total_wait_s())
    return tuple(1e3 * statistics.median(v) for v in (bare, hidden, compute))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on 4 spawned ranks and print the table and the hierarchical/alltoall ratio."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--link-model", action="store_true")
    args = p.parse_args(argv)
    for k in (4, 8):
        if k not in args.top_k:
            args.top_k.append(k)
    results = run_ranks(_bench, WORLD, args, timeout_s=600, pg_timeout_s=120, stop_on_error=True)
    if failures(results):
        raise RuntimeError(f"ep_dispatch failed:\n{failures(results)}")
    rows, (bare_ms, hidden_ms, compute_ms) = results[0].value
    print(f"ep_dispatch: {WORLD} ranks = {WORLD // RANKS_PER_NODE} nodes x {RANKS_PER_NODE} (gloo, CPU), "
          f"T={args.tokens} tokens/rank, D={args.dim} fp32, E={args.experts}, iters={args.iters}, "
          f"link model {'on' if args.link_model else 'off'}")
    print(f"{'top_k':>5} {'dispatcher':<13} {'ms/iter':>8} {'intra MB':>9} {'inter MB':>9}  "
          "(dispatch+combine forward; bytes sent by all ranks per iteration)")
    for k, name, ms, intra, inter in rows:
        print(f"{k:>5} {name:<13} {ms:>8.2f} {intra / 1e6:>9.3f} {inter / 1e6:>9.3f}")
    print(f"link-model overlap (8 MB all-to-all, inter 1 GB/s, rank 0): exposed wait {bare_ms:.2f} ms "
          f"waited at once, {hidden_ms:.2f} ms after {compute_ms:.2f} ms of compute")
    inter = {(k, n): b for k, n, _, _, b in rows}
    ratios = ", ".join(f"top-k {k}: {inter[(k, 'hierarchical')] / inter[(k, 'alltoall')]:.3f}"
                       for k in (4, 8))
    print(f"inter-node bytes hierarchical / alltoall: {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
