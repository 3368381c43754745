"""rms_norm: y = x / sqrt(mean(x^2) + eps) * scale, computed in fp32 (fp64 for fp64 input).

Legend (the package's, docs/moe.md): X rows (any leading dims), D features.
The scale gradient is produced in the dx pass (it is small: a D-vector), never deferred on the tape.
Under torch.func transforms an autograd Function (recomputing rstd in its backward); under tape
autograd aten's fused rms_norm on the fp32 copy, with its own backward (no Python per call).
"""

from __future__ import annotations

import torch

from fmoe._compat import Function, functorch_active, needs_grad
from fmoe.ops._dtypes import cast, compute_dtype


class _RMSNorm(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x_XD: torch.Tensor, scale_D: torch.Tensor, eps: float) -> torch.Tensor:
        ct = compute_dtype(x_XD.dtype)
        xf_XD = x_XD.to(ct)
        rstd_N1 = torch.rsqrt(xf_XD.pow(2).mean(-1, keepdim=True) + eps)
        return (xf_XD * rstd_N1 * scale_D.to(ct)).to(x_XD.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_XD, scale_D, eps = inputs
        ctx.save_for_backward(x_XD, scale_D)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, g_XD):
        x_XD, scale_D = ctx.saved_tensors
        ct = compute_dtype(x_XD.dtype)
        # rstd is recomputed (one reduction) rather than saved: saves an [X, 1] fp32 tensor per call.
        xf_XD = x_XD.to(ct)
        rstd_N1 = torch.rsqrt(xf_XD.pow(2).mean(-1, keepdim=True) + ctx.eps)
        xhat_XD = xf_XD * rstd_N1
        gf_XD = g_XD.to(ct)
        dx = dscale = None
        if needs_grad(ctx)[0]:
            dxhat_XD = gf_XD * scale_D.to(ct)
            dx = (rstd_N1 * (dxhat_XD - xhat_XD * (dxhat_XD * xhat_XD).mean(-1, keepdim=True))).to(x_XD.dtype)
        if needs_grad(ctx)[1]:
            dscale = (gf_XD * xhat_XD).reshape(-1, x_XD.shape[-1]).sum(0).to(scale_D.dtype)
        return dx, dscale, None


def rms_norm(x_XD: torch.Tensor, scale_D: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Return y_XD = x_XD * rsqrt(mean(x_XD^2, -1) + eps) * scale_D, in x's dtype and shape.

    Leading dims of x are kept. Math in fp32 (fp64 for fp64 inputs). Differentiable in x and scale;
    the scale gradient comes in the dx pass.
    """
    if x_XD.dim() < 1 or not x_XD.is_floating_point():
        raise ValueError(f"rms_norm: x must be a floating tensor with a feature dim, got {x_XD.dtype} "
                         f"of shape {tuple(x_XD.shape)}")
    if scale_D.shape != (x_XD.shape[-1],):
        raise ValueError(f"rms_norm: scale must have shape ({x_XD.shape[-1]},), got {tuple(scale_D.shape)}")
    if not scale_D.is_floating_point():
        raise ValueError(f"rms_norm: scale must be floating point, got {scale_D.dtype}")
    if not eps >= 0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps}")
    if not functorch_active():
        # Tape autograd: aten's fused rms_norm on the fp32 copy (its own backward; the scale gradient is
        # never deferred, so nothing needs the Function's Python backward here).
        ct = compute_dtype(x_XD.dtype)
        return cast(torch.nn.functional.rms_norm(cast(x_XD, ct), (x_XD.shape[-1],), cast(scale_D, ct),
                                                 float(eps)), x_XD.dtype)
    return _RMSNorm.apply(x_XD, scale_D, float(eps))
