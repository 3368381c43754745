"""The synchronous, differentiable dispatch / combine: one adapter over a dispatcher's issue / wait form.

Legend (the package's, docs/moe.md): E global experts, L local experts, R rows of this rank's
expert-sorted layout, M rows this rank's experts receive, D width.

`fmoe.transforms.program.exchanged(issue, transpose, acts)` is an autograd Function (correct under
torch.func.vjp) whose forward issues an exchange (e.g. `ex.start_dispatch(plan, acts)`) and waits, and
whose backward issues its transpose and waits: the route is written once, in the dispatcher's `start_*`
methods (fmoe/dispatch/exchange.py), and serves both the layer (here) and the pipeline's phases.
`SyncRows` gives a row-level Exchange the `Dispatcher` protocol (fmoe/dispatch/base.py) from it, and
`as_exchange` the other way round: the one place a dispatcher with only that protocol (dispatch /
combine, e.g. a research script's) is told apart and wrapped (`InlineRows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from fmoe.dispatch.exchange import Exchange, RowPlan
from fmoe.transforms.program import Ready, exchanged

if TYPE_CHECKING:
    from fmoe.config import MoEConfig


def as_exchange(dispatcher: Any) -> Exchange:
    """Returns the Exchange of `dispatcher`: itself when it declares one (fmoe.dispatch.exchange.Exchange:
    every fmoe dispatcher), else `InlineRows` over its synchronous dispatch / combine. The single
    adapter point: code past it asks the Exchange's capabilities, never the dispatcher's class."""
    return dispatcher if hasattr(dispatcher, "start_plan") else InlineRows(dispatcher)


class SyncRows:
    """`dispatch` / `combine` (the Dispatcher protocol) of a row-level Exchange: plan (the host sync),
    then the exchange and permute-2, each differentiable."""

    def dispatch(self, x_RD: torch.Tensor, counts_E: torch.Tensor, probs_R: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, Any, torch.Tensor | None, RowPlan]:
        """Return (x_MD grouped by local expert, counts_L, probs_M or None, the plan as combine's meta)."""
        plan = self.start_plan_rows(counts_E, x_RD.shape[0]).wait()
        acts = {"rows_RD": x_RD} if probs_R is None else {"rows_RD": x_RD, "probs_R": probs_R}
        issue, transpose = partial(self.start_dispatch, plan), partial(self.start_dispatch_transpose, plan)
        out = exchanged(issue, transpose, acts)
        probs_M = out.get("probs_M")
        return (plan.to_experts(out["rows_MD"]), plan.counts_L,
                None if probs_M is None else plan.to_experts(probs_M), plan)

    def combine(self, y_MD: torch.Tensor, meta: RowPlan) -> torch.Tensor:
        """Return y_RD: expert outputs in this rank's original expert-sorted row order."""
        out = exchanged(partial(self.start_combine, meta), partial(self.start_combine_transpose, meta),
                        {"rows_MD": meta.from_experts(y_MD)})
        return out["rows_RD"]


class InlineRows:
    """The row-level Exchange of a dispatcher known only by its synchronous `dispatch` / `combine` (the
    Dispatcher protocol, e.g. a research script's): its exchanges run inline (`local`), so autograd
    differentiates what its calls do. For sequential runs (fmoe.model); a pipeline's executor needs an
    issue / wait form (fmoe.parallel.phased) to overlap the exchanges with compute."""

    local = True  # Exchange capabilities: its calls run where they are made
    splits_rows = False

    def __init__(self, dispatcher: Any):
        self.dispatcher = dispatcher
        self.num_local_experts = dispatcher.num_local_experts

    def token_level(self, cfg: MoEConfig) -> bool:
        """False: the Dispatcher protocol takes layout rows."""
        return False

    def token_exchange(self) -> Exchange:
        raise TypeError("a synchronous dispatcher (dispatch / combine) moves layout rows only")

    def start_plan(self, route: Any) -> Ready:
        """Returns a Ready plan to be filled by the dispatch (its counts are the dispatcher's answer)."""
        return Ready(_InlinePlan(route.layout.counts_E))

    def start_dispatch(self, plan: _InlinePlan, acts: dict) -> Ready:
        """Returns Ready acts with "rows_RD" (and "probs_R") moved to "rows_MD" ("probs_M")."""
        rest = {k: v for k, v in acts.items() if k not in ("rows_RD", "probs_R")}
        x_MD, plan.counts_L, probs_M, plan.meta = self.dispatcher.dispatch(acts["rows_RD"], plan.counts_E,
                                                                           acts.get("probs_R"))
        return Ready({**rest, "rows_MD": x_MD, **({} if probs_M is None else {"probs_M": probs_M})})

    def start_combine(self, plan: _InlinePlan, acts: dict) -> Ready:
        """Returns Ready acts with "rows_MD" moved back to "rows_RD"."""
        rest = {k: v for k, v in acts.items() if k != "rows_MD"}
        return Ready({**rest, "rows_RD": self.dispatcher.combine(acts["rows_MD"], plan.meta)})

    def start_dispatch_transpose(self, plan: _InlinePlan, ct: dict) -> Ready:
        raise TypeError("an inline exchange is differentiated by autograd, never transposed")

    start_combine_transpose = start_dispatch_transpose


@dataclass
class _InlinePlan:
    """An inline exchange's plan: the layout's counts, then what the dispatch answered (rows arrive
    grouped by local expert, so permute-2 is the identity)."""

    counts_E: torch.Tensor
    counts_L: Any = None
    meta: Any = None

    def to_experts(self, x_MD: torch.Tensor) -> torch.Tensor:
        """Returns the rows as they are (already grouped)."""
        return x_MD

    from_experts = to_experts
