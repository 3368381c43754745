"""The executor's host cost: microseconds of host time per action, fmoe against torch.distributed.pipelining.

    .venv/bin/python benchmarks/host_overhead.py                 # every 2-rank schedule, 20 rounds
    .venv/bin/python benchmarks/host_overhead.py --profile 1f1b  # where fmoe's host time goes, by decision

Model: the pipeline benchmark's MoE GPT (benchmarks/pipeline.py: same model, same torch pairs, same cut)
at a size whose compute is next to nothing (D 8, 4 layers of 4 experts, S 4, one sequence per
microbatch, 8 microbatches), so a step's time is what the runtimes do around the compute: fmoe's executor
under a compute model that gives every phase zero seconds (schedule.compute_model, default 0: its clock
bookkeeping is part of the cost, as in every modelled run), torch's schedule runtime as it is.
Per schedule and rank, per action (F, I, W, B of one stage and microbatch; an F&B pair counts 2; the same
count for both runtimes, whose multi-stage lists the pipeline benchmark checks equal): the CPU time of
the rank's main thread during one step (time.thread_time: the host work itself, which the other
processes of a shared machine do not add to, unlike wall time) and the wall time (both ranks started by
a barrier). fmoe runs traced (the timeline, as `fmoe train` records it) and untraced (ExecOptions(trace=
False); a revision without the option prints "-"). Rounds alternate the runtimes and reverse their order
every other round; medians over rounds, and the paired ratio (the median of each round's fmoe / torch,
CPU). `gap` = the traced executor's time between its timeline events (summarize(...).gap: its own
bookkeeping, and any descheduling on a loaded machine).

--profile SCHEDULE: cProfile of --reps steps of one fmoe schedule on each rank, grouped by what the
executor decides (docs/pipeline.md, "The host budget"): the rows it spends most in.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
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
from fmoe.schedule.compute_model import ComputeModel
from fmoe.schedule.ir import ops_of
from fmoe.schedule.options import ExecOptions
from fmoe.schedule.timeline import summarize


def tiny_shapes(args: argparse.Namespace) -> None:
    """Sets the near-zero-compute model on `args` (in place)."""
    args.d_model, args.heads, args.layers, args.experts, args.top_k, args.d_ff = 8, 2, 4, 4, 2, 8
    args.vocab, args.seq, args.micro_batch = 32, 4, 1


def _actions(s: S.Schedule, rank: int) -> int:
    return sum(len(ops_of(a)) for a in s.ranks[rank])


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = P.model_config(args)
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    state = init_gpt_state(cfg)
    data = P.batches(cfg, args)
    options = ExecOptions(compute_model=ComputeModel({}, default=0.0))
    # untraced: no timeline (ExecOptions.trace; a revision without the option always traces)
    untraced = (dataclasses.replace(options, trace=False)
                if "trace" in {f.name for f in dataclasses.fields(ExecOptions)} else None)
    fmoe, bare, torch_runs, actions = {}, {}, {}, {}
    for name in args.schedules:
        s = S.build(name, world, args.microbatches)
        chunks = _ranks.even_chunks(cfg, len(set(s.placement.layer_chunk)))
        program = gpt_program(cfg, s, rank, chunks=chunks)  # built once per run, as `fmoe train` does
        shared = SharedGrads(holders(cfg, s.placement, chunks), None)
        fmoe[name] = (lambda program=program, shared=shared:
                      gpt_pipeline_step(program, params, state, data, shared=shared, options=options,
                                        check=False))
        if untraced is not None:
            bare[name] = (lambda program=program, shared=shared:
                          gpt_pipeline_step(program, params, state, data, shared=shared, options=untraced,
                                            check=False))
        actions[name] = _actions(s, rank)
    if args.profile:
        return _profile(rank, fmoe[args.profile], args)
    if not args.no_torch:
        for cls_name, (after, per_rank) in P.TORCH.items():
            if after in fmoe:
                v = P._torch_variant(cfg, cls_name, per_rank, args.microbatches, rank, params, data)
                torch_runs[after] = v
    out: dict[str, Any] = {name: {k: [] for k in ("fmoe", "bare", "torch", "fmoe wall", "bare wall",
                                                  "torch wall", "gap")} for name in fmoe}
    out["_actions"] = actions

    def timed(fn) -> tuple[float, float, Any]:
        dist.barrier()
        t, c = time.perf_counter(), time.thread_time()
        got = fn()
        return time.perf_counter() - t, time.thread_time() - c, got

    for name in fmoe:  # warm-up
        timed(fmoe[name])
        if name in bare:
            timed(bare[name])
        if name in torch_runs:
            P._reset(torch_runs[name])
            timed(torch_runs[name].run)
    for k in range(args.reps):
        for name in fmoe:
            for who in ["fmoe", "bare", "torch"] if k % 2 == 0 else ["torch", "bare", "fmoe"]:
                if who == "torch" and name in torch_runs:
                    P._reset(torch_runs[name])
                    wall, cpu, _ = timed(torch_runs[name].run)
                elif who == "bare" and name in bare:
                    wall, cpu, _ = timed(bare[name])
                elif who == "fmoe":
                    wall, cpu, step = timed(fmoe[name])
                    out[name]["gap"].append(summarize(step.result.events).gap)
                else:
                    continue
                out[name][who].append(cpu)
                out[name][who + " wall"].append(wall)
    return out


# what the executor decides, by the functions that decide it: (group, files, function names); a row goes to
# the first group that names its file (None: any) and its function (a prefix)
GROUPS = (
    ("P2P issue / wait (gloo)", None, ("<built-in method torch._C._distributed_c10d", "isend", "irecv",
                                      "wait_work", "_isend", "_irecv", "_wait_work", "_release_sends",
                                      "_reap_sends", "get_global_rank", "_global", "_tag")),
    ("wire bookkeeping", ("execute.py",), ("_pump", "_send_ready_behind", "_issue_through", "_recv_spec",
                                           "_post_recv", "_send")),
    ("deps look-ups", ("deps.py", "ir.py"), ("",)),
    ("boundaries", ("execute.py",), ("_take_boundary", "_give_boundary")),
    ("trace records", ("execute.py", "timeline.py", "<string>"), ("_event", "_trace_event", "_comm_events",
                                                                  "__init__")),
    ("compute model", ("compute_model.py",), ("",)),
    ("checks", ("execute.py", "program.py"), ("_check_floating", "check_", "_complete")),
    ("grad sums", ("execute.py",), ("_add_at", "_add_tree", "_run_dw", "_dw_into_sums", "_sums_of",
                                    "_sums_like", "__call__")),
    ("executor, other", ("execute.py", "rank_plan.py", "options.py"), ("",)),
    ("programs / model / autograd", None, ("",)),
)


def _group_of(fn: str, where: list[str]) -> str:
    for name, files, prefixes in GROUPS:
        if (files is None or where[-1] in files) and any(fn.startswith(p) for p in prefixes):
            return name
    return GROUPS[-1][0]


def _profile(rank: int, step, args: argparse.Namespace) -> dict[str, Any]:
    for _ in range(2):
        step()
    prof = cProfile.Profile(time.thread_time)  # CPU time: what load on the machine does not add to
    dist.barrier()
    t = time.perf_counter()
    prof.enable()
    for _ in range(args.reps):
        step()
    prof.disable()
    wall = (time.perf_counter() - t) / args.reps
    st = pstats.Stats(prof)
    rows = []
    for (file, _line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((fn, file.rsplit("/", 2)[-2:], nc / args.reps, tt / args.reps, ct / args.reps))
    return {"wall": wall, "rows": rows}


def _report_profile(args: argparse.Namespace, results: list[dict]) -> None:
    s = S.build(args.profile, 2, args.microbatches)
    for rank, got in enumerate(results):
        n = _actions(s, rank)
        print(f"rank {rank}: {args.profile} step {1e6 * got['wall']:.0f} us under cProfile, {n} actions, "
              f"{1e6 * got['wall'] / n:.0f} us per action")
        rows = sorted(got["rows"], key=lambda r: -r[3])
        print(f"  {'function':44} {'where':34} {'calls':>6} {'self us':>8} {'cum us':>8}")
        for fn, where, calls, tt, ct in rows[:args.top]:
            print(f"  {fn[:44]:44} {'/'.join(where)[:34]:34} {calls:6.0f} {1e6 * tt:8.0f} {1e6 * ct:8.0f}")
        groups: dict[str, float] = {}
        for fn, where, _, tt, _ in got["rows"]:
            g = _group_of(fn, where)
            groups[g] = groups.get(g, 0.0) + tt
        print("  self time per step by what it decides (us; per action):")
        for g, _, _ in GROUPS:
            print(f"    {g:30} {1e6 * groups.get(g, 0.0):8.0f} {1e6 * groups.get(g, 0.0) / n:7.1f}")


def _report(args: argparse.Namespace, results: list[dict]) -> None:
    print(f"host microseconds per action, median over {args.reps} rounds: CPU time of the rank's main thread "
          "(what load on the machine does not add to), and wall time; paired: median of the rounds' ratios "
          "(CPU); gap: the traced executor's wall time between its timeline events")
    print(f"{'':25} {'---------- CPU ----------':>25} {'--------- wall ---------':>25}")
    print(f"{'schedule':20} {'rank':>4} {'fmoe':>8} {'untraced':>8} {'torch':>8} {'fmoe':>8} {'untraced':>8} "
          f"{'torch':>8} {'gap':>6} {'fmoe/torch':>10} {'untraced/torch':>14}")
    for name in args.schedules:
        for rank, got in enumerate(results):
            n = got["_actions"][name]
            row = got[name]
            t = row["torch"]

            def us(xs: list[float], n: int = n) -> str:
                return f"{1e6 * statistics.median(xs) / n:.0f}" if xs else "-"

            def paired(xs: list[float], t: list[float] = t) -> str:
                return f"{statistics.median(a / b for a, b in zip(xs, t)):.3f}" if xs and t else "-"

            keys = ("fmoe", "bare", "torch", "fmoe wall", "bare wall", "torch wall", "gap")
            cols = [us(row[k]) for k in keys]
            print(f"{name:20} {rank:4d} " + " ".join(f"{c:>8}" for c in cols[:6]) + f" {cols[6]:>6} "
                  f"{paired(row['fmoe']):>10} {paired(row['bare']):>14}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _ranks.add_model_arguments(p)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--profile", choices=S.registry.NAMES, help="cProfile (CPU) one schedule")
    p.add_argument("--top", type=int, default=30, help="--profile: rows printed per rank")
    p.add_argument("--only", nargs="+", choices=S.registry.NAMES, metavar="SCHEDULE")
    args = p.parse_args(argv)
    tiny_shapes(args)
    args.schedules = (args.profile,) if args.profile else tuple(args.only or S.registry.NAMES)
    results = _ranks.spawn(_rank, 2, (args,), args.timeout, "host overhead", args.pg_timeout)
    if args.profile:
        _report_profile(args, results)
    else:
        _report(args, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
