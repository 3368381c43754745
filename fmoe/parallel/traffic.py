"""Expert-parallel all-to-all bytes per link class, from routing alone (no process group).

Legend (the package's, docs/moe.md): T tokens on a rank, K top-k slots, E global experts, P ranks of the
expert group, L = E / P local experts (expert-group rank q = a*I + i owns experts q*L .. q*L+L-1),
A = P / I nodes the group spans, I ranks of the group per node.

Same conventions as `CommCounters` (fmoe/parallel/counters.py): bytes a rank sends under the direct
exchange model, per link class ("intra" / "inter"), nothing counted for rows a rank keeps. The exact
functions reproduce the counters of one dispatch, op by op:

    alltoall_dispatch_bytes       "alltoall.dispatch": (token, k) rows to the rank owning expert ids[t, k]
    alltoall_combine_bytes        "alltoall.combine": the same rows back (a rank sends what it received)
    hierarchical_dispatch_bytes   "hier.inter.dispatch" (all "inter"), "hier.intra.dispatch" (all "intra")
    hierarchical_combine_bytes    "hier.inter.combine", "hier.intra.combine": the same rows back

`row_bytes` is one row's payload (D x element size; for combine the expert output's width). Not counted
here, as the counters keep them under separate ops: the count exchanges ("alltoall.counts": L int64 to
every peer; "hier.inter.counts": one int64 to every other node; "hier.intra.counts": L int64 to every
other rank of the node), the routing ids the hierarchical dispatcher sends with each token crossing a
node ("hier.inter.ids": K int64 per crossing, i.e. inter dispatch rows x 8K bytes), and probabilities
when given ("alltoall.probs" / "hier.inter.probs": one element per row / K per crossing). The exact
functions assume the counters' CommGroups have a Topology whose nodes match `ranks_per_node` (a
CommGroup without one counts everything as "intra").

`expected_alltoall_bytes` / `expected_hierarchical_bytes` give the mean under uniform random routing, for
a planner that has no routing yet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fmoe.parallel.topology import INTER, INTRA


def _group_shape(num_experts: int, group_size: int, ranks_per_node: int, top_k: int) -> tuple[int, int]:
    """Return (L, I): experts per rank and ranks of the group per node (I = P when the group fits a node)."""
    if group_size < 1 or ranks_per_node < 1:
        raise ValueError(f"group_size ({group_size}) and ranks_per_node ({ranks_per_node}) must be >= 1")
    if num_experts < 1 or num_experts % group_size:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the expert group "
                         f"size {group_size}: every rank owns whole experts")
    if group_size > ranks_per_node and group_size % ranks_per_node:
        raise ValueError(f"expert group of {group_size} ranks must span whole nodes of {ranks_per_node} "
                         f"ranks (or fit in one node)")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be in 1 .. num_experts ({num_experts}): a token picks "
                         f"distinct experts")
    return num_experts // group_size, min(ranks_per_node, group_size)


def _check_ids(ids_TK_per_rank: Sequence[torch.Tensor], num_experts: int, ranks_per_node: int,
               ) -> tuple[int, int]:
    """Validate every rank's routing; return (L, I) as `_group_shape`."""
    if not ids_TK_per_rank:
        raise ValueError("ids_TK_per_rank: need the routing of every rank of the expert group (got none)")
    shapes = {tuple(ids.shape[1:]) for ids in ids_TK_per_rank}
    if any(ids.dim() != 2 for ids in ids_TK_per_rank) or len(shapes) != 1:
        raise ValueError(f"ids_TK_per_rank: need 2-d [T, K] tensors with one K for all ranks, got shapes "
                         f"{[tuple(ids.shape) for ids in ids_TK_per_rank]}")
    for ids in ids_TK_per_rank:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
            raise ValueError(f"ids_TK_per_rank: expert ids must lie in 0 .. {num_experts - 1}")
    return _group_shape(num_experts, len(ids_TK_per_rank), ranks_per_node, shapes.pop()[0])


