"""All-to-all dispatcher: exchange counts, one variable all-to-all each way, permute-2 around it.

Legend (the package's, docs/moe.md): P ranks in the expert group, E global experts, L = E / P local
experts (rank p owns experts p*L .. p*L+L-1), R rows of this rank's layout sorted by global expert,
M rows received for the local experts, D width. recv_PL[p, l]: rows source rank p sends to local
expert l.

Host synchronisation (explicit): `exchange_counts` blocks, and the split sizes and the rows per local
expert are read to the host in one `.tolist()` per dispatch; combine and the backward reuse them and
do not synchronise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from fmoe.ops import Counts
from fmoe.parallel.collectives import CommGroup, all_to_all, exchange_counts
from fmoe.parallel.rows import TokenLevelMixin, chunk_transpose_index
from fmoe.parallel.tp_extends_ep import experts_per_rank


def split_sizes(counts_PL: torch.Tensor,
                recv_PL: torch.Tensor) -> tuple[list[int], list[int], tuple[int, ...]]:
    """Return (send_P, recv_P, counts_L): rows to / from each rank and rows per local expert, read to the
    host in one `.tolist()` (the one host sync of a layer's forward)."""
    P = counts_PL.shape[0]
    sizes = torch.cat([counts_PL.sum(1), recv_PL.sum(1), recv_PL.sum(0)]).tolist()
    return sizes[:P], sizes[P:2 * P], tuple(sizes[2 * P:])


@dataclass(frozen=True)
class AllToAllMeta:
    """What combine needs: permute-2 inverse [M], rows sent to [P] / received from [P] each rank."""

    inverse_M: torch.Tensor
    send_P: list[int]
    recv_P: list[int]


class AllToAllDispatcher(TokenLevelMixin):
    """Dispatch by a variable all-to-all over `comm` (the ep x tp expert group); holds no parameters."""

    def __init__(self, comm: CommGroup, num_experts: int):
        self.comm = comm
        self.num_experts = num_experts
        self.num_local_experts = experts_per_rank(num_experts, 1, comm.size)

    def dispatch(self, x_RD: torch.Tensor, counts_E: torch.Tensor, probs_R: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, AllToAllMeta]:
        """Return (x_MD grouped by local expert, counts_L, probs_M or None, meta)."""
        P = self.comm.size
        # expert-major: rank p owns the L consecutive experts p*L .. p*L+L-1
        counts_PL = rearrange(counts_E.to(torch.int64), "(p l) -> p l", p=P)
        recv_PL = exchange_counts(counts_PL, self.comm, op="alltoall.counts")  # blocks
        send_P, recv_P, counts_L = split_sizes(counts_PL, recv_PL)  # the host sync
        x_MD = all_to_all(x_RD, self.comm, recv_P, send_P, op="alltoall.dispatch")
        # permute-2: (source, local expert) -> (local expert, source)
        idx_M = chunk_transpose_index(recv_PL, sum(recv_P))
        x_MD = x_MD.index_select(0, idx_M)
        probs_M = None
        if probs_R is not None:
            probs_M = all_to_all(probs_R, self.comm, recv_P, send_P, op="alltoall.probs")
            probs_M = probs_M.index_select(0, idx_M)
        meta = AllToAllMeta(torch.argsort(idx_M), send_P, recv_P)
        return x_MD, Counts(counts_L, recv_PL.sum(0).to(x_RD.device)), probs_M, meta

    def combine(self, y_MD: torch.Tensor, meta: AllToAllMeta) -> torch.Tensor:
        """Return y_RD: expert outputs in this rank's original expert-sorted row order."""
        y_MD = y_MD.index_select(0, meta.inverse_M)  # undo permute-2
        return all_to_all(y_MD, self.comm, meta.send_P, meta.recv_P, op="alltoall.combine")
