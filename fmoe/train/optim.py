"""The optimizer of `fmoe train`: torch.optim.AdamW over this rank's leaves, weight-decay exclusions,
linear warmup then cosine, and clipping by the global norm.

The learning rate is a function of the step alone (`lr_at`), so a resumed run needs no scheduler state.
"""

from __future__ import annotations

import math

import torch

from fmoe.train.config import TrainConfig
from fmoe.train.shards import Leaf


def lr_at(tc: TrainConfig, step: int) -> float:
    """Returns the learning rate of 0-based step `step`: linear warmup from lr / warmup to lr over the
    first `warmup` steps, then cosine from lr down to min_lr at the last step."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    decay_steps = max(1, tc.steps - tc.warmup - 1)
    progress = min(1.0, (step - tc.warmup) / decay_steps)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(tc: TrainConfig, leaves: list[Leaf],
                    tensors: dict[str, torch.Tensor]) -> torch.optim.AdamW:
    """Returns torch.optim.AdamW over `tensors[leaf.key]` for each leaf, two groups (decayed, and norms
    and biases without decay); fused on accelerators, foreach on CPU."""
    decay = [tensors[lf.key] for lf in leaves if lf.decay]
    rest = [tensors[lf.key] for lf in leaves if not lf.decay]
    groups = [g for g in ({"params": decay, "weight_decay": tc.weight_decay},
                          {"params": rest, "weight_decay": 0.0}) if g["params"]]
    device = next(iter(tensors.values())).device
    fast = {"fused": True} if device.type != "cpu" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr_at(tc, 0), betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps,
                             **fast)


def init_adam_state(opt: torch.optim.AdamW) -> None:
    """Creates AdamW's per-parameter state (step 0, zero moments) now rather than at the first step, so
    a checkpoint can be loaded into it in place."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not opt.state[p]:
                opt.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def clip_factor(norm: torch.Tensor, max_norm: float) -> float:
    """Returns the factor gradients are scaled by: min(1, max_norm / (norm + 1e-6)); 1 when max_norm is 0
    (clipping off). A non-finite norm raises FloatingPointError (a diverged step must not be applied)."""
    value = float(norm)
    if not math.isfinite(value):
        raise FloatingPointError(f"the gradient norm is {value}: the step diverged (lower --lr, or check "
                                 "the data)")
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (value + 1e-6))
