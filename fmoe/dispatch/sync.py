"""The synchronous, differentiable dispatch / combine: one adapter over a dispatcher's issue / wait form.

Legend (the package's, docs/moe.md): E global experts, L local experts, R rows of this rank's
expert-sorted layout, M rows this rank's experts receive, D width.

`exchanged(issue, transpose, acts, out_keys)` is an autograd Function (correct under torch.func.vjp)
whose forward issues an exchange (e.g. `ex.start_dispatch(plan, acts)`) and waits, and whose backward
issues its transpose and waits: the route is written once, in the dispatcher's `start_*` methods
(fmoe/dispatch/exchange.py), and serves both the layer (here) and the pipeline's phases.
`SyncRows` gives a row-level Exchange the `Dispatcher` protocol (fmoe/dispatch/base.py) from it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from fmoe._compat import Function
from fmoe.dispatch.exchange import RowPlan


class _Exchanged(Function):
    @staticmethod
    def forward(issue, transpose, keys, out_keys, *tensors):
        out = issue(dict(zip(keys, tensors))).wait()
        return tuple(out[k] for k in out_keys)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.transpose, ctx.keys, ctx.out_keys = inputs[1:4]

    @staticmethod
    def backward(ctx, *cts):
        back = ctx.transpose(dict(zip(ctx.out_keys, cts))).wait()
        return (None,) * 4 + tuple(back[k] for k in ctx.keys)


def exchanged(issue: Callable[[dict], Any], transpose: Callable[[dict], Any], acts: dict[str, torch.Tensor],
              out_keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Returns {out_keys: tensors}: `issue(acts)` (a Pending of a linear exchange) waited, differentiable:
    its backward waits `transpose(cotangents)`."""
    out = _Exchanged.apply(issue, transpose, tuple(acts), out_keys, *acts.values())
    return dict(zip(out_keys, out))


class SyncRows:
    """`dispatch` / `combine` (the Dispatcher protocol) of a row-level Exchange: plan (the host sync),
    then the exchange and permute-2, each differentiable."""

    def dispatch(self, x_RD: torch.Tensor, counts_E: torch.Tensor, probs_R: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, Any, torch.Tensor | None, RowPlan]:
        """Return (x_MD grouped by local expert, counts_L, probs_M or None, the plan as combine's meta)."""
        plan = self.start_plan_rows(counts_E, x_RD.shape[0]).wait()
        acts = {"rows_RD": x_RD} if probs_R is None else {"rows_RD": x_RD, "probs_R": probs_R}
        keys = ("rows_MD",) + (("probs_M",) if len(acts) > 1 else ())
        issue, transpose = partial(self.start_dispatch, plan), partial(self.start_dispatch_transpose, plan)
        out = exchanged(issue, transpose, acts, keys)
        probs_M = out.get("probs_M")
        return (plan.to_experts(out["rows_MD"]), plan.counts_L,
                None if probs_M is None else plan.to_experts(probs_M), plan)

    def combine(self, y_MD: torch.Tensor, meta: RowPlan) -> torch.Tensor:
        """Return y_RD: expert outputs in this rank's original expert-sorted row order."""
        out = exchanged(partial(self.start_combine, meta), partial(self.start_combine_transpose, meta),
                        {"rows_MD": meta.from_experts(y_MD)}, ("rows_RD",))
        return out["rows_RD"]
