"""`fmoe train` at pp 1 x ep 1 against a plain nn.Module training loop of the same model, side by side.

Both train the tiny preset's model (or `--preset small`) from the same weights on the same microbatches:
fmoe's `Trainer` (the job's own step: gpt_loss per microbatch, autograd, AdamW, clipping) and
`benchmarks/_module_gpt.ModuleGPT` with torch.optim.AdamW (same groups and hyperparameters), loss.backward()
per microbatch and clip_grad_norm_. First both run `--check-steps` steps and their losses must agree
(the same function trained the same way); then interleaved rounds, the order alternating, step times
as medians, tokens/s = global batch x sequence length / step time. A second estimate pairs the sides
within each round (module's mean step / fmoe's, from steps seconds apart) and takes the median of those
ratios: on a box whose speed drifts over seconds it cancels most of the drift. Peak memory: each side in
a fresh process, the RSS high-water mark (Linux VmHWM) of one step after a warm-up, and its rise over the
RSS before the step.

    .venv/bin/python benchmarks/train.py [--preset tiny] [--rounds 40] [--steps-per-round 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _module_gpt import ModuleGPT, module_from_params, param_leaves  # noqa: E402
from _ranks import measure_rss  # noqa: E402

from fmoe.train.config import TrainConfig  # noqa: E402
from fmoe.train.data import microbatches  # noqa: E402
from fmoe.train.loop import Trainer, World  # noqa: E402
from fmoe.train.optim import lr_at  # noqa: E402
from fmoe.train.shards import decays  # noqa: E402

SIDES = ("fmoe", "module")


class ModuleLoop:
    """The peer: ModuleGPT, torch.optim.AdamW, loss.backward(), clip_grad_norm_ — nanoGPT's loop."""

    def __init__(self, tc: TrainConfig, trainer: Trainer):
        self.tc, self.dataset = tc, trainer.dataset
        # --bf16: torch's own mixed precision, autocast (weights cast per op and microbatch, fp32 masters)
        self.autocast = tc.bf16
        self.model: ModuleGPT = module_from_params(tc.model(), trainer.params, trainer.state)
        decay, rest = [], []
        for path, p, _ in param_leaves(self.model):  # fmoe's rule, on the same fmoe paths
            (decay if decays(path) else rest).append(p)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=tc.lr,
                                     betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps, foreach=True)
        self.step_done = 0

    def step(self) -> float:
        """One step; returns the mean main loss over the microbatches (this model's whole loss minus
        nothing: the module returns the training loss, the comparison uses that)."""
        tc = self.tc
        for g in self.opt.param_groups:
            g["lr"] = lr_at(tc, self.step_done)
        batches = microbatches(self.dataset, self.step_done, global_batch=tc.global_batch_size,
                               micro_batch=tc.micro_batch_size, data_rank=0, data_ranks=1, seed=tc.seed)
        total = 0.0
        for ids, targets in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss = self.model(ids, targets)
            (loss / len(batches)).backward()
            total += float(loss.detach())
        if tc.clip_grad:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.clip_grad, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step_done += 1
        return total / len(batches)


def _setup(args: argparse.Namespace) -> tuple[TrainConfig, Trainer, ModuleLoop]:
    tc = TrainConfig.from_sources(args.preset, None, {"pp": 1, "ep": 1, "steps": 1000, "progress": False,
                                                      "bf16": args.bf16})
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    trainer = Trainer(tc, World(0, 1, None, torch.device("cpu")))
    return tc, trainer, ModuleLoop(tc, trainer)


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _child(args: argparse.Namespace) -> None:
    """One warm-up step then one measured step of `args.child` in this fresh process; prints JSON with
    the peak RSS and its rise over the RSS before the step (MiB)."""
    _, trainer, module = _setup(args)
    step = trainer.step if args.child == "fmoe" else module.step
    step()
    _, peak, rise = measure_rss(step)
    print(json.dumps({"peak_mib": peak, "rise_mib": rise}))


def main() -> None:
    """Checks that both sides train the same function, times them interleaved, measures peak memory;
    prints the table and the tokens/s ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps-per-round", type=int, default=1)
    ap.add_argument("--check-steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true",
                    help="mixed precision: fmoe's bf16-mixed policy against the module under torch.autocast")
    ap.add_argument("--child", choices=SIDES, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        _child(args)
        return
    tc, trainer, module = _setup(args)
    for _ in range(args.check_steps):  # the same function, trained the same way
        ours, theirs = trainer.step()["loss"], module.step()
        if abs(ours - theirs) > (3e-3 if args.bf16 else 1e-4) * abs(theirs):
            raise SystemExit(f"the two sides disagree at step {trainer.step_done}: fmoe {ours} vs module "
                             f"{theirs}")
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    paired: list[float] = []  # per round: module's mean step / fmoe's, from steps seconds apart
    steps = {"fmoe": trainer.step, "module": module.step}
    for r in range(args.rounds):
        this_round: dict[str, list[float]] = {s: [] for s in SIDES}
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            for _ in range(args.steps_per_round):
                this_round[side].append(_timed(steps[side])[0])
            times[side] += this_round[side]
        paired.append(statistics.fmean(this_round["module"]) / statistics.fmean(this_round["fmoe"]))
    mem = {}
    for side in SIDES:
        cmd = [sys.executable, __file__, "--child", side, "--preset", args.preset, "--threads",
               str(args.threads)] + (["--bf16"] if args.bf16 else [])
        mem[side] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    tokens = tc.global_batch_size * tc.seq_length
    med = {s: statistics.median(times[s]) for s in SIDES}
    print(f"fmoe train vs nn.Module loop: preset {args.preset} at pp 1 x ep 1 ({tc.num_layers} layers, "
          f"D {tc.hidden_size}, {tc.num_experts} experts top-{tc.moe_router_topk}, {tc.microbatches} "
          f"microbatches of {tc.micro_batch_size} x {tc.seq_length}), "
          f"{'bf16 mixed (module: autocast)' if args.bf16 else 'fp32'}, {args.threads} thread(s); "
          f"losses agree over {args.check_steps} steps; {args.rounds} rounds x {args.steps_per_round} steps, "
          "medians")
    print(f"{'side':<8} {'step ms':>8} {'tokens/s':>9} {'peak RSS MiB':>13} {'rise in step MiB':>17}")
    for s in SIDES:
        print(f"{s:<8} {med[s] * 1e3:8.1f} {tokens / med[s]:9.0f} {mem[s]['peak_mib']:13.1f} "
              f"{mem[s]['rise_mib']:17.1f}")
    best = {s: min(times[s]) for s in SIDES}
    print(f"fastest step: fmoe {best['fmoe'] * 1e3:.1f} ms, module {best['module'] * 1e3:.1f} ms "
          f"(ratio {best['module'] / best['fmoe']:.3f})")
    print(f"fmoe / module tokens/s, median of the per-round ratios: {statistics.median(paired):.3f} "
          f"(quartiles {' / '.join(f'{q:.3f}' for q in statistics.quantiles(paired, n=4))})")
    print(f"fmoe / module: tokens/s {med['module'] / med['fmoe']:.3f} (target >= 0.95), peak RSS "
          f"{mem['fmoe']['peak_mib'] / mem['module']['peak_mib']:.3f}x")


if __name__ == "__main__":
    main()
