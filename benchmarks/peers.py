"""fmoe's MoE layer against its peers, side by side: time and peak memory per implementation and precision.

    .venv/bin/pip install -e '.[bench]'        # transformers
    .venv/bin/pip install --no-deps torchtitan && .venv/bin/pip install spmd_types tyro triton  # optional
    .venv/bin/python benchmarks/peers.py       # the three shapes of issue 14, fp32 and bf16
    .venv/bin/python benchmarks/peers.py --shapes 256,512,8,2,64 --rounds 5
    .venv/bin/python benchmarks/peers.py --shapes 256,512,8,2,64 --precisions fp32 --op-split --no-memory

Legend (docs/moe.md): T tokens, D model width, F expert width, E experts, K top-k slots.

Implementations, one MoE layer (softmax top-k router with renormalised gates, SwiGLU experts, no shared
expert, no balancing loss), forward + backward of the output against a fixed cotangent (tape autograd,
`torch.autograd.grad` to the input and every weight), the same weights everywhere:
- fmoe: `fmoe.moe` (grouped GEMMs over expert-sorted rows);
- hf-grouped_mm / hf-eager: transformers' `Qwen3MoeSparseMoeBlock` with `_experts_implementation`
  "grouped_mm" and "eager" (its loop over the experts that received tokens);
- titan: torchtitan's `MoE` (models/common/moe.py: `TokenChoiceTopKRouter` with softmax scores and
  `route_norm`, `RoutedExperts` = `LocalTokenDispatcher` + `GroupedExperts`, no shared expert,
  `load_balance_coeff=None`), built on CPU in one process, no process group or device mesh; when it
  imports (it is not a dependency; skipped, saying so, when absent).
Precisions: fp32 (everything fp32), and bf16 mixed: fmoe's `bf16-mixed` policy as `fmoe train` runs it
(the fp32 masters cast to bf16 once per step, inside the timed step; bf16 GEMMs, fp32 router and combine;
each bf16 weight gradient summed into fp32 by a post-accumulate hook as the backward makes it), the HF
modules cast to bf16 (what their bf16 training runs: bf16 weights and gradients, no masters).
torchtitan's `GroupedExperts` casts x and the expert weights to bf16 inside its forward whatever their
dtype, so titan's bf16 is its stock module: fp32 parameters and input, bf16 grouped GEMMs, fp32 router and
combine (fmoe's policy); its fp32 is torchtitan's MoE patched to fp32 (a `GroupedExperts` subclass whose
grouped GEMMs run in the input dtype).
The bf16 plain-matmul ceiling is the layer's matmul FLOPs as dense bf16 `torch.mm` calls of the same shapes
(benchmarks/moe_layer.py's `ceiling_step`), timed in the same rounds. "matmuls alone" is the layer's matmuls
through `torch._grouped_mm` (benchmarks/grouped_ceiling.py's `expert_products`: the kernel every
implementation here calls, over balanced expert blocks), also in the same rounds: its time over the
fastest peer's is the least fmoe / fastest peer any implementation on that kernel can reach.

First the same function: in fp32 each peer's output and gradients must agree with fmoe's to 1e-4 relative
to the largest entry, or the script stops; in bf16 every implementation's difference from fmoe's fp32 run
is printed (a peer's bf16 router picks other experts for near-tied tokens). Times: one warm-up per
implementation, then `--rounds` rounds, each starting one implementation later (medians of wall time,
"ms", and of the thread's CPU time, "cpu ms"; "paired": the median over rounds of one step's CPU time over
another's in the same round, which a loaded machine moves far less than wall time). Peak memory:
each (shape, precision, implementation) in a fresh process with freed blocks returned to the OS, the RSS
high-water mark of one step after a warm-up, minus the RSS before it. `--op-split`: each implementation's
step again under a dispatch mode that times every aten call (thread CPU time), GEMMs apart from the other
ops, against the fastest peer's step: where the GEMMs and the other ops alone exceed 0.9 of it, no work on
the Python around them reaches the target.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _ranks import measure_rss, return_freed_memory
from grouped_ceiling import expert_products
from moe_layer import ceiling_step, interleaved_samples, layer_flops

from fmoe import MoEConfig, init_moe, moe
from fmoe.precision import POLICIES, accumulate, cast_to_compute

SHAPES = ((1024, 1024, 16, 4, 4096), (512, 256, 64, 8, 2048), (256, 512, 8, 2, 64))  # D, F, E, K, T
HAS_HF = importlib.util.find_spec("transformers") is not None
HAS_TITAN = importlib.util.find_spec("torchtitan") is not None


@functools.cache
def _titan_import_error() -> str | None:
    """None when torchtitan's MoE imports, else why not (then titan is skipped)."""
    if not HAS_TITAN:
        return "torchtitan is not installed"
    try:
        import torchtitan.models.common.moe  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import skips the peer
        return f"torchtitan does not import ({type(e).__name__}: {e})"
    return None


