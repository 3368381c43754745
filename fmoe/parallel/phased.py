"""Dispatchers as issue / wait pairs, for a pipeline executor that runs exchanges outside any vjp.

Legend (the package's, docs/moe.md): T tokens, K top-k slots, E global experts, L local experts, P ranks
of the expert group, R rows of this rank's expert-sorted layout, M rows this rank's experts receive,
A nodes, I ranks per node, U tokens a rank receives across nodes, D width.

`phased(dispatcher)` gives the dispatcher's Exchange: four linear exchanges, each issued by a `start_*`
call that returns a Pending (`wait()` gives the moved tensors; compute may run in between):
    start_dispatch(plan, acts)            -> rows at the experts         (forward)
    start_combine(plan, acts)             -> rows back                   (forward)
    start_dispatch_transpose(plan, ct)    -> cotangents of the inputs    (backward: the same exchange
    start_combine_transpose(plan, ct)     -> cotangents of the outputs    with the splits swapped)
and `start_plan(route)`, the count exchange: host syncs that size every split, issued as soon as routing
is known. Permute-2 (received rows -> grouped by local expert) is compute: `plan.to_experts` /
`plan.from_experts` are differentiable index_selects the expert phase runs.

Two granularities (`token_level`):
- row level (Local, AllToAll, AllGather): the layer permutes tokens into its expert-sorted rows
  (permute-1) and unpermutes with the gate weights afterwards; dispatch moves acts["rows_RD"] (and
  acts["probs_R"] when the gate weights travel) to "rows_MD" ("probs_M"), combine moves "rows_MD" back
  to "rows_RD".
- token level (Hierarchical, dropless with gate weights at combine): dispatch reads whole tokens,
  acts["normed_TD"] (left in place for the shared expert) and acts["probs_TK"], and sends a token to a
  node once however many of its experts live there; the gate weights arrive as "probs_M" and the expert
  phase applies them; combine folds the top-k sum into the exchange and returns "y_TD".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fmoe.dispatch.local import LocalDispatcher
from fmoe.ops import Counts, expert_counts
from fmoe.parallel.allgather import AllGatherDispatcher, gather_index, gather_sizes
from fmoe.parallel.alltoall import AllToAllDispatcher, split_sizes
from fmoe.parallel.collectives import CommGroup, all_gather_async, all_to_all_async, reduce_scatter_async
from fmoe.parallel.hierarchical import HierarchicalDispatcher
from fmoe.parallel.rows import chunk_transpose_index, expert_ids_of_rows


@dataclass(frozen=True)
class RowPlan:
    """Split sizes and indices of one layer's exchange. counts_L: rows per local expert after permute-2
    (host ints where known); idx_M / inverse_M: permute-2 and its inverse (None: rows already grouped);
    the rest is the Exchange's own (None on one process)."""

    counts_L: Any
    idx_M: torch.Tensor | None = None
    inverse_M: torch.Tensor | None = None
    send_P: list[int] | None = None  # all-to-all: rows to each rank
    recv_P: list[int] | None = None  # all-to-all: rows from each rank
    hier: Any = None  # the route of a two-stage exchange: _HierPlan (hierarchical), _GatherPlan (all-gather)

    def to_experts(self, x_MD: torch.Tensor) -> torch.Tensor:
        """Returns received rows [M, ...] regrouped by local expert (permute-2; differentiable)."""
        return x_MD if self.idx_M is None else x_MD.index_select(0, self.idx_M)

    def from_experts(self, y_MD: torch.Tensor) -> torch.Tensor:
        """Returns expert-grouped rows [M, ...] back in the received order (inverse permute-2)."""
        return y_MD if self.inverse_M is None else y_MD.index_select(0, self.inverse_M)


