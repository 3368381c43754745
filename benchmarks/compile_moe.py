"""The MoE layer compiled against eager, and against torchtitan's MoE eager and compiled, forward + backward.

    .venv/bin/python benchmarks/compile_moe.py                        # D1024 F1024 E16 K4 T4096 fp32
    .venv/bin/python benchmarks/compile_moe.py --shape 256,256,8,2,512 --rounds 3 --no-memory

Legend (docs/moe.md): T tokens, D model width, F expert width, E experts, K top-k slots.

One step: the layer on x_TD, its output against a fixed cotangent ct_TD, the gradients of x and every
weight. Implementations (the same weights, softmax top-k router with gates renormalised after the top-k,
SwiGLU experts, no shared expert, no balancing loss):
- eager: `fmoe.moe`, tape autograd (`torch.autograd.grad`);
- compiled: `torch.compile(fullgraph=True)` of that forward (inductor; AOT autograd compiles its backward);
  fp32 grouped GEMMs reach the compiler as the library op fmoe::grouped_mm (fmoe/ops/_grouped_op.py);
- compiled-split: `fmoe.transforms.compiled.CompiledSplit` (inductor), the split backward `fmoe train
  --compile` runs: forward, dx pass and dw pass as three compiled graphs, all three per step;
- titan-eager / titan-compiled: torchtitan's `MoE` (benchmarks/peers.py's `_titan_moe`: its Config
  dataclasses, `TokenChoiceTopKRouter` softmax with route_norm, `GroupedExperts`, `LocalTokenDispatcher`,
  load_balance_coeff None), stock, eager and under `torch.compile(fullgraph=True)`, `torch.autograd.grad`.
  Its GroupedExperts casts x and the fp32 expert weights to bf16 for `torch._grouped_mm` inside its
  forward, so its expert GEMMs run in bf16 (router and combine fp32): not the same arithmetic as fmoe's
  fp32 rows (the printed difference shows it; a CPU with avx512_bf16 runs them about twice as fast);
- titan-fp32-eager / titan-fp32-compiled: the same module with its grouped GEMMs kept in fp32
  (peers.py's patched GroupedExperts), the same arithmetic as fmoe's. Its compiled form fails in torch
  2.13 (aten._grouped_mm's fake-tensor rule takes bf16 only).
torchtitan is not a dependency: where it does not import, or a compiled form fails here, the script says
so in one line and compares with what runs.

First calls (compile included) are timed apart. Then `--rounds` rounds, each starting one implementation
later (medians). Peak memory: each implementation in a fresh process, the RSS high-water mark of one step
after a warm-up minus the RSS before it.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from _ranks import measure_rss, return_freed_memory
from moe_layer import interleaved_medians
from peers import _titan_grads_as_fmoe, _titan_import_error, _titan_moe, _titan_weights

from fmoe import MoEConfig, init_moe, moe
from fmoe.transforms.compiled import CompiledSplit

Shape = tuple[int, int, int, int, int]
Grads = dict[str, torch.Tensor]  # "x" and fmoe's weight paths ("experts.w_gate_up", ...)
Step = Callable[[], tuple[torch.Tensor, Grads]]  # one forward + backward: (y_TD, gradients)
FMOE = ("eager", "compiled", "compiled-split", "compiled-bf16")
TITAN = ("titan-eager", "titan-compiled", "titan-fp32-eager", "titan-fp32-compiled")


def make(shape: Shape, seed: int = 0) -> tuple[MoEConfig, dict, torch.Tensor, torch.Tensor]:
    """Returns (cfg, params with requires_grad, x_TD with requires_grad, ct_TD), fp32."""
    D, F, E, K, T = shape
    cfg = MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, aux_loss_coef=0.0)
    gen = torch.Generator().manual_seed(seed)
    params = {k: {kk: v.requires_grad_() for kk, v in sub.items()} for k, sub in init_moe(cfg, gen).items()}
    x_TD = torch.randn(T, D, generator=gen, requires_grad=True)
    ct_TD = torch.randn(T, D, generator=gen)
    return cfg, params, x_TD, ct_TD


def _named(params: dict, x_grad: torch.Tensor, weight_grads) -> Grads:
    paths = [f"{k}.{n}" for k, sub in params.items() for n in sub]
    return {"x": x_grad, **dict(zip(paths, weight_grads, strict=True))}


def tape_step(cfg: MoEConfig, params: dict, x_TD: torch.Tensor, ct_TD: torch.Tensor, compiled: bool) -> Step:
    """fmoe's layer by tape autograd; `compiled`: its forward under torch.compile (inductor)."""
    weights = [v for sub in params.values() for v in sub.values()]

    def forward(p: dict, x: torch.Tensor) -> torch.Tensor:
        return moe(p, x, cfg)[0]

    fn = torch.compile(forward, fullgraph=True) if compiled else forward

    def step() -> tuple[torch.Tensor, Grads]:
        y_TD = fn(params, x_TD)
        dx_TD, *dws = torch.autograd.grad(y_TD, [x_TD, *weights], ct_TD)
        return y_TD, _named(params, dx_TD, dws)

    return step


