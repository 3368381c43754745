"""All-gather dispatcher (MISSION.md feature 13): gather the group's rows, index_select the local ones.

Legend (the package's, docs/moe.md): P ranks in the expert group (ep x tp), E global experts, L local
experts, R rows of this rank's expert-sorted layout, R_max = max R over ranks (gathered rows are padded
to R_max per rank), M rows for the local experts, D width. counts_PE[p, e]: rows rank p holds for
expert e.

Written once as issue / wait exchanges (fmoe/dispatch/exchange.py; `dispatch` / `combine` are the
synchronous adapter of fmoe/dispatch/sync.py over them): the plan gathers the counts and builds the row
index; dispatch all-gathers the padded expert-sorted rows and picks the local experts' rows with
`index_select` (no expanded gather index). Combine writes the expert outputs back with `index_put` into a
zero [P*R_max, D] buffer and reduce-scatters it: every row has exactly one owner, so the sum is a
placement. Row level only: the token-level entry point (`dispatch_tokens`, fmoe.parallel.rows) is
permute-1 and unpermute around this route, as in the model.

Host synchronisation (explicit), per dispatch: one blocking all-gather of counts, R_max and the rows per
local expert read in one host sync (`gather_sizes`). Combine and the backward: none.

Agreement: ranks that disagree on the expert count would gather messages of different sizes (gloo aborts)
or select other ranks' rows (a wrong answer, no error). Every rank raises the same ValueError instead:
the dispatcher all-gathers (num_experts, len(counts_E)) once, on its first dispatch (one more small
blocking all-gather, once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange

from fmoe._index import exclusive_cumsum
from fmoe.dispatch.exchange import Chain, RowExchange, RowPlan, traffic_op
from fmoe.dispatch.sync import SyncRows
from fmoe.ops import Counts
from fmoe.parallel.collectives import CommGroup, all_gather_async, all_gather_counts, reduce_scatter_async
from fmoe.parallel.host_read import read_ints
from fmoe.parallel.rows import TokenLevelMixin
from fmoe.parallel.tp_extends_ep import experts_per_rank


@dataclass(frozen=True)
class GatherRoute:
    """The row-level route of one layer (RowPlan.route): gathered-row index of each local row [M]
    (already grouped by local expert, so no permute-2), padded rows per rank R_max, this rank's R."""

    idx_M: torch.Tensor
    rows_padded: int
    rows: int


def _by_rank(values: list[int]) -> str:
    """'4 on group ranks [0], 8 on group ranks [1]': each value with the group ranks that hold it."""
    ranks: dict[int, list[int]] = {}
    for p, v in enumerate(values):
        ranks.setdefault(v, []).append(p)
    return ", ".join(f"{v} on group ranks {rs}" for v, rs in ranks.items())


def check_agreement(rows_PH: list[list[int]], names: tuple[str, ...]) -> None:
    """Raise ValueError unless every rank's header (row p of rows_PH, one entry per name) is the same;
    all ranks hold the same rows, so all raise alike."""
    for h, name in enumerate(names):
        values = [row[h] for row in rows_PH]
        if len(set(values)) > 1:
            raise ValueError(f"AllGatherDispatcher: the ranks of the expert group disagree on {name}: "
                             f"{_by_rank(values)}")


def gather_sizes(counts_PE: torch.Tensor, rank: int, L: int,
                 after: Sequence[Any] | None = None) -> tuple[int, tuple[int, ...]]:
    """Return (r_max, counts_L): the most rows any rank holds (the padded rows per rank) and the rows per
    local expert of `rank`, as host ints read in one host sync (the one of the layer's forward). `after`:
    the counts' all-gather handles (on a device the read waits for them alone, from a side stream:
    fmoe/parallel/host_read.py); None: `.tolist()` on the current stream."""
    P = counts_PE.shape[0]

    def flat() -> torch.Tensor:
        return torch.cat([counts_PE.sum(1), counts_PE[:, rank * L:(rank + 1) * L].sum(0)])

    sizes = flat().tolist() if after is None else read_ints(flat, counts_PE.device, after)
    return max(sizes[:P], default=0), tuple(sizes[P:])


