"""linear: y = x @ w (+ b), with weights stored [in, out] and a deferrable weight gradient.

Under split_vjp (its forward runs inside `fmoe.transforms.tape.recording`), a tape, or a torch.func
transform, the product is an autograd Function whose backward may defer dw to the tape; otherwise it is
the native matmul, whose backward is autograd's own (the same gradients, no Python per call).

Legend (the package's, docs/moe.md): X rows (any leading dims flattened), D input features, F output features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fmoe._compat import Function, functorch_active, needs_grad
from fmoe.transforms.tape import may_defer, weight_grad_or_defer


def _weight_grad(x_XD: torch.Tensor, g_XF: torch.Tensor) -> torch.Tensor:
    return x_XD.reshape(-1, x_XD.shape[-1]).t() @ g_XF.reshape(-1, g_XF.shape[-1])


def _weight_grad_into(out_DF: torch.Tensor, x_XD: torch.Tensor, g_XF: torch.Tensor) -> torch.Tensor:
    """out_DF += x^T g in one GEMM (beta = 1): no dw tensor, no separate pass to add it."""
    return out_DF.addmm_(x_XD.reshape(-1, x_XD.shape[-1]).t(), g_XF.reshape(-1, g_XF.shape[-1]))


@dataclass(frozen=True)
class Dense:
    """The dense product y = x @ w (leading dims of x kept) and its two backward products: what `linear`
    and the fused MLP products (_mlp_products.py) run."""

    def fwd(self, x_XD: torch.Tensor, w_DF: torch.Tensor) -> torch.Tensor:
        return x_XD @ w_DF

    def dx(self, g_XF: torch.Tensor, w_DF: torch.Tensor) -> torch.Tensor:
        return g_XF @ w_DF.t()

    def dw(self, x_XD: torch.Tensor, g_XF: torch.Tensor) -> torch.Tensor:
        return _weight_grad(x_XD, g_XF)

    def dw_into(self, out_DF: torch.Tensor, x_XD: torch.Tensor, g_XF: torch.Tensor) -> torch.Tensor:
        """Adds dw(x, g) into out_DF in place; returns out_DF."""
        return _weight_grad_into(out_DF, x_XD, g_XF)


DENSE = Dense()


class _Linear(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x_XD: torch.Tensor, w_DF: torch.Tensor) -> torch.Tensor:
        return DENSE.fwd(x_XD, w_DF)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_XD, w_DF = inputs
        ctx.save_for_backward(x_XD, w_DF)
        ctx.w_plain = w_DF  # the caller's tensor object: the tape keys deferral on it

    @staticmethod
    def backward(ctx, g_XF):
        x_XD, w_DF = ctx.saved_tensors
        dx = DENSE.dx(g_XF, w_DF) if needs_grad(ctx)[0] else None
        dw = None
        if needs_grad(ctx)[1]:
            dw = weight_grad_or_defer(ctx.w_plain, DENSE.dw, x_XD, g_XF, accumulate=DENSE.dw_into)
        return dx, dw


def linear(x_XD: torch.Tensor, w_DF: torch.Tensor, b_F: torch.Tensor | None = None) -> torch.Tensor:
    """Return y_XF = x_XD @ w_DF (+ b_F); leading dims of x are kept. The dw is deferrable."""
    if x_XD.shape[-1] != w_DF.shape[0]:
        raise ValueError(f"linear: x has {x_XD.shape[-1]} features, w is {tuple(w_DF.shape)} ([in, out])")
    if may_defer() or functorch_active():
        y = _Linear.apply(x_XD, w_DF)
    else:  # plain autograd and no tape: nothing can defer dw, so the native matmul (no Python backward)
        y = x_XD @ w_DF
    return y if b_F is None else y + b_F