def _rows_PP(ids_TK_per_rank: Sequence[torch.Tensor], L: int) -> torch.Tensor:
    """Return S_PP[p, q]: the (token, k) rows of rank p whose expert rank q owns."""
    P = len(ids_TK_per_rank)
    return torch.stack([torch.bincount(ids.reshape(-1).to(torch.int64) // L, minlength=P)
                        for ids in ids_TK_per_rank])


def _by_link(rows_PP: torch.Tensor, I: int, row_bytes: int) -> list[dict[str, int]]:
    """Bytes each rank p sends (rows_PP[p, q] rows to q), split by link class; rows to oneself dropped."""
    P = rows_PP.shape[0]
    node_P = torch.arange(P) // I
    same_PP = node_P[:, None] == node_P[None, :]
    off_PP = rows_PP * ~torch.eye(P, dtype=torch.bool)  # a rank's rows to itself are not sent
    intra_P, inter_P = (off_PP * same_PP).sum(1).tolist(), (off_PP * ~same_PP).sum(1).tolist()
    return [{INTRA: a * row_bytes, INTER: b * row_bytes} for a, b in zip(intra_P, inter_P)]


def alltoall_dispatch_bytes(ids_TK_per_rank: list[torch.Tensor], num_experts: int, ranks_per_node: int,
                            row_bytes: int) -> list[dict[str, int]]:
    """Return, per expert-group rank, {"intra": bytes, "inter": bytes} its "alltoall.dispatch" sends.

    `ids_TK_per_rank[p]` is rank p's routing; each (token, k) row goes to the rank owning its expert, and
    rows to the sender itself are free. AllToAllDispatcher.combine sends the same rows back: see
    `alltoall_combine_bytes` (summed over ranks, combine bytes equal dispatch bytes).
    """
    L, I = _check_ids(ids_TK_per_rank, num_experts, ranks_per_node)
    return _by_link(_rows_PP(ids_TK_per_rank, L), I, row_bytes)


def alltoall_combine_bytes(ids_TK_per_rank: list[torch.Tensor], num_experts: int, ranks_per_node: int,
                           row_bytes: int) -> list[dict[str, int]]:
    """Return, per rank, {"intra", "inter"} bytes its "alltoall.combine" sends: every row it received in
    dispatch goes back to its source (the dispatch matrix transposed)."""
    L, I = _check_ids(ids_TK_per_rank, num_experts, ranks_per_node)
    return _by_link(_rows_PP(ids_TK_per_rank, L).t(), I, row_bytes)


def _hier_PP(ids_TK_per_rank: Sequence[torch.Tensor], L: int, I: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (inter_PP, intra_PP) rows sent from expert-group rank p to q at each level.

    inter_PP[(a', i), (a, i)]: tokens of rank (a', i) with at least one expert on node a (one row per
    (token, node), however many of its experts live there). intra_PP[(a, i), (a, j)]: the (token, k) rows
    rank (a, i) holds after the inter level (its node's rows of the tokens of every rank (a', i)) whose
    expert rank (a, j) owns, i.e. the sum over a' of S_PP[(a', i), (a, j)].
    """
    P = len(ids_TK_per_rank)
    A = P // I
    inter_PP = torch.zeros(P, P, dtype=torch.int64)
    for p, ids in enumerate(ids_TK_per_rank):
        need_TA = torch.zeros(ids.shape[0], A, dtype=torch.bool)
        need_TA.scatter_(1, ids.to(torch.int64) // (L * I), True)  # dedup: a node needs a token once
        inter_PP[p, torch.arange(A) * I + p % I] = need_TA.sum(0)  # to the rank at position i of node a
    S = _rows_PP(ids_TK_per_rank, L).reshape(A, I, A, I)  # [a', i, a, j]
    relay_IAJ = S.sum(0)  # rows rank (a, i) relays to (a, j), over every source node a'
    intra = torch.zeros(A, I, A, I, dtype=torch.int64)
    for a in range(A):
        intra[a, :, a, :] = relay_IAJ[:, a, :]
    return inter_PP, intra.reshape(P, P)


def _merge(inter: list[dict[str, int]], intra: list[dict[str, int]]) -> list[dict[str, int]]:
    # The inter level only talks across nodes and the intra level only inside one: one op per link class.
    assert all(d[INTRA] == 0 for d in inter) and all(d[INTER] == 0 for d in intra)
    return [{INTRA: b[INTRA], INTER: a[INTER]} for a, b in zip(inter, intra)]


def hierarchical_dispatch_bytes(ids_TK_per_rank: list[torch.Tensor], num_experts: int, ranks_per_node: int,
                                row_bytes: int) -> list[dict[str, int]]:
    """Return, per expert-group rank, {"inter": "hier.inter.dispatch" bytes, "intra": "hier.intra.dispatch"
    bytes} of HierarchicalDispatcher.dispatch_tokens.

    Inter: each token once to every other node owning one of its experts. Intra: the rows of the tokens
    this rank then holds (its own and those of the same-position rank of every other node) whose expert
    is on this node, to their owner rank. Depends on every rank's routing, not only this rank's.
    """
    L, I = _check_ids(ids_TK_per_rank, num_experts, ranks_per_node)
    inter_PP, intra_PP = _hier_PP(ids_TK_per_rank, L, I)
    return _merge(_by_link(inter_PP, I, row_bytes), _by_link(intra_PP, I, row_bytes))


def hierarchical_combine_bytes(ids_TK_per_rank: list[torch.Tensor], num_experts: int, ranks_per_node: int,
                               row_bytes: int) -> list[dict[str, int]]:
    """Return, per rank, {"inter": "hier.inter.combine" bytes, "intra": "hier.intra.combine" bytes}: each
    level sends back what it received (one summed row per (token, node) across nodes)."""
    L, I = _check_ids(ids_TK_per_rank, num_experts, ranks_per_node)
    inter_PP, intra_PP = _hier_PP(ids_TK_per_rank, L, I)
    return _merge(_by_link(inter_PP.t(), I, row_bytes), _by_link(intra_PP.t(), I, row_bytes))


def expected_alltoall_bytes(tokens: int, top_k: int, num_experts: int, group_size: int, ranks_per_node: int,
                            row_bytes: float) -> dict[str, float]:
    """Return the mean {"intra", "inter"} bytes one rank's "alltoall.dispatch" sends under uniform routing.

    Uniform routing: every token picks top_k distinct experts uniformly among E. Each of the T*K rows,
    taken alone, has a uniform expert (sampling without replacement changes the joint law, not the
    marginal), so its owner is any given rank with probability L/E = 1/P. By linearity:
    intra = T*K*(I-1)/P rows, inter = T*K*(P-I)/P rows (I = P when the group fits one node). Combine
    sends the same mean back.
    """
    _, I = _group_shape(num_experts, group_size, ranks_per_node, top_k)
    rows = tokens * top_k
    return {INTRA: rows * (I - 1) / group_size * row_bytes,
            INTER: rows * (group_size - I) / group_size * row_bytes}


def expected_hierarchical_bytes(tokens: int, top_k: int, num_experts: int, group_size: int,
                                ranks_per_node: int, row_bytes: float) -> dict[str, float]:
    """Return the mean {"inter": "hier.inter.dispatch", "intra": "hier.intra.dispatch"} bytes one rank
    sends under uniform routing, every rank of the group holding `tokens` tokens.

    Inter: a token misses a given node when all its K distinct experts lie among the E - E/A experts of
    the other nodes, with probability C(E - E/A, K) / C(E, K) (hypergeometric). So it crosses to
    (A-1) * (1 - C(E - E/A, K) / C(E, K)) other nodes on average: that many rows per token.
    Intra: rank (a, i) holds the rows bound for node a of the tokens of the A ranks (a', i) (its own
    included). Each such (token, k) row has a uniform expert, so it goes to one given other rank (a, j)
    of the node with probability 1/P; over A*T*K source rows and I-1 targets:
    A*T*K*(I-1)/P = T*K*(I-1)/I rows. With A = 1 that is the all-to-all's T*K*(P-1)/P, as it should.
    Combine sends the same means back.
    """
    _, I = _group_shape(num_experts, group_size, ranks_per_node, top_k)
    A, E, K = group_size // I, num_experts, top_k
    miss = math.comb(E - E // A, K) / math.comb(E, K)  # comb(n, k) = 0 for k > n: K = E hits every node
    return {INTRA: tokens * K * (I - 1) / I * row_bytes,
            INTER: tokens * (A - 1) * (1 - miss) * row_bytes}
