"""One rank's step on one process: what the executor and split_vjp add to the model's own host time.

    .venv/bin/python benchmarks/step_host.py --d-model 16 --d-ff 16 --heads 2 --seq 4 --vocab 32
    .venv/bin/python benchmarks/step_host.py --reps 10                 # the pipeline benchmark's shapes

The pipeline benchmark's model (benchmarks/pipeline.py, same weights and microbatches) as one stage of a
1-rank "1f1b" schedule, run four ways over the same microbatches, each a whole step with its gradients:
- `step`: `gpt_pipeline_step` (the executor, split_vjp, the stage program), its timeline traced;
- `untraced`: the same with `ExecOptions(trace=False)`;
- `floor`: the same stage program's layers run by `run_phases` with the parameters as leaves that need
  gradients, one `backward()` per microbatch (what the executor runs, without it and without split_vjp);
- `fresh`: the floor with the parameters detached into new leaves for every microbatch (`--fresh`; what
  split_vjp makes per call: the part of its cost that is per leaf, not bookkeeping);
- `torch`: benchmarks/pipeline.py's TorchStage (nn.Modules) under tape autograd, one `backward()` per
  microbatch (what torch.distributed.pipelining's stages run).
Rounds rotate the order (and reverse it every other round); figures are the medians of each way's CPU
time of the main thread (time.thread_time), and the medians of the per-round ratios to `floor` and to
`torch`. At small shapes the compute is next to nothing, so `step / floor - 1` is the executor's and
split_vjp's host cost, `floor / torch` the functional model's against nn.Modules. CPU only: no device.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import _ranks
import pipeline as P
import torch

from fmoe import init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe._compat import tree_flatten, tree_unflatten
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.pipeline.step import microbatch_meta
from fmoe.schedule.options import DEFAULTS, ExecOptions
from fmoe.train.host_memory import keep_freed_memory
from fmoe.transforms.program import run_phases, tree_params


def ways(args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    """Returns the ways of running one step (module docstring), each a function of no argument."""
    cfg = P.model_config(args)
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    state = init_gpt_state(cfg)
    data = P.batches(cfg, args)
    s = S.build("1f1b", 1, args.microbatches)
    chunks = _ranks.even_chunks(cfg, 1)
    program = gpt_program(cfg, s, 0, chunks=chunks)  # built once per run, as `fmoe train` does
    B, S_ = data[0][0].shape
    stage = program.stage_programs(params, (B, S_))[0]
    leaves = [x for x in tree_flatten(stage.params)[0] if isinstance(x, torch.Tensor)]
    metas = microbatch_meta(data, state)
    untraced = ExecOptions(trace=False)  # the timeline is not recorded
    module = P.TorchStage(cfg, params, chunks[0])

    def floor() -> None:
        for x in leaves:
            x.requires_grad_(True)
            x.grad = None
        for meta in metas:
            ran = run_phases(stage.layers, tree_params(stage.params), {}, dict(meta))
            (sum(ran.losses.values()) / len(metas)).backward()
        for x in leaves:
            x.requires_grad_(False)
            x.grad = None

    def fresh() -> None:
        flat, spec = tree_flatten(stage.params)
        sums: list[torch.Tensor | None] = [None] * len(flat)
        for meta in metas:
            mine = [x.detach().requires_grad_() for x in flat]
            ran = run_phases(stage.layers, tree_params(tree_unflatten(mine, spec)), {}, dict(meta))
            for x, g in zip(mine, sums):
                x.grad = g
            (sum(ran.losses.values()) / len(metas)).backward()
            sums = [x.grad for x in mine]

    def torch_stage() -> None:
        module.zero_grad(set_to_none=True)
        for ids, targets in data:
            (P._ce(module(ids), targets) / len(data)).backward()

    def step(options: ExecOptions = DEFAULTS) -> object:
        return gpt_pipeline_step(program, params, state, data, check=False, options=options)

    out = {"step": step, "untraced": lambda: step(untraced), "floor": floor, "fresh": fresh,
           "torch": torch_stage}
    if not args.fresh:
        del out["fresh"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _ranks.add_model_arguments(p)
    p.add_argument("--reps", type=int, default=20, help="rounds (each runs every way once)")
    p.add_argument("--fresh", action="store_true", help="also run the floor on fresh leaves per microbatch")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()
    fns = ways(args)
    for fn in fns.values():  # warm-up
        fn()
    names = list(fns)
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order if r % 2 == 0 else order[::-1]:
            t = time.thread_time()
            fns[k]()
            cpu[k].append(time.thread_time() - t)
    print(f"CPU ms per step (median of {args.reps} rounds) and per-round ratios (medians)")
    print(f"{'way':10} {'ms':>8} {'/ floor':>8} {'/ torch':>8}")
    for k in names:
        to_floor = statistics.median(a / b for a, b in zip(cpu[k], cpu["floor"]))
        to_torch = statistics.median(a / b for a, b in zip(cpu[k], cpu["torch"]))
        print(f"{k:10} {1e3 * statistics.median(cpu[k]):8.2f} {to_floor:8.3f} {to_torch:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
