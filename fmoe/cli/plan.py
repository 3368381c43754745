"""Plan a parallel layout: rank every (tp, pp, ep, vpp, dp, schedule, overlap, ...) by simulated step time.

Every candidate passes the runtime's own rules (layout sizes, experts per rank, the microbatches and the
chunks per rank each schedule runs: only the interleaved schedules take a vpp), is screened by a closed
form, and the best are simulated with `fmoe.schedule.simulate`; the table gives step time, tokens/s, MFU,
bubble, exposed communication and memory, and a PNG shows the best layout's timeline. docs/plan.md.

Examples:
  fmoe plan --model pangu-ultra-moe --cluster ascend-910b --devices 6144 --global-batch 3072
  fmoe plan --model deepseek-v3 --cluster h800 --devices 2048 --global-batch 3840 --top 5 --json
  fmoe plan --model tiny --cluster local --devices 2 --global-batch 32      # what fmoe train would run
  fmoe plan --model tiny --cluster local --devices 2 --global-batch 32 --explain "tp1 pp2 ep1 vpp1 dp1 mb4"
  fmoe plan --model small --cluster h100 --devices 8 --explain "tp1 pp2 ep2 vpp2 dp2 mb1" --schedule zbv
  fmoe plan --model model.toml --cluster cluster.toml --devices 64 --capacity-factors none,1.25
  fmoe plan --model deepseek-v3 --published    # as the published run: FP8, 4 nodes per token, 2048 H800
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from fmoe.calibrate.machine import cluster_file
from fmoe.calibrate.models import load_model, model_names
from fmoe.plan import estimate as E
from fmoe.plan import layout as L
from fmoe.plan import search as Q
from fmoe.plan.specs import (
    CLUSTER_PRESETS,
    FP8_GROUPS,
    PUBLISHED,
    ClusterSpec,
    PlanError,
    Published,
    load_cluster,
)
from fmoe.plan.train_flags import train_overrides
from fmoe.train.config import PRESETS, TrainConfig
from fmoe.train.modifiers import Needs, parser_defaults, unmodified


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the model, cluster, batch and search options to `parser` (and the description and examples
    `fmoe plan --help` prints); returns None."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument(
        "--model",
        required=True,
        help=f'a preset ({", ".join(model_names())}) or a TOML file (base = "preset", fields)',
    )
    parser.add_argument(
        "--cluster", default=None,
        help=f"a preset ({', '.join((*CLUSTER_PRESETS, 'local'))}) or a TOML file "
        "(required but with --published)",
    )
    parser.add_argument(
        "--devices", type=int, default=None,
        help="devices in the job (a multiple of a node; required but with --published)",
    )
    parser.add_argument(
        "--published", action="store_true",
        help=f"as the preset's published run ({', '.join(PUBLISHED)}): its precision, routing limit, "
        "recompute, batch, sequence length, cluster and devices (flags given explicitly win); reports the "
        "published layout's rank and predicted tokens/s against the published",
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per step (default: 1024, or the train preset's for tiny/small)",
    )
    parser.add_argument("--seq-length", type=int, default=None, help="sequence length (default: the model's)")
    parser.add_argument("--top", type=int, default=10, help="rows of the table")
    parser.add_argument("--micro-batches", default="1,2,4", help="micro batch sizes to search")
    parser.add_argument("--vpp", default="2,4", help="chunks per rank to search for interleaved schedules")
    parser.add_argument("--cp", default=None,
                        help="context-parallel sizes to search, e.g. 1,2,4 (default: 1, and for sequences of "
                             "16k or more the sizes leaving each rank 4k positions or more)")
    parser.add_argument(
        "--capacity-factors",
        default="none",
        help="'none' (dropless) and/or capacity factors, e.g. none,1.0,1.25",
    )
    parser.add_argument(
        "--imbalance",
        type=float,
        default=1.2,
        help="expected max / mean expert load when dropless (time and memory headroom)",
    )
    parser.add_argument("--no-zero1", action="store_true", help="replicate the Adam state (no ZeRO-1)")
    parser.add_argument("--simulate-top", type=int, default=32, help="candidates simulated after screening")
    parser.add_argument("--json", action="store_true", help="print the ranked candidates as JSON")
    parser.add_argument(
        "--timeline", default=None, metavar="PNG",
        help="write the timeline of the best layout (of the --explain one with --explain) to this PNG "
        "(default: none)",
    )
    parser.add_argument(
        "--explain",
        default=None,
        metavar="LAYOUT",
        help="break one layout down, e.g. 'tp8 pp16 ep4 vpp2 dp12 mb1' (with --schedule)",
    )
    parser.add_argument("--schedule", default=None, help="with --explain: the schedule (default: its best)")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise PlanError(f"{flag}: {text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise PlanError(f"{flag}: give positive integers, got {text!r}")
    return values


def _caps(text: str) -> tuple[float | None, ...]:
    out: list[float | None] = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        if word.lower() == "none":
            out.append(None)
            continue
        try:
            x = float(word)
        except ValueError:
            raise PlanError(f"--capacity-factors: {word!r} is not 'none' or a number") from None
        if not x > 0:
            raise PlanError(f"--capacity-factors: a capacity factor must be > 0, got {word}")
        out.append(x)
    if not out:
        raise PlanError("--capacity-factors: give 'none' and/or numbers")
    return tuple(out)


def _published(args: argparse.Namespace) -> Published | None:
    """The published run `--published` names (PlanError for a model without one), or None."""
    if not args.published:
        return None
    if args.model not in PUBLISHED:
        raise PlanError(f"--published: no published run of {args.model!r} (have {', '.join(PUBLISHED)})")
    return PUBLISHED[args.model]


def context(args: argparse.Namespace) -> E.Context:
    """Returns the planning Context the arguments describe (PlanError on a bad spec); `--published` fills
    what the flags leave out from the published run and constrains precision, routing and recompute."""
    pub = _published(args)
    model = load_model(args.model)
    if pub is not None:
        model = pub.model(model)
    if args.seq_length is not None:
        model = model.replace(seq=args.seq_length)
    cluster_name = args.cluster if args.cluster is not None or pub is None else pub.cluster
    devices = args.devices if args.devices is not None or pub is None else pub.devices
    if cluster_name is None or devices is None:
        raise PlanError("--cluster and --devices are required (but with --published)")
    # "local": this machine, as its calibration's spec file says (measured on first use)
    cluster = load_cluster(cluster_name, files={"local": lambda: str(cluster_file(progress=_calibrating))})
    gb = args.global_batch
    if gb is None and pub is not None:
        gb = pub.global_batch
    if gb is None:
        if args.model in ("tiny", "small"):
            from fmoe.train.config import TrainConfig

            gb = TrainConfig.from_sources(preset=args.model).global_batch_size
        else:
            gb = 1024
    if not args.imbalance >= 1.0:
        raise PlanError(f"--imbalance is max / mean load: must be >= 1, got {args.imbalance}")
    recompute = pub.recompute or None if pub is not None else None
    return E.Context(model, cluster, devices, gb, args.imbalance, recompute)


def _say(line: str, end: str = "\n") -> None:
    """A progress line on stderr (stdout keeps the table and --json clean); on a terminal, `end="\r"`
    lets the next line replace it."""
    print(line, end=end if sys.stderr.isatty() else "\n", file=sys.stderr, flush=True)


def _calibrating(done: int, total: int, path: object) -> None:
    if done == 0:
        _say(f"fmoe plan: --cluster local: measuring this machine once (about 5 minutes; kept in {path})")
    else:  # a round takes about 20 s: each one said
        _say(f"fmoe plan: calibration round {done}/{total}", end="\r" if done < total else "\n")


_last_said = [0.0]
SAY_EVERY_S = 5.0  # off a terminal, a progress line at most this often (and the last one)


def _searching(what: str, done: int, total: int) -> None:
    now = time.monotonic()
    if what == "screened":
        _say(f"fmoe plan: {done} of {total} layouts fit; simulating the best")
    elif sys.stderr.isatty() or done == total or now - _last_said[0] >= SAY_EVERY_S:
        _say(f"fmoe plan: screened {done} layouts" if what == "screening" else
             f"fmoe plan: simulated {done}/{total}", end="\r" if done < total or not total else "\n")
    else:
        return
    _last_said[0] = now


def run(args: argparse.Namespace) -> int:
    """Plans and prints; returns 0, or 2 after one `fmoe plan: error: ...` line for an impossible request."""
    try:
        return _run(args)
    except PlanError as exc:
        print(f"fmoe plan: error: {exc}", file=sys.stderr)
        return 2


# flag -> what it needs (fmoe.train.modifiers: one rule for train and plan)
PLAN_MODIFIERS = {"schedule": Needs("--explain LAYOUT", lambda args: args.explain is not None)}


def _run(args: argparse.Namespace) -> int:
    modifier = unmodified(PLAN_MODIFIERS, args, parser_defaults(add_arguments, PLAN_MODIFIERS))
    if modifier is not None:
        raise PlanError(modifier)
    ctx = context(args)
    t0 = time.perf_counter()
    result = Q.plan(
        ctx,
        simulate_top=args.simulate_top,
        micro_batches=_ints(args.micro_batches, "--micro-batches"),
        vpps=_ints(args.vpp, "--vpp"),
        capacity_factors=_caps(args.capacity_factors),
        zero1=not args.no_zero1,
        cps=None if args.cp is None else _ints(args.cp, "--cp"),
        progress=_searching,
    )
    seconds = time.perf_counter() - t0
    if args.explain is not None:
        return _explain(ctx, args, result)
    top = result.best[: max(args.top, 1)]
    if args.json:
        print(json.dumps([p.as_dict() for p in top], indent=1))
        if args.timeline:
            _say(f"fmoe plan: timeline of the best: {_write_timeline(result.best[0], args.timeline)}")
        return 0
    m = ctx.model
    print(
        f"{m.name} ({_precision(ctx)}, seq {m.seq}) on {ctx.devices} x {ctx.cluster.name}, "
        f"global batch {ctx.global_batch}: "
        f"{result.screened} candidates fit, {len(result.rejected)} rejected, {len(result.best)} simulated, "
        f"in {seconds:.1f} s"
    )
    print(Q.format_table(top))
    pub = _published(args)
    if pub is not None:
        print(_published_line(ctx, pub, result))
    if len(result.best) > 1:
        print("why: " + Q.why(result.best[0], result.best[1]))
    _print_train_command(args.model, result.best[0], ctx)
    if args.timeline:
        print(f"timeline of the best: {_write_timeline(result.best[0], args.timeline)}")
    return 0


def _write_timeline(pred: E.Prediction, path: str) -> str:
    """Draws `pred`'s simulated schedule to `path`, titled with the table's figures and the layout (the
    picture draws at most SIM_CAP x pp + pp microbatches, the table's step all of them); returns `path`."""
    from fmoe.schedule.timeline import write_png

    rep = E.timeline(pred)
    write_png(rep, path, title=timeline_title(pred, rep.makespan), unit="s")
    return path


def timeline_title(pred: E.Prediction, makespan: float) -> str:
    """The plan timeline's title: the layout and the table's figures for it, then what the picture draws
    (`makespan`: its simulated pipeline's)."""
    lay = pred.layout
    drawn = E.timeline_microbatches(pred)
    part = (f"{drawn} of {pred.microbatches} microbatches drawn" if drawn < pred.microbatches
            else f"{pred.microbatches} microbatches")
    title = (f"{lay.label()} {lay.schedule}, overlap {Q.overlap_label(pred)}: step {pred.step_s:.4g} s, "
             f"bubble {100 * pred.bubble:.1f}% (as in the table)\n{part}: makespan {makespan:.4g} s "
             f"(the pipeline only, without the optimizer and data-parallel sums)")
    return title


def _precision(ctx: E.Context) -> str:
    """The model's dtype and its FP8 GEMMs, saying when the cluster runs them at the dtype's peak."""
    m = ctx.model
    if not m.fp8_gemms:
        return m.dtype
    groups = "all linear GEMMs" if len(m.fp8_gemms) == len(FP8_GROUPS) else ", ".join(m.fp8_gemms)
    if not ctx.cluster.fp8_flops:
        return f"{m.dtype}; FP8 asked for {groups}, but {ctx.cluster.name} has no FP8: run in {m.dtype}"
    return f"{m.dtype}, FP8 {groups}"


def _published_line(ctx: E.Context, pub: Published, result: Q.PlanResult) -> str:
    """One line: the published layout's rank among the ranked layouts and its predicted tokens/s against
    the published (evaluated directly when the search did not simulate it)."""
    want = {**Q.parse_label(pub.layout), "schedule": pub.schedule}
    want.setdefault("hierarchical", False)
    matches = [p for p in result.best if all(getattr(p.layout, k) == v for k, v in want.items())]
    if matches:
        pred, rank = matches[0], result.best.index(matches[0]) + 1
        where = f"rank {rank} of {len(result.best)}"
    else:
        pred = E.fastest_fitting(ctx, _layout(ctx, want))
        ahead = sum(p.step_s < pred.step_s for p in result.best)
        where = f"not simulated by the search; {ahead} of the {len(result.best)} simulated are faster"
    fits = "" if pred.fits else f" (does not fit: {pred.reason})"
    return (f"published: {pub.layout} {pub.schedule}, recompute {pred.layout.recompute}: {where}; "
            f"predicted {pred.tokens_per_s / 1e6:.3g}M tokens/s vs {pub.tokens_per_s / 1e6:.3g}M published "
            f"({100 * (pred.tokens_per_s / pub.tokens_per_s - 1):+.0f}%){fits} [{pub.source}]")


def _layout(ctx: E.Context, fields: dict[str, object]) -> L.Layout:
    """The Layout `fields` (parse_label's, plus a schedule) name, the rest at defaults (dp fills the
    devices); PlanError naming the rule it breaks."""
    fields = {"vpp": 1, "micro_batch": 1, "overlap": True, "schedule": "1f1b", **fields}
    if "dp" not in fields:
        sizes = [int(fields.get(k, 1)) for k in ("tp", "pp", "ep", "cp")]  # type: ignore[call-overload]
        fields["dp"] = ctx.devices // (sizes[0] * sizes[1] * sizes[2] * sizes[3])
    base = L.Layout(tp=1, pp=1, ep=1, dp=1, vpp=1, schedule="1f1b", overlap=True, micro_batch=1)
    lay = replace(base, **fields)
    why_not = L.problem(ctx.model, ctx.cluster, ctx.devices, lay, ctx.global_batch)
    if why_not is not None:
        raise PlanError(f"{lay.label()} {lay.schedule}: {why_not}")
    return lay


def train_command(preset: str, layout: L.Layout, global_batch: int, cluster: ClusterSpec,
                  overlap_modes: tuple[str, str] = ("pair", "none"), seq_length: int | None = None) -> str:
    """Returns the `fmoe train` command line of `train_overrides` on model preset `preset` (flags that
    differ from TrainConfig's defaults only; `seq_length` where it differs from the preset's)."""
    defaults = TrainConfig()
    if seq_length == TrainConfig.from_sources(preset=preset).seq_length:
        seq_length = None
    parts = ["fmoe train", f"--preset {preset}"]
    for name, value in train_overrides(layout, global_batch, cluster, overlap_modes, seq_length).items():
        if getattr(defaults, name) == value and name != "seq_length":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else f"--no-{name.replace('_', '-')}")
        elif isinstance(value, tuple):  # a flag that takes several values (--recompute-modules A B)
            parts.append(" ".join((flag, *map(str, value))))
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def _print_train_command(model: str, best: E.Prediction, ctx: E.Context) -> None:
    """Prints the `fmoe train` command of the best layout when the model is also a training preset."""
    if model not in PRESETS:
        return
    try:
        print("train it: " + train_command(model, best.layout, ctx.global_batch, ctx.cluster,
                                           best.overlap_modes, ctx.model.seq))
    except PlanError as exc:  # a layout the runtime does not run (the planner should not rank it)
        print(f"train it: not with fmoe train: {exc}")


