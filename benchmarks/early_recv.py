"""Receives on gloo: posted when asked for (gloo's default) against the wire order, side by side.

    .venv/bin/python benchmarks/early_recv.py --reps 9
    .venv/bin/python benchmarks/early_recv.py --reps 15 --schedules 1f1b,interleaved

Model and batch: benchmarks/pipeline.py's (MoE GPT, D 256, S 128, B 2, 8 microbatches, 2 gloo ranks, one
thread each), through gpt_pipeline_step, untraced. Each schedule runs both ways in one process per rank,
`ExecOptions(early_recv=True)` ("early": what gloo runs, fmoe.schedule.wire.tag_matched) and
`early_recv=False` ("wire": every receive in the wire order, what NCCL and HCCL need), in the same round
back to back, the order reversed every other round. Prints per schedule the medians of the step time (the
slower rank's, per round) and the median of the per-round ratios early / wire, and per rank the time spent
inside `dist.isend` and `dist.irecv` calls (medians over rounds): a gloo call that waits for its pair's
lock (the transport pushing another message on the same pair) shows there. CPU only: no device.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import _ranks
import pipeline as P
import torch
import torch.distributed as dist

from fmoe import init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.parallel.shared_grads import SharedGrads
from fmoe.pipeline import gpt_pipeline_step, gpt_program, holders
from fmoe.schedule.options import ExecOptions
from fmoe.train.host_memory import keep_freed_memory

WAYS = {"early": ExecOptions(early_recv=True, trace=False),
        "wire": ExecOptions(early_recv=False, trace=False)}
P2P = ("isend", "irecv")


def _timed_p2p(spent: dict[str, float]) -> None:
    """Wraps dist.isend / dist.irecv in this rank so that the seconds spent inside them add up in `spent`."""
    for name in P2P:
        real = getattr(dist, name)

        def timed(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - t

        setattr(dist, name, timed)


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    keep_freed_memory()
    torch.set_num_threads(1)
    cfg = P.model_config(args)
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    state, data = init_gpt_state(cfg), P.batches(cfg, args)
    spent = dict.fromkeys(P2P, 0.0)
    _timed_p2p(spent)
    out: dict[str, Any] = {}
    for name in args.schedules:
        s = S.build(name, world, args.microbatches)
        chunks = _ranks.even_chunks(cfg, len(set(s.placement.layer_chunk)))
        shared = SharedGrads(holders(cfg, s.placement, chunks), None)  # built once: it creates process groups
        program = gpt_program(cfg, s, rank, chunks=chunks)
        for options in WAYS.values():  # warm-up
            gpt_pipeline_step(program, params, state, data, shared=shared, options=options)
        wall: dict[str, list[float]] = {w: [] for w in WAYS}
        calls: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
        for r in range(args.reps):
            for way in list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]:
                gc.collect()
                dist.barrier()
                spent.update(dict.fromkeys(P2P, 0.0))
                t = time.perf_counter()
                gpt_pipeline_step(program, params, state, data, shared=shared, options=WAYS[way])
                wall[way].append(time.perf_counter() - t)
                calls[way].append(dict(spent))
        out[name] = {"wall": wall, "calls": calls}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _ranks.add_model_arguments(p)
    p.add_argument("--reps", type=int, default=9, help="rounds (each runs both ways of every schedule)")
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb_h1,zbv,dualpipev")
    args = p.parse_args(argv)
    args.schedules = args.schedules.split(",")
    ranks = _ranks.spawn(_rank, 2, (args,), args.timeout, "early_recv", pg_timeout_s=args.pg_timeout)
    print(f"2 gloo ranks, {args.microbatches} microbatches, {args.reps} rounds: step ms (slower rank, "
          "medians), early / wire (median of per-round ratios); ms per step inside dist.isend / dist.irecv, "
          "per rank")
    for name in args.schedules:
        step = {w: [max(r[name]["wall"][w][i] for r in ranks) for i in range(args.reps)] for w in WAYS}
        ratio = statistics.median(a / b for a, b in zip(step["early"], step["wire"]))
        inside = "  ".join(
            f"r{k} {w} {1e3 * statistics.median(c['isend'] for c in r[name]['calls'][w]):.1f}/"
            f"{1e3 * statistics.median(c['irecv'] for c in r[name]['calls'][w]):.1f}"
            for k, r in enumerate(ranks) for w in WAYS)
        print(f"{name:12} early {1e3 * statistics.median(step['early']):6.1f}  wire "
              f"{1e3 * statistics.median(step['wire']):6.1f}  early/wire {ratio:.3f}   isend/irecv: {inside}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