@functools.cache
def _titan_fp32_experts() -> type:
    """torchtitan's GroupedExperts patched to fp32: the same grouped GEMMs, run in the input dtype (the
    stock forward casts x and the weights to bf16)."""
    import torch.nn.functional as Fn
    from torchtitan.models.common.moe import GroupedExperts

    class Fp32GroupedExperts(GroupedExperts):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            h_RF = Fn.silu(self._grouped_mm(A=x_RD, B_t=self.w1_EFD.transpose(-2, -1), offs=offs))
            h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=self.w3_EFD.transpose(-2, -1), offs=offs)
            return self._grouped_mm(A=h_RF, B_t=self.w2_EDF.transpose(-2, -1), offs=offs)

    return Fp32GroupedExperts


def _titan_moe(cfg: MoEConfig, params: dict[str, Any], fp32: bool) -> torch.nn.Module:
    """torchtitan's MoE holding fmoe's weights (gate [E, D], w1 / w3 [E, F, D], w2 [E, D, F]), fp32
    parameters; `fp32`: the grouped GEMMs in fp32 (patched), else torchtitan's stock bf16 ones."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    # its router asks for an fp32 autocast, which CPU autocast does not support (it warns, then runs the
    # fp32 gate as it is)
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    D, F, E, K = cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.top_k
    experts = _titan_fp32_experts() if fp32 else GroupedExperts
    block = MoE.Config(
        num_experts=E,
        load_balance_coeff=None,  # no expert bias
        shared_experts=None,
        router=TokenChoiceTopKRouter.Config(
            num_experts=E,
            gate=Linear.Config(in_features=D, out_features=E),
            top_k=K,
            score_func="softmax",
            route_norm=True,  # gates renormalised after top-k (fmoe's topk_norm="after")
        ),
        routed_experts=RoutedExperts.Config(
            inner_experts=experts.Config(dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K),
        ),
    ).build()
    ex, inner = params["experts"], block.routed_experts.inner_experts
    with torch.no_grad():
        block.router.gate.weight.copy_(params["router"]["w"].t())
        inner.w1_EFD.copy_(ex["w_gate_up"][..., :F].transpose(1, 2))
        inner.w3_EFD.copy_(ex["w_gate_up"][..., F:].transpose(1, 2))
        inner.w2_EDF.copy_(ex["w_down"].transpose(1, 2))
    return block


def _titan_weights(block: torch.nn.Module) -> list[torch.Tensor]:
    inner = block.routed_experts.inner_experts
    return [block.router.gate.weight, inner.w1_EFD, inner.w3_EFD, inner.w2_EDF]


def _titan_grads_as_fmoe(grads: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """titan's weight gradients (in `_titan_weights` order) in fmoe's layout (for the agreement check)."""
    d_gate, d_w1, d_w3, d_w2 = grads
    return {
        "router.w": d_gate.t(),
        "experts.w_gate_up": torch.cat([d_w1, d_w3], 1).transpose(1, 2),
        "experts.w_down": d_w2.transpose(1, 2),
    }


def _hf_block(cfg: MoEConfig, params: dict[str, Any], impl: str, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Qwen3MoeSparseMoeBlock holding fmoe's weights (router [E, D], gate_up [E, 2F, D],
    down [E, D, F]) in `dtype`, running the experts with `impl` ("grouped_mm" or "eager")."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hc = Qwen3MoeConfig(
        hidden_size=cfg.d_model,
        moe_intermediate_size=cfg.d_ff,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=True,
        hidden_act="silu",
    )
    hc._experts_implementation = impl
    block = Qwen3MoeSparseMoeBlock(hc)
    ex = params["experts"]
    with torch.no_grad():
        block.gate.weight.copy_(params["router"]["w"].t())
        block.experts.gate_up_proj.copy_(ex["w_gate_up"].transpose(1, 2))
        block.experts.down_proj.copy_(ex["w_down"].transpose(1, 2))
    return block.to(dtype)


def _hf_grads_as_fmoe(
    block: torch.nn.Module, grads: tuple[torch.Tensor, ...], F: int
) -> dict[str, torch.Tensor]:
    """The peer's weight gradients in fmoe's layout (for the agreement check)."""
    d_router, d_gate_up, d_down = grads
    return {
        "router.w": d_router.t(),
        "experts.w_gate_up": d_gate_up.transpose(1, 2),
        "experts.w_down": d_down.transpose(1, 2),
    }


def build(name: str, shape: tuple[int, ...], precision: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Returns (step, grads) for implementation `name`: step() runs forward + backward once; grads() runs it
    and returns (y [T, D], {"x": dx, fmoe weight path: dw}) as fp32, for the agreement check."""
    D, F, E, K, T = shape
    cfg = MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, aux_loss_coef=0.0)
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    x_TD, ct_TD = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    bf16 = precision == "bf16"
    dt = torch.bfloat16 if bf16 else torch.float32
    x, ct = x_TD.to(dt).requires_grad_(), ct_TD.to(dt)
    if name == "fmoe":
        policy = POLICIES["bf16-mixed" if bf16 else "fp32"]
        names = [(k, n) for k in ("router", "experts") for n in params[k]]

        def run() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            p = cast_to_compute(params, policy)
            leaves = [p[k][n].requires_grad_() for k, n in names]
            if not policy.mixed:
                y = moe(p, x, cfg, check=False)[0]
                return y, torch.autograd.grad(y, [x, *leaves], ct)
            # bf16-mixed as `fmoe train` runs it: the cast of the fp32 masters is part of the step (once
            # per step), and each bf16 weight gradient goes into its fp32 sum as the backward makes it.
            sums: dict[int, torch.Tensor] = {}

            def into_fp32(k: int):
                def hook(t: torch.Tensor) -> None:
                    sums[k] = accumulate(sums.get(k), t.grad, policy)
                    t.grad = None
                return hook

            hooks = [t.register_post_accumulate_grad_hook(into_fp32(k)) for k, t in enumerate(leaves)]
            x.grad = None
            y = moe(p, x, cfg, check=False)[0]
            y.backward(ct)
            for h in hooks:
                h.remove()
            return y, (x.grad, *[sums[k] for k in range(len(leaves))])

        def grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            y, (dx, *dws) = run()
            return y.float(), {"x": dx.float(), **{f"{k}.{n}": d.float() for (k, n), d in zip(names, dws)}}

        return run, grads
    if name.startswith("hf-"):
        block = _hf_block(cfg, params, name[3:], dt)
        weights = [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]

        def run() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            y = block(x.unsqueeze(0)).squeeze(0)
            return y, torch.autograd.grad(y, [x, *weights], ct)

        def grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            y, (dx, *dws) = run()
            return y.float(), {
                "x": dx.float(),
                **{k: v.float() for k, v in _hf_grads_as_fmoe(block, dws, F).items()},
            }

        return run, grads
    if name == "titan":
        # bf16: torchtitan's stock module (fp32 parameters and input, bf16 grouped GEMMs inside)
        block = _titan_moe(cfg, params, fp32=not bf16)
        weights = _titan_weights(block)
        xt, ctt = x_TD.clone().requires_grad_(), ct_TD

        def run() -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            y = block(xt.unsqueeze(0)).squeeze(0)
            return y, torch.autograd.grad(y, [xt, *weights], ctt)

        def grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            y, (dx, *dws) = run()
            return y.float(), {
                "x": dx.float(),
                **{k: v.float() for k, v in _titan_grads_as_fmoe(dws).items()},
            }

        return run, grads
    raise ValueError(f"unknown implementation {name!r}")


