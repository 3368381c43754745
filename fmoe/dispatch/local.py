"""The local dispatcher: every expert lives on this rank, so dispatch and combine move nothing.

Legend: E experts (all local, L = E), N expert-sorted rows (M = N here), D model width.
It implements `fmoe.dispatch.base.Dispatcher` exactly; the expert-parallel dispatchers replace it
without any change to the MoE layer or the stage functions.
"""

from __future__ import annotations

from typing import Any

import torch


class LocalDispatcher:
    """Identity dispatcher for a single process (no parameters, no communication)."""

    def __init__(self, num_experts: int) -> None:
        if num_experts <= 0:
            raise ValueError(f"LocalDispatcher: num_experts must be positive, got {num_experts}")
        self.num_local_experts = num_experts

    def dispatch(
        self, x_ND: torch.Tensor, counts_E: torch.Tensor, probs_N: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any]:
        """Return (x_ND, counts_E, probs_N, None): the rows stay where they are."""
        if counts_E.shape != (self.num_local_experts,):
            raise ValueError(f"LocalDispatcher.dispatch: counts must be [{self.num_local_experts}], got "
                             f"{tuple(counts_E.shape)}")
        return x_ND, counts_E, probs_N, None

    def combine(self, y_MD: torch.Tensor, meta: Any) -> torch.Tensor:
        """Return y_MD unchanged (M = N locally)."""
        return y_MD
