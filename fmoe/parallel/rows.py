"""Row bookkeeping shared by the dispatchers: chunk reordering and the token-level entry point.

Legend (the package's, docs/moe.md): T tokens, K top-k slots, N = T * K (token, slot) pairs, R rows of
this rank's expert-sorted layout (R = N at the token level, which is dropless), E global experts,
L local experts, P ranks, D width, M rows this rank's experts receive, X / Y two chunk axes (e.g. source
rank x local expert).
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange

from fmoe._index import exclusive_cumsum
from fmoe.ops import permute, sort_layout, unpermute


def chunk_transpose_index(counts_XY: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Return idx_M such that x_MD.index_select(0, idx_M) turns chunks stored in (x, y) order into (y, x).

    Rows arrive as consecutive chunks, chunk (x, y) of counts_XY[x, y] rows, x-major (e.g. by source rank,
    then by local expert); the result lists them y-major (by local expert, then source rank) — permute-2.
    Its inverse is `torch.argsort(idx_M)`. `total` (= counts_AB.sum(), a host int the caller already
    has from its split sizes) avoids reading the device counts here; None reads them (a host sync).
    """
    counts_XY = counts_XY.to(torch.int64)
    start_XY = exclusive_cumsum(counts_XY.reshape(-1)).reshape(counts_XY.shape)  # chunk starts, x-major
    # the chunks in y-major order: their source start and their length
    start_YX, len_YX = rearrange(start_XY, "x y -> (y x)"), rearrange(counts_XY, "x y -> (y x)")
    m = int(len_YX.sum()) if total is None else total
    pos_M = torch.arange(m, device=counts_XY.device)
    return pos_M + torch.repeat_interleave(start_YX - exclusive_cumsum(len_YX), len_YX, output_size=m)


def expert_ids_of_rows(counts_E: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Return e_R: the expert id of each expert-sorted row, from counts_E (`total` = R if known: no sync)."""
    n = int(counts_E.sum()) if total is None else total
    return torch.repeat_interleave(torch.arange(counts_E.numel(), device=counts_E.device),
                                   counts_E.to(torch.int64), output_size=n)


class TokenLevelMixin:
    """`dispatch_tokens` / `combine_tokens` for a row-level dispatcher: `fmoe.ops.permute` (permute-1),
    the row-level seam, `fmoe.ops.unpermute` (their inverse-permutation backwards included).

    Gives every dispatcher the token-level entry point the hierarchical one needs natively:

        x_MD, counts_L, meta = d.dispatch_tokens(x_TD, ids_TK, probs_TK)
        y_TD = d.combine_tokens(experts(x_MD, counts_L), meta)   # sum_k probs_TK[t, k] * y(t, k)
    """

    num_experts: int

    def dispatch_tokens(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, probs_TK: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Return (x_MD, counts_L, meta): this rank's expert rows for tokens routed by ids_TK."""
        layout = sort_layout(ids_TK, self.num_experts)  # permute-1: stable sort by expert id
        x_MD, counts_L, _, meta = self.dispatch(permute(x_TD, layout), layout.counts_E)
        return x_MD, counts_L, (meta, layout, probs_TK)

    def combine_tokens(self, y_MD: torch.Tensor, meta: Any) -> torch.Tensor:
        """Return y_TD [T, D]: expert outputs brought back, weighted by probs_TK (if given), summed over k."""
        inner, layout, probs_TK = meta
        return unpermute(self.combine(y_MD, inner), probs_TK, layout)