class Chain:
    """A Pending of exchanges in sequence. `first` = (result, handles) of the exchange issued at
    construction (no handles: the result is already there); each later step is a function of the previous
    result that issues the next exchange and returns (result, handles). `wait()` waits each step's
    handles, then runs the next; it returns the last result. `completed_at` (a time.perf_counter() value,
    set by wait()): when the last exchange that sent something completed, the later of its link-model
    completion and the moment its works finished (a late EP peer included); a trailing step that issues
    nothing (a rename, a slice) does not move it, nor does the wait itself when the exchange finished
    while compute hid it. None before wait(), and when no step sent anything."""

    def __init__(self, first: tuple[Any, list], *later: Any):
        self.result, self.handles = first
        self.later = list(later)
        self.completed_at: float | None = None
        self._finished = _finish_stamps(self.handles)

    @property
    def in_flight(self) -> bool:
        """True when the exchange issued first is travelling (False: nothing was sent, e.g. locally)."""
        return bool(self.handles)

    def wait(self) -> Any:
        """Runs the chain to the end; returns its result."""
        while True:
            for h in self.handles:
                h.wait()
            if self.handles:
                stamps, n = self._finished
                # a work without a finish stamp (a device's, a fake's): its wait's return stands for it
                done = max(stamps) if n and len(stamps) == n else time.perf_counter()
                self.completed_at = max([done] + [getattr(h, "not_before", 0.0) for h in self.handles])
            if not self.later:
                return self.result
            self.result, self.handles = self.later.pop(0)(self.result)
            self._finished = _finish_stamps(self.handles)


def _finish_stamps(handles: list) -> tuple[list[float], int]:
    """Returns (stamps, n): `stamps` gets time.perf_counter() appended as each of the n works of `handles`
    finishes, from its future's callback on the thread that completes it (gloo's), so an exchange that
    finished while compute hid it is not dated at its wait. n = 0 when any handle has no CPU works with
    futures: a device's future completes at launch, so its time says nothing (fake handles have none)."""
    stamps: list[float] = []
    works = []
    for h in handles:
        ws = getattr(h, "_works", None)  # CommHandle's c10d works (fmoe/parallel/async_comm.py)
        if not ws or getattr(h, "on_device", True):
            return stamps, 0
        works += ws
    try:
        for w in works:
            w.get_future().add_done_callback(lambda _f: stamps.append(time.perf_counter()))
    except (AttributeError, RuntimeError):  # a backend whose works have no future
        return stamps, 0
    return stamps, len(works)


def _a2a(rows: dict[str, torch.Tensor], comm: CommGroup, out_s: list[int], in_s: list[int],
         op: str) -> tuple[dict[str, torch.Tensor], list]:
    """Issues one all-to-all per tensor of `rows` (plain tensors, no autograd); returns (outputs, handles)."""
    out, handles = {}, []
    with torch.no_grad():
        for k, x in rows.items():
            out[k], h = all_to_all_async(x.detach(), comm, out_s, in_s, op=op)
            handles.append(h)
    return out, handles


def _moving(acts: dict[str, torch.Tensor], src: str, dst: str) -> tuple[dict, dict, dict[str, str]]:
    """Splits acts into the row-aligned tensors that move (rows_<src>D, probs_<src>) and the rest; returns
    (moving, rest, renames to the destination keys)."""
    keys = [k for k in (f"rows_{src}D", f"probs_{src}") if k in acts]
    return ({k: acts[k] for k in keys}, {k: v for k, v in acts.items() if k not in keys},
            {k: k.replace(f"_{src}", f"_{dst}") for k in keys})


def _renamed(rest: dict, names: dict[str, str]) -> Any:
    return lambda moved: {**rest, **{names[k]: v for k, v in moved.items()}}