def split_step(cfg: MoEConfig, params: dict, x_TD: torch.Tensor, ct_TD: torch.Tensor) -> Step:
    """fmoe's layer as CompiledSplit's three inductor graphs: forward, dx pass, dw pass."""
    split = CompiledSplit(lambda p, x: ({"y": moe(p, x, cfg)[0]}, {}), "inductor")

    def step() -> tuple[torch.Tensor, Grads]:
        out, vjp_dx, _ = split(params, x_TD)
        (dx_TD,), vjp_dw = vjp_dx({"y": ct_TD})
        dparams = vjp_dw()
        return out["y"], _named(params, dx_TD, [v for sub in dparams.values() for v in sub.values()])

    return step


def titan_step(cfg: MoEConfig, params: dict, x_TD: torch.Tensor, ct_TD: torch.Tensor, fp32: bool,
               compiled: bool) -> Step:
    """torchtitan's MoE holding the same weights: stock (bf16 grouped GEMMs inside), or `fp32` (patched);
    `compiled`: under torch.compile (inductor)."""
    block = _titan_moe(cfg, params, fp32=fp32)
    weights = _titan_weights(block)
    fn = torch.compile(block, fullgraph=True) if compiled else block
    x_1TD = x_TD.detach().unsqueeze(0).requires_grad_()

    def step() -> tuple[torch.Tensor, Grads]:
        y_TD = fn(x_1TD).squeeze(0)
        dx_1TD, *dws = torch.autograd.grad(y_TD, [x_1TD, *weights], ct_TD)
        return y_TD, {"x": dx_1TD.squeeze(0), **_titan_grads_as_fmoe(tuple(dws))}

    return step


def _bf16(params: dict, x_TD: torch.Tensor, ct_TD: torch.Tensor) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The same inputs in bf16 (leaves that need gradients): the arithmetic torchtitan's stock experts do."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(torch.bfloat16).requires_grad_()

    return ({k: {n: cast(v) for n, v in sub.items()} for k, sub in params.items()}, cast(x_TD),
            ct_TD.to(torch.bfloat16))


def build(name: str, shape: Shape) -> Step:
    """The step of implementation `name` at `shape` (inputs from `make`, the same for every name)."""
    cfg, params, x_TD, ct_TD = make(shape)
    if name == "compiled-bf16":
        return tape_step(cfg, *_bf16(params, x_TD, ct_TD), compiled=True)
    if name == "compiled-split":
        return split_step(cfg, params, x_TD, ct_TD)
    if name in TITAN:
        return titan_step(cfg, params, x_TD, ct_TD, fp32="fp32" in name, compiled=name.endswith("compiled"))
    return tape_step(cfg, params, x_TD, ct_TD, compiled=name == "compiled")


def rel_diff(got: tuple[torch.Tensor, Grads], want: tuple[torch.Tensor, Grads]) -> float:
    """The largest difference of the output and every gradient, relative to the reference's largest entry."""
    pairs = [(got[0], want[0])] + [(got[1][k], w) for k, w in want[1].items()]
    return max(float((g.detach().float() - w.detach()).abs().max() / w.detach().abs().max())
               for g, w in pairs)


