"""linear: y = x @ w (+ b), with weights stored [in, out] and a deferrable weight gradient.

Legend: N rows (any leading dims flattened), D input features, F output features.
"""

from __future__ import annotations

import torch

from fmoe.transforms.tape import defer_weight_grad, plain


def _weight_grad(x_ND: torch.Tensor, g_NF: torch.Tensor) -> torch.Tensor:
    return x_ND.reshape(-1, x_ND.shape[-1]).t() @ g_NF.reshape(-1, g_NF.shape[-1])


class _Linear(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x_ND: torch.Tensor, w_DF: torch.Tensor) -> torch.Tensor:
        return x_ND @ w_DF

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_ND, w_DF = inputs
        ctx.save_for_backward(x_ND, w_DF)
        ctx.w_plain = w_DF  # the caller's tensor object: the tape keys deferral on it

    @staticmethod
    def backward(ctx, g_NF):
        x_ND, w_DF = ctx.saved_tensors
        dx = g_NF @ w_DF.t() if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            x_keep, g_keep = plain(x_ND), plain(g_NF)
            dw = defer_weight_grad(ctx.w_plain, lambda: _weight_grad(x_keep, g_keep))
            if dw is None:
                dw = _weight_grad(x_ND, g_NF)
        return dx, dw


def linear(x_ND: torch.Tensor, w_DF: torch.Tensor, b_F: torch.Tensor | None = None) -> torch.Tensor:
    """Return y_NF = x_ND @ w_DF (+ b_F); leading dims of x are kept. The dw is deferrable."""
    if x_ND.shape[-1] != w_DF.shape[0]:
        raise ValueError(f"linear: x has {x_ND.shape[-1]} features, w is {tuple(w_DF.shape)} ([in, out])")
    y = _Linear.apply(x_ND, w_DF)
    return y if b_F is None else y + b_F
