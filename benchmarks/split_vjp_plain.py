"""split_vjp(engine="autograd") with plain_ops="dx" (default) vs "defer", side by side in one run.

Three models, each run both ways, interleaved repetition by repetition (the order alternating) and
compared by medians:
  moe block   fmoe.model.block (attention + MoE, fmoe.ops only: the tape already defers every weight)
  fmoe dense  fmoe.dense.dense_stack (RMSNorm -> SwiGLU MLP, fmoe.ops only)
  plain mlp   LayerNorm -> F.linear -> SiLU -> F.linear, residual (plain torch ops: nothing on the tape)
Per model and mode: the step (forward + vjp_dx + vjp_dw), the dx pass alone (what a zero-bubble
schedule keeps on the critical path), the FLOPs of each pass, and the peak of tensor memory over the
step (transforms.testing.tracked_peak_bytes, one extra run). Ratios are defer / dx. Then the graph
walk alone (transforms/_plain_defer.PlainSplit), what "defer" adds to a dx pass that has nothing to defer.

    .venv/bin/python benchmarks/split_vjp_plain.py [--reps 15] [--tokens 512] [--d-model 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fmoe.block import init_block
from fmoe.config import GPTConfig, MoEConfig
from fmoe.dense import dense_stack, init_dense_stack
from fmoe.model import block
from fmoe.transforms import split_vjp
from fmoe.transforms.testing import tracked_peak_bytes

MODES = ("dx", "defer")


def plain_mlp(p: dict[str, Any], x_TD: torch.Tensor) -> torch.Tensor:
    for blk in p["layers"]:
        h = F.layer_norm(x_TD, x_TD.shape[-1:], blk["ln_w"], blk["ln_b"])
        x_TD = x_TD + F.linear(F.silu(F.linear(h, blk["w_in"], blk["b_in"])), blk["w_out"], blk["b_out"])
    return x_TD


def init_plain_mlp(layers: int, d: int, f: int, gen: torch.Generator) -> dict[str, Any]:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    return {"layers": [{"ln_w": 1 + 0.1 * r(d), "ln_b": 0.1 * r(d), "w_in": r(f, d), "b_in": 0.1 * r(f),
                        "w_out": r(d, f), "b_out": 0.1 * r(d)} for _ in range(layers)]}


def models(args: argparse.Namespace) -> dict[str, tuple[Callable[..., Any], Any, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    d, f, t = args.d_model, 4 * args.d_model, args.tokens
    moe = MoEConfig(d_model=d, d_ff=d, num_experts=8, top_k=2, aux_loss_coef=0.01, num_shared_experts=1)
    cfg = GPTConfig(vocab_size=64, d_model=d, n_layers=1, n_heads=4, n_kv_heads=2, moe=moe)

    def moe_block(p: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, aux = block(p, x, cfg, check=False)
        return y, aux.loss

    return {
        "moe block": (moe_block, init_block(cfg, gen), torch.randn(4, t // 4, d, generator=gen)),
        "fmoe dense": (dense_stack, init_dense_stack(args.layers, d, f, gen),
                       torch.randn(t, d, generator=gen)),
        "plain mlp": (plain_mlp, init_plain_mlp(args.layers, d, f, gen), torch.randn(t, d, generator=gen)),
    }


def ones_like_tree(out: Any) -> Any:
    return tuple(torch.ones_like(o) for o in out) if isinstance(out, tuple) else torch.ones_like(out)


def step(f: Callable[..., Any], p: Any, x: torch.Tensor, mode: str) -> tuple[float, float]:
    """One forward + dx + dw; returns (step seconds, dx seconds)."""
    t0 = time.perf_counter()
    out, vjp_dx = split_vjp(f, p, x, engine="autograd", plain_ops=mode)
    ct = ones_like_tree(out)
    t1 = time.perf_counter()
    _, vjp_dw = vjp_dx(ct)
    t2 = time.perf_counter()
    vjp_dw()
    t3 = time.perf_counter()
    return t3 - t0, t2 - t1


def pass_flops(f: Callable[..., Any], p: Any, x: torch.Tensor, mode: str) -> tuple[int, int]:
    out, vjp_dx = split_vjp(f, p, x, engine="autograd", plain_ops=mode)
    with FlopCounterMode(display=False) as c_dx:
        _, vjp_dw = vjp_dx(ones_like_tree(out))
    with FlopCounterMode(display=False) as c_dw:
        vjp_dw()
    return c_dx.get_total_flops(), c_dw.get_total_flops()


def walk_ms(f: Callable[..., Any], p: Any, x: torch.Tensor, reps: int) -> tuple[float, int]:
    """Median ms of the graph walk alone (PlainSplit on the graph of one forward), and the graph's nodes."""
    from fmoe._compat import tree_flatten
    from fmoe.transforms._plain_defer import PlainSplit

    leaves = [t.detach().requires_grad_() for t in tree_flatten(p)[0]] + [x.detach().requires_grad_()]
    spec = torch.utils._pytree.tree_structure(p)
    with torch.enable_grad():
        out = f(torch.utils._pytree.tree_unflatten(leaves[:-1], spec), leaves[-1])
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
    is_param = [True] * (len(leaves) - 1) + [False]
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        PlainSplit(outs, leaves, is_param)
        samples.append(time.perf_counter() - t0)
    nodes, queue = set(), [o.grad_fn for o in outs]
    while queue:
        n = queue.pop()
        if n is not None and n not in nodes:
            nodes.add(n)
            queue.extend(c for c, _ in n.next_functions)
    return statistics.median(samples) * 1e3, len(nodes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, D {args.d_model}, "
          f"{args.tokens} tokens, {args.layers} layers (dense stacks), {args.reps} reps")
    print("| model | mode | step ms | step / dx | dx pass ms | dx / dx | dx GFLOP | dw GFLOP | peak MiB "
          "| peak / dx |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    walks = {}
    for name, (f, p, x) in models(args).items():
        walks[name] = walk_ms(f, p, x, args.reps)
        for mode in MODES:  # warm up
            step(f, p, x, mode)
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for r in range(args.reps):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                times[mode].append(step(f, p, x, mode))
        med = {m: (statistics.median(s for s, _ in v), statistics.median(d for _, d in v))
               for m, v in times.items()}
        peak = {m: tracked_peak_bytes(lambda m=m, f=f, p=p, x=x: step(f, p, x, m))[1] for m in MODES}
        for mode in MODES:
            dx_fl, dw_fl = pass_flops(f, p, x, mode)
            print(f"| {name} | {mode} | {med[mode][0] * 1e3:.2f} | {med[mode][0] / med['dx'][0]:.3f} "
                  f"| {med[mode][1] * 1e3:.2f} | {med[mode][1] / med['dx'][1]:.3f} | {dx_fl / 1e9:.3f} "
                  f"| {dw_fl / 1e9:.3f} | {peak[mode] / 2**20:.1f} | {peak[mode] / peak['dx']:.3f} |")
    print()
    for name, (ms, nodes) in walks.items():
        print(f"graph walk alone, {name}: {ms:.3f} ms median over {nodes} graph nodes")


if __name__ == "__main__":
    main()