def gather_index(counts_PE: torch.Tensor, rank: int, L: int, r_max: int,
                 m: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (idx_M, counts_L): the index into all ranks' gathered rows ([P * R_max], rank p's at
    p * R_max) of each row of `rank`'s L local experts, grouped by local expert then source rank, and the
    rows per local expert. counts_PE[p, e]: rows rank p holds for expert e, expert-sorted. `m`: the rows
    of the local experts when the caller knows it (no host sync), else read here."""
    P = counts_PE.shape[0]
    start_PE = exclusive_cumsum(counts_PE, dim=1)  # first row of expert e within rank p's rows
    mine_PL = counts_PE[:, rank * L:(rank + 1) * L]
    base_PL = start_PE[:, rank * L:(rank + 1) * L] + r_max * torch.arange(P, device=counts_PE.device)[:, None]
    # the chunks in (local expert, rank) order: their gathered start and their length
    base_LP, len_LP = rearrange(base_PL, "p l -> (l p)"), rearrange(mine_PL, "p l -> (l p)")
    m = int(len_LP.sum()) if m is None else m
    idx_M = torch.arange(m, device=counts_PE.device) + torch.repeat_interleave(
        base_LP - exclusive_cumsum(len_LP), len_LP, output_size=m)
    return idx_M, mine_PL.sum(0)


class AllGatherDispatcher(TokenLevelMixin, SyncRows, RowExchange):
    """Dispatch by all-gather + index_select, combine by index_put + reduce-scatter; no parameters."""

    def __init__(self, comm: CommGroup, num_experts: int):
        self.comm = comm
        self.num_experts = num_experts
        self.num_local_experts = experts_per_rank(num_experts, 1, comm.size)
        self._agreed = False  # the row level's expert count checked against the group's (first dispatch)

    def _agree_once(self, counts_E: torch.Tensor) -> None:
        """On the first row-level dispatch, raise ValueError on every rank unless all agree on num_experts and
        route over that many experts (len(counts_E)); the counts' own all-gather needs one size everywhere."""
        if self._agreed:
            return
        mine = torch.tensor([self.num_experts, counts_E.numel()], device=counts_E.device)
        rows_PH = all_gather_counts(mine, self.comm, op="allgather.agree").tolist()  # blocks
        check_agreement(rows_PH, ("num_experts", "the routed experts (len(counts_E))"))
        if rows_PH[0][0] != rows_PH[0][1]:
            raise ValueError(f"AllGatherDispatcher: every rank routes over {rows_PH[0][1]} experts "
                             f"(len(counts_E)), but num_experts is {rows_PH[0][0]}")
        self._agreed = True

    def start_plan_rows(self, counts_E: torch.Tensor, rows: int) -> Chain:
        """Issues the counts' all-gather; its wait gives the RowPlan (the layer's one host sync)."""
        comm, L = self.comm, self.num_local_experts
        self._agree_once(counts_E)
        with torch.no_grad():
            got, h = all_gather_async(counts_E.to(torch.int64).reshape(1, -1).contiguous(), comm,
                                      op="allgather.counts")

        def plan(counts_PE: torch.Tensor) -> tuple[RowPlan, list]:
            counts_PE = counts_PE.reshape(comm.size, -1)
            r_max, counts_L = gather_sizes(counts_PE, comm.rank, L, [h])  # the host sync
            idx_M, counts_L_dev = gather_index(counts_PE, comm.rank, L, r_max, sum(counts_L))
            return RowPlan(counts_L=Counts(counts_L, counts_L_dev), route=GatherRoute(idx_M, r_max, rows)), []

        return Chain((got, [h]), plan)

    def move(self, plan: RowPlan, rows: dict, reverse: bool, name: str) -> tuple[dict, list, Any]:
        """Dispatch: all-gather the padded rows, index_select the local ones. Reverse (combine, the
        dispatch's transpose): index_put into zeros, reduce-scatter, drop the padding."""
        g, comm = plan.route, self.comm
        out, handles = {}, []
        with torch.no_grad():
            for k, x in rows.items():
                x, op = x.detach(), traffic_op("allgather", name, k)
                if reverse:  # M rows -> their places among all ranks' padded rows -> summed back per rank
                    buf = x.new_zeros((comm.size * g.rows_padded, *x.shape[1:]))
                    out[k], h = reduce_scatter_async(buf.index_put_((g.idx_M,), x), comm, op=op)
                else:
                    pad = (0, 0) * (x.dim() - 1) + (0, g.rows_padded - g.rows)
                    out[k], h = all_gather_async(F.pad(x, pad), comm, op=op)
                handles.append(h)

        def finish(got: dict) -> dict:
            if reverse:
                return {k: v[:g.rows] for k, v in got.items()}
            return {k: v.index_select(0, g.idx_M) for k, v in got.items()}

        return out, handles, finish
