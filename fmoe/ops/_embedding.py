"""embedding: row lookup out[...] = table_VD[ids[...]], with a deferrable table gradient.

Legend: V vocabulary rows, D features, N ids (any shape; `ids_N` stands for ids of any shape).
The table gradient is a scatter-add of the cotangent rows into a [V, D] zero tensor; while a
`split_vjp` tape defers the table, the dx pass records it as a thunk (ids have no gradient, so the
dx pass of an embedding does no work at all).
"""

from __future__ import annotations

import torch

from fmoe.transforms.tape import defer_weight_grad, plain


def _table_grad(ids_N: torch.Tensor, g_ND: torch.Tensor, V: int, dtype: torch.dtype) -> torch.Tensor:
    # Repeated ids accumulate: sum in fp32 for half-precision tables, then round once.
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    D = g_ND.shape[-1]
    dt_VD = torch.zeros(V, D, dtype=acc, device=g_ND.device)
    dt_VD.index_add_(0, ids_N.reshape(-1), g_ND.reshape(-1, D).to(acc))
    return dt_VD.to(dtype)


class _Embedding(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(ids_N: torch.Tensor, table_VD: torch.Tensor) -> torch.Tensor:
        return table_VD.index_select(0, ids_N.reshape(-1)).reshape(*ids_N.shape, table_VD.shape[-1])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ids_N, table_VD = inputs
        ctx.save_for_backward(ids_N)
        ctx.V, ctx.dtype = table_VD.shape[0], table_VD.dtype
        ctx.w_plain = table_VD  # the caller's tensor object: the tape keys deferral on it

    @staticmethod
    def backward(ctx, g_ND):
        (ids_N,) = ctx.saved_tensors
        dtable = None
        if ctx.needs_input_grad[1]:
            ids_keep, g_keep, V, dtype = plain(ids_N), plain(g_ND), ctx.V, ctx.dtype
            dtable = defer_weight_grad(ctx.w_plain, lambda: _table_grad(ids_keep, g_keep, V, dtype))
            if dtable is None:
                dtable = _table_grad(ids_N, g_ND, V, dtype)
        return None, dtable


def embedding(ids_N: torch.Tensor, table_VD: torch.Tensor, *, check_range: bool = True) -> torch.Tensor:
    """Return out_ND = table_VD[ids_N] with shape ids.shape + (D,), in the table's dtype.

    `ids_N` is an integer tensor of any shape with values in [0, V). With `check_range` (default) the
    range is verified with one host sync (ids.min/max), raising ValueError; pass False inside vmap or
    to skip the sync. Differentiable in the table only; its gradient is deferrable on a tape.
    """
    if ids_N.is_floating_point() or ids_N.is_complex() or ids_N.dtype == torch.bool:
        raise ValueError(f"embedding: ids must be an integer tensor, got {ids_N.dtype}")
    if table_VD.dim() != 2 or not table_VD.is_floating_point():
        raise ValueError(f"embedding: table must be a floating [V, D] tensor, got {table_VD.dtype} "
                         f"of shape {tuple(table_VD.shape)}")
    if check_range and ids_N.numel():
        lo, hi = torch.aminmax(ids_N)
        lo, hi = torch.stack([lo, hi]).tolist()  # one host sync for both bounds
        if lo < 0 or hi >= table_VD.shape[0]:
            raise ValueError(f"embedding: ids must lie in [0, {table_VD.shape[0]}), got min {lo}, max {hi}")
    return _Embedding.apply(ids_N.long(), table_VD)
