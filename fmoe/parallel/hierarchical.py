"""Hierarchical dispatcher (MISSION.md feature 24): across nodes once per token, then all-to-all inside.

Legend (the package's, docs/moe.md): T tokens on this rank, K top-k slots, A nodes the expert group
spans, I expert-group ranks per node, E global experts, L local experts (expert-group rank q = a*I + i
owns experts q*L .. q*L+L-1), X items (tokens, or layout rows as K = 1 tokens), U items this rank
receives from the other nodes' rank i (plus its own), R (item, k) rows bound for this node held by this
rank, sorted by expert, M rows for the local experts, D width.

Dispatch, for items routed by ids_XK:
  1. inter-node (over the ranks with the same node-local position i, one per node): the item goes once
     to every node that owns at least one of its top-k experts, with its probs. This is the all-gather
     across nodes of the paper restricted to the nodes that need the item; an item crosses to a node at
     most once, however many of its experts live there. Its (item, k) rows bound for this node are then
     picked, sorted by expert id (the relay rows R).
  2. intra-node all-to-all of those rows to their owner rank, then permute-2 (group by local expert).
Combine is the transpose: back inside the node, the rows of an item summed on this node before the one
transfer back across nodes. The plan (`start_plan`) exchanges the counts and the ids that size both.

The route is written once, as the two linear moves `_inter` (items <-> R) and `_intra` (R <-> M) and their
transposes, issued and waited as exchanges (fmoe/dispatch/exchange.py): dispatch = inter, intra; combine
= intra^T, inter^T. The pipeline's phases run them directly; the synchronous entry points are the adapter
of fmoe/dispatch/sync.py over them:
- token level (native, dropless with gate weights at combine): `dispatch_tokens(x_TD, ids_TK, probs_TK)`
  / `combine_tokens(y_MD, meta) -> y_TD` (which replace permute-1 and unpermute): the probs stop at the
  relay rows, where combine weights the rows before folding them (no probs cross inside the node);
- row level (the `Dispatcher` protocol): `dispatch(x_RD, counts_E)` / `combine`, each row an item with
  K = 1 (same route, no dedup), the probs carried to the experts.
`token_exchange()` is the token-level Exchange of the pipeline: its probs go on to the experts, whose
phase applies them. Host synchronisation (explicit), per plan: the inter-node counts read as split sizes,
the number of rows bound for this node (R), and the intra-node counts read as split sizes; every other
size is derived from those host ints. The exchanges do not synchronise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from fmoe.dispatch.exchange import Chain, RowPlan, chained, takes_tokens
from fmoe.dispatch.sync import SyncRows
from fmoe.ops import Counts, expert_counts
from fmoe.parallel.alltoall import split_sizes
from fmoe.parallel.collectives import CommGroup
from fmoe.parallel.phased import a2a_each
from fmoe.parallel.rows import chunk_transpose_index, expert_ids_of_rows
from fmoe.parallel.tp_extends_ep import experts_per_rank
from fmoe.transforms.program import exchanged

if TYPE_CHECKING:
    from fmoe.config import MoEConfig


@dataclass(frozen=True)
class HierRoute:
    """The route of one layer (RowPlan.route; shapes in the module legend)."""

    send_item: torch.Tensor  # [sum send_A] item index of each item sent across nodes, node-major
    send_A: list[int]  # items sent to each node
    recv_A: list[int]  # items received from each node (sum U)
    order_R: torch.Tensor  # [R] flat (received item, k) index of each row bound for this node, by expert
    row_u: torch.Tensor  # [R] received item of each such row
    send_I: list[int]  # rows sent to each rank of this node
    recv_I: list[int]  # rows received from each rank of this node
    items: int  # X
    top_k: int  # K


class HierarchicalDispatcher(SyncRows):
    """Two-level dispatch over `inter` (one rank per node) and `intra` (this node's ranks); no parameters.

    `inter` and `intra` are ParallelLayout.group("expert_inter") / ("expert_intra") wrapped in CommGroups;
    expert-group rank = inter.rank * intra.size + intra.rank.
    """

    local = False  # Exchange capabilities (fmoe/dispatch/exchange.py)
    splits_rows = False  # two stages: a row chunk of the inter-node move is not one of the intra-node move
    whole_tokens = False  # this Exchange's acts: layout rows (False) or whole tokens (token_exchange())

    def __init__(self, inter: CommGroup, intra: CommGroup, num_experts: int):
        self.inter, self.intra = inter, intra
        self.num_experts = num_experts
        self.num_local_experts = experts_per_rank(num_experts, 1, inter.size * intra.size)
        self.node = inter.rank
        self.node_experts = self.num_local_experts * intra.size  # experts per node

    def token_level(self, cfg: MoEConfig) -> bool:
        """True when `cfg` lets the layer hand it whole tokens (`takes_tokens`: dropless, gate weights at
        combine): a token then crosses to a node once however many of its experts live there."""
        return takes_tokens(cfg)

    def token_exchange(self) -> HierarchicalDispatcher:
        """The token-level Exchange (module docstring): dispatch reads normed_TD / probs_TK, combine gives
        y_TD."""
        ex = copy.copy(self)
        ex.whole_tokens = True
        return ex

    # ---- the synchronous entry points (fmoe/dispatch/sync.py) -------------------------------------
    def dispatch_tokens(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, probs_TK: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Return (x_MD grouped by local expert, counts_L, meta) for tokens routed by ids_TK.

        `combine_tokens` then returns sum_k probs_TK[t, k] * y(t, k) (plain sum without probs).
        """
        plan = self._start_plan_ids(ids_TK.to(torch.int64)).wait()
        acts = {"x": x_TD} if probs_TK is None else {"x": x_TD, "probs": probs_TK}
        relay = self._exchanged(plan, acts, self._inter, "dispatch")  # the probs stop at the relay rows
        x_M = self._exchanged(plan, {"x": relay["x"]}, self._intra, "dispatch")["x"]
        return plan.to_experts(x_M), plan.counts_L, (plan, relay.get("probs"))

    def combine_tokens(self, y_MD: torch.Tensor, meta: Any) -> torch.Tensor:
        """Return y_TD: weighted top-k sum of the expert outputs, crossing each node boundary once."""
        plan, row_w = meta
        back = {"x": plan.from_experts(y_MD)}
        y_R = self._exchanged(plan, back, self._intra, "combine", transposed=True)["x"]
        if row_w is not None:  # weighted on the relay rank, before its rows of a token are summed
            y_R = y_R * row_w.unsqueeze(-1).to(y_R.dtype)
        return self._exchanged(plan, {"x": y_R}, self._inter, "combine", transposed=True)["x"]

    def _exchanged(self, plan: RowPlan, acts: dict, move: Any, name: str, transposed: bool = False) -> dict:
        """One move as a differentiable exchange (its backward is the move transposed)."""
        def issue(a: dict, t: bool, n: str) -> Chain:
            return chained(a, partial(move, plan, transpose=t, name=n))

        backward = partial(issue, t=not transposed, n=f"{name}.bwd")
        return exchanged(partial(issue, t=transposed, n=name), backward, acts)

    # ---- the plan ---------------------------------------------------------------------------------
    def start_plan(self, route: Any) -> Chain:
        """Issues the plan of a routed layer: its whole tokens for the token-level Exchange, else its
        layout rows."""
        if self.whole_tokens:
            return self._start_plan_ids(route.ids_TK.to(torch.int64))
        return self.start_plan_rows(route.layout.counts_E, route.layout.num_rows)

    def start_plan_rows(self, counts_E: torch.Tensor, rows: int) -> Chain:
        """Issues the plan of expert-sorted rows, each an item with K = 1."""
        return self._start_plan_ids(expert_ids_of_rows(counts_E, rows).unsqueeze(1))

    def _start_plan_ids(self, ids_XK: torch.Tensor) -> Chain:
        """Issues the count and id exchanges (three host syncs); the wait gives the RowPlan."""
        A, I, K = self.inter.size, self.intra.size, ids_XK.shape[1]
        # 1. inter-node: item x goes to node a once if any of its experts lives there.
        need_XA = torch.zeros((ids_XK.shape[0], A), dtype=torch.bool, device=ids_XK.device)
        need_XA.scatter_(1, ids_XK // self.node_experts, True)
        send_A_t = need_XA.sum(0).reshape(A, 1).contiguous()
        recv, handles = a2a_each({"n": send_A_t}, self.inter, [1] * A, [1] * A, "hier.inter.counts")
        box: dict[str, Any] = {}

        def ids_step(got: dict) -> tuple[dict, list]:
            send_A, recv_A = send_A_t.reshape(A).tolist(), got["n"].reshape(A).tolist()  # host sync
            # node-major, items ascending within a node; sized by the host split sizes (nonzero would sync)
            send_item = torch.nonzero_static(need_XA.t(), size=sum(send_A))[:, 1]
            box.update(send_A=send_A, recv_A=recv_A, send_item=send_item)
            ids = {"ids": ids_XK.index_select(0, send_item)}  # integers: moved, never differentiated
            return a2a_each(ids, self.inter, recv_A, send_A, "hier.inter.ids")

        def intra_counts(got: dict) -> tuple[dict, list]:
            # 2. the (item, k) rows bound for this node by expert id (stable: item order within expert)
            ids_UK, first = got["ids"], self.node * self.node_experts
            local_UK = (ids_UK >= first) & (ids_UK < first + self.node_experts)
            key = torch.where(local_UK, ids_UK - first, self.node_experts).reshape(-1)
            r = int(local_UK.sum())  # host sync: rows bound for this node
            order_R = torch.argsort(key, stable=True)[:r]
            # expert-major within the node: rank i of the node owns its L consecutive experts
            counts_IL = expert_counts(key.index_select(0, order_R), self.node_experts).reshape(I, -1)
            counts_IL = counts_IL.contiguous()
            box.update(order_R=order_R, counts_IL=counts_IL)
            return a2a_each({"c": counts_IL}, self.intra, [1] * I, [1] * I, "hier.intra.counts")

        def plan(got: dict) -> tuple[RowPlan, list]:
            recv_IL = got["c"]
            send_I, recv_I, counts_L, _ = split_sizes(box["counts_IL"], recv_IL)  # host sync: split sizes
            idx_M = chunk_transpose_index(recv_IL, sum(recv_I))  # 3. permute-2
            order_R = box["order_R"]
            route = HierRoute(box["send_item"], box["send_A"], box["recv_A"], order_R, order_R // K, send_I,
                              recv_I, ids_XK.shape[0], K)
            return RowPlan(counts_L=Counts(counts_L, recv_IL.sum(0)), idx_M=idx_M,
                           inverse_M=torch.argsort(idx_M), route=route), []

        return Chain((recv, handles), ids_step, intra_counts, plan)

    # ---- the route: two linear moves and their transposes -----------------------------------------
    def _inter(self, plan: RowPlan, acts: dict, *, transpose: bool, name: str) -> tuple[dict, list, Any]:
        """Items x [X, D] (+ probs [X, K]) -> relay rows [R, D] (+ [R]) across nodes; transposed, relay rows
        summed per received item, sent back and summed per item."""
        h = plan.route
        if not transpose:
            send = {k: v.reshape(h.items, h.top_k).index_select(0, h.send_item) if k == "probs" else
                    v.index_select(0, h.send_item) for k, v in acts.items()}

            def relay(got: dict) -> dict:
                return {k: v.reshape(-1).index_select(0, h.order_R) if k == "probs" else
                        v.index_select(0, h.row_u) for k, v in got.items()}

            return (*a2a_each(send, self.inter, h.recv_A, h.send_A, "hier.inter", name), relay)
        u = sum(h.recv_A)
        fold = {k: v.new_zeros(u * h.top_k).index_add(0, h.order_R, v).reshape(u, h.top_k)
                if k == "probs" else v.new_zeros((u, *v.shape[1:])).index_add(0, h.row_u, v)
                for k, v in acts.items()}

        def per_item(got: dict) -> dict:
            return {k: v.new_zeros((h.items, *v.shape[1:])).index_add(0, h.send_item, v)
                    for k, v in got.items()}

        return (*a2a_each(fold, self.inter, h.send_A, h.recv_A, "hier.inter", name), per_item)

    def _intra(self, plan: RowPlan, acts: dict, *, transpose: bool, name: str) -> tuple[dict, list, Any]:
        """Relay rows [R, ...] -> the owner ranks' rows [M, ...] (received order) inside the node; back
        when transposed."""
        h = plan.route
        out_s, in_s = (h.send_I, h.recv_I) if transpose else (h.recv_I, h.send_I)
        return (*a2a_each(acts, self.intra, out_s, in_s, "hier.intra", name), dict)

    # ---- the Exchange (fmoe/dispatch/exchange.py) -------------------------------------------------
    def _keys(self) -> tuple[str, str, str]:
        """(items, their probs, the combined items) in acts."""
        return ("normed_TD", "probs_TK", "y_TD") if self.whole_tokens else ("rows_RD", "probs_R", "rows_RD")

    def _moves(self, plan: RowPlan, transpose: bool, name: str) -> list:
        moves = [partial(self._inter, plan, transpose=transpose, name=name),
                 partial(self._intra, plan, transpose=transpose, name=name)]
        return moves[::-1] if transpose else moves

    def start_dispatch(self, plan: RowPlan, acts: dict) -> Chain:
        """Issues items (+ probs) -> rows at the experts, rows_MD (+ probs_M); other acts pass through (the
        tokens stay: the shared expert reads them)."""
        xk, pk, _ = self._keys()
        rest = {k: v for k, v in acts.items() if k != pk and (self.whole_tokens or k != xk)}
        moving = {"x": acts[xk], **({"probs": acts[pk]} if pk in acts else {})}
        return chained(moving, *self._moves(plan, False, "dispatch"), then=lambda got: {
            **rest, "rows_MD": got["x"], **({"probs_M": got["probs"]} if "probs" in got else {})})

    def start_dispatch_transpose(self, plan: RowPlan, ct: dict) -> Chain:
        """Issues the cotangents of rows_MD (+ probs_M) back to those of the items (+ their probs)."""
        xk, pk, _ = self._keys()
        rest = {k: v for k, v in ct.items() if k not in ("rows_MD", "probs_M")}
        moving = {"x": ct["rows_MD"], **({"probs": ct["probs_M"]} if "probs_M" in ct else {})}

        def named(got: dict) -> dict:
            out = dict(rest)
            # normed_TD also feeds the shared expert: its two cotangents add up
            out[xk] = got["x"] if xk not in out else out[xk] + got["x"]
            if "probs" in got:
                out[pk] = got["probs"] if self.whole_tokens else got["probs"].reshape(-1)
            return out

        return chained(moving, *self._moves(plan, True, "dispatch.bwd"), then=named)

    def start_combine(self, plan: RowPlan, acts: dict) -> Chain:
        """Issues rows_MD back to items, folding each item's rows on this node before crossing nodes."""
        rest = {k: v for k, v in acts.items() if k != "rows_MD"}
        return chained({"x": acts["rows_MD"]}, *self._moves(plan, True, "combine"),
                       then=lambda got: {**rest, self._keys()[2]: got["x"]})

    def start_combine_transpose(self, plan: RowPlan, ct: dict) -> Chain:
        """Issues the cotangent of the combined items back to that of rows_MD."""
        key = self._keys()[2]
        rest = {k: v for k, v in ct.items() if k != key}
        return chained({"x": ct[key]}, *self._moves(plan, False, "combine.bwd"),
                       then=lambda got: {**rest, "rows_MD": got["x"]})
