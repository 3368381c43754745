"""The optimizer of `fmoe train`: torch.optim.AdamW over this rank's leaves (optionally ZeRO-1 sharded),
weight-decay exclusions, the learning rate of each step (fmoe/train/lr_schedule.py: Megatron's warmup and
decay styles), and clipping by the global norm.

The learning rate is a function of the step alone (`lr_at`), so a resumed run needs no scheduler state.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from fmoe.train.config import TrainConfig
from fmoe.train.lr_schedule import LRSchedule
from fmoe.train.shards import Leaf


def lr_at(tc: TrainConfig, step: int) -> float:
    """Returns the learning rate of 0-based step `step` (`step` steps done before it): Megatron's
    OptimizerParamScheduler with num_steps = step (fmoe/train/lr_schedule.py)."""
    return LRSchedule.of(tc).at(step)


def _groups(tc: TrainConfig, leaves: list[Leaf], tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """AdamW's two parameter groups: decayed, and norms and biases without decay (empty ones left out)."""
    decay = [tensors[lf.key] for lf in leaves if lf.decay]
    rest = [tensors[lf.key] for lf in leaves if not lf.decay]
    return [g for g in ({"params": decay, "weight_decay": tc.weight_decay},
                        {"params": rest, "weight_decay": 0.0}) if g["params"]]


def initial_step(p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Returns AdamW's `step` state for parameter `p` of param group `group`, exactly as torch's lazy init
    makes it (torch/optim/adam.py, `_init_group`): fused or capturable, a 0-dim fp32 tensor on p's device
    (the fused kernel reads it through a device pointer); otherwise a 0-dim CPU tensor (kept on the host
    so reading it launches no kernel) in fp64 under a float64 default dtype, else fp32. torch checks the
    device only when it creates the state itself, so a state created here must follow the same rule."""
    if group.get("fused") or group.get("capturable"):
        return torch.zeros((), dtype=torch.float32, device=p.device)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.zeros((), dtype=dtype, device="cpu")


class LeafOptimizer:
    """torch.optim.AdamW over this rank's leaves: one plain AdamW, or with `--use-distributed-optimizer`
    (ZeRO-1) torch's ZeroRedundancyOptimizer, one over the dense leaves sharded across the data group and
    one over the expert leaves sharded across dp, so each rank keeps the AdamW state of its share only
    and broadcasts its updated weights. Fused on accelerators, foreach on CPU.

    `state_of(key)`: the AdamW state of a leaf kept on this rank (None where another rank keeps it),
    created up front (step 0, zero moments) so a checkpoint loads into it in place."""

    def __init__(self, tc: TrainConfig, leaves: list[Leaf], tensors: dict[str, torch.Tensor], *,
                 data_group: Any = None, dp_group: Any = None):
        device = next(iter(tensors.values())).device
        kw = {"lr": lr_at(tc, 0), "betas": (tc.adam_beta1, tc.adam_beta2), "eps": tc.adam_eps,
              **({"fused": True} if device.type != "cpu" else {"foreach": True})}
        self.tensors = tensors
        self.optimizers: list[Any] = []
        parts = [(leaves, None)]
        if tc.use_distributed_optimizer:
            parts = [([lf for lf in leaves if not lf.expert], data_group),
                     ([lf for lf in leaves if lf.expert], dp_group)]
        for part, group in parts:
            if not part:
                continue
            groups = _groups(tc, part, tensors)
            if group is not None and dist.get_world_size(group) > 1:
                # imported here: torch.distributed.optim imports torch.jit helpers that warn on import
                from torch.distributed.optim import ZeroRedundancyOptimizer

                zero = ZeroRedundancyOptimizer(groups[0]["params"], torch.optim.AdamW, process_group=group,
                                               **{**kw, "weight_decay": groups[0]["weight_decay"]})
                for g in groups[1:]:
                    zero.add_param_group(g)
                self.optimizers.append(zero)
            else:
                self.optimizers.append(torch.optim.AdamW(groups, **kw))
        for local in self._locals():
            for group in local.param_groups:
                for p in group["params"]:
                    if not local.state[p]:
                        keep = torch.preserve_format
                        local.state[p] = {"step": initial_step(p, group),
                                          "exp_avg": torch.zeros_like(p, memory_format=keep),
                                          "exp_avg_sq": torch.zeros_like(p, memory_format=keep)}

    def _locals(self) -> list[torch.optim.Optimizer]:
        return [getattr(o, "optim", o) for o in self.optimizers]  # a ZeRO's own shard is its .optim

    def set_lr(self, lr: float) -> None:
        """Sets the learning rate of every parameter group."""
        for o in self.optimizers:
            for g in o.param_groups:
                g["lr"] = lr

    def step(self) -> None:
        """One AdamW step from the leaves' .grad (and, sharded, the broadcast of the updated shares)."""
        for o in self.optimizers:
            o.step()

    def state_of(self, key: str) -> dict[str, torch.Tensor] | None:
        """The AdamW state of leaf `key` if this rank keeps it, else None."""
        t = self.tensors[key]
        for local in self._locals():
            if t in local.state:
                return local.state[t]
        return None


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
