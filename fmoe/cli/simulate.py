"""Simulate a pipeline schedule: print a summary table and write a timeline PNG / trace JSON.

The schedule is generated and verified as data (fmoe.schedule), then simulated with the given costs per
stage: forward F, input grad I, weight grad W, P2P latency, and MoE all-to-all that F&B pairs hide (seed
000's fb overlap). The table gives makespan, bubble, peak activations and the share of all-to-all hidden
in warmup, steady state and cooldown; docs/schedules.md.

Examples:
  fmoe simulate --schedule dualpipev --pp 4 --microbatches 16 --a2a 0.25 --out timeline.png
  fmoe simulate --schedule dualpipev --pp 4 -m 16 --a2a 0.5 --lone-hide 0.5 --trace trace.json
  fmoe simulate --schedule interleaved --pp 4 -m 8 --v 4 --print-schedule   # only interleaved takes --v
  fmoe simulate --schedule 1f1b --pp 4 -m 8 --layers 16 --first-extra 1 --last-extra 2   # stage imbalance
  fmoe simulate --schedule zb_h1 --pp 4 -m 8 --f 1 --i 1 --w 0.5   # zero bubble: W fills the gaps
  fmoe simulate --schedule-file my_1f1b.txt --a2a 0.25   # a schedule written out (docs/schedules.md)

--schedule-file reads a schedule in its printed form (as `--print-schedule` shows one): one line
`r<k>: F0.0 F0.1 B0.0 ...` per rank, `#` comments allowed; its lines are the ranks, its microbatch ids
the microbatches and where its stages run the placement, so --schedule, --pp, --microbatches and --v are
refused beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from fmoe import schedule
from fmoe.schedule.registry import ALL_NAMES
from fmoe.train.modifiers import Needs, parser_defaults, unmodified


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the schedule, shape and cost options to `parser` (and the description and examples
    `fmoe simulate --help` prints); returns None."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument("--schedule", choices=ALL_NAMES, default=None, help="(default 1f1b)")
    parser.add_argument("--pp", type=int, default=None, help="pipeline ranks (default 4)")
    parser.add_argument("--microbatches", "-m", type=int, default=None, help="(default 16)")
    parser.add_argument("--schedule-file", default=None, metavar="PATH",
                        help="a schedule in its printed form, instead of --schedule, --pp, --microbatches")
    parser.add_argument("--v", type=int, default=None,
                        help="chunks per rank of the interleaved schedules (default 2; the others run "
                             "their own count and refuse another)")
    parser.add_argument("--f", type=float, default=1.0, help="forward time per stage")
    parser.add_argument("--i", type=float, default=1.0, help="input-grad time per stage")
    parser.add_argument("--w", type=float, default=1.0, help="weight-grad time per stage")
    parser.add_argument("--p2p", type=float, default=0.0, help="P2P latency")
    parser.add_argument("--a2a", type=float, default=0.0, help="one all-to-all of one MoE layer")
    parser.add_argument("--moe-layers", type=int, default=1, help="MoE layers per stage")
    parser.add_argument("--lone-hide", type=float, default=0.0,
                        help="share of a lone step's all-to-all hidden (seed fb overlap: 0.5)")
    parser.add_argument("--no-pair-overlap", action="store_true", help="F&B pairs do not hide all-to-all")
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer layers in the model: stage costs become layers x (f, i, w)")
    parser.add_argument("--first-extra", type=float, default=0.0,
                        help="extra cost on the first stage (embedding), in layers")
    parser.add_argument("--last-extra", type=float, default=0.0,
                        help="extra cost on the last stage (loss head, MTP), in layers")
    parser.add_argument("--placement", choices=("even", "balanced"), default="balanced",
                        help="with --layers: split layers evenly, or even out rank cost (place_layers)")
    parser.add_argument("--print-schedule", action="store_true", help="print the per-rank action lists")
    parser.add_argument("--out", default=None, help="timeline PNG path")
    parser.add_argument("--trace", default=None, help="Chrome/Perfetto trace JSON path")


def run(args: argparse.Namespace) -> int:
    """Builds, verifies and simulates the schedule; prints the report; returns 0, or 2 after printing one
    `error: ...` line for a bad schedule, layer placement or cost (a ScheduleError naming the value)."""
    try:
        return _run(args)
    except schedule.ScheduleError as exc:
        print(f"error: {exc}")
        return 2


# flag -> what it needs (fmoe.train.modifiers: one rule for train, plan and simulate)
SIMULATE_MODIFIERS = dict.fromkeys(("first_extra", "last_extra", "placement"),
                                   Needs("--layers N", lambda args: args.layers is not None))


def _run(args: argparse.Namespace) -> int:
    """`run` without the error handling: raises ScheduleError for a bad argument; returns 0."""
    modifier = unmodified(SIMULATE_MODIFIERS, args, parser_defaults(add_arguments, SIMULATE_MODIFIERS))
    if modifier is not None:
        raise schedule.ScheduleError(modifier)
    s = _schedule(args)
    schedule.verify(s)
    if args.schedule_file is not None:  # what the file was read as (verified: an error stays one line)
        print(f"schedule file {args.schedule_file}: pp {s.pp}, {s.m} microbatches, {s.placement.kind} "
              f"placement ({s.placement.num_stages} stages, {s.placement.num_stages // s.pp} per rank)")
    # the flags as given are checked first, so an error names the value typed (not layers x it)
    costs = schedule.Costs(f=args.f, i=args.i, w=args.w, p2p=args.p2p, a2a=args.a2a,
                           moe_layers=args.moe_layers, lone_hide=args.lone_hide,
                           pair_overlap=not args.no_pair_overlap)
    if args.layers is not None:
        per_stage = _stage_layers(s, args)
        costs = dataclasses.replace(costs, **{k: tuple(getattr(args, k) * n for n in per_stage)
                                              for k in ("f", "i", "w")})
    if args.print_schedule:
        print(s)
    rep = schedule.simulate(s, costs)
    print(schedule.format_report(rep))
    if args.out:
        print(f"wrote {schedule.write_png(rep, args.out)}")
    if args.trace:
        print(f"wrote {schedule.write_trace(rep, args.trace)}")
    return 0


# the flags a schedule file replaces, and what they default to without one
SHAPE_FLAGS = {"schedule": "1f1b", "pp": 4, "microbatches": 16, "v": None}


def _schedule(args: argparse.Namespace) -> schedule.Schedule:
    """The schedule to simulate: --schedule-file's (unverified), or the one --schedule, --pp, -m and --v
    build. Raises ScheduleError for a file that does not parse, or shape flags given beside it."""
    if args.schedule_file is None:
        got = {k: d if getattr(args, k) is None else getattr(args, k) for k, d in SHAPE_FLAGS.items()}
        return schedule.build(got["schedule"], got["pp"], got["microbatches"], got["v"])
    given = [f"--{k}" for k in SHAPE_FLAGS if getattr(args, k) is not None]
    if given:
        raise schedule.ScheduleError(f"--schedule-file gives the schedule, its ranks and microbatches: leave "
                                     f"out {', '.join(given)}")
    return schedule.load_schedule(args.schedule_file)


def _stage_layers(s: schedule.Schedule, args: argparse.Namespace) -> tuple[float, ...]:
    """Per-stage cost in layers (layers + first/last extra); prints the placement and its imbalance.
    Raises ScheduleError for a negative or non-finite extra."""
    for flag, x in (("--first-extra", args.first_extra), ("--last-extra", args.last_extra)):
        if not math.isfinite(x) or x < 0:
            raise schedule.ScheduleError(f"{flag} must be a finite number >= 0, got {x!r}")
    if args.placement == "balanced":
        layers = schedule.place_layers(s.placement, args.layers, args.first_extra, args.last_extra, 1).layers
    else:
        layers = schedule.even_layers(s.placement, args.layers, min_layers=1)
    rank_cost = schedule.rank_costs(s.placement, layers, args.first_extra, args.last_extra)
    print(f"layers per stage ({args.placement}): {' '.join(map(str, layers))}; "
          f"rank cost imbalance {schedule.imbalance_pct(rank_cost):.2f}%")
    return schedule.stage_costs(s.placement, layers, args.first_extra, args.last_extra)
