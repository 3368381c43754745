"""`fmoe train`'s recompute choices side by side: bytes a forward keeps for its backward, and step time.

    .venv/bin/python benchmarks/recompute.py --rounds 7

One process, `gpt_loss` (fmoe train's accumulate path) on the tiny preset with an MTP block, fp32, B x S
tokens. Per choice: the bytes torch's allocator holds when the forward has returned (its result alive),
counted by the profiler (not timed), and the median time of a forward + backward over `rounds` rounds
that run every choice once each, the order rotating. Ratios are against no recompute.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from fmoe import init_gpt, init_gpt_state
from fmoe.model import gpt_loss
from fmoe.train.config import TrainConfig

CHOICES: dict[str, dict[str, Any]] = {
    "none": {},
    "full": {"recompute_granularity": "full"},
    "full, first layer": {"recompute_granularity": "full", "recompute_method": "block",
                          "recompute_num_layers": 1},
    "selective core_attn": {"recompute_granularity": "selective"},
    "selective mlp": {"recompute_granularity": "selective", "recompute_modules": ("mlp",)},
    "selective moe": {"recompute_granularity": "selective", "recompute_modules": ("moe",)},
    "selective shared_experts": {"recompute_granularity": "selective",
                                 "recompute_modules": ("shared_experts",)},
    "adaptive (scale 1)": {"moe_adaptive_recompute_activation": True,
                           "moe_adaptive_recompute_activation_scale": 1.0},
}


def _setup(flags: dict[str, Any], batch: int, seq: int) -> tuple[Any, ...]:
    cfg = TrainConfig(mtp=True, **flags).model()
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    for t in torch.utils._pytree.tree_leaves(params):
        t.requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    return cfg, params, init_gpt_state(cfg), ids, targets


def held_bytes(setup: tuple[Any, ...]) -> int:
    """Bytes allocated by one forward and still held when it returned."""
    cfg, params, state, ids, targets = setup
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = gpt_loss(params, ids, targets, cfg, state)
    held = sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    del out
    return held


def step_s(setup: tuple[Any, ...]) -> float:
    """Seconds of one forward + backward."""
    cfg, params, state, ids, targets = setup
    t = time.perf_counter()
    loss, _ = gpt_loss(params, ids, targets, cfg, state)
    loss.backward()
    dt = time.perf_counter() - t
    for p in torch.utils._pytree.tree_leaves(params):
        p.grad = None
    return dt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    setups = {name: _setup(flags, args.batch, args.seq) for name, flags in CHOICES.items()}
    held = {name: held_bytes(s) for name, s in setups.items()}
    names = list(CHOICES)
    for s in setups.values():
        step_s(s)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(step_s(setups[name]))
    base_t, base_b = statistics.median(times["none"]), held["none"]
    print(f"recompute choices: tiny preset + MTP, fp32, B={args.batch} x S={args.seq}, one process, "
          f"{args.rounds} rounds (medians, order rotating)")
    print(f"{'choice':<26} {'held KiB':>9} {'held/none':>9} {'step ms':>8} {'step/none':>9}")
    for name in names:
        t = statistics.median(times[name])
        print(f"{name:<26} {held[name] / 1024:9.0f} {held[name] / base_b:9.3f} {1e3 * t:8.2f} "
              f"{t / base_t:9.3f}")


if __name__ == "__main__":
    main()