def _explain(ctx: E.Context, args: argparse.Namespace, result: Q.PlanResult) -> int:
    want = Q.parse_label(args.explain)
    matches = [
        p
        for p in result.best
        if all(getattr(p.layout, k) == v for k, v in want.items())
        and (args.schedule is None or p.layout.schedule == args.schedule)
    ]
    if matches:
        pred = matches[0]
    else:  # not among the simulated: evaluate it directly
        base = {"vpp": 1, "micro_batch": 1, "dp": None, "overlap": True, "schedule": args.schedule}
        fields = {**base, **want}
        if fields["dp"] is None:
            fields["dp"] = ctx.devices // (fields.get("tp", 1) * fields.get("pp", 1) * fields.get("ep", 1)
                                           * fields.get("cp", 1))
        if fields["schedule"] is None:
            fields["schedule"] = "1f1b"
        lay = replace(
            L.Layout(tp=1, pp=1, ep=1, dp=1, vpp=1, schedule="1f1b", overlap=True, micro_batch=1), **fields
        )
        why_not = L.problem(ctx.model, ctx.cluster, ctx.devices, lay, ctx.global_batch)
        if why_not is not None:
            raise PlanError(f"--explain {args.explain!r}: {why_not}")
        pred = E.fastest_fitting(ctx, lay)
    if args.json:
        print(json.dumps(pred.as_dict(), indent=1))
    else:
        print(Q.explain(pred))
        if args.timeline:
            print(f"timeline: {_write_timeline(pred, args.timeline)}")
        rank = next((k for k, p in enumerate(result.best, 1) if p.layout == pred.layout), None)
        if rank is not None and rank > 1:
            print("why the best beats it: " + Q.why(result.best[0], pred))
        elif rank is None and not pred.fits:
            print(f"does not fit: {pred.reason}")
    return 0
