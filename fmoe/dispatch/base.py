"""The dispatch/combine seam: how routed token rows reach the experts and come back.

Legend (the package's, docs/moe.md): E global experts, L experts local to this rank, R rows of this
rank's expert-sorted layout (sorted by global expert id, counts_E[e] rows for expert e), M rows this
rank's local experts receive (grouped by local expert), D model width.

A dispatcher moves rows only; routing, permutation and probability weighting stay in the MoE layer.
It holds no parameters, so a stage function `lambda params, x: dispatcher.dispatch(x, counts_E)` can be
differentiated by `split_vjp` like any other. The local dispatcher is the identity; the
expert-parallel ones (fmoe/parallel) write each exchange once, as issue / wait methods (exchange.py), and
get dispatch / combine from the differentiable adapter over them (sync.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Dispatcher(Protocol):
    """Moves expert-sorted token rows to the ranks that own the experts and back."""

    num_local_experts: int

    def dispatch(
        self, x_RD: torch.Tensor, counts_E: torch.Tensor, probs_R: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any]:
        """Return (x_MD, counts_L, probs_M or None, meta): rows for this rank's experts, grouped by local
        expert, their per-expert counts (int64, on x's device), the matching gate weights when probs_R
        (one per layout row) is given, and opaque metadata for `combine`."""
        ...

    def combine(self, y_MD: torch.Tensor, meta: Any) -> torch.Tensor:
        """Return y_RD: expert outputs sent back, in this rank's original expert-sorted row order."""
        ...