class _RowExchange:
    """Row-level exchanges over `move(plan, rows, reverse) -> (raw, handles, finish)`: issue, then
    `finish(raw)` after the wait gives the moved rows (module docstring)."""

    token_level = False
    local = False  # True: nothing leaves this process (the exchange completes at issue)

    def _start(self, plan: RowPlan, acts: dict, src: str, dst: str, reverse: bool) -> Any:
        moving, rest, names = _moving(acts, src, dst)
        raw, handles, finish = self.move(plan, moving, reverse)
        rename = _renamed(rest, names)
        return Chain((raw, handles), _lift(lambda got: rename(finish(got))))

    def start_dispatch(self, plan: RowPlan, acts: dict) -> Any:
        """Issues rows_RD (+ probs_R) -> rows_MD (+ probs_M); other acts pass through."""
        return self._start(plan, acts, "R", "M", reverse=False)

    def start_dispatch_transpose(self, plan: RowPlan, ct: dict) -> Any:
        """Issues the cotangents of rows_MD (+ probs_M) back to those of rows_RD (+ probs_R)."""
        return self._start(plan, ct, "M", "R", reverse=True)

    def start_combine(self, plan: RowPlan, acts: dict) -> Any:
        """Issues rows_MD -> rows_RD; other acts pass through."""
        return self._start(plan, acts, "M", "R", reverse=True)

    def start_combine_transpose(self, plan: RowPlan, ct: dict) -> Any:
        """Issues the cotangent of rows_RD back to that of rows_MD."""
        return self._start(plan, ct, "R", "M", reverse=False)


def _same(x: Any) -> Any:
    return x


def _lift(f: Any) -> Any:
    """A Chain step that runs `f` on the result and issues nothing."""
    return lambda result: (f(result), [])


class _LocalExchange(_RowExchange):
    local = True

    def __init__(self, d: LocalDispatcher):
        self.d = d

    def start_plan(self, route: Any) -> Any:
        layout = route.layout  # a padded layout's counts are host ints too: both forms, no sync
        return Chain((RowPlan(counts_L=Counts(layout.counts, layout.counts_E)), []))

    def move(self, plan: RowPlan, rows: dict, reverse: bool) -> tuple[dict, list, Any]:
        return dict(rows), [], _same


class _AllToAllExchange(_RowExchange):
    def __init__(self, d: AllToAllDispatcher):
        self.d = d

    def start_plan(self, route: Any) -> Any:
        P, L = self.d.comm.size, self.d.num_local_experts
        counts_PL = route.layout.counts_E.to(torch.int64).reshape(P, L).contiguous()
        recv, handles = _a2a({"counts": counts_PL}, self.d.comm, [1] * P, [1] * P, "alltoall.counts")

        def plan(got: dict) -> tuple[RowPlan, list]:
            recv_PL = got["counts"]
            send_P, recv_P, counts_L = split_sizes(counts_PL, recv_PL)  # the host sync of the layer
            idx_M = chunk_transpose_index(recv_PL, sum(recv_P))
            return RowPlan(counts_L=Counts(counts_L, recv_PL.sum(0)), idx_M=idx_M,
                           inverse_M=torch.argsort(idx_M), send_P=send_P, recv_P=recv_P), []

        return Chain((recv, handles), plan)

    def move(self, plan: RowPlan, rows: dict, reverse: bool) -> tuple[dict, list, Any]:
        out_s, in_s = (plan.send_P, plan.recv_P) if reverse else (plan.recv_P, plan.send_P)
        op = f"alltoall.{'combine' if reverse else 'dispatch'}"
        raw, handles = _a2a(rows, self.d.comm, out_s, in_s, op)
        return raw, handles, _same


@dataclass(frozen=True)
class _GatherPlan:
    """The all-gather route of one layer: gathered-row index of each local row [M] (already grouped by
    local expert), padded rows per rank R_max, this rank's rows R."""

    idx_M: torch.Tensor
    rows_padded: int
    rows: int


