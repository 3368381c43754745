"""Peak memory of one MoE layer's forward + backward, per way of differentiating it, side by side.

    .venv/bin/python benchmarks/memory.py            # D 1024, F 1024, E 16, K 4, T 4096, fp32
    .venv/bin/python benchmarks/memory.py --tokens 512
    .venv/bin/python benchmarks/memory.py --layer dense --d-model 512   # a dense SwiGLU MLP

Each mode runs in a fresh process: one warm-up step, then the RSS high-water mark (Linux VmHWM, reset
through /proc/self/clear_refs) of one forward + full backward, minus the RSS before it; glibc malloc
returns every freed block of 64 KiB or more to the OS at once, so the rise does not depend on what the
earlier steps of the process left in the heap. Next to it the peak of tracked tensor allocations
(torch.profiler's memory events: exact, what tests/test_memory.py asserts on). Modes:
- autograd: `fmoe.moe` on leaves that require grad, `loss.backward()` (tape autograd: the reference);
- func.vjp: `torch.func.vjp` of the same function, its vjp_fn called as is (retain_graph=True, its
  default: the graph's saved tensors outlive the backward, so the whole forward is held at its end);
- func.vjp(retain_graph=False): the same, each saved tensor freed once the backward has used it;
- split_vjp(func) / split_vjp(autograd): fmoe.transforms.split_vjp with each engine, dx then dw.
The gradients of every mode are checked against the autograd mode's (printed max relative difference).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
from _ranks import measure_rss, return_freed_memory

from fmoe import MoEConfig, init_moe, init_moe_state, moe
from fmoe.dense import init_swiglu_mlp, swiglu_mlp
from fmoe.transforms.testing import DIFF_MODES, grads_by, tracked_peak_bytes

MODES = DIFF_MODES


def _setup(args: argparse.Namespace):
    """(f, params, x_TD, ct_TD): the layer as f(params, x) -> y_TD, its weights, an input, a cotangent."""
    g = torch.Generator().manual_seed(1)
    x_TD = torch.randn(args.tokens, args.d_model, generator=g)
    ct_TD = torch.randn(args.tokens, args.d_model, generator=g)
    if args.layer == "dense":
        params = init_swiglu_mlp(args.d_model, args.d_ff, torch.Generator().manual_seed(0))
        return (lambda p, x: swiglu_mlp(p, x)), params, x_TD, ct_TD
    cfg = MoEConfig(d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts, top_k=args.top_k)
    params, state = init_moe(cfg, torch.Generator().manual_seed(0)), init_moe_state(cfg)
    return lambda p, x: moe(p, x, cfg, state, check=False)[0], params, x_TD, ct_TD


def _step(mode: str, f, params, x_TD, ct_TD) -> list[torch.Tensor]:
    """One forward + backward; returns the gradients (params leaves, then x) in tree order."""
    return grads_by(mode, f, params, x_TD, ct_TD)


def _child(args: argparse.Namespace) -> None:
    return_freed_memory()  # the rise then counts what the step holds, whatever earlier steps left
    setup = _setup(args)
    ref = _step("autograd", *setup)
    grads = _step(args.child, *setup)  # warm-up (and the gradients to compare)
    diff = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(grads, ref))
    del grads, ref
    _, _, rise = measure_rss(lambda: _step(args.child, *setup))
    _, tracked = tracked_peak_bytes(lambda: _step(args.child, *setup))
    print(json.dumps({"rise_mib": rise, "tracked_mib": tracked / 2**20, "grad_rel_diff": diff}))


def main() -> None:
    """Measures every mode in its own process; prints the table and the ratios to tape autograd."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layer", choices=["moe", "dense"], default="moe",
                    help="the MoE layer, or a dense SwiGLU MLP (fmoe.dense.swiglu_mlp) of D, F")
    ap.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        _child(args)
        return
    flags = ["--d-model", str(args.d_model), "--d-ff", str(args.d_ff), "--experts", str(args.experts),
             "--top-k", str(args.top_k), "--tokens", str(args.tokens), "--layer", args.layer]
    out = {}
    for mode in MODES:
        done = subprocess.run([sys.executable, __file__, "--child", mode, *flags], check=True,
                              capture_output=True, text=True)
        out[mode] = json.loads(done.stdout)
    what = (f"one dense SwiGLU MLP: D {args.d_model}, F {args.d_ff}" if args.layer == "dense" else
            f"one MoE layer: D {args.d_model}, F {args.d_ff}, E {args.experts}, K {args.top_k}")
    print(f"{what}, T {args.tokens}, fp32, forward + backward; peak memory of one step (fresh process each)")
    print(f"{'mode':<30} {'rise MiB':>9} {'/ autograd':>11} {'tracked MiB':>12} {'/ autograd':>11} "
          f"{'grad rel diff':>14}")
    ref = out["autograd"]
    for mode in MODES:
        r = out[mode]
        print(f"{mode:<30} {r['rise_mib']:9.1f} {r['rise_mib'] / ref['rise_mib']:11.3f} "
              f"{r['tracked_mib']:12.1f} {r['tracked_mib'] / ref['tracked_mib']:11.4f} "
              f"{r['grad_rel_diff']:14.1e}")


if __name__ == "__main__":
    main()
