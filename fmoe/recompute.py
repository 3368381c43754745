"""Load-aware adaptive recompute (MISSION.md feature 15).

A layer whose routing is skewed holds far more expert activations than a balanced one (rows per
expert follow the load). When the largest expert load exceeds `scale` x the mean load (default 2.0),
the layer's routed-expert computation runs under `fmoe.transforms.remat` (only its inputs are saved; the
backward recomputes gate/up/activation); otherwise activations are saved as usual.

Legend: E experts, M expert-sorted rows, D model width.
Host sync: the decision reads max(counts) and sum(counts) (one small read per layer and step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fmoe.transforms import nothing_saveable, remat


def overloaded(counts_E: torch.Tensor, scale: float = 2.0) -> bool:
    """True when max(counts_E) > scale * mean(counts_E) (False when nothing is routed)."""
    if counts_E.numel() == 0:
        return False
    load_E = counts_E.to(torch.float64)
    mx, total = torch.stack([load_E.max(), load_E.sum()]).tolist()  # one host read for both
    return total > 0 and mx > scale * total / counts_E.numel()


def maybe_remat(f: Callable[..., Any], recompute: bool) -> Callable[..., Any]:
    """Return `remat(f, policy=nothing_saveable)` when `recompute`, else f itself."""
    return remat(f, policy=nothing_saveable) if recompute else f
