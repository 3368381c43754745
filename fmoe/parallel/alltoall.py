"""All-to-all dispatcher: exchange counts, one variable all-to-all each way, permute-2 around it.

Legend (the package's, docs/moe.md): P ranks in the expert group, E global experts, L = E / P local
experts (rank p owns experts p*L .. p*L+L-1), R rows of this rank's layout sorted by global expert,
M rows received for the local experts, D width. recv_PL[p, l]: rows source rank p sends to local
expert l.

The route is written once, as issue / wait exchanges (fmoe/dispatch/exchange.py); `dispatch` /
`combine` are the synchronous adapter over them (fmoe/dispatch/sync.py).

Host synchronisation (explicit): the plan waits the count exchange, and the split sizes and the rows per
local expert are read to the host in one `.tolist()` per dispatch; the exchanges and their transposes
reuse them and do not synchronise.
"""

from __future__ import annotations

from typing import Any

import torch

from fmoe.dispatch.exchange import Chain, RowExchange, RowPlan, unchanged
from fmoe.dispatch.sync import SyncRows
from fmoe.ops import Counts
from fmoe.parallel.collectives import CommGroup
from fmoe.parallel.phased import a2a_each
from fmoe.parallel.rows import TokenLevelMixin, chunk_transpose_index
from fmoe.parallel.tp_extends_ep import experts_per_rank


def split_sizes(counts_PL: torch.Tensor,
                recv_PL: torch.Tensor) -> tuple[list[int], list[int], tuple[int, ...]]:
    """Return (send_P, recv_P, counts_L): rows to / from each rank and rows per local expert, read to the
    host in one `.tolist()` (the one host sync of a layer's forward)."""
    P = counts_PL.shape[0]
    sizes = torch.cat([counts_PL.sum(1), recv_PL.sum(1), recv_PL.sum(0)]).tolist()
    return sizes[:P], sizes[P:2 * P], tuple(sizes[2 * P:])


class AllToAllDispatcher(TokenLevelMixin, SyncRows, RowExchange):
    """Dispatch by a variable all-to-all over `comm` (the ep x tp expert group); holds no parameters."""

    def __init__(self, comm: CommGroup, num_experts: int):
        self.comm = comm
        self.num_experts = num_experts
        self.num_local_experts = experts_per_rank(num_experts, 1, comm.size)

    def start_plan_rows(self, counts_E: torch.Tensor, rows: int) -> Chain:
        """Issues the count exchange; its wait gives the RowPlan (the layer's one host sync)."""
        P, L = self.comm.size, self.num_local_experts
        # expert-major: rank p owns the L consecutive experts p*L .. p*L+L-1
        counts_PL = counts_E.to(torch.int64).reshape(P, L).contiguous()
        recv, handles = a2a_each({"counts": counts_PL}, self.comm, [1] * P, [1] * P, "alltoall.counts")

        def plan(got: dict) -> tuple[RowPlan, list]:
            recv_PL = got["counts"]
            send_P, recv_P, counts_L = split_sizes(counts_PL, recv_PL)  # the host sync
            # permute-2: (source, local expert) -> (local expert, source)
            idx_M = chunk_transpose_index(recv_PL, sum(recv_P))
            return RowPlan(counts_L=Counts(counts_L, recv_PL.sum(0)), idx_M=idx_M,
                           inverse_M=torch.argsort(idx_M), send_P=send_P, recv_P=recv_P), []

        return Chain((recv, handles), plan)

    def move(self, plan: RowPlan, rows: dict, reverse: bool, name: str) -> tuple[dict, list, Any]:
        """Issues one all-to-all per tensor of `rows` (layout -> experts, or back when `reverse`)."""
        out_s, in_s = (plan.send_P, plan.recv_P) if reverse else (plan.recv_P, plan.send_P)
        raw, handles = a2a_each(rows, self.comm, out_s, in_s, "alltoall", name)
        return raw, handles, unchanged
