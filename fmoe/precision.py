"""Mixed precision as a named policy (JAX's jmp style): what dtype weights are kept in, computed in, and
what gradients accumulate in.

    policy = POLICIES["bf16-mixed"]          # fp32 master weights, bf16 compute, fp32 gradients
    compute = cast_to_compute(params, policy)    # once per step, not once per microbatch
    ... differentiate the loss w.r.t. `compute` per microbatch ...
    acc = accumulate(acc, grads, policy)         # fp32 sum over microbatches
    optimizer step on the fp32 master weights from `acc`

fp16 ("fp16-mixed") also needs loss scaling: its 5 exponent bits flush small gradients to zero. The loss
is multiplied by `LossScale.scale` before the backward, the fp32 gradient sums divided by it after, and
a step whose gradients hold an inf or nan is skipped while the scale backs off (Megatron's
DynamicGradScaler, hysteresis included):

    ls = LossScale.dynamic_scale()           # 2**16 to start
    ... backward of loss * ls.scale ...
    finite = unscale_(grads, ls)             # grads /= scale in place; 0-dim bool tensor, no host sync
    if finite: optimizer step                # the same decision on every rank (all-reduce the flag)
    ls = ls.adjust(bool(finite))

The model's ops decide the rest from their input dtype (fmoe/ops/_dtypes.py): with bf16 activations the
GEMMs, attention and experts run in bf16 (accumulating in fp32 inside the kernels), while the router's
logits and softmax, the norms' statistics, the gate-weighted combine and the cross-entropy run in fp32.
The EP dispatchers send what they are given: bf16 on the wire. Tolerances against an fp32 oracle:
docs/precision.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from fmoe._compat import tree_map


@dataclass(frozen=True)
class Policy:
    """param_dtype: the master weights (and optimizer state); compute_dtype: the copies the model runs
    with; grad_dtype: what gradients are accumulated in over microbatches (and reduced in)."""

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    grad_dtype: torch.dtype

    @property
    def mixed(self) -> bool:
        """True when the model computes in another dtype than the master weights are kept in."""
        return self.compute_dtype != self.param_dtype


POLICIES: dict[str, Policy] = {
    "fp32": Policy(torch.float32, torch.float32, torch.float32),
    "bf16-mixed": Policy(torch.float32, torch.bfloat16, torch.float32),
    "bf16": Policy(torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "fp16-mixed": Policy(torch.float32, torch.float16, torch.float32),
    "fp64": Policy(torch.float64, torch.float64, torch.float64),
}


def cast_to_compute(params: Any, policy: Policy) -> Any:
    """Returns the params pytree with every floating leaf in policy.compute_dtype: new tensors (detached
    copies) when the dtype changes, the same objects when it does not."""
    def cast(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != policy.compute_dtype:
            return t.detach().to(policy.compute_dtype)
        return t

    return tree_map(cast, params)


def accumulate(total: torch.Tensor | None, grad: torch.Tensor, policy: Policy) -> torch.Tensor:
    """Returns total + grad in policy.grad_dtype, summed into `total` in place; with total None a new
    tensor (never `grad` itself, which autograd may still own)."""
    if total is None:
        return grad.to(policy.grad_dtype, copy=True)
    return total.add_(grad.to(policy.grad_dtype))


@dataclass(frozen=True)
class LossScale:
    """The loss-scaling state of an fp16 run: a value, updated by `adjust` after every step (pure).

    scale: what the loss is multiplied by before the backward. dynamic: False keeps it fixed (a static
    scale; steps with non-finite gradients are still skipped). After `growth_interval` finite steps in a
    row the scale grows by `growth_factor`; a non-finite step resets that count, uses up one of
    `hysteresis` allowances, and when none is left multiplies the scale by `backoff_factor` (not below
    `min_scale`). `good_steps` and `hysteresis_left` are the counters; both go into checkpoints.
    """

    scale: float
    dynamic: bool = True
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    hysteresis: int = 2
    good_steps: int = 0
    hysteresis_left: int = 2

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"LossScale: scale must be a positive finite number, got {self.scale}")
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(f"LossScale: growth_interval and hysteresis must be >= 1, got "
                             f"{self.growth_interval}, {self.hysteresis}")
        if not (self.growth_factor > 1.0 and 0.0 < self.backoff_factor < 1.0 and self.min_scale > 0):
            raise ValueError(f"LossScale: need growth_factor > 1, 0 < backoff_factor < 1 and min_scale > 0, "
                             f"got {self.growth_factor}, {self.backoff_factor}, {self.min_scale}")

    @classmethod
    def dynamic_scale(cls, initial: float = 2.0**16, *, growth_interval: int = 1000, min_scale: float = 1.0,
                      hysteresis: int = 2) -> LossScale:
        """Returns a dynamic LossScale starting at `initial` (torch.amp's default 2**16; Megatron's 2**32)."""
        return cls(initial, True, growth_interval, min_scale=min(min_scale, initial), hysteresis=hysteresis,
                   hysteresis_left=hysteresis)

    @classmethod
    def static_scale(cls, scale: float) -> LossScale:
        """Returns a fixed LossScale (Megatron's --loss-scale)."""
        return cls(scale, False, min_scale=min(1.0, scale))

    def adjust(self, finite: bool) -> LossScale:
        """Returns the state after a step whose (unscaled) gradients were all finite, or were not."""
        if not self.dynamic:
            return self
        if not finite:
            left = self.hysteresis_left - 1
            if left > 0:
                return replace(self, good_steps=0, hysteresis_left=left)
            return replace(self, scale=max(self.scale * self.backoff_factor, self.min_scale), good_steps=0,
                           hysteresis_left=0)
        good = self.good_steps + 1
        if good < self.growth_interval:
            return replace(self, good_steps=good)
        return replace(self, scale=self.scale * self.growth_factor, good_steps=0,
                       hysteresis_left=self.hysteresis)


def unscale_(grads: Iterable[torch.Tensor], loss_scale: LossScale) -> torch.Tensor:
    """Divides every gradient by loss_scale.scale in place; returns a 0-dim bool tensor (on the first
    gradient's device; True for none): whether every entry of every gradient is finite. No host sync."""
    inv = 1.0 / loss_scale.scale
    finite: torch.Tensor | None = None
    for g in grads:
        if inv != 1.0:
            g.mul_(inv)
        ok = torch.isfinite(g).all()
        finite = ok if finite is None else finite & ok
    return torch.ones((), dtype=torch.bool, device="cpu") if finite is None else finite


# ---- defaults that fit the device ---------------------------------------------------------------------

_FP32_ON_DEVICE = ("fp32 on {device}: the fast grouped GEMM (torch._grouped_mm) is bf16 on sm90+ and fp32 "
                   "takes a per-group fallback with a host sync; --bf16 (the default there) is faster")


def default_policy(device_type: str, *, bf16: bool | None, fp16: bool,
                   dtype: torch.dtype) -> tuple[Policy, str | None]:
    """Returns (the precision policy, a warning or None) of a run on `device_type` ("cpu", "cuda", "npu")
    from its flags: `bf16` True / False / None (not given), `fp16`, `dtype` (of everything, without mixed
    precision). fp16 or bf16 given: that mixed policy. Not given: bf16-mixed on an accelerator when dtype
    is fp32 (the fast grouped GEMM is bf16), else everything in `dtype`. An accelerator run in fp32 by
    choice (bf16 False) comes with the warning. On CPU nothing changes: fp32 unless a flag says otherwise."""
    if fp16:
        return POLICIES["fp16-mixed"], None
    if bf16:
        return POLICIES["bf16-mixed"], None
    if device_type != "cpu" and dtype == torch.float32:
        if bf16 is None:
            return POLICIES["bf16-mixed"], None
        return POLICIES["fp32"], _FP32_ON_DEVICE.format(device=device_type)
    return Policy(dtype, dtype, dtype), None


def float32_matmul_precision(device_type: str, tf32: bool) -> str | None:
    """Returns what `torch.set_float32_matmul_precision` should be set to on `device_type`: "high" (TF32
    tensor cores for fp32 matmuls; torch's default "highest" never uses them) on CUDA unless `tf32` is
    False; None (leave torch's setting alone) on CPU, and on NPU, where torch_npu has its own switch."""
    return "high" if device_type == "cuda" and tf32 else None
