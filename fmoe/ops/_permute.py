"""permute / unpermute: token rows to expert-sorted rows and back, with inverse-permutation backwards.

    layout = sort_layout(ids_TK, E)                   # stable sort of the flattened expert ids
    x_MD = permute(x_TD, layout)                       # row m is token row_src_M[m] // K (index_select)
    y_TD = unpermute(y_MD, probs_TK, layout)           # sum_k probs[t, k] * y[row_dst_N[t * K + k]]

Legend: T tokens, D features, K experts per token, N = T * K (token, slot) pairs (n = t * K + k),
M rows of the expert-sorted layout, E experts.

A `Layout` is two index vectors that are inverse to each other on the kept pairs:
- row_src_M [M]: the pair n feeding row m, or N for a padding row (drop-and-pad);
- row_dst_N [N]: the row of pair n, or M when the pair was dropped.
Dropless: M = N and both are permutations. Capacity drop: M < N, dropped pairs point at M.
Drop-and-pad: M = E * C, expert e owns rows [e*C, (e+1)*C), unused rows are padding.
Every forward and backward is one `index_select` of rows from a source extended by one zero row
(index N//K = T, or M), so padding and dropped pairs read zeros: no scatter, no expanded index, no
generic index autograd. The backward of permute is the inverse permutation (row_dst) followed by the
sum over the K slots; the backward of unpermute is the forward permutation (row_src).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Expert-sorted row layout of N = T*K (token, slot) pairs. See the module docstring.

    row_src_M: int64 [M]; row_dst_N: int64 [N]; tok_M: int64 [M] = row_src_M // K (T for padding);
    counts_E: int64 [E] rows per expert in the layout (C each when padded), on the ids' device;
    counts: the same as python ints when known on the host without a sync (padded layouts), else None;
    num_tokens T; top_k K; full: True when both index vectors are permutations of [0, N) (dropless),
    so no zero row is ever read.
    """

    row_src_M: torch.Tensor
    row_dst_N: torch.Tensor
    tok_M: torch.Tensor
    counts_E: torch.Tensor
    counts: tuple[int, ...] | None
    num_tokens: int
    top_k: int
    full: bool = False

    @property
    def num_rows(self) -> int:
        """M, the number of rows of the layout."""
        return self.row_src_M.shape[0]


def _inverse(order_N: torch.Tensor) -> torch.Tensor:
    inv_N = torch.empty_like(order_N)
    inv_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    return inv_N


def sort_layout(ids_TK: torch.Tensor, num_experts: int) -> Layout:
    """Return the dropless layout: pairs stably sorted by expert id (ties keep token order). No host sync."""
    T, K = ids_TK.shape
    ids_N = ids_TK.reshape(-1)
    order_N = torch.sort(ids_N, stable=True).indices
    counts_E = torch.bincount(ids_N, minlength=num_experts)
    return Layout(row_src_M=order_N, row_dst_N=_inverse(order_N), tok_M=order_N // K, counts_E=counts_E,
                  counts=None, num_tokens=T, top_k=K, full=True)


def _zero_row(x_RD: torch.Tensor) -> torch.Tensor:
    return torch.cat([x_RD, x_RD.new_zeros(1, *x_RD.shape[1:])])


