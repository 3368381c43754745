"""All-to-all dispatcher: exchange counts, one variable all-to-all each way, permute-2 around it.

Legend (the package's, docs/moe.md): P ranks in the expert group, E global experts, L = E / P local
experts (rank p owns experts p*L .. p*L+L-1), R rows of this rank's layout sorted by global expert,
M rows received for the local experts, D width. recv_PL[p, l]: rows source rank p sends to local
expert l.

The route is written once, as issue / wait exchanges (fmoe/dispatch/exchange.py); `dispatch` /
`combine` are the synchronous adapter over them (fmoe/dispatch/sync.py).

Host synchronisation (explicit): the plan waits the count exchange, and the split sizes and the rows per
local expert are read to the host in one read per dispatch (on a device from a side stream after the
count exchange, not from the compute stream: fmoe/parallel/host_read.py); the exchanges, their
transposes and `row_chunks` reuse them and do not synchronise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fmoe.dispatch.exchange import Chain, RowExchange, RowPlan, unchanged
from fmoe.dispatch.sync import SyncRows
from fmoe.ops import Counts
from fmoe.parallel.collectives import CommGroup
from fmoe.parallel.host_read import read_ints, upload_ints
from fmoe.parallel.phased import a2a_each
from fmoe.parallel.rows import TokenLevelMixin, chunk_transpose_index
from fmoe.parallel.tp_extends_ep import experts_per_rank

HostMatrix = tuple[tuple[int, ...], ...]


def split_sizes(counts_PL: torch.Tensor, recv_PL: torch.Tensor, after: Sequence[Any] | None = None,
                ) -> tuple[list[int], list[int], tuple[int, ...], HostMatrix]:
    """Return (send_P, recv_P, counts_L, recv_PL): rows to / from each rank, rows per local expert and
    rows from each rank per local expert, read to the host at once (the one host sync of a layer's
    forward). `after`: the handles of the count exchange that made recv_PL: on a device the read then
    waits for them alone, on a side stream (fmoe/parallel/host_read.py), not for the compute stream;
    None: `.tolist()` on the current stream."""
    P, L = recv_PL.shape

    def flat() -> torch.Tensor:
        return torch.cat([counts_PL.sum(1), recv_PL.sum(1), recv_PL.sum(0), recv_PL.reshape(-1)])

    sizes = flat().tolist() if after is None else read_ints(flat, recv_PL.device, after)
    matrix = tuple(tuple(sizes[2 * P + L + p * L:2 * P + L + (p + 1) * L]) for p in range(P))
    return sizes[:P], sizes[P:2 * P], tuple(sizes[2 * P:2 * P + L]), matrix


@dataclass(frozen=True)
class RowChunk:
    """Chunk c of a layer's all-to-all split in row chunks (`row_chunks`): its own RowPlan, `rows_R` the
    indices of this rank's layout rows it sends (and gets back), and `num_rows` R of the whole layout."""

    plan: RowPlan
    rows_R: torch.Tensor
    num_rows: int


def _bounds(k: int, c: int, n: int) -> tuple[int, int]:
    """Rows [lo, hi) of chunk c of n of a block of k rows (both ends of a link compute the same)."""
    return k * c // n, k * (c + 1) // n


def row_chunks(plan: RowPlan, n: int, device: torch.device) -> tuple[RowChunk, ...]:
    """Splits the all-to-all of `plan` into `n` exchanges of row chunks: chunk c sends rows [k c / n,
    k (c+1) / n) of each block of k rows this rank sends to a peer, and receives the same share of each
    block a peer sends it, so each chunk is a whole all-to-all of its own and the experts can start on
    chunk 0 while chunk 1 travels. Routing, capacity and the balancing losses are the whole microbatch's:
    only the movement is split. Host ints only (no sync: the plan's count exchange read them), put on
    the device in one non-blocking copy (`upload_ints`)."""
    if plan.send_P is None or plan.recv_P is None or plan.recv_PL is None:
        raise ValueError("row chunks need an all-to-all plan (send_P, recv_P and recv_PL)")
    starts = [0]
    for k in plan.send_P:
        starts.append(starts[-1] + k)
    host, spans = [], []  # every chunk's rows_R and recv_PL, in one buffer: one upload
    for c in range(n):
        sends = [_bounds(k, c, n) for k in plan.send_P]
        rows = [r for s, (lo, hi) in zip(starts, sends) for r in range(s + lo, s + hi)]
        recv_PL = []
        for k, row in zip(plan.recv_P, plan.recv_PL):  # a peer's block is sorted by local expert
            lo, hi = _bounds(k, c, n)
            begin, kept = 0, []
            for count in row:
                kept.append(max(0, min(hi, begin + count) - max(lo, begin)))
                begin += count
            recv_PL.append(tuple(kept))
        spans.append((len(host), len(rows), sends, tuple(recv_PL)))
        host += rows + [k for row in recv_PL for k in row]
    dev = upload_ints(host, device)
    out = []
    for at, num, sends, recv_PL in spans:
        recv_P = [sum(r) for r in recv_PL]
        counts_L = tuple(sum(col) for col in zip(*recv_PL))
        recv_PL_dev = dev[at + num:at + num + len(recv_PL) * len(counts_L)].view(len(recv_PL), len(counts_L))
        idx_M = chunk_transpose_index(recv_PL_dev, sum(recv_P))
        sub = RowPlan(counts_L=Counts(counts_L, recv_PL_dev.sum(0)), idx_M=idx_M,
                      inverse_M=torch.argsort(idx_M),
                      send_P=[hi - lo for lo, hi in sends], recv_P=recv_P, recv_PL=recv_PL)
        out.append(RowChunk(sub, dev[at:at + num], starts[-1]))
    return tuple(out)


class AllToAllDispatcher(TokenLevelMixin, SyncRows, RowExchange):
    """Dispatch by a variable all-to-all over `comm` (the ep x tp expert group); holds no parameters."""

    splits_rows = True  # each chunk of every peer's block is an all-to-all of its own (`row_chunks`)

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
            send_P, recv_P, counts_L, recv_host = split_sizes(counts_PL, recv_PL, handles)  # the host sync
            # permute-2: (source, local expert) -> (local expert, source)
            idx_M = chunk_transpose_index(recv_PL, sum(recv_P))
            return RowPlan(counts_L=Counts(counts_L, recv_PL.sum(0)), idx_M=idx_M,
                           inverse_M=torch.argsort(idx_M), send_P=send_P, recv_P=recv_P,
                           recv_PL=recv_host), []

        return Chain((recv, handles), plan)

    def move(self, plan: RowPlan, rows: dict, reverse: bool, name: str) -> tuple[dict, list, Any]:
        """Issues one all-to-all per tensor of `rows` (layout -> experts, or back when `reverse`)."""
        out_s, in_s = (plan.send_P, plan.recv_P) if reverse else (plan.recv_P, plan.send_P)
        raw, handles = a2a_each(rows, self.comm, out_s, in_s, "alltoall", name)
        return raw, handles, unchanged
