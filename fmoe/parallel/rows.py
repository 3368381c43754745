"""Row bookkeeping shared by the dispatchers: chunk reordering and the token-level entry point.

Legend: T tokens, K top-k, N = T*K routed rows, E global experts, L local experts, P ranks, D width,
M rows this rank's experts receive, A/B two chunk axes (e.g. source rank x local expert).
"""

from __future__ import annotations

from typing import Any

import torch


def exclusive_cumsum(n_X: torch.Tensor) -> torch.Tensor:
    """Return start_X: start_X[i] = sum(n_X[:i]) (int64)."""
    c = torch.cumsum(n_X.to(torch.int64), 0)
    return c - n_X.to(torch.int64)


def chunk_transpose_index(counts_AB: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Return idx_M such that x_MD.index_select(0, idx_M) turns chunks stored in (a, b) order into (b, a).

    Rows arrive as consecutive chunks, chunk (a, b) of counts_AB[a, b] rows, a-major (e.g. by source rank,
    then by local expert); the result lists them b-major (by local expert, then source rank) — permute-2.
    Its inverse is `torch.argsort(idx_M)`. `total` (= counts_AB.sum(), a host int the caller already
    has from its split sizes) avoids reading the device counts here; None reads them (a host sync).
    """
    counts_AB = counts_AB.to(torch.int64)
    start_AB = exclusive_cumsum(counts_AB.reshape(-1)).reshape(counts_AB.shape)
    start_X, len_X = start_AB.t().reshape(-1), counts_AB.t().reshape(-1)
    m = int(len_X.sum()) if total is None else total
    pos_M = torch.arange(m, device=counts_AB.device)
    return pos_M + torch.repeat_interleave(start_X - exclusive_cumsum(len_X), len_X, output_size=m)


def expert_ids_of_rows(counts_E: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Return e_N: the expert id of each expert-sorted row, from counts_E (`total` = N if known: no sync)."""
    n = int(counts_E.sum()) if total is None else total
    return torch.repeat_interleave(torch.arange(counts_E.numel(), device=counts_E.device),
                                   counts_E.to(torch.int64), output_size=n)


class TokenLevelMixin:
    """`dispatch_tokens` / `combine_tokens` for a row-level dispatcher: permute-1, the seam, unpermute.

    Gives every dispatcher the token-level entry point the hierarchical one needs natively:

        x_MD, counts_L, meta = d.dispatch_tokens(x_TD, ids_TK, probs_TK)
        y_TD = d.combine_tokens(experts(x_MD, counts_L), meta)   # sum_k probs_TK[t, k] * y(t, k)
    """

    num_experts: int

    def dispatch_tokens(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, probs_TK: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Return (x_MD, counts_L, meta): this rank's expert rows for tokens routed by ids_TK."""
        k = ids_TK.shape[1]
        order_N = torch.argsort(ids_TK.reshape(-1), stable=True)  # permute-1: stable sort by expert id
        token_N = order_N // k
        counts_E = torch.bincount(ids_TK.reshape(-1), minlength=self.num_experts)
        x_MD, counts_L, _, meta = self.dispatch(x_TD.index_select(0, token_N), counts_E)
        probs_N = None if probs_TK is None else probs_TK.reshape(-1).index_select(0, order_N)
        return x_MD, counts_L, (meta, token_N, probs_N, x_TD.shape[0])

    def combine_tokens(self, y_MD: torch.Tensor, meta: Any) -> torch.Tensor:
        """Return y_TD: expert outputs brought back, weighted by probs_TK (if given) and summed over k."""
        inner, token_N, probs_N, t = meta
        y_ND = self.combine(y_MD, inner)
        if probs_N is not None:
            y_ND = y_ND * probs_N.unsqueeze(-1).to(y_ND.dtype)
        return y_ND.new_zeros((t, *y_ND.shape[1:])).index_add(0, token_N, y_ND)
