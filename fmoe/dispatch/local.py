"""The local dispatcher: every expert lives on this rank, so dispatch and combine move nothing.

Legend (the package's, docs/moe.md): E experts (all local, L = E), R expert-sorted layout rows (M = R
here), D model width.
It implements `fmoe.dispatch.base.Dispatcher` exactly, and the issue / wait exchanges of
fmoe/dispatch/exchange.py (each complete at issue); the expert-parallel dispatchers replace it without
any change to the MoE layer, the stage functions or the pipeline's phases.
"""

from __future__ import annotations

from typing import Any

import torch

from fmoe._checks import positive
from fmoe.dispatch.exchange import Chain, RowExchange, RowPlan, renamed, rows_apart, unchanged
from fmoe.ops import Counts


class LocalDispatcher(RowExchange):
    """Identity dispatcher for a single process (no parameters, no communication)."""

    local = True

    def __init__(self, num_experts: int) -> None:
        positive("LocalDispatcher: num_experts", num_experts)
        self.num_local_experts = num_experts

    def dispatch(
        self, x_RD: torch.Tensor, counts_E: torch.Tensor, probs_R: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any]:
        """Return (x_RD, counts_E, probs_R, None): the rows stay where they are (M = R, L = E)."""
        if counts_E.shape != (self.num_local_experts,):
            raise ValueError(f"LocalDispatcher.dispatch: counts must be [{self.num_local_experts}], got "
                             f"{tuple(counts_E.shape)}")
        return x_RD, counts_E, probs_R, None

    def combine(self, y_MD: torch.Tensor, meta: Any) -> torch.Tensor:
        """Return y_MD unchanged (it is y_RD: M = R locally)."""
        return y_MD

    def start_plan(self, route: Any) -> Chain:
        """The plan, complete at issue: a padded layout's counts are host ints too (both forms, no sync)."""
        layout = route.layout
        return Chain((RowPlan(counts_L=Counts(layout.counts, layout.counts_E)), []))

    def move(self, plan: RowPlan, rows: dict, reverse: bool, name: str) -> tuple[dict, list, Any]:
        """Moves nothing."""
        return dict(rows), [], unchanged

    def _start(self, plan: RowPlan, acts: dict, src: str, dst: str, name: str) -> Chain:
        """Every exchange: the renamed acts, complete at issue (no chain of moves to run: it moves nothing,
        and a layer runs six of them per microbatch)."""
        rows, rest = rows_apart(acts, src)
        return Chain((renamed(rest, rows, src, dst), []))
