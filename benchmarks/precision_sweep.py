"""Worst relative gradient error of bf16-mixed and fp16-mixed against float64, over seeds and MoE configs.

    .venv/bin/python benchmarks/precision_sweep.py      # the figures of docs/precision.md

The tests' tiny GPT and helpers (tests/test_precision.py: `_cfg`, `_grads`, `same_routing`); a case counts
only where every token's experts match the float64 run's. fp16 uses the largest power-of-two loss scale
from 2**16 down that keeps every gradient finite, as the dynamic scale would settle on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_precision as T  # noqa: E402

from fmoe._compat import keystr, tree_flatten_with_path, tree_map  # noqa: E402
from fmoe.precision import POLICIES, LossScale, cast_to_compute, unscale_  # noqa: E402

CONFIGS = [(1, 1, False), (2, 1, True), (4, 2, False), (8, 2, True)]  # (E, K, mtp)
SEEDS = range(16)


def _half_grads(master, ids, targets, cfg, policy: str) -> tuple[float, list, list[torch.Tensor], float]:
    """(loss, routes, unscaled fp32 gradients, the loss scale used) in `policy`."""
    scale = 2.0**16 if policy == "fp16-mixed" else 1.0
    while True:
        loss, routes, grads = T._grads(cast_to_compute(master, POLICIES[policy]), ids, targets, cfg, scale)
        if all(bool(torch.isfinite(g).all()) for g in grads):
            break
        scale /= 2
    grads = [g.float() for g in grads]
    unscale_(grads, LossScale.static_scale(scale))
    return loss, routes, grads, scale


def main() -> None:
    """Prints, per policy, the cases routed like float64 and the worst error per leaf group."""
    torch.set_num_threads(1)
    worst: dict[str, dict[str, float]] = {"bf16-mixed": {}, "fp16-mixed": {}}
    kept = dict.fromkeys(worst, 0)
    scales: set[float] = set()
    for E, K, mtp in CONFIGS:
        for seed in SEEDS:
            cfg = T._cfg(E, K, mtp)
            master = T.init_gpt(cfg, torch.Generator().manual_seed(seed))
            seq = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed + 1))
            ids, targets = seq[:, :-1], seq[:, 1:]
            loss64, routes64, grads64 = T._grads(tree_map(lambda t: t.double(), master), ids, targets, cfg)
            names = [keystr(p) for p, _ in tree_flatten_with_path(master)[0]]
            for policy, w in worst.items():
                loss, routes, grads, scale = _half_grads(master, ids, targets, cfg, policy)
                if not T.same_routing(routes, routes64):
                    continue
                kept[policy] += 1
                if policy == "fp16-mixed":
                    scales.add(scale)
                for name, g, ref in zip(names, grads, grads64):
                    if T.is_zero_gradient(ref, grads64):
                        continue  # top-1 renormalised gates are 1: the router's gradient is 0
                    group = "w_q, w_k" if ("'w_q'" in name or "'w_k'" in name) else "other leaves"
                    w[group] = max(w.get(group, 0.0), float((g.double() - ref).norm() / ref.norm()))
                w["loss (relative)"] = max(w.get("loss (relative)", 0.0), abs(loss - loss64) / abs(loss64))
    cases = len(CONFIGS) * len(SEEDS)
    for policy, w in worst.items():
        figures = ", ".join(f"{k} {v:.4f}" for k, v in w.items())
        print(f"{policy}: {kept[policy]} of {cases} cases routed like float64; worst {figures}")
    print(f"fp16 loss scales used: {sorted(scales)}")


if __name__ == "__main__":
    main()
