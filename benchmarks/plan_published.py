"""Why a published layout ranks where it does in `fmoe plan`: its rank and prediction, then two measured
counterfactuals, each the planner's own model with one thing changed.

    .venv/bin/python benchmarks/plan_published.py --model pangu-ultra-moe
    .venv/bin/python benchmarks/plan_published.py --model deepseek-v3

- Even stages: the simulator on the layout's own per-stage costs and on the same costs with every stage
  the mean stage (the same work, even stages), with and without the all-to-all and P2P. The gap is what
  uneven stages cost the layout (the balanced cut evens the ranks; a schedule with several chunks per
  rank also waits on its slowest stage); the even run keeps the schedule's own bubble (interleaved pp 16
  vpp 2 with 64 microbatches: the textbook 10.49%, seed 003).
- Overlapped hierarchical levels: fmoe's hierarchical dispatch runs its two levels one after the other;
  DeepSeek's kernels forward the IB traffic over NVLink as it arrives. The whole search again with the
  levels priced overlapped (`estimate.HIER_LEVELS_OVERLAP`): the layout's rank and prediction then.
Each search takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from fmoe import schedule as S
from fmoe.cli import plan as P
from fmoe.plan import estimate as E
from fmoe.plan import layout as L
from fmoe.plan import search as Q
from fmoe.plan.specs import PUBLISHED


def _mean(t: tuple[float, ...] | float) -> float:
    return sum(t) / len(t) if isinstance(t, tuple) else t


def _rank(ctx: E.Context, want: dict, top: int) -> tuple[E.Prediction, int, list[E.Prediction]]:
    """The published layout's prediction, its rank among the search's simulated layouts (1 + those
    faster) and the search's first `top`."""
    result = Q.plan(ctx)
    pred = E.fastest_fitting(ctx, P._layout(ctx, want))
    return pred, 1 + sum(p.step_s < pred.step_s for p in result.best), result.best[:top]


def _print_rank(tag: str, pred: E.Prediction, rank: int, best: list[E.Prediction], published: float) -> None:
    print(f"{tag}: published layout {pred.layout.label()} {pred.layout.schedule}: rank {rank}, "
          f"{pred.tokens_per_s / 1e6:.3f}M tokens/s ({100 * (pred.tokens_per_s / published - 1):+.0f}% of "
          f"{published / 1e6:.2f}M published), step {pred.step_s:.2f} s, overlap "
          f"{'/'.join(pred.overlap_modes)}, recompute {pred.layout.recompute}")
    print(Q.format_table(best))


def even_stages(pred: E.Prediction) -> None:
    """Prints the simulator on `pred`'s per-stage costs and on even stages."""
    lay, c = pred.layout, pred.costs
    m = min(pred.microbatches, E.SIM_CAP * lay.pp + lay.pp)
    s = L.executed_schedule(lay.schedule, lay.pp, m, max(lay.vpp, 1))
    even = dataclasses.replace(c, f=_mean(c.f), i=_mean(c.i), w=_mean(c.w), b=_mean(c.b))
    fb = [f + b for f, b in zip(c.f, c.b)]
    print(f"per stage F + B of a microbatch / the mean stage ({m} microbatches simulated of "
          f"{pred.microbatches}): " + " ".join(f"{x / (sum(fb) / len(fb)):.2f}" for x in fb))
    print(f"  {'costs':<34} {'makespan s':>10} {'bubble':>7}")
    for name, costs in (("the layout's per-stage costs", c), ("every stage the mean stage", even),
                        ("per-stage, no all-to-all or P2P", dataclasses.replace(c, a2a=0.0, p2p=0.0)),
                        ("even, no all-to-all or P2P", dataclasses.replace(even, a2a=0.0, p2p=0.0))):
        r = S.simulate(s, costs)
        bubble_pct = 100 * sum(r.bubble_fraction) / len(r.bubble_fraction)
        print(f"  {name:<34} {r.makespan:10.3f} {bubble_pct:6.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(PUBLISHED), required=True)
    parser.add_argument("--top", type=int, default=6)
    args = parser.parse_args(argv)
    plan_args = argparse.ArgumentParser()
    P.add_arguments(plan_args)
    ctx = P.context(plan_args.parse_args(["--model", args.model, "--published"]))
    pub = PUBLISHED[args.model]
    want = {**Q.parse_label(pub.layout), "schedule": pub.schedule}
    want.setdefault("hierarchical", False)
    pred, rank, best = _rank(ctx, want, args.top)
    _print_rank("as the runtime runs it", pred, rank, best, pub.tokens_per_s)
    even_stages(pred)
    E.HIER_LEVELS_OVERLAP = True
    try:
        pred, rank, best = _rank(ctx, want, args.top)
    finally:
        E.HIER_LEVELS_OVERLAP = False
    _print_rank("hierarchical levels overlapped", pred, rank, best, pub.tokens_per_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
