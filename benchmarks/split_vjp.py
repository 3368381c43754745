"""split_vjp overhead, side by side in one run: split backward vs full torch.func.vjp vs nn.Module.

Model: 8 x (RMSNorm -> linear -> SwiGLU -> linear, residual), hidden 1024, ffn 2816, 2048 tokens, fp32, CPU.
Variants are interleaved repetition by repetition (the order rotating each time) and compared by
medians, so machine noise and order effects hit them alike. Prints three ratios:
  (vjp_dx + vjp_dw) / full torch.func.vjp backward     target <= 1.05
  fmoe step (fwd + split bwd) / nn.Module fwd + loss.backward()   target <= 1.05
  vjp_dx / full backward     the share a zero-bubble scheduler keeps on the critical path

    .venv/bin/python benchmarks/split_vjp.py [--reps 5] [--layers 8] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from fmoe.dense import dense_stack, init_dense_stack
from fmoe.transforms import split_vjp


class ModuleMLP(nn.Module):
    """The same block as fmoe.dense.swiglu_mlp, written the usual nn.Module way."""

    def __init__(self, p: dict[str, torch.Tensor]):
        super().__init__()
        self.norm = nn.RMSNorm(p["norm"].shape[0], eps=1e-6)
        self.gate = nn.Linear(*p["w_gate"].shape, bias=False)
        self.up = nn.Linear(*p["w_up"].shape, bias=False)
        self.down = nn.Linear(*p["w_down"].shape, bias=False)
        with torch.no_grad():
            self.norm.weight.copy_(p["norm"])
            self.gate.weight.copy_(p["w_gate"].t())
            self.up.weight.copy_(p["w_up"].t())
            self.down.weight.copy_(p["w_down"].t())

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ff", type=int, default=2816)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()

    gen = torch.Generator().manual_seed(0)
    params = init_dense_stack(args.layers, args.d_model, args.d_ff, gen)
    x = torch.randn(args.tokens, args.d_model, generator=gen)
    ct = torch.randn(args.tokens, args.d_model, generator=gen)
    module = nn.Sequential(*[ModuleMLP(p) for p in params["layers"]])

    clock = time.perf_counter
    sample: dict[str, float] = {}

    def split_step() -> None:
        t0 = clock()
        out, vjp_dx = split_vjp(dense_stack, params, x)
        t1 = clock()
        _, vjp_dw = vjp_dx(ct)
        t2 = clock()
        vjp_dw()
        t3 = clock()
        sample.update(dx=t2 - t1, dw=t3 - t2, fmoe_step=t3 - t0)

    def full_step() -> None:
        _, full_fn = torch.func.vjp(dense_stack, params, x)
        t0 = clock()
        full_fn(ct)
        sample["full_bwd"] = clock() - t0

    def module_step() -> None:
        module.zero_grad(set_to_none=True)
        t0 = clock()
        (module(x) * ct).sum().backward()
        sample["module_step"] = clock() - t0

    variants = [split_step, full_step, module_step]
    times: dict[str, list[float]] = {k: [] for k in ["dx", "dw", "full_bwd", "fmoe_step", "module_step"]}
    for rep in range(args.reps + 1):  # the first repetition warms up and is discarded
        # Rotate the order each repetition so no variant always runs after the same neighbour.
        for step in variants[rep % 3:] + variants[:rep % 3]:
            step()
        if rep > 0:
            for k, v in sample.items():
                times[k].append(v)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"split_vjp benchmark: {args.layers} blocks, D={args.d_model}, F={args.d_ff}, "
          f"T={args.tokens}, fp32, {torch.get_num_threads()} threads, {args.reps} reps (medians, ms)")
    for k, v in med.items():
        print(f"  {k:<12} {v * 1e3:9.1f}")
    split_over_full = (med["dx"] + med["dw"]) / med["full_bwd"]
    print(f"(vjp_dx + vjp_dw) / full vjp backward : {split_over_full:.3f}  (target <= 1.05)")
    step_ratio = med["fmoe_step"] / med["module_step"]
    print(f"fmoe step / nn.Module step            : {step_ratio:.3f}  (target <= 1.05)")
    print(f"vjp_dx / full vjp backward            : {med['dx'] / med['full_bwd']:.3f}")


if __name__ == "__main__":
    main()