def implementations() -> list[str]:
    """The implementations that can run here (fmoe, and the peers that import)."""
    return (
        ["fmoe"]
        + (["hf-grouped_mm", "hf-eager"] if HAS_HF else [])
        + (["titan"] if _titan_import_error() is None else [])
    )


def check_same_function(shape: tuple[int, ...], precision: str, names: list[str]) -> dict[str, float]:
    """Returns each implementation's largest relative difference (output and every gradient) from fmoe's
    fp32 run. In fp32 it raises SystemExit above 1e-4 (the same function). In bf16 it only reports: a peer
    computing its router in bf16 picks other experts for near-tied tokens, so its output may differ by
    more than rounding (fmoe's bf16-mixed router stays fp32)."""
    y_ref, g_ref = build("fmoe", shape, "fp32")[1]()
    out = {}
    for name in names:
        y, grads = build(name, shape, precision)[1]()
        worst = 0.0
        for key, a, b in [("y", y, y_ref)] + [(k, grads[k], g_ref[k]) for k in g_ref]:
            rel = float((a - b).abs().max().detach() / b.abs().max().detach().clamp(min=1e-30))
            worst = max(worst, rel)
            if precision == "fp32" and rel > 1e-4:
                raise SystemExit(f"{name} fp32 {shape}: {key} differs from fmoe by {rel:.2e} (> 1e-4)")
        out[name] = worst
    return out


