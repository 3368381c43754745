"""One MoE layer, forward + backward, per grouped_linear backend and for the loop oracle, side by side.

    .venv/bin/python benchmarks/moe_layer.py                  # D 1024, F 1024, E 16, K 4, 4096 tokens, fp32
    .venv/bin/python benchmarks/moe_layer.py --tokens 512 --repeats 1     # a quick look

Legend (docs/moe.md): T tokens, D model width, F expert width, E experts, K top-k slots, N = T * K
(token, slot) pairs (the rows of the dropless layout).

Prints tokens/s (median of interleaved repetitions) for each backend and for the loop oracle of
tests/moe_oracle.py (run on a few tokens: it is a python loop), then the layer's achieved FLOP rate
over a plain-matmul ceiling measured in the same run: the same matmul FLOPs (router, and gate/up/down
forward, dx and dw) done as single dense `torch.mm` calls of the same shapes. FLOPs are counted
analytically (matmuls only): 3 passes x (2 T D E + 3 x 2 N D F).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from fmoe.config import MoEConfig
from fmoe.layer import init_moe
from fmoe.model import moe
from fmoe.ops import available_backends

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def layer_flops(T: int, D: int, F: int, E: int, K: int) -> float:
    """Matmul FLOPs of one forward + backward (dx and dw) of the layer."""
    return 3 * (2 * T * D * E + 3 * 2 * T * K * D * F)


def interleaved_samples(steps: dict, repeats: int,
                        warm_up: bool = True) -> dict[str, list[tuple[float, float]]]:
    """Per step, one (wall seconds, CPU seconds of this thread) per round: one warm-up each (`warm_up`;
    False where the caller has run each step already), then `repeats` rounds running every step in turn.

    Each round starts one variant later (a rotation), so no variant always runs right after the same
    neighbour: the order effects of the allocator and caches spread over all of them. The thread's CPU
    time (time.thread_time) is the steps' own work, which other processes on a loaded machine add to far
    less than to wall time.
    """
    for fn in steps.values() if warm_up else ():
        fn()
    names = list(steps)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0, c0 = time.perf_counter(), time.thread_time()
            steps[name]()
            samples[name].append((time.perf_counter() - t0, time.thread_time() - c0))
    return samples


def interleaved_medians(steps: dict, repeats: int, warm_up: bool = True) -> dict[str, float]:
    """Median wall time per step over `interleaved_samples`' rounds."""
    return {name: statistics.median(w for w, _ in ts)
            for name, ts in interleaved_samples(steps, repeats, warm_up).items()}


def layer_step(params, x_TD, cfg, ct_TD):
    def f(p, x):
        return moe(p, x, cfg)[0]

    def step():
        _, vjp_fn = torch.func.vjp(f, params, x_TD)
        vjp_fn(ct_TD)

    return step


def ceiling_step(T: int, D: int, F: int, E: int, K: int, gen: torch.Generator,
                 dtype: torch.dtype = torch.float32):
    """The layer's matmuls as dense torch.mm calls of the same shapes (fwd, dx, dw for each weight), in
    `dtype`; returns the step (a callable)."""
    N = T * K

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    x_TD, w_DE, g_TE = randn(T, D), randn(D, E), randn(T, E)
    x_ND, h_NF = randn(N, D), randn(N, F)
    w_DF, w_FD = randn(D, F), randn(F, D)
    g_NF, g_ND = randn(N, F), randn(N, D)

    def step():
        x_TD @ w_DE, g_TE @ w_DE.t(), x_TD.t() @ g_TE                    # router fwd, dx, dw
        for _ in range(2):                                               # gate and up
            x_ND @ w_DF, g_NF @ w_DF.t(), x_ND.t() @ g_NF
        h_NF @ w_FD, g_ND @ w_FD.t(), h_NF.t() @ g_ND                    # down

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--oracle-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    T, D, F, E, K = args.tokens, args.d_model, args.d_ff, args.experts, args.top_k
    gen = torch.Generator().manual_seed(0)
    cfg = MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K)
    params = init_moe(cfg, gen)
    x_TD = torch.randn(T, D, generator=gen)
    ct_TD = torch.randn(T, D, generator=gen)
    flops = layer_flops(T, D, F, E, K)
    print(f"MoE layer fwd+bwd: T={T} D={D} F={F} E={E} K={K} fp32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {flops / 1e9:.1f} GFLOP per step (matmuls)")

    steps = {"plain-matmul ceiling": ceiling_step(T, D, F, E, K, gen)}
    for backend in [b for b in available_backends(torch.float32) if b != "npu"]:
        steps["moe/" + backend] = layer_step(params, x_TD, cfg.replace(backend=backend), ct_TD)
    times = interleaved_medians(steps, args.repeats)
    t_ceiling = times.pop("plain-matmul ceiling")
    print(f"{'plain-matmul ceiling':>22}: {t_ceiling * 1e3:9.1f} ms  {flops / t_ceiling / 1e9:7.1f} GFLOP/s")
    results = {}
    for name, t in times.items():
        results[name.split("/")[1]] = t
        print(f"{name:>22}: {t * 1e3:9.1f} ms  {flops / t / 1e9:7.1f} GFLOP/s  "
              f"{T / t:10.0f} tokens/s  vs ceiling {t_ceiling / t:.2f}")

    from moe_oracle import oracle_moe  # test-only loop oracle

    To = args.oracle_tokens
    p_req = {k: {n: w.detach().clone().requires_grad_() for n, w in v.items()} for k, v in params.items()}
    x_o = x_TD[:To].clone().requires_grad_()

    def oracle_step():
        y, _, _ = oracle_moe(p_req, x_o, cfg)
        leaves = [w for v in p_req.values() for w in v.values()]
        torch.autograd.grad((y * ct_TD[:To]).sum(), [x_o, *leaves], allow_unused=True)

    t_o = interleaved_medians({"oracle": oracle_step}, 1)["oracle"]
    print(f"{'loop oracle':>22}: {t_o * 1e3:9.1f} ms for {To} tokens  {To / t_o:10.1f} tokens/s")
    best = min(results, key=results.get)
    print(f"best backend {best}: {T / results[best]:.0f} tokens/s, achieved/ceiling = "
          f"{t_ceiling / results[best]:.2f}, {T / results[best] / (To / t_o):.0f}x the oracle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
