"""The runtime's layer cut against the cuts its rule passed over (issue 33, feature 23), side by side.

    .venv/bin/python benchmarks/cut_choice.py [--preset small] [--schedule dualpipev] [--pp 2] [--reps 5]

One gloo process per pipeline rank runs a step of `gpt_pipeline_step` (MTP on) under each cut of the
same model, in an order rotated every rep: the runtime's (`cut_gpt`), the rule blind to stages (the
least costliest rank, `even_chunks=False`; it may put the MTP module alone on the last chunk) and the
best cut keeping the head, the loss and MTP on the last chunk (no split), alike cuts run once. Per cut:
the median step time, the measured per-rank compute imbalance ((max/mean - 1) x 100 of each rank's
median compute seconds) beside the modelled one per rank and per chunk, and each rank's peak RSS rise
over a step; then each step time over the runtime's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _ranks
import torch
import torch.distributed as dist

from fmoe import init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.config import GPTConfig
from fmoe.flops import gpt_tail_part_flops
from fmoe.pipeline import gpt_pipeline_step, gpt_program, split_microbatches
from fmoe.pipeline.cut import ChunkSpec, cut_costs, cut_gpt
from fmoe.schedule.stages import cost_placement
from fmoe.train.config import TrainConfig


def model(preset: str) -> tuple[GPTConfig, int, int]:
    """The preset's GPT with MTP on, its sequence length and micro-batch size."""
    tc = TrainConfig.from_sources(preset=preset)
    return GPTConfig(**{**tc.model().__dict__, "mtp": True}), tc.seq_length, tc.micro_batch_size


def cuts(cfg: GPTConfig, s: S.Schedule, seq: int) -> dict[str, tuple[ChunkSpec, ...]]:
    """{"runtime", "stage-blind", "MTP with the loss"}: the cuts, alike ones once (the first name kept)."""
    layers, first, (head, mtp) = gpt_tail_part_flops(cfg, seq)
    chunks = cost_placement(s.placement)  # as cut_gpt prices it
    blind = S.balance_layers_or_empty(chunks, layers, first, head + mtp, split_last=mtp, even_chunks=False)
    kept = S.balance_layers_or_empty(chunks, layers, first, head + mtp)
    out: dict[str, tuple[ChunkSpec, ...]] = {"runtime": cut_gpt(cfg, s.placement, seq=seq)}
    for name, cut in (("stage-blind", blind), ("MTP with the loss", kept)):
        spec = cut_gpt(cfg, s.placement, layers=cut.layers, min_layers=0, mtp_alone=cut.split_last > 0)
        if spec not in out.values():
            out[name] = spec
    return out


def _rank(rank: int, world: int, preset: str, schedule: str, m: int, reps: int) -> dict:
    torch.manual_seed(0)
    cfg, seq, mb = model(preset)
    s = S.build(schedule, world, m)
    params, state = init_gpt(cfg, torch.Generator().manual_seed(0)), init_gpt_state(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (mb * m, seq + 1), generator=torch.Generator().manual_seed(1))
    batches = split_microbatches(tokens[:, :-1], tokens[:, 1:], m)
    by_cut = cuts(cfg, s, seq)
    _ranks.return_freed_memory()
    out: dict[str, dict[str, list[float]]] = {k: {"step": [], "compute": [], "rss": []} for k in by_cut}
    names = list(by_cut)
    for name in names:  # a warm-up step per cut
        gpt_pipeline_step(gpt_program(cfg, s, rank, chunks=by_cut[name]), params, state, batches,
                          group=dist.group.WORLD)
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotated order
            dist.barrier()
            t0 = time.perf_counter()
            step, _, rise = _ranks.measure_rss(lambda n=name: gpt_pipeline_step(
                gpt_program(cfg, s, rank, chunks=by_cut[n]), params, state, batches, group=dist.group.WORLD))
            dist.barrier()
            out[name]["step"].append(time.perf_counter() - t0)
            compute = sum(e.end - e.start for e in step.result.events if e.lane == "compute")
            out[name]["compute"].append(compute)
            out[name]["rss"].append(rise)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--schedule", default="dualpipev")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args()
    cfg, seq, _ = model(args.preset)
    s = S.build(args.schedule, args.pp, args.microbatches)
    by_cut = cuts(cfg, s, seq)
    results = _ranks.spawn(_rank, args.pp, (args.preset, args.schedule, args.microbatches, args.reps),
                           args.timeout, "cut_choice")
    print(f"{args.preset} + MTP, {args.schedule} pp {args.pp}, {args.microbatches} microbatches, "
          f"{args.reps} reps (medians)")
    step_of = {}
    for name, chunks in by_cut.items():
        counts = "+".join(str(len(c.layers)) for c in chunks)
        where = "MTP alone" if not chunks[-1].head else "MTP with the loss"
        step_of[name] = statistics.median(max(r[name]["step"][i] for r in results) for i in range(args.reps))
        compute = [statistics.median(r[name]["compute"]) for r in results]
        ranks, per_chunk = cut_costs(cfg, s.placement, chunks, seq)
        rss = [max(r[name]["rss"]) for r in results]
        measured = S.imbalance_pct(tuple(compute))
        print(f"  {name:<18} {counts:<10} {where:<18} step {step_of[name]:.3f} s, compute per rank "
              f"{_ranks.per_rank(compute, '{:.3f}')} s, imbalance measured {measured:.1f}%"
              f" (modelled {S.imbalance_pct(ranks):.1f}% per rank, {S.imbalance_pct(per_chunk):.1f}% per "
              f"chunk), peak RSS rise per rank {_ranks.per_rank(rss)} MiB")
    for name in list(by_cut)[1:]:
        print(f"  step time, {name} / runtime: {step_of[name] / step_of['runtime']:.3f}")


if __name__ == "__main__":
    main()
