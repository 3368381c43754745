"""Dispatchers as issue / wait exchanges, for a pipeline executor that runs exchanges outside any vjp.

Legend (the package's, docs/moe.md): T tokens, K top-k slots, E global experts, L local experts, P ranks
of the expert group, R rows of this rank's expert-sorted layout, M rows this rank's experts receive,
A nodes, I ranks per node, U tokens a rank receives across nodes, D width.

Each dispatcher writes its route once, as the issue / wait exchanges of fmoe/dispatch/exchange.py, next
to its own code (alltoall.py, allgather.py, hierarchical.py, fmoe/dispatch/local.py); `phased(dispatcher)`
returns the Exchange the pipeline's phases drive, and the layer's synchronous dispatch / combine is the
adapter of fmoe/dispatch/sync.py over the same methods. `a2a_each` is the all-to-all they share.

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

from typing import Any

import torch

from fmoe.dispatch.exchange import Chain, Exchange, RowPlan, traffic_op
from fmoe.dispatch.sync import as_exchange
from fmoe.parallel.collectives import CommGroup, all_to_all_async

__all__ = ["Chain", "RowPlan", "a2a_each", "phased"]


def a2a_each(rows: dict[str, torch.Tensor], comm: CommGroup, out_s: list[int], in_s: list[int], prefix: str,
             name: str | None = None) -> tuple[dict[str, torch.Tensor], list]:
    """Issues one all-to-all per tensor of `rows` (plain tensors, no autograd); returns (outputs, handles).
    Counted as `prefix` alone, or per tensor as `traffic_op(prefix, name, key)`."""
    out, handles = {}, []
    with torch.no_grad():
        for k, x in rows.items():
            op = prefix if name is None else traffic_op(prefix, name, k)
            out[k], h = all_to_all_async(x.detach(), comm, out_s, in_s, op=op)
            handles.append(h)
    return out, handles


def phased(dispatcher: Any, token_level: bool = False) -> Exchange:
    """Returns the Exchange of `dispatcher` (module docstring; `fmoe.dispatch.sync.as_exchange`: one with
    only dispatch / combine runs inline). `token_level`: its token-level Exchange, which takes whole
    tokens (asked for where `Exchange.token_level(cfg)` says so: the hierarchical dispatcher, dropless
    with gate weights at combine)."""
    ex = as_exchange(dispatcher)
    return ex.token_exchange() if token_level else ex
