"""The fused SwiGLU MLP products against their composition under split_vjp: time and peak memory.

    .venv/bin/python benchmarks/mlp_products.py            # routed experts, M 16384, D 1024, F 1024, E 16

`fused`: grouped_linear_pair + swiglu_grouped_linear (what fmoe's experts run under a split backward);
`composed`: grouped_linear, swiglu, grouped_linear. One forward + dx + dw per step, each split_vjp engine,
interleaved repetitions with the order alternating, medians; the peak of tracked allocations of one step
per variant and engine, each in a fresh process after a warm-up (in one process, memory freed late by
an earlier measurement can be counted against a later one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from fmoe.ops import grouped_linear, grouped_linear_pair, swiglu, swiglu_grouped_linear
from fmoe.transforms import split_vjp
from fmoe.transforms.testing import tracked_peak_bytes


def main() -> None:
    """Prints per engine the median step of each variant, their ratio and their tracked peaks."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)  # variant, engine
    args = ap.parse_args()
    torch.set_num_threads(1)
    M, D, F, E = args.rows, args.d_model, args.d_ff, args.experts
    counts = [M // E] * E
    counts[0] += M - sum(counts)
    g = torch.Generator().manual_seed(0)
    shapes = {"wg": (D, F), "wu": (D, F), "wd": (F, D)}
    params = {k: torch.randn(E, *s, generator=g) * 0.03 for k, s in shapes.items()}
    x_MD, ct_MD = torch.randn(M, D, generator=g), torch.randn(M, D, generator=g)

    def composed(p, x):
        h = swiglu(grouped_linear(x, p["wg"], counts), grouped_linear(x, p["wu"], counts))
        return grouped_linear(h, p["wd"], counts)

    def fused(p, x):
        return swiglu_grouped_linear(*grouped_linear_pair(x, p["wg"], p["wu"], counts), p["wd"], counts)

    variants = {"composed": composed, "fused": fused}

    def step(f, engine: str):
        _, vjp_dx = split_vjp(f, params, x_MD, engine=engine)
        (_,), vjp_dw = vjp_dx(ct_MD)
        return vjp_dw()

    if args.child:
        name, engine = args.child
        step(variants[name], engine)
        print(json.dumps(tracked_peak_bytes(lambda: step(variants[name], engine))[1] / 2**20))
        return
    flags = ["--rows", str(M), "--d-model", str(D), "--d-ff", str(F), "--experts", str(E)]
    print(f"routed-expert MLP under split_vjp: M {M}, D {D}, F {F}, E {E}, fp32, 1 thread, {args.reps} reps")
    for engine in ("autograd", "func"):
        times: dict[str, list[float]] = {k: [] for k in variants}
        for f in variants.values():
            step(f, engine)  # warm-up
        for r in range(args.reps):
            for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                t = time.perf_counter()
                step(variants[name], engine)
                times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        peak = {}
        for k in variants:
            done = subprocess.run([sys.executable, __file__, *flags, "--child", k, engine], check=True,
                                  capture_output=True, text=True)
            peak[k] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"engine {engine}: composed {med['composed'] * 1e3:.0f} ms, fused {med['fused'] * 1e3:.0f} ms, "
              f"fused / composed {med['fused'] / med['composed']:.3f}; tracked peak MiB composed "
              f"{peak['composed']:.1f}, fused {peak['fused']:.1f}")


if __name__ == "__main__":
    main()
