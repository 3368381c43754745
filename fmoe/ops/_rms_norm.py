"""rms_norm: y = x / sqrt(mean(x^2) + eps) * scale, computed in fp32 (fp64 for fp64 input).

Legend: N rows (any leading dims), D features.
The scale gradient is produced in the dx pass (it is small: a D-vector), never deferred on the tape.
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _RMSNorm(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x_ND: torch.Tensor, scale_D: torch.Tensor, eps: float) -> torch.Tensor:
        ct = _compute_dtype(x_ND.dtype)
        xf_ND = x_ND.to(ct)
        rstd_N1 = torch.rsqrt(xf_ND.pow(2).mean(-1, keepdim=True) + eps)
        return (xf_ND * rstd_N1 * scale_D.to(ct)).to(x_ND.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_ND, scale_D, eps = inputs
        ctx.save_for_backward(x_ND, scale_D)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, g_ND):
        x_ND, scale_D = ctx.saved_tensors
        ct = _compute_dtype(x_ND.dtype)
        # rstd is recomputed (one reduction) rather than saved: saves an [N, 1] fp32 tensor per call.
        xf_ND = x_ND.to(ct)
        rstd_N1 = torch.rsqrt(xf_ND.pow(2).mean(-1, keepdim=True) + ctx.eps)
        xhat_ND = xf_ND * rstd_N1
        gf_ND = g_ND.to(ct)
        dx = dscale = None
        if ctx.needs_input_grad[0]:
            dxhat_ND = gf_ND * scale_D.to(ct)
            dx = (rstd_N1 * (dxhat_ND - xhat_ND * (dxhat_ND * xhat_ND).mean(-1, keepdim=True))).to(x_ND.dtype)
        if ctx.needs_input_grad[1]:
            dscale = (gf_ND * xhat_ND).reshape(-1, x_ND.shape[-1]).sum(0).to(scale_D.dtype)
        return dx, dscale, None


def rms_norm(x_ND: torch.Tensor, scale_D: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Return y_ND = x_ND * rsqrt(mean(x_ND^2, -1) + eps) * scale_D, in x's dtype and shape.

    Leading dims of x are kept. Math in fp32 (fp64 for fp64 inputs). Differentiable in x and scale;
    the scale gradient comes in the dx pass.
    """
    if x_ND.dim() < 1 or not x_ND.is_floating_point():
        raise ValueError(f"rms_norm: x must be a floating tensor with a feature dim, got {x_ND.dtype} "
                         f"of shape {tuple(x_ND.shape)}")
    if scale_D.shape != (x_ND.shape[-1],):
        raise ValueError(f"rms_norm: scale must have shape ({x_ND.shape[-1]},), got {tuple(scale_D.shape)}")
    if not scale_D.is_floating_point():
        raise ValueError(f"rms_norm: scale must be floating point, got {scale_D.dtype}")
    if not eps >= 0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps}")
    return _RMSNorm.apply(x_ND, scale_D, float(eps))
