"""The MoE layer through a dispatcher's token-level entry point (needed for hierarchical dedup).

Legend: T tokens, D model width, K experts per token, M rows this rank's experts receive, L local experts.

`fmoe.layer.moe(..., dispatcher=d)` hands the dispatcher expert-sorted rows (one per (token, slot)), which
is all the row-level protocol sees, so a token bound for two experts on one remote node crosses twice.
`moe_tokens` composes the same router and experts around `d.dispatch_tokens(x_TD, ids_TK, probs_TK)` /
`d.combine_tokens`, which take over permute-1 and unpermute (and, for the hierarchical dispatcher, fold
the top-k sum into the return trip). Dropless only, gate weights applied at combine.
"""

from __future__ import annotations

from typing import Any

import torch

from fmoe.config import MoEConfig
from fmoe.experts import routed_experts, shared_experts
from fmoe.router import route


def moe_tokens(params: dict[str, Any], x_TD: torch.Tensor, cfg: MoEConfig, dispatcher: Any,
               state: dict[str, Any] | None = None, seq_len: int | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (y_TD, loss): the MoE layer's output [T, D] (x's dtype) and its differentiable balancing loss.

    `params["experts"]` holds this rank's L local experts; router and shared weights are replicated.
    `dispatcher` needs `dispatch_tokens` / `combine_tokens` (every fmoe.parallel dispatcher has them).
    """
    if cfg.capacity_factor is not None or cfg.dynamic_capacity_window or cfg.probs_in_expert:
        raise ValueError("moe_tokens: dropless with gate weights at combine only (no capacity_factor, "
                         "dynamic_capacity_window or probs_in_expert)")
    r = route(params["router"], x_TD, cfg, state, seq_len)
    x_MD, counts_L, meta = dispatcher.dispatch_tokens(x_TD, r.ids_TK, r.probs_TK)
    y_MD = routed_experts(params["experts"], x_MD, counts_L, None, cfg.backend)
    y_TD = dispatcher.combine_tokens(y_MD, meta).to(x_TD.dtype)
    if "shared" in params:
        y_TD = y_TD + shared_experts(params["shared"], x_TD)
    return y_TD, r.loss
