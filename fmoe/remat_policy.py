"""Load-aware adaptive remat: when to rematerialise a layer's experts.

A layer whose routing is skewed holds far more expert activations than a balanced one (rows per
expert follow the load). With `MoEConfig.adaptive_remat`, when the largest expert load exceeds
`remat_load_scale` x the mean load (default 2.0) the layer's routed-expert computation runs under
`fmoe.transforms.remat` with `nothing_saveable` (only its inputs are saved; the backward recomputes
gate / up / activation); otherwise under `everything_saveable`, which is the function itself.

Legend (docs/moe.md): E experts.
Host sync: the decision reads max(counts) and sum(counts) (one small read per layer and step).
"""

from __future__ import annotations

import torch

from fmoe.transforms.remat import Policy, everything_saveable, nothing_saveable


def overloaded(counts_E: torch.Tensor, scale: float = 2.0) -> bool:
    """Return True when max(counts_E) > scale * mean(counts_E) (False when nothing is routed)."""
    if counts_E.numel() == 0:
        return False
    load_E = counts_E.to(torch.float64)
    mx, total = torch.stack([load_E.max(), load_E.sum()]).tolist()  # one host read for both
    return total > 0 and mx > scale * total / counts_E.numel()


def expert_policy(remat: bool) -> Policy:
    """Return the remat policy of the routed experts: nothing_saveable when `remat`, else
    everything_saveable (under which `fmoe.transforms.remat(f, policy)` is f itself)."""
    return nothing_saveable if remat else everything_saveable