def _child(args: argparse.Namespace) -> None:
    return_freed_memory()
    step = build(args.child, tuple(args.child_shape), args.child_precision)[0]
    step()
    _, _, rise = measure_rss(step)
    print(json.dumps({"rise_mib": rise}))


def _memory(name: str, shape: tuple[int, ...], precision: str) -> float:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--child-precision",
        precision,
        "--child-shape",
        *map(str, shape),
    ]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["rise_mib"]


GEMMS = ("aten.mm", "aten._grouped_mm", "aten.bmm", "aten.addmm")


@dataclasses.dataclass
class OpSplit:
    """One step's aten calls (thread CPU time, seconds) under a dispatch mode: GEMMs, the other ops and
    their number; `step`: the same step run plainly in the same round."""

    step: float
    gemm: float
    other: float
    ops: int


def op_split(steps: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[OpSplit]]:
    """Per implementation and round, its step run plainly and then under a dispatch mode timing every aten
    call (the calls only: the Python around them and autograd's bookkeeping are neither), GEMMs apart;
    rounds rotate the implementations' order as `interleaved_samples` does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Timed(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.gemm = self.other = 0.0
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            t0 = time.thread_time()
            out = func(*args, **(kwargs or {}))
            dt = time.thread_time() - t0
            if str(func).startswith(GEMMS):
                self.gemm += dt
            else:
                self.other, self.ops = self.other + dt, self.ops + 1
            return out

    names = list(steps)
    out: dict[str, list[OpSplit]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.thread_time()
            steps[n]()
            plain = time.thread_time() - t0
            with Timed() as m:
                steps[n]()
            out[n].append(OpSplit(plain, m.gemm, m.other, m.ops))
    return out


def _paired(samples: dict[str, list[tuple[float, float]]], a: str, b: str) -> float:
    """The median over rounds of a's CPU time / b's in the same round (seconds apart, so a drift of the
    machine's speed between rounds cancels)."""
    return statistics.median(x[1] / y[1] for x, y in zip(samples[a], samples[b]))


def main() -> None:
    """Checks the same function, times every implementation interleaved, measures peak memory; prints one
    table per shape and precision with the targets."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=None, help="D,F,E,K,T (default: issue 14's three)")
    ap.add_argument("--precisions", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--op-split", action="store_true",
                    help="also time each implementation's GEMMs and its other aten ops apart (dispatch mode)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-precision", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--child-shape", nargs=5, type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        _child(args)
        return
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else list(SHAPES)
    names = implementations()
    print(f"torch {torch.__version__}, {args.threads} thread(s); implementations: {', '.join(names)}")
    if not HAS_HF:
        print("transformers is not installed: its blocks are skipped (pip install -e '.[bench]')")
    if _titan_import_error() is not None:
        print(f"{_titan_import_error()}: its MoE is skipped")
    for shape in shapes:
        D, F, E, K, T = shape
        flops = layer_flops(T, D, F, E, K)
        for precision in args.precisions:
            diffs = check_same_function(shape, precision, names)
            steps = {n: build(n, shape, precision)[0] for n in names}
            if precision == "bf16":
                steps["bf16 mm ceiling"] = ceiling_step(
                    T, D, F, E, K, torch.Generator().manual_seed(2), torch.bfloat16
                )
            # The layer's matmuls alone through the kernel every implementation here calls (router dense,
            # experts' grouped forward, dx and dw over balanced row blocks): no implementation built on
            # it is faster, so their time over the fastest peer's bounds what fmoe / fastest can reach.
            steps["matmuls alone"] = expert_products(
                T, D, F, E, K, torch.bfloat16 if precision == "bf16" else torch.float32, "grouped_mm",
                torch.Generator().manual_seed(3))
            samples = interleaved_samples(steps, args.rounds)
            times = {n: statistics.median(w for w, _ in ts) for n, ts in samples.items()}
            cpu = {n: statistics.median(c for _, c in ts) for n, ts in samples.items()}
            mem = {n: None if args.no_memory else _memory(n, shape, precision) for n in names}
            print(
                f"\nD {D}, F {F}, E {E}, K {K}, T {T}, {precision}: {args.rounds} rounds, medians; "
                "diff: largest relative difference of y and the gradients from fmoe fp32"
            )
            print(f"{'implementation':<16} {'ms':>9} {'cpu ms':>9} {'GFLOP/s':>8} {'peak rise MiB':>14} "
                  f"{'diff':>8}")
            for n, t in times.items():
                m, d = mem.get(n), diffs.get(n)
                print(
                    f"{n:<16} {t * 1e3:9.2f} {cpu[n] * 1e3:9.2f} {flops / t / 1e9:8.1f} "
                    f"{'' if m is None else f'{m:14.1f}'} {'' if d is None else f'{d:8.1e}'}"
                )
            peers = [n for n in names if n != "fmoe"]
            if peers:
                fastest = min(peers, key=times.get)
                line = (
                    f"fmoe time / fastest peer ({fastest}): {times['fmoe'] / times[fastest]:.3f} "
                    f"(target <= 0.9; the matmuls alone: {times['matmuls alone'] / times[fastest]:.3f})"
                )
                fastest_cpu = min(peers, key=cpu.get)
                line += (f"; CPU time, paired per round: fmoe / {fastest_cpu} "
                         f"{_paired(samples, 'fmoe', fastest_cpu):.3f}, the matmuls alone "
                         f"{_paired(samples, 'matmuls alone', fastest_cpu):.3f}")
                if not args.no_memory:
                    low = min(peers, key=mem.get)
                    line += f"; fmoe peak / lowest peer ({low}): {mem['fmoe'] / mem[low]:.3f} (target <= 1.0)"
                print(line)
            if args.op_split:  # the aten calls alone, against the fastest peer's plain step in each round
                split = op_split({n: steps[n] for n in names}, args.rounds)
                base = min((n for n in names if n != "fmoe"), key=times.get, default="fmoe")
                for n in names:
                    gemm = statistics.median(o.gemm for o in split[n]) * 1e3
                    other = statistics.median(o.other for o in split[n]) * 1e3
                    floor = statistics.median((o.gemm + o.other) / b.step
                                              for o, b in zip(split[n], split[base]))
                    print(f"  {n:<14} aten calls under a dispatch mode: GEMMs {gemm:9.2f} ms, other ops "
                          f"{other:8.2f} ms ({split[n][-1].ops} calls); their sum / {base}'s plain step "
                          f"in the same round {floor:.3f}")
            if precision == "bf16":
                print(
                    f"fmoe bf16 / bf16 plain-matmul ceiling: {times['bf16 mm ceiling'] / times['fmoe']:.3f} "
                    "(target >= 0.7)"
                )


if __name__ == "__main__":
    main()
