"""Mixed precision as a named policy (JAX's jmp style): what dtype weights are kept in, computed in, and
what gradients accumulate in.

    policy = POLICIES["bf16-mixed"]          # fp32 master weights, bf16 compute, fp32 gradients
    compute = cast_to_compute(params, policy)    # once per step, not once per microbatch
    ... differentiate the loss w.r.t. `compute` per microbatch ...
    acc = accumulate(acc, grads, policy)         # fp32 sum over microbatches
    optimizer step on the fp32 master weights from `acc`

The model's ops decide the rest from their input dtype (fmoe/ops/_dtypes.py): with bf16 activations the
GEMMs, attention and experts run in bf16 (accumulating in fp32 inside the kernels), while the router's
logits and softmax, the norms' statistics, the gate-weighted combine and the cross-entropy run in fp32.
The EP dispatchers send what they are given: bf16 on the wire. Tolerances against an fp32 oracle:
docs/precision.md.
"""

from __future__ import annotations

from dataclasses import dataclass
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
