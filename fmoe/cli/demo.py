"""Demo: a dense SwiGLU stack whose backward is split into dx now and dw later, with FLOPs and timings.

Prints, for one training step of the stack, the FLOPs of forward, dx pass and dw pass (counted by
torch.utils.flop_counter) and their wall times, and checks that the split gradients equal the unsplit
torch.func.vjp ones.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from fmoe.dense import dense_stack, init_dense_stack
from fmoe.transforms import split_vjp

SIZES = ("layers", "d_model", "d_ff", "tokens")  # options that must be positive ints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the demo's options on `parser`."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-ff", type=int, default=704)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)


def bad_argument(args: argparse.Namespace) -> str | None:
    """Return one line naming the first size option that is not a positive int, or None if all are."""
    for name in SIZES:
        value = getattr(args, name)
        if not value > 0:
            return f"error: --{name.replace('_', '-')} must be a positive integer, got {value}"
    return None


def _flops(fn):
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, counter.get_total_flops()


def _step(params, x_TD, ct_TD, counted: bool):
    """One split step and one unsplit backward; returns grads, flops (or times) per pass."""
    measure = _flops if counted else _clock
    (out, vjp_dx), f = measure(lambda: split_vjp(dense_stack, params, x_TD))
    ((dx_TD,), vjp_dw), dx = measure(lambda: vjp_dx(ct_TD))
    dparams, dw = measure(vjp_dw)
    _, full_fn = torch.func.vjp(dense_stack, params, x_TD)
    ref, full = measure(lambda: full_fn(ct_TD))
    return (dparams, dx_TD), ref, {"forward": f, "dx (now)": dx, "dw (later)": dw, "full vjp backward": full}


def _clock(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    """Run the demo step and print the dx/dw split; returns 0, or 2 after printing one `error: ...` line
    for a size option (--layers, --d-model, --d-ff, --tokens) that is not positive."""
    error = bad_argument(args)
    if error is not None:
        print(error)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    params = init_dense_stack(args.layers, args.d_model, args.d_ff, gen)
    x_TD = torch.randn(args.tokens, args.d_model, generator=gen)
    ct_TD = torch.randn(args.tokens, args.d_model, generator=gen)

    # imported here: it loads hypothesis, which no other fmoe command (nor a training rank) needs
    from fmoe.transforms.testing import assert_close

    grads, ref, flops = _step(params, x_TD, ct_TD, counted=True)
    assert_close(grads, ref)
    _step(params, x_TD, ct_TD, counted=False)  # warm-up
    _, _, times = _step(params, x_TD, ct_TD, counted=False)

    print(f"fmoe demo: {args.layers} x (RMSNorm -> SwiGLU MLP, residual), D={args.d_model} "
          f"F={args.d_ff}, T={args.tokens}, fp32, {torch.get_num_threads()} threads")
    print(f"{'pass':<22}{'GFLOP':>10}{'share':>8}{'ms':>10}")
    bwd = flops["dx (now)"] + flops["dw (later)"]
    for name, fl in flops.items():
        share = f"{fl / bwd:.0%}" if name != "forward" else ""
        print(f"{name:<22}{fl / 1e9:>10.3f}{share:>8}{times[name] * 1e3:>10.1f}")
    print(f"dx + dw FLOPs == full backward FLOPs: {bwd == flops['full vjp backward']}; "
          "split gradients match torch.func.vjp: True")
    return 0