def root_cause(e: BaseException) -> str:
    """The first line of the innermost exception `e` was raised from or while handling (dynamo wraps the
    op's own error twice)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def first_calls(steps: dict[str, Step]) -> tuple[dict[str, float], dict[str, float]]:
    """Runs each step once (compiling the compiled ones); returns (first-call seconds, difference from
    eager fmoe). A compiled torchtitan that fails is dropped from `steps`, saying why in one line."""
    seconds, diffs, results = {}, {}, {}
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # root_cause says it
    for name in list(steps):
        t = time.perf_counter()
        try:
            results[name] = steps[name]()
        except Exception as e:  # noqa: BLE001 - the peer's compiled form may not run on this machine
            if not (name in TITAN and name.endswith("compiled")):
                raise
            print(f"{name}: fails here ({root_cause(e)}), so no row")
            del steps[name]
            continue
        seconds[name] = time.perf_counter() - t
        diffs[name] = rel_diff(results[name], results["eager"])
    return seconds, diffs


def peak_rss_of(name: str, shape: Shape) -> float:
    """MiB: a fresh process's RSS high-water mark over one step (after a warm-up) minus its RSS before."""
    cmd = [sys.executable, __file__, "--memory-of", name, "--shape", ",".join(map(str, shape))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def _memory_child(name: str, shape: Shape) -> None:
    return_freed_memory()
    step = build(name, shape)
    step()  # warm-up (and compile)
    _, _, rise_mib = measure_rss(step)
    print(json.dumps({"peak_mib": rise_mib}))


def print_ratios(med: dict[str, float]) -> None:
    """The ratios of the medians: fmoe's compiled forms against eager and against torchtitan's forms (the
    target against its compiled stock form, or its eager one where that failed)."""
    def ratio(a: str, b: str, note: str = "") -> None:
        if a in med and b in med:
            print(f"  {a} / {b}: {med[a] / med[b]:.3f}{note}")

    peer = "titan-compiled" if "titan-compiled" in med else "titan-eager"
    target = " (target <= 1.0)" if peer == "titan-compiled" else " (titan's eager: its compiled form failed)"
    ratio("compiled", "eager")
    ratio("compiled-split", "eager")
    ratio("compiled-split", "compiled")
    ratio("titan-compiled", "titan-eager")
    ratio("compiled", peer, target)
    ratio("compiled-split", peer, target)
    ratio("compiled-bf16", peer, " (bf16 GEMMs both)")
    ratio("compiled", "titan-fp32-eager", " (the same fp32 arithmetic)")
    ratio("eager", "titan-fp32-eager", " (the same fp32 arithmetic)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1024,1024,16,4,4096", help="D,F,E,K,T")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory-of", choices=FMOE + TITAN, help=argparse.SUPPRESS)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated implementations to run (eager, the "
                    f"reference, always runs); of {', '.join(FMOE + TITAN)}")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    if len(shape) != 5:
        ap.error(f"--shape takes D,F,E,K,T (five integers), got {args.shape!r}")
    if args.memory_of:
        _memory_child(args.memory_of, shape)
        return
    titan_missing = _titan_import_error()
    names = FMOE + (() if titan_missing else TITAN)
    if args.only:
        wanted = {"eager", *args.only.split(",")}
        unknown = wanted - set(FMOE + TITAN)
        if unknown:
            ap.error(f"--only: unknown implementation(s) {sorted(unknown)}; of {', '.join(FMOE + TITAN)}")
        names = tuple(n for n in names if n in wanted)
    if titan_missing:
        print(f"{titan_missing}: no torchtitan rows (benchmarks/peers.py says how to install it)")
    steps = {n: build(n, shape) for n in names}
    first_s, diffs = first_calls(steps)
    med = interleaved_medians(steps, args.rounds, warm_up=False)  # first_calls ran each once
    mem = {} if args.no_memory else {n: peak_rss_of(n, shape) for n in steps}
    print(f"shape D,F,E,K,T = {shape}, fp32 inputs and parameters, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.rounds} rotated rounds; diff: largest "
          "relative difference of y and every gradient from eager fmoe (titan: bf16 expert GEMMs; "
          "compiled-bf16: fmoe's layer in bf16)")
    print(f"{'implementation':<16} {'first call s':>12} {'median s':>9} {'peak RSS MiB':>13} {'diff':>8}")
    for n in steps:
        rss = f"{mem[n]:13.0f}" if n in mem else f"{'-':>13}"
        print(f"{n:<16} {first_s[n]:12.1f} {med[n]:9.3f} {rss} {diffs[n]:8.1e}")
    print("ratios of the medians:")
    print_ratios(med)


if __name__ == "__main__":
    main()
