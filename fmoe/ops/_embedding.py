"""embedding: row lookup out[...] = table_VD[ids[...]], with a deferrable table gradient.

Legend (the package's, docs/moe.md): V vocabulary rows, D features, X ids (any shape; `ids_X` stands
for ids of any shape).
The table gradient is a scatter-add of the cotangent rows into a [V, D] zero tensor; while a
`split_vjp` tape defers the table, the dx pass records it as a thunk (ids have no gradient, so the
dx pass of an embedding does no work at all).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fmoe._compat import Function, functorch_active, needs_grad
from fmoe.ops import _grouped_linear  # HOST_READS_FREE, read at call time (tests empty it)
from fmoe.ops._dtypes import compute_dtype
from fmoe.transforms.tape import may_defer, weight_grad_or_defer


def _table_grad(ids_X: torch.Tensor, g_XD: torch.Tensor, V: int, dtype: torch.dtype) -> torch.Tensor:
    # Repeated ids accumulate: sum in fp32 for half-precision tables, then round once.
    acc = compute_dtype(dtype)
    D = g_XD.shape[-1]
    # Out of place: under vmap (per-example gradients) g is batched and an in-place add into the unbatched
    # zeros is not allowed; index_add's cost is the same.
    dt_VD = torch.zeros(V, D, dtype=acc, device=g_XD.device).index_add(0, ids_X.reshape(-1),
                                                                       g_XD.reshape(-1, D).to(acc))
    return dt_VD.to(dtype)


def _table_grad_into(out_VD: torch.Tensor, ids_X: torch.Tensor, g_XD: torch.Tensor, V: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """Adds _table_grad into out_VD in place; returns out_VD. A full-precision table's rows are added
    straight into it (no [V, D] zeros, no pass adding them); a half-precision one keeps its fp32 sum."""
    if compute_dtype(dtype) != dtype:
        return out_VD.add_(_table_grad(ids_X, g_XD, V, dtype))
    return out_VD.index_add_(0, ids_X.reshape(-1), g_XD.reshape(-1, g_XD.shape[-1]).to(dtype))


class _Embedding(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(ids_X: torch.Tensor, table_VD: torch.Tensor) -> torch.Tensor:
        return table_VD.index_select(0, ids_X.reshape(-1)).reshape(*ids_X.shape, table_VD.shape[-1])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ids_X, table_VD = inputs
        ctx.save_for_backward(ids_X)
        ctx.V, ctx.dtype = table_VD.shape[0], table_VD.dtype
        ctx.w_plain = table_VD  # the caller's tensor object: the tape keys deferral on it

    @staticmethod
    def backward(ctx, g_XD):
        (ids_X,) = ctx.saved_tensors
        dtable = None
        if needs_grad(ctx)[1]:
            dtable = weight_grad_or_defer(ctx.w_plain, _table_grad, ids_X, g_XD, ctx.V, ctx.dtype,
                                          accumulate=_table_grad_into)
        return None, dtable


def embedding(ids_X: torch.Tensor, table_VD: torch.Tensor, *, check_range: bool = True) -> torch.Tensor:
    """Return out_XD = table_VD[ids_X] with shape ids.shape + (D,), in the table's dtype.

    `ids_X` is an integer tensor of any shape with values in [0, V). With `check_range` (default) the
    range is verified with one host sync (ids.min/max), raising ValueError (on an accelerator with a
    device-side assert, no sync); pass False inside vmap or
    to skip the sync (under tape autograd on CPU aten's own bounds check stands in, at no cost).
    Differentiable in the table only; its gradient is deferrable on a tape.
    """
    if ids_X.is_floating_point() or ids_X.is_complex() or ids_X.dtype == torch.bool:
        raise ValueError(f"embedding: ids must be an integer tensor, got {ids_X.dtype}")
    if table_VD.dim() != 2 or not table_VD.is_floating_point():
        raise ValueError(f"embedding: table must be a floating [V, D] tensor, got {table_VD.dtype} "
                         f"of shape {tuple(table_VD.shape)}")
    native = table_VD.device.type == "cpu" and table_VD.dtype == compute_dtype(table_VD.dtype)
    if native and not (may_defer() or functorch_active()):
        # Plain autograd on CPU, a full-precision table and no tape: aten's embedding, whose backward (a
        # serial, so deterministic, scatter-add on CPU) is autograd's own; devices keep the Function's
        # index_add_, half-precision tables its fp32 sum. aten bounds-checks the ids itself; its
        # IndexError becomes the ValueError of _check_ids.
        try:
            return F.embedding(ids_X.long(), table_VD)
        except IndexError:
            _check_ids(ids_X, table_VD.shape[0])
            raise
    if check_range:
        _check_ids(ids_X, table_VD.shape[0])
    return _Embedding.apply(ids_X.long(), table_VD)


def _check_ids(ids_X: torch.Tensor, V: int) -> None:
    """Raise ValueError unless every id lies in [0, V) (one host sync for both bounds). On an accelerator
    a device-side assert instead, so the host can run ahead (a bad id fails at the next sync, as aten's
    own index kernels do there)."""
    if not ids_X.numel() or _grouped_linear.traced():
        return  # under vmap / compile the ids have no data to read; aten's index kernel checks them itself
    if ids_X.device.type not in _grouped_linear.HOST_READS_FREE:
        torch._assert_async(((ids_X >= 0) & (ids_X < V)).all(), f"embedding: ids must lie in [0, {V})")
        return
    lo, hi = torch.stack(list(torch.aminmax(ids_X))).tolist()
    if lo < 0 or hi >= V:
        raise ValueError(f"embedding: ids must lie in [0, {V}), got min {lo}, max {hi}")