class _AllGatherExchange(_RowExchange):
    """Dispatch: all-gather the padded rows, index_select the local ones (grouped by local expert, so no
    permute-2). Combine, its transpose: index_put into zeros, reduce-scatter, drop the padding."""

    def __init__(self, d: AllGatherDispatcher):
        self.d = d

    def start_plan(self, route: Any) -> Any:
        comm, L = self.d.comm, self.d.num_local_experts
        counts_E = route.layout.counts_E.to(torch.int64).reshape(1, -1).contiguous()
        with torch.no_grad():
            got, h = all_gather_async(counts_E, comm, op="allgather.counts")

        def plan(counts_PE: torch.Tensor) -> tuple[RowPlan, list]:
            counts_PE = counts_PE.reshape(comm.size, -1)
            r_max, counts_L = gather_sizes(counts_PE, comm.rank, L)  # the host sync of the layer
            idx_M, counts_L_dev = gather_index(counts_PE, comm.rank, L, r_max, sum(counts_L))
            gather = _GatherPlan(idx_M, r_max, route.layout.num_rows)
            return RowPlan(counts_L=Counts(counts_L, counts_L_dev), hier=gather), []

        return Chain((got, [h]), plan)

    def move(self, plan: RowPlan, rows: dict, reverse: bool) -> tuple[dict, list, Any]:
        g, comm = plan.hier, self.d.comm
        out, handles = {}, []
        with torch.no_grad():
            for k, x in rows.items():
                x = x.detach()
                if reverse:  # M rows -> their places among all ranks' padded rows -> summed back per rank
                    buf = x.new_zeros((comm.size * g.rows_padded, *x.shape[1:]))
                    out[k], h = reduce_scatter_async(buf.index_put_((g.idx_M,), x), comm,
                                                     op="allgather.combine")
                else:
                    pad = (0, 0) * (x.dim() - 1) + (0, g.rows_padded - g.rows)
                    out[k], h = all_gather_async(F.pad(x, pad), comm, op="allgather.dispatch")
                handles.append(h)

        def finish(got: dict) -> dict:
            if reverse:
                return {k: v[:g.rows] for k, v in got.items()}
            return {k: v.index_select(0, g.idx_M) for k, v in got.items()}

        return out, handles, finish


@dataclass(frozen=True)
class _HierPlan:
    """The hierarchical route of one layer (see fmoe/parallel/hierarchical.py): items (tokens, or rows as
    K = 1 tokens) sent across nodes, the (item, k) rows bound for this node and their intra-node splits."""

    send_item: torch.Tensor  # [sum send_A] item index of each item sent across nodes, node-major
    send_A: list[int]
    recv_A: list[int]
    order_R: torch.Tensor  # [R] flat (received item, k) index of each row bound for this node, by expert
    row_u: torch.Tensor  # [R] received item of each such row
    send_I: list[int]
    recv_I: list[int]
    items: int  # T (or R at row level)
    top_k: int


