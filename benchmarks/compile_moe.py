"""The MoE layer compiled (torch.compile, inductor) against eager, forward + backward, side by side.

    .venv/bin/python benchmarks/compile_moe.py                        # D1024 F1024 E16 K4 T4096 fp32
    .venv/bin/python benchmarks/compile_moe.py --shape 256,256,8,2,512 --rounds 3

Legend (docs/moe.md): T tokens, D model width, F expert width, E experts, K top-k slots.

One step: `fmoe.moe` on x_TD, the output against a fixed cotangent, `torch.autograd.grad` to x and every
weight (tape autograd; compiled: torch.compile of the layer's forward, whose backward AOT autograd
compiles too). fp32 grouped GEMMs reach the compiler as the library op fmoe::grouped_mm
(fmoe/ops/_grouped_op.py). Compile time is the first call's, apart. Then `--rounds` rounds, each starting
with the other implementation (medians). Peak memory: each implementation in a fresh process, the RSS
high-water mark of one step after a warm-up minus the RSS before it. torchtitan's MoE is timed where it
imports (not a dependency; its fp32 grouped GEMM does not compile in torch 2.13: aten._grouped_mm's
fake-tensor rule is bf16 only), else the script says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time

import torch
from _ranks import measure_rss, return_freed_memory

from fmoe import MoEConfig, init_moe, moe


def make(shape: tuple[int, int, int, int, int], seed: int = 0):
    D, F, E, K, T = shape
    cfg = MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K)
    gen = torch.Generator().manual_seed(seed)
    params = {k: {kk: v.requires_grad_() for kk, v in sub.items()} for k, sub in init_moe(cfg, gen).items()}
    x_TD = torch.randn(T, D, generator=gen, requires_grad=True)
    ct_TD = torch.randn(T, D, generator=gen)
    return cfg, params, x_TD, ct_TD


def steps(cfg, params, x_TD, ct_TD):
    leaves = [x_TD] + [v for sub in params.values() for v in sub.values()]

    def forward(p, x):
        return moe(p, x, cfg)[0]

    compiled = torch.compile(forward, fullgraph=True)

    def run(fn):
        def step():
            y_TD = fn(params, x_TD)
            return torch.autograd.grad(y_TD, leaves, ct_TD)
        return step

    return {"eager": run(forward), "compiled": run(compiled)}


def peak_rss_of(name: str, shape) -> float:
    """MiB: a fresh process's RSS high-water mark over one step (after a warm-up) minus its RSS before."""
    cmd = [sys.executable, __file__, "--memory-of", name, "--shape", ",".join(map(str, shape))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def _memory_child(name: str, shape) -> None:
    return_freed_memory()
    step = steps(*make(shape))[name]
    step()  # warm-up (and compile)
    _, _, rise_mib = measure_rss(step)
    print(json.dumps({"peak_mib": rise_mib}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1024,1024,16,4,4096", help="D,F,E,K,T")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory-of", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    ap.add_argument("--no-memory", action="store_true")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    if args.memory_of:
        _memory_child(args.memory_of, shape)
        return
    cfg, params, x_TD, ct_TD = make(shape)
    fns = steps(cfg, params, x_TD, ct_TD)
    t = time.perf_counter()
    want = fns["eager"]()
    eager_first = time.perf_counter() - t
    t = time.perf_counter()
    got = fns["compiled"]()
    compile_s = time.perf_counter() - t
    err = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))
    print(f"shape D,F,E,K,T = {shape} fp32; compiled vs eager max rel. err. {err:.1e}; "
          f"first call: eager {eager_first:.2f} s, compiled {compile_s:.1f} s (compile included)")
    times: dict[str, list[float]] = {n: [] for n in fns}
    order = list(fns)
    for r in range(args.rounds):
        for name in order[r % 2:] + order[:r % 2]:
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
    med = {n: statistics.median(v) for n, v in times.items()}
    line = f"median of {args.rounds}: eager {med['eager']:.3f} s, compiled {med['compiled']:.3f} s, " \
           f"compiled / eager {med['compiled'] / med['eager']:.3f}"
    print(line)
    if not args.no_memory:
        mem = {n: peak_rss_of(n, shape) for n in fns}
        print(f"peak RSS over one step: eager {mem['eager']:.0f} MiB, compiled {mem['compiled']:.0f} MiB")
    if importlib.util.find_spec("torchtitan") is None:
        print("torchtitan: not installed here, so no torchtitan row (benchmarks/peers.py says how to install "
              "it; its fp32 grouped GEMM would not compile in torch 2.13 anyway: aten._grouped_mm's "
              "fake-tensor rule is bf16 only)")


if __name__ == "__main__":
    main()
