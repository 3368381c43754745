"""Small glue as aten ops: the pipeline benchmark's model with the glue as its Functions against aten's ops.

    .venv/bin/python benchmarks/host_bound_glue.py --reps 15          # the pipeline benchmark's shapes
    .venv/bin/python benchmarks/host_bound_glue.py --d-model 512 --d-ff 512 --seq 256 --heads 8 \
        --layers 4 --microbatches 4 --reps 7 --aten-below 8388608      # rows of 2-4 MiB as aten ops too

benchmarks/step_host.py's `floor` (the stage program's layers run by `run_phases`, one `backward()` per
microbatch: the model without the executor) run two ways in one process, and its `torch` (the same
model and weights as benchmarks/pipeline.py's nn.Modules):
- `functions`: permute, unpermute and the packed SwiGLU as their autograd Functions at every size
  (fmoe.ops._host_bound.HOST_BOUND_BYTES set to 0: one-pass bag sums, a Python forward and backward each);
- `aten`: the library's rule (rows under HOST_BOUND_BYTES moved by aten's own differentiable ops), or
  with `--aten-below BYTES` rows under that size (to find where the two forms meet).
Rounds rotate the order and reverse it every other round; printed: medians of each way's CPU time of the
main thread (time.thread_time) for the forwards and the backwards of a step, and the medians of the
per-round ratios to `torch` and to `functions`; beside them each way's peak tensor memory over one step
(`fmoe.transforms.testing.tracked_peak_bytes`: allocations counted, not the machine's RSS). The gradients
of the two fmoe ways are compared first. CPU only.
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
from fmoe._compat import tree_flatten
from fmoe.ops import _host_bound
from fmoe.pipeline import gpt_program
from fmoe.pipeline.step import microbatch_meta
from fmoe.train.host_memory import keep_freed_memory
from fmoe.transforms.program import run_phases, tree_params
from fmoe.transforms.testing import tracked_peak_bytes

Way = Callable[[list[float]], list[torch.Tensor]]


def ways(args: argparse.Namespace, aten_below: int) -> dict[str, Way]:
    """Returns the three ways (module docstring), each adding its forward and backward CPU seconds into
    the list it is given and returning the step's gradients."""
    cfg = P.model_config(args)
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    data = P.batches(cfg, args)
    chunks = _ranks.even_chunks(cfg, 1)
    program = gpt_program(cfg, S.build("1f1b", 1, args.microbatches), 0, chunks=chunks)
    stage = program.stage_programs(params, tuple(data[0][0].shape))[0]
    leaves = [x for x in tree_flatten(stage.params)[0] if isinstance(x, torch.Tensor)]
    metas = microbatch_meta(data, init_gpt_state(cfg))
    module = P.TorchStage(cfg, params, chunks[0])

    def floor(limit: int) -> Way:
        def run(acc: list[float]) -> list[torch.Tensor]:
            old, _host_bound.HOST_BOUND_BYTES = _host_bound.HOST_BOUND_BYTES, limit
            try:
                for x in leaves:
                    x.requires_grad_(True)
                    x.grad = None
                for meta in metas:
                    t = time.thread_time()
                    ran = run_phases(stage.layers, tree_params(stage.params), {}, dict(meta))
                    loss = sum(ran.losses.values()) / len(metas)
                    t1 = time.thread_time()
                    loss.backward()
                    acc[0] += t1 - t
                    acc[1] += time.thread_time() - t1
                grads = [x.grad for x in leaves]
                for x in leaves:
                    x.requires_grad_(False)
                    x.grad = None
                return grads
            finally:
                _host_bound.HOST_BOUND_BYTES = old
        return run

    def torch_stage(acc: list[float]) -> list[torch.Tensor]:
        module.zero_grad(set_to_none=True)
        for ids, targets in data:
            t = time.thread_time()
            loss = P._ce(module(ids), targets) / len(data)
            t1 = time.thread_time()
            loss.backward()
            acc[0] += t1 - t
            acc[1] += time.thread_time() - t1
        return [p.grad for p in module.parameters()]

    return {"functions": floor(0), "aten": floor(aten_below), "torch": torch_stage}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _ranks.add_model_arguments(p)
    p.add_argument("--reps", type=int, default=15, help="rounds (each runs every way once)")
    p.add_argument("--aten-below", type=int, default=_host_bound.HOST_BOUND_BYTES,
                   help="the `aten` way moves rows under this many bytes as aten ops (default: the "
                   "library's)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()
    fns = ways(args, args.aten_below)
    a, b = fns["functions"]([0.0, 0.0]), fns["aten"]([0.0, 0.0])  # warm-up, and the gradients compared
    worst = max(float((x - y).abs().max() / x.abs().max().clamp(min=1e-30)) for x, y in zip(a, b))
    fns["torch"]([0.0, 0.0])
    names = list(fns)
    peak_mib = {k: tracked_peak_bytes(lambda k=k: fns[k]([0.0, 0.0]))[1] / 2**20 for k in names}
    cpu: dict[str, list[list[float]]] = {k: [] for k in names}
    for r in range(args.reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order if r % 2 == 0 else order[::-1]:
            acc = [0.0, 0.0]
            fns[k](acc)
            cpu[k].append(acc)
    print(f"glue as Functions vs aten ops (rows under {args.aten_below} bytes): gradients within "
          f"{worst:.1e} of each other (max relative)")
    print(f"CPU ms per step (median of {args.reps} rounds) and per-round ratios (medians)")
    print(f"{'way':10} {'fwd ms':>8} {'bwd ms':>8} {'/ torch':>8} {'fwd/torch':>10} {'/ functions':>12} "
          f"{'peak MiB':>9}")

    def ratio(k: str, base: str, part: Callable[[list[float]], float]) -> float:
        return statistics.median(part(x) / part(y) for x, y in zip(cpu[k], cpu[base]))

    for k in names:
        fwd = 1e3 * statistics.median(x[0] for x in cpu[k])
        bwd = 1e3 * statistics.median(x[1] for x in cpu[k])
        print(f"{k:10} {fwd:8.1f} {bwd:8.1f} {ratio(k, 'torch', sum):8.3f} "
              f"{ratio(k, 'torch', lambda x: x[0]):10.3f} {ratio(k, 'functions', sum):12.3f} "
              f"{peak_mib[k]:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
