"""split_vjp's two engines side by side: one pipeline step of an MoE GPT through the executor (pp = 1,
1F1B over 4 microbatches), compute phases differentiated by torch.func.vjp ("func") or tape autograd
("autograd"). Interleaved repetitions with the order alternating, medians; the peak RSS of one step per
engine, each in a fresh process (Linux VmHWM, reset before the step): the rise over the RSS before the
step is what the step's activations and gradients cost.

    .venv/bin/python benchmarks/engines.py [--reps 7] [--layers 4] [--d-model 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from _ranks import measure_rss

from fmoe import GPTConfig, MoEConfig, init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.schedule.options import ExecOptions

ENGINES = ("func", "autograd")


def _setup(args: argparse.Namespace):
    moe = MoEConfig(d_model=args.d_model, d_ff=args.d_model, num_experts=8, top_k=2)
    cfg = GPTConfig(vocab_size=1024, d_model=args.d_model, n_layers=args.layers, n_heads=4, moe=moe)
    params, state = init_gpt(cfg, torch.Generator().manual_seed(0)), init_gpt_state(cfg)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 1024, (2, args.seq + 1), generator=g) for _ in range(4)]
    return cfg, params, state, [(s_[:, :-1], s_[:, 1:]) for s_ in seqs], S.one_f_one_b(1, 4)


def _step(setup, engine: str) -> tuple[float, float]:
    cfg, params, state, batches, s = setup
    t0 = time.perf_counter()
    out = gpt_pipeline_step(gpt_program(cfg, s, 0), params, state, batches,
                            options=ExecOptions(engine=engine))
    return time.perf_counter() - t0, float(out.loss)


def _child(args: argparse.Namespace) -> None:
    """Two steps of `args.child` in this fresh process (a warm-up, then the measured one, with the RSS
    high-water mark reset in between through /proc/self/clear_refs); prints the measured step's peak RSS
    and its rise over the RSS before it (MiB), and the loss, as JSON."""
    setup = _setup(args)
    _step(setup, args.child)
    (_, loss), peak, rise = measure_rss(lambda: _step(setup, args.child))
    print(json.dumps({"peak_mib": peak, "step_rise_mib": rise, "loss": loss}))


def main() -> None:
    """Times both engines interleaved, then measures each one's peak RSS in a child; prints the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--child", choices=ENGINES, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        _child(args)
        return
    setup = _setup(args)
    times: dict[str, list[float]] = {e: [] for e in ENGINES}
    losses = {e: _step(setup, e)[1] for e in ENGINES}  # warm-up (and the losses agree)
    for rep in range(args.reps):
        for e in ENGINES if rep % 2 else ENGINES[::-1]:
            times[e].append(_step(setup, e)[0])
    mem = {}
    for e in ENGINES:
        cmd = [sys.executable, __file__, "--child", e, "--layers", str(args.layers), "--d-model",
               str(args.d_model), "--seq", str(args.seq)]
        mem[e] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    med = {e: statistics.median(times[e]) for e in ENGINES}
    print(f"MoE GPT: {args.layers} MoE layers, D={args.d_model}, E=8, K=2, 4 microbatches of 2 x {args.seq} "
          f"tokens, 1F1B on one rank, fp32, 1 thread; {args.reps} interleaved reps (medians)")
    print(f"{'engine':<10} {'step ms':>8} {'peak RSS MiB':>13} {'rise in step MiB':>17} {'loss':>10}")
    for e in ENGINES:
        print(f"{e:<10} {med[e] * 1e3:8.1f} {mem[e]['peak_mib']:13.1f} {mem[e]['step_rise_mib']:17.1f} "
              f"{losses[e]:10.6f}")
    print(f"autograd / func: time {med['autograd'] / med['func']:.3f}, "
          f"peak rise {mem['autograd']['step_rise_mib'] / max(mem['func']['step_rise_mib'], 1e-9):.3f}; "
          f"|dloss| {abs(losses['autograd'] - losses['func']):.1e}")


if __name__ == "__main__":
    main()
