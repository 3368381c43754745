"""Dispatchers as issue / wait pairs, for a pipeline executor that runs the exchange outside any vjp.

Legend (the package's, docs/moe.md): E global experts, L local experts, P ranks of the expert group,
R rows of this rank's expert-sorted layout, M rows this rank's experts receive, D width.

An exchange is linear in the rows, so its backward is the same exchange the other way (the splits
swapped): `start_rows(d, plan, rows, reverse=False)` is dispatch, `reverse=True` is combine, and the
transpose of each is the other. Both return a Pending whose `wait()` gives the moved rows; in between, the
caller computes. The count exchange, a host sync, is its own step (`start_plan`), issued as soon as
routing is known. Permute-2 (source-major -> expert-major rows) is compute: `RowPlan.to_experts` and
`from_experts` are differentiable index_selects that the expert phase runs.

`rows` is a dict of row-aligned tensors (the hidden rows, and the gate weights when they travel with
them), all exchanged with the same splits. Supported: LocalDispatcher (nothing moves) and
AllToAllDispatcher (one variable all-to-all per tensor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from fmoe.dispatch.local import LocalDispatcher
from fmoe.parallel.alltoall import AllToAllDispatcher
from fmoe.parallel.async_comm import CommHandle
from fmoe.parallel.collectives import all_to_all_async
from fmoe.parallel.rows import chunk_transpose_index


@dataclass(frozen=True)
class RowPlan:
    """Split sizes of one layer's exchange. counts_L: rows per local expert after permute-2 (host ints
    where known); send_P / recv_P: rows to / from each rank (None: nothing moves); idx_M / inverse_M:
    permute-2 and its inverse (None: rows already grouped by local expert)."""

    counts_L: Any
    send_P: list[int] | None = None
    recv_P: list[int] | None = None
    idx_M: torch.Tensor | None = None
    inverse_M: torch.Tensor | None = None

    def to_experts(self, x_MD: torch.Tensor) -> torch.Tensor:
        """Returns received rows [M, ...] regrouped by local expert (permute-2; differentiable)."""
        return x_MD if self.idx_M is None else x_MD.index_select(0, self.idx_M)

    def from_experts(self, y_MD: torch.Tensor) -> torch.Tensor:
        """Returns expert-grouped rows [M, ...] back in the received order (inverse permute-2)."""
        return y_MD if self.inverse_M is None else y_MD.index_select(0, self.inverse_M)


class Exchange:
    """A Pending over CommHandles: `wait()` waits them and returns `result`; `completed_at` is the link
    model's completion time (perf_counter seconds) when there is one."""

    def __init__(self, handles: list[CommHandle], result: Any):
        self.handles, self.result = handles, result
        nb = max((h.not_before for h in handles), default=0.0)
        self.completed_at: float | None = nb if nb > 0 else None

    def wait(self) -> Any:
        """Waits every handle; returns the exchanged result."""
        for h in self.handles:
            h.wait()
        if self.completed_at is None:
            self.completed_at = time.perf_counter()
        return self.result


class _Done:
    def __init__(self, value: Any):
        self.value = value
        self.completed_at: float | None = None

    def wait(self) -> Any:
        return self.value


class _PlanPending:
    """The count exchange in flight; `wait()` reads the counts to the host and returns the RowPlan."""

    def __init__(self, d: AllToAllDispatcher, counts_PL: torch.Tensor):
        self.counts_PL = counts_PL
        with torch.no_grad():
            self.recv_PL, self.handle = all_to_all_async(counts_PL.contiguous(), d.comm, op="alltoall.counts")
        self.completed_at: float | None = None

    def wait(self) -> RowPlan:
        self.handle.wait()
        self.completed_at = time.perf_counter()
        send_P, recv_P = self.counts_PL.sum(1).tolist(), self.recv_PL.sum(1).tolist()  # host sync
        idx_M = chunk_transpose_index(self.recv_PL, sum(recv_P))
        return RowPlan(counts_L=self.recv_PL.sum(0).tolist(), send_P=send_P, recv_P=recv_P, idx_M=idx_M,
                       inverse_M=torch.argsort(idx_M))


def start_plan(d: Any, counts_E: torch.Tensor, counts_host: tuple[int, ...] | None = None) -> Any:
    """Issues the count exchange of dispatcher `d` for a layout with counts_E [E] rows per expert;
    returns a Pending whose `wait()` gives the RowPlan. `counts_host`: the same counts as host ints, if
    known (saves a sync on one process)."""
    if isinstance(d, LocalDispatcher):
        return _Done(RowPlan(counts_L=counts_host if counts_host is not None else counts_E))
    if isinstance(d, AllToAllDispatcher):
        P = d.comm.size
        return _PlanPending(d, counts_E.to(torch.int64).reshape(P, d.num_local_experts))
    raise TypeError(f"{type(d).__name__} has no issue/wait exchange for pipeline phases; use "
                    "LocalDispatcher or AllToAllDispatcher")


def start_rows(d: Any, plan: RowPlan, rows: dict[str, torch.Tensor], reverse: bool) -> Any:
    """Issues the exchange of `rows` (row-aligned tensors): dispatch (reverse False: R rows out, M in) or
    combine (reverse True: M out, R in); returns a Pending whose `wait()` gives the moved dict."""
    if plan.send_P is None:
        return _Done(dict(rows))
    out_s, in_s = (plan.send_P, plan.recv_P) if reverse else (plan.recv_P, plan.send_P)
    moved, handles = {}, []
    with torch.no_grad():
        for k, x in rows.items():
            moved[k], h = all_to_all_async(x.detach(), d.comm, out_s, in_s,
                                           op=f"alltoall.{'combine' if reverse else 'dispatch'}")
            handles.append(h)
    return Exchange(handles, moved)
