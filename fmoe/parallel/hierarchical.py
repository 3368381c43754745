"""Hierarchical dispatcher (MISSION.md feature 24): across nodes once per token, then all-to-all inside.

Legend (the package's, docs/moe.md): T tokens on this rank, K top-k slots, A nodes the expert group
spans, I expert-group ranks per node, E global experts, L local experts (expert-group rank q = a*I + i
owns experts q*L .. q*L+L-1), U tokens this rank receives from the other nodes' rank i (plus its own),
R (token, expert) rows bound for this node held by this rank, sorted by expert (its layout), M rows for
the local experts, D width.

Dispatch, for a token routed by ids_TK:
  1. inter-node (over the ranks with the same node-local position i, one per node): the token goes once
     to every node that owns at least one of its top-k experts, with its ids and probs. This is the
     all-gather across nodes of the paper restricted to the nodes that need the token; a token crosses to
     a node at most once, however many of its experts live there.
  2. sort: the rows (token, k) whose expert is on this node, by expert id;
  3. intra-node all-to-all of those rows to their owner rank, then permute-2 (group by local expert).
Combine runs it backwards and folds the top-k sum into it: each node weights its rows by probs and sums
them per token before the one transfer back across nodes.

The dedup needs token-level routing, so the native entry point is `dispatch_tokens(x_TD, ids_TK,
probs_TK)` / `combine_tokens(y_MD, meta) -> y_TD` (which replaces permute-1 and unpermute). The row-level
`Dispatcher` protocol (`dispatch(x_RD, counts_E)` / `combine`) also works, treating each row as a token
with K = 1 (same route, no dedup). Host synchronisation (explicit), per dispatch: the inter-node count
exchange read to the host as split sizes, the number of rows bound for this node (R), and the intra-node
count exchange read as split sizes; every other size is derived from those host ints. Combine does not
synchronise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from fmoe.parallel.collectives import CommGroup, all_to_all, exchange_counts
from fmoe.parallel.rows import chunk_transpose_index, expert_ids_of_rows
from fmoe.parallel.tp_extends_ep import experts_per_rank


@dataclass(frozen=True)
class HierarchicalMeta:
    """What combine needs (shapes in the module legend)."""

    send_tok: torch.Tensor  # [sum send_A] token index of each row sent across nodes, node-major
    send_A: list[int]  # tokens sent to each node
    recv_A: list[int]  # tokens received from each node (sum U)
    row_u: torch.Tensor  # [R] received token of each row bound for this node, sorted by expert
    row_w: torch.Tensor | None  # [R] probability of each row when combine weights, else None
    send_I: list[int]  # rows sent to each rank of this node
    recv_I: list[int]  # rows received from each rank of this node
    inverse_M: torch.Tensor  # [M] undoes permute-2
    tokens: int  # T


class HierarchicalDispatcher:
    """Two-level dispatch over `inter` (one rank per node) and `intra` (this node's ranks); no parameters.

    `inter` and `intra` are ParallelLayout.group("expert_inter") / ("expert_intra") wrapped in CommGroups;
    expert-group rank = inter.rank * intra.size + intra.rank.
    """

    def __init__(self, inter: CommGroup, intra: CommGroup, num_experts: int):
        self.inter, self.intra = inter, intra
        self.num_experts = num_experts
        self.num_local_experts = experts_per_rank(num_experts, 1, inter.size * intra.size)
        self.node = inter.rank
        self.node_experts = self.num_local_experts * intra.size  # experts per node

    # ---- token level (native) ---------------------------------------------------------------------
    def dispatch_tokens(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, probs_TK: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, HierarchicalMeta]:
        """Return (x_MD grouped by local expert, counts_L, meta) for tokens routed by ids_TK.

        `combine_tokens` then returns sum_k probs_TK[t, k] * y(t, k) (plain sum without probs).
        """
        x_MD, counts_L, _, meta = self._dispatch(x_TD, ids_TK, probs_TK, weight_in_combine=True)
        return x_MD, counts_L, meta

    def combine_tokens(self, y_MD: torch.Tensor, meta: HierarchicalMeta) -> torch.Tensor:
        """Return y_TD: weighted top-k sum of the expert outputs, crossing each node boundary once."""
        # back to the rank that sent each row inside the node
        y_MD = y_MD.index_select(0, meta.inverse_M)
        y_RD = all_to_all(y_MD, self.intra, meta.send_I, meta.recv_I, op="hier.intra.combine")
        if meta.row_w is not None:
            y_RD = y_RD * meta.row_w.unsqueeze(-1).to(y_RD.dtype)
        # fold the top-k rows of each token on this node before crossing back: one row per (token, node)
        u = sum(meta.recv_A)
        y_UD = y_RD.new_zeros((u, *y_RD.shape[1:])).index_add(0, meta.row_u, y_RD)
        y_back = all_to_all(y_UD, self.inter, meta.send_A, meta.recv_A, op="hier.inter.combine")
        return y_back.new_zeros((meta.tokens, *y_back.shape[1:])).index_add(0, meta.send_tok, y_back)

    # ---- row level (the Dispatcher protocol) ------------------------------------------------------
    def dispatch(self, x_RD: torch.Tensor, counts_E: torch.Tensor, probs_R: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, HierarchicalMeta]:
        """Return (x_MD, counts_L, probs_M or None, meta): each expert-sorted row as a token with K = 1."""
        ids_R1 = expert_ids_of_rows(counts_E.to(x_RD.device), x_RD.shape[0]).unsqueeze(1)
        probs_R1 = None if probs_R is None else probs_R.unsqueeze(1)
        return self._dispatch(x_RD, ids_R1, probs_R1, weight_in_combine=False)

    def combine(self, y_MD: torch.Tensor, meta: HierarchicalMeta) -> torch.Tensor:
        """Return y_RD: expert outputs in this rank's original expert-sorted row order."""
        return self.combine_tokens(y_MD, meta)

    # ---- the route ----------------------------------------------------------------------------------
    def _dispatch(self, x_TD, ids_TK, probs_TK, *, weight_in_combine):
        A, I, K, dev = self.inter.size, self.intra.size, ids_TK.shape[1], x_TD.device
        ids_TK = ids_TK.to(torch.int64)
        # 1. inter-node: token t goes to node a once if any of its experts lives there.
        node_TK = ids_TK // self.node_experts
        need_TA = torch.zeros((x_TD.shape[0], A), dtype=torch.bool, device=dev)
        need_TA.scatter_(1, node_TK, True)
        send_A_t = need_TA.sum(0)
        recv_A_t = exchange_counts(send_A_t.reshape(A, 1), self.inter, op="hier.inter.counts").reshape(A)
        send_A, recv_A = send_A_t.tolist(), recv_A_t.tolist()  # host sync (split sizes)
        # node-major, tokens ascending within a node; sized by the host split sizes (nonzero would sync)
        send_tok = torch.nonzero_static(need_TA.t(), size=sum(send_A))[:, 1]
        x_UD = all_to_all(x_TD.index_select(0, send_tok), self.inter, recv_A, send_A,
                          op="hier.inter.dispatch")
        with torch.no_grad():  # routing ids are integers: moved, never differentiated
            ids_UK = all_to_all(ids_TK.index_select(0, send_tok), self.inter, recv_A, send_A,
                                op="hier.inter.ids")
        probs_UK = None
        if probs_TK is not None:
            probs_UK = all_to_all(probs_TK.index_select(0, send_tok), self.inter, recv_A, send_A,
                                  op="hier.inter.probs")
        # 2. sort the (token, k) rows bound for this node by expert id (stable: token order within expert).
        first = self.node * self.node_experts
        local_UK = (ids_UK >= first) & (ids_UK < first + self.node_experts)
        key = torch.where(local_UK, ids_UK - first, self.node_experts).reshape(-1)
        r = int(local_UK.sum())  # host sync: rows bound for this node
        order_R = torch.argsort(key, stable=True)[:r]
        row_u, row_e = order_R // K, key.index_select(0, order_R)
        # expert-major within the node: rank i of the node owns its L consecutive experts
        counts_IL = rearrange(torch.bincount(row_e, minlength=self.node_experts), "(i l) -> i l", i=I)
        # 3. intra-node all-to-all to the owner rank, then permute-2.
        recv_IL = exchange_counts(counts_IL, self.intra, op="hier.intra.counts")
        send_I, recv_I = counts_IL.sum(1).tolist(), recv_IL.sum(1).tolist()  # host sync (split sizes)
        x_MD = all_to_all(x_UD.index_select(0, row_u), self.intra, recv_I, send_I, op="hier.intra.dispatch")
        idx_M = chunk_transpose_index(recv_IL, sum(recv_I))
        x_MD = x_MD.index_select(0, idx_M)
        row_p = None if probs_UK is None else probs_UK.reshape(-1).index_select(0, order_R)
        probs_M = None
        if row_p is not None and not weight_in_combine:
            probs_M = all_to_all(row_p, self.intra, recv_I, send_I, op="hier.intra.probs")
            probs_M = probs_M.index_select(0, idx_M)
        meta = HierarchicalMeta(send_tok, send_A, recv_A, row_u, row_p if weight_in_combine else None,
                                send_I, recv_I, torch.argsort(idx_M), x_TD.shape[0])
        return x_MD, recv_IL.sum(0).to(dev), probs_M, meta
