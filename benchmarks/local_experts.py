"""A local MoE layer's experts with permute and unpermute inside (fmoe.ops.local_experts) against the three
steps (permute, routed_experts, unpermute), side by side in one run.

    .venv/bin/python benchmarks/local_experts.py                   # the peers' first two shapes (peers.py)
    .venv/bin/python benchmarks/local_experts.py --shapes 64,32,4,2,64 --rounds 1 --no-memory   # a smoke run

Per shape (D, F, E, K, T as peers.py; fp32, one thread, dropless softmax top-k, no shared expert): `fmoe.moe`
forward and backward (tape autograd, `torch.autograd.grad` to x and every weight against a fixed cotangent),
once with the MoE phases' rule as it is ("fused": `local_experts` where `local_experts_pay`) and once with
the rule refusing it ("3 steps"), the same weights and inputs. Both sides' outputs and gradients are
checked to agree (1e-5 relative to the largest entry) first. Rounds alternate the order; medians of the
thread's CPU time of the forward and of the backward, the minor page faults of a step (each a 4 KiB page
zero-filled by the kernel: glibc maps every block of 32 MiB or more afresh), and paired = the median over
rounds of fused / 3 steps. Peak: each side in a fresh process with freed blocks returned to the OS, the RSS
high-water mark of one step after a warm-up, minus the RSS before it (peers.py's measure).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from _ranks import measure_rss, return_freed_memory

import fmoe.phases as phases
from fmoe import MoEConfig, init_moe, moe

SHAPES = ((1024, 1024, 16, 4, 4096), (512, 256, 64, 8, 2048))  # D, F, E, K, T (peers.py's first two)
RULE = phases.local_experts_pay


def step_fn(shape: tuple[int, ...], fused: bool):
    """Returns step() -> (y, grads): one forward + backward of fmoe.moe at `shape`, with the phases' rule
    (`fused`) or refusing local_experts."""
    D, F, E, K, T = shape
    cfg = MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, aux_loss_coef=0.0)
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    x, ct = torch.randn(T, D, generator=g).requires_grad_(), torch.randn(T, D, generator=g)
    leaves = [v.requires_grad_() for d in params.values() for v in d.values()]

    def step(times: list | None = None):
        phases.local_experts_pay = RULE if fused else (lambda *a: False)
        t0 = time.thread_time()
        y = moe(params, x, cfg, check=False)[0]
        t1 = time.thread_time()
        grads = torch.autograd.grad(y, [x, *leaves], ct)
        if times is not None:
            times.append((t1 - t0, time.thread_time() - t1))
        return y, grads

    return step


def check_same(shape: tuple[int, ...]) -> float:
    """The largest difference of the two sides' y and gradients relative to the largest entry; raises
    SystemExit above 1e-5."""
    (y1, g1), (y3, g3) = step_fn(shape, True)(), step_fn(shape, False)()
    worst = max(float((a - b).detach().abs().max() / b.detach().abs().max().clamp(min=1e-30))
                for a, b in zip((y1, *g1), (y3, *g3)))
    if worst > 1e-5:
        raise SystemExit(f"{shape}: fused and three steps differ by {worst:.2e}")
    return worst


def _child(shape: tuple[int, ...], fused: bool) -> None:
    return_freed_memory()
    step = step_fn(shape, fused)
    step()
    _, _, rise = measure_rss(step)
    print(json.dumps({"rise_mib": rise}))


def _peak(shape: tuple[int, ...], fused: bool) -> float:
    cmd = [sys.executable, __file__, "--child", "fused" if fused else "steps", "--shapes",
           ",".join(map(str, shape))]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["rise_mib"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None, help="D,F,E,K,T (default: peers.py's first two)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else list(SHAPES)
    if args.child:
        _child(shapes[0], args.child == "fused")
        return 0
    print(f"torch {torch.__version__}, 1 thread; fp32; ms = thread CPU time, medians of {args.rounds} rounds")
    print(f"{'shape (D,F,E,K,T)':22} {'side':8} {'fwd ms':>8} {'bwd ms':>8} {'step ms':>8} {'fault MiB':>9} "
          f"{'peak MiB':>9}")
    for shape in shapes:
        worst = check_same(shape)
        steps = {"fused": step_fn(shape, True), "3 steps": step_fn(shape, False)}
        times: dict[str, list] = {k: [] for k in steps}
        faults: dict[str, list] = {k: [] for k in steps}
        for fn in steps.values():
            fn()  # warm-up
        for r in range(args.rounds):
            for k in list(steps) if r % 2 == 0 else list(steps)[::-1]:
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                steps[k](times[k])
                faults[k].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4 / 1024)
        peaks = {} if args.no_memory else {k: _peak(shape, k == "fused") for k in steps}
        for k in steps:
            fwd = statistics.median(f for f, _ in times[k]) * 1e3
            bwd = statistics.median(b for _, b in times[k]) * 1e3
            step = statistics.median(f + b for f, b in times[k]) * 1e3
            peak = f"{peaks[k]:9.1f}" if peaks else f"{'-':>9}"
            fault = statistics.median(faults[k])
            print(f"{str(shape):22} {k:8} {fwd:8.1f} {bwd:8.1f} {step:8.1f} {fault:9.1f} {peak}")
        paired = statistics.median((f1 + b1) / (f3 + b3) for (f1, b1), (f3, b3)
                                   in zip(times["fused"], times["3 steps"]))
        memory = f", peak {peaks['fused'] / peaks['3 steps']:.3f}" if peaks else ""
        print(f"{'':22} fused / 3 steps: step {paired:.3f} (paired){memory}; largest difference {worst:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