def _rows(x_RD: torch.Tensor, index_I: torch.Tensor, full: bool) -> torch.Tensor:
    """x_RD[index_I] where index R means a zero row; `full` (a permutation, no sentinel) skips the
    copy that appends the zero row."""
    return x_RD.index_select(0, index_I) if full else _zero_row(x_RD).index_select(0, index_I)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(x_TD, tok_M, row_dst_N, K, full):
        return _rows(x_TD, tok_M, full)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_TD, tok_M, row_dst_N, K, full = inputs
        ctx.save_for_backward(row_dst_N)
        ctx.T, ctx.K, ctx.full = x_TD.shape[0], K, full

    @staticmethod
    def backward(ctx, g_MD):
        (row_dst_N,) = ctx.saved_tensors
        # Inverse permutation: the row of each (t, k) pair (dropped pairs read the zero row), then sum over k.
        g_NX = _rows(g_MD, row_dst_N, ctx.full)
        g_TKX = g_NX.reshape(ctx.T, ctx.K, *g_MD.shape[1:])
        if ctx.K == 1:
            dx = g_TKX[:, 0]
        else:
            dx = g_TKX.to(_acc_dtype(g_MD.dtype)).sum(1).to(g_MD.dtype)
        return dx, None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(y_MD, probs_TK, row_src_M, row_dst_N, tok_M, T, K, full):
        y_TKD = _rows(y_MD, row_dst_N, full).reshape(T, K, y_MD.shape[-1])
        acc = _acc_dtype(y_MD.dtype)
        if probs_TK is None:
            return y_TKD.to(acc).sum(1).to(y_MD.dtype)
        # [T, 1, K] @ [T, K, D]: the weighted sum over the K slots as one batched matmul.
        return torch.bmm(probs_TK.to(acc).unsqueeze(1), y_TKD.to(acc)).squeeze(1).to(y_MD.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        y_MD, probs_TK, row_src_M, row_dst_N, tok_M, T, K, full = inputs
        ctx.weighted = probs_TK is not None
        ctx.save_for_backward(y_MD, probs_TK if ctx.weighted else None, row_src_M, row_dst_N, tok_M)
        ctx.T, ctx.K, ctx.full = T, K, full

    @staticmethod
    def backward(ctx, g_TD):
        y_MD, probs_TK, row_src_M, row_dst_N, tok_M = ctx.saved_tensors
        T, K = ctx.T, ctx.K
        acc = _acc_dtype(y_MD.dtype)
        dy = dprobs = None
        if ctx.needs_input_grad[0]:
            # Forward permutation: row m gets the cotangent of its token, times its gate weight.
            g_MD = _rows(g_TD, tok_M, ctx.full)
            if ctx.weighted:
                p_M = _rows(probs_TK.reshape(-1, 1), row_src_M, ctx.full)
                g_MD = (g_MD.to(acc) * p_M.to(acc)).to(y_MD.dtype)
            dy = g_MD
        if ctx.weighted and ctx.needs_input_grad[1]:
            # d probs[t, k] = <g[t], y[row of (t, k)]>; the rows are re-gathered rather than saved.
            y_TKD = _rows(y_MD, row_dst_N, ctx.full).reshape(T, K, y_MD.shape[-1])
            dprobs = torch.bmm(y_TKD.to(acc), g_TD.to(acc).unsqueeze(-1)).squeeze(-1).to(probs_TK.dtype)
        return dy, dprobs, None, None, None, None, None, None


def permute(x_TD: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Return x_MD: row m is x_TD[layout.tok_M[m]] (zeros for padding rows). Differentiable in x."""
    if x_TD.shape[0] != layout.num_tokens:
        raise ValueError(f"permute: x has {x_TD.shape[0]} rows, layout is for {layout.num_tokens} tokens")
    return _Permute.apply(x_TD, layout.tok_M, layout.row_dst_N, layout.top_k, layout.full)


def permute_probs(probs_TK: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Return probs_M: the gate weight of each layout row (0 for padding rows). Differentiable."""
    p_N1 = probs_TK.reshape(-1, 1)
    return _Permute.apply(p_N1, layout.row_src_M, layout.row_dst_N, 1, layout.full).reshape(-1)


def unpermute(y_MD: torch.Tensor, probs_TK: torch.Tensor | None, layout: Layout) -> torch.Tensor:
    """Return y_TD = sum_k probs_TK[t, k] * y_MD[row of (t, k)] (dropped pairs add 0), in y's dtype.

    With probs_TK None the K rows are summed unweighted (gate weights already applied in the expert).
    The weighted sum accumulates in fp32 (fp64 for fp64). Differentiable in y and probs.
    """
    if y_MD.shape[0] != layout.num_rows:
        raise ValueError(f"unpermute: y has {y_MD.shape[0]} rows, layout has {layout.num_rows}")
    if probs_TK is not None and probs_TK.shape != (layout.num_tokens, layout.top_k):
        raise ValueError(f"unpermute: probs must be [{layout.num_tokens}, {layout.top_k}], got "
                         f"{tuple(probs_TK.shape)}")
    return _Unpermute.apply(y_MD, probs_TK, layout.row_src_M, layout.row_dst_N, layout.tok_M,
                            layout.num_tokens, layout.top_k, layout.full)