class _HierarchicalExchange:
    """Two-level exchanges: across nodes once per item, then all-to-all inside the node."""

    def __init__(self, d: HierarchicalDispatcher, token_level: bool):
        self.d = d
        self.token_level = token_level

    def start_plan(self, route: Any) -> Any:
        d = self.d
        if self.token_level:
            ids_XK = route.ids_TK.to(torch.int64)
        else:
            layout = route.layout
            ids_XK = expert_ids_of_rows(layout.counts_E, layout.num_rows).unsqueeze(1)
        A, K = d.inter.size, ids_XK.shape[1]
        need_XA = torch.zeros((ids_XK.shape[0], A), dtype=torch.bool, device=ids_XK.device)
        need_XA.scatter_(1, ids_XK // d.node_experts, True)
        send_A_t = need_XA.sum(0).reshape(A, 1).contiguous()
        recv, handles = _a2a({"n": send_A_t}, d.inter, [1] * A, [1] * A, "hier.inter.counts")
        box: dict[str, Any] = {}

        def ids_step(got: dict) -> tuple[dict, list]:
            send_A, recv_A = send_A_t.reshape(A).tolist(), got["n"].reshape(A).tolist()  # host sync
            send_item = torch.nonzero_static(need_XA.t(), size=sum(send_A))[:, 1]
            box.update(send_A=send_A, recv_A=recv_A, send_item=send_item)
            return _a2a({"ids": ids_XK.index_select(0, send_item)}, d.inter, recv_A, send_A, "hier.inter.ids")

        def intra_counts(got: dict) -> tuple[dict, list]:
            ids_UK = got["ids"]
            first = d.node * d.node_experts
            local_UK = (ids_UK >= first) & (ids_UK < first + d.node_experts)
            key = torch.where(local_UK, ids_UK - first, d.node_experts).reshape(-1)
            r = int(local_UK.sum())  # host sync: rows bound for this node
            order_R = torch.argsort(key, stable=True)[:r]
            row_e = key.index_select(0, order_R)
            I = d.intra.size
            counts_IL = expert_counts(row_e, d.node_experts).reshape(I, -1).contiguous()
            box.update(order_R=order_R, counts_IL=counts_IL)
            return _a2a({"c": counts_IL}, d.intra, [1] * I, [1] * I, "hier.intra.counts")

        def plan(got: dict) -> tuple[RowPlan, list]:
            recv_IL, counts_IL = got["c"], box["counts_IL"]
            send_I, recv_I, counts_L = split_sizes(counts_IL, recv_IL)  # host sync: split sizes
            idx_M = chunk_transpose_index(recv_IL, sum(recv_I))
            hier = _HierPlan(box["send_item"], box["send_A"], box["recv_A"], box["order_R"],
                             box["order_R"] // K, send_I, recv_I, ids_XK.shape[0], K)
            return RowPlan(counts_L=Counts(counts_L, recv_IL.sum(0)), idx_M=idx_M,
                           inverse_M=torch.argsort(idx_M), hier=hier), []

        return Chain((recv, handles), ids_step, intra_counts, plan)

    # dispatch: items [X, D] (+ probs [X, K]) -> rows [M, D] (+ probs [M])
    def _dispatch_keys(self) -> tuple[str, str, str]:
        return ("normed_TD", "probs_TK", "probs_M") if self.token_level else ("rows_RD", "probs_R", "probs_M")

    def start_dispatch(self, plan: RowPlan, acts: dict) -> Any:
        """Issues items -> rows at the experts (inter-node, then intra-node); other acts pass through."""
        d, h = self.d, plan.hier
        xk, pk, pm = self._dispatch_keys()
        send = {"x": acts[xk].index_select(0, h.send_item)}
        if pk in acts:
            send["p"] = acts[pk].reshape(h.items, -1).index_select(0, h.send_item)
        rest = {k: v for k, v in acts.items() if k != pk and (self.token_level or k != xk)}

        def intra(got: dict) -> tuple[dict, list]:
            rows = {"x": got["x"].index_select(0, h.row_u)}
            if "p" in got:
                rows["p"] = got["p"].reshape(-1).index_select(0, h.order_R)
            return _a2a(rows, d.intra, h.recv_I, h.send_I, "hier.intra.dispatch")

        def name(got: dict) -> tuple[dict, list]:
            out = {**rest, "rows_MD": got["x"]}
            if "p" in got:
                out[pm] = got["p"]
            return out, []

        return Chain(_a2a(send, d.inter, h.recv_A, h.send_A, "hier.inter.dispatch"), intra, name)

    def start_dispatch_transpose(self, plan: RowPlan, ct: dict) -> Any:
        """Issues the cotangents of rows_MD (+ probs_M) back to those of the items (+ their probs)."""
        d, h = self.d, plan.hier
        xk, pk, pm = self._dispatch_keys()
        back = {"x": ct["rows_MD"]}
        if pm in ct:
            back["p"] = ct[pm]
        rest = {k: v for k, v in ct.items() if k not in ("rows_MD", pm)}
        u = sum(h.recv_A)

        def inter(got: dict) -> tuple[dict, list]:
            x = got["x"]
            rows = {"x": x.new_zeros((u, *x.shape[1:])).index_add(0, h.row_u, x)}
            if "p" in got:
                p = got["p"]
                rows["p"] = p.new_zeros(u * h.top_k).index_add(0, h.order_R, p).reshape(u, h.top_k)
            return _a2a(rows, d.inter, h.send_A, h.recv_A, "hier.inter.dispatch_t")

        def scatter(got: dict) -> tuple[dict, list]:
            x = got["x"]
            g = x.new_zeros((h.items, *x.shape[1:])).index_add(0, h.send_item, x)
            out = dict(rest)
            out[xk] = g if xk not in out else out[xk] + g  # normed_TD also feeds the shared expert
            if "p" in got:
                p = got["p"]
                gp = p.new_zeros((h.items, p.shape[1])).index_add(0, h.send_item, p)
                out[pk] = gp if self.token_level else gp.reshape(-1)
            return out, []

        return Chain(_a2a(back, d.intra, h.send_I, h.recv_I, "hier.intra.dispatch_t"), inter, scatter)

    # combine: rows [M, D] -> items [X, D], summed over the K slots (weights applied in the experts)
    def _combine_key(self) -> str:
        return "y_TD" if self.token_level else "rows_RD"

    def start_combine(self, plan: RowPlan, acts: dict) -> Any:
        """Issues rows_MD back to items, folding each item's rows on this node before crossing nodes."""
        d, h = self.d, plan.hier
        rest = {k: v for k, v in acts.items() if k != "rows_MD"}
        u = sum(h.recv_A)

        def inter(got: dict) -> tuple[dict, list]:
            y = got["y"]
            return _a2a({"y": y.new_zeros((u, *y.shape[1:])).index_add(0, h.row_u, y)}, d.inter,
                        h.send_A, h.recv_A, "hier.inter.combine")

        def scatter(got: dict) -> tuple[dict, list]:
            y = got["y"]
            return {**rest, self._combine_key(): y.new_zeros((h.items, *y.shape[1:])).index_add(
                0, h.send_item, y)}, []

        return Chain(_a2a({"y": acts["rows_MD"]}, d.intra, h.send_I, h.recv_I, "hier.intra.combine"),
                     inter, scatter)

    def start_combine_transpose(self, plan: RowPlan, ct: dict) -> Any:
        """Issues the cotangent of the combined items back to that of rows_MD."""
        d, h = self.d, plan.hier
        key = self._combine_key()
        rest = {k: v for k, v in ct.items() if k != key}

        def intra(got: dict) -> tuple[dict, list]:
            return _a2a({"y": got["y"].index_select(0, h.row_u)}, d.intra, h.recv_I, h.send_I,
                        "hier.intra.combine_t")

        def name(got: dict) -> tuple[dict, list]:
            return {**rest, "rows_MD": got["y"]}, []

        first = _a2a({"y": ct[key].index_select(0, h.send_item)}, d.inter, h.recv_A, h.send_A,
                     "hier.inter.combine_t")
        return Chain(first, intra, name)


def phased(dispatcher: Any, token_level: bool = False) -> Any:
    """Returns the Exchange of `dispatcher` (module docstring). `token_level`: take whole tokens (only
    the hierarchical dispatcher, for dropless routing with gate weights at combine; see
    fmoe.layer.uses_token_dispatch). Raises TypeError for a dispatcher without issue / wait exchanges."""
    if isinstance(dispatcher, HierarchicalDispatcher):
        return _HierarchicalExchange(dispatcher, token_level)
    if token_level:
        raise TypeError(f"{type(dispatcher).__name__} has no token-level exchange")
    if isinstance(dispatcher, LocalDispatcher):
        return _LocalExchange(dispatcher)
    if isinstance(dispatcher, AllToAllDispatcher):
        return _AllToAllExchange(dispatcher)
    if isinstance(dispatcher, AllGatherDispatcher):
        return _AllGatherExchange(dispatcher)
    raise TypeError(f"{type(dispatcher).__name__} has no issue/wait exchanges for pipeline phases; use "
                    "LocalDispatcher, AllToAllDispatcher, AllGatherDispatcher or HierarchicalDispatcher")
