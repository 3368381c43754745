"""One rank's initialisation, drawn alone (keyed unit draws, fmoe/gpt_init.py) against the whole model
drawn in one pass and then cut (what every rank did before): peak allocation and time, side by side.

    .venv/bin/python benchmarks/sharded_init.py --rounds 5

The rank: tp rank 1 of 2, expert rank 3 of an expert group of 4, holding the second half of the
layers (a pipeline rank of 2) and the head, on a model of the `small` preset widened (`--width`).
Peak bytes are torch.profiler's allocation events during the call (`tracked_peak_bytes`), not timed;
times are medians over `rounds` rounds that run each way once, the order alternating. Also times the
whole model drawn both ways (keyed units cost a generator per unit).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from fmoe.config import GPTConfig
from fmoe.gpt_init import _init_tree, init_gpt_shard
from fmoe.tp_layout import shard_gpt
from fmoe.train.config import TrainConfig
from fmoe.transforms.testing import tracked_peak_bytes


def _cfg(width: int) -> GPTConfig:
    tc = TrainConfig.from_sources(preset="small", overrides={
        "hidden_size": width, "ffn_hidden_size": 3 * width, "moe_ffn_hidden_size": width, "mtp": True,
        "first_k_dense": 1, "vocab_size": 8 * width})
    return tc.model()


def _holds(cfg: GPTConfig) -> list[tuple[str, ...]]:
    half = cfg.n_layers // 2
    return [("layers", str(i)) for i in range(half, cfg.n_layers)] + [("mtp",), ("norm",), ("head",),
                                                                        ("embed",)]


def _whole_then_cut(cfg: GPTConfig) -> dict[str, Any]:
    """The old way: every rank draws the whole tree from one generator, then keeps its share."""
    full = _init_tree(cfg, torch.Generator().manual_seed(0), torch.float32)
    mine = shard_gpt(full, cfg, 1, 2)
    L = cfg.moe.num_experts // 4
    for block in [*mine["layers"][cfg.num_dense_layers:], mine["mtp"]["block"]]:
        block["moe"]["experts"] = {k: v[3 * L:4 * L].clone() for k, v in block["moe"]["experts"].items()}
    return mine


def _share(cfg: GPTConfig) -> dict[str, Any]:
    return init_gpt_shard(cfg, 0, tp=(1, 2), experts=(3, 4), holds=_holds(cfg))


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()
    cfg = _cfg(args.width)
    ways = {"whole, then cut": lambda: _whole_then_cut(cfg), "the share alone": lambda: _share(cfg),
            "whole, one pass": lambda: _init_tree(cfg, torch.Generator().manual_seed(0), torch.float32),
            "whole, keyed units": lambda: init_gpt_shard(cfg, 0)}
    peaks = {name: tracked_peak_bytes(fn)[1] for name, fn in ways.items()}
    kept = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(_share(cfg))
               if not t.is_meta)
    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(_timed(ways[name]))
    print(f"model: D {cfg.d_model}, {cfg.n_layers} layers, E {cfg.moe.num_experts}, V {cfg.vocab_size}; "
          f"the rank keeps {kept / 2**20:.1f} MiB")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name in names:
        print(f"  {name:<20} peak {peaks[name] / 2**20:8.1f} MiB   median {med[name]:.3f} s")
    print(f"  peak, share alone / whole then cut: {peaks['the share alone'] / peaks['whole, then cut']:.3f}")
    print(f"  time, share alone / whole then cut: {med['the share alone'] / med['whole, then cut']:.3f}")
    print(f"  time, whole keyed / whole one pass: {med['whole, keyed units'] / med['whole, one pass']:.3f}")


if __name__ == "__main__":
    main()
