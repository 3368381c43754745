"""cross_entropy: mean over non-ignored rows of -log softmax(logits)[target], with a closed-form backward.

Legend: N rows, V classes (vocabulary).
Math in fp32 (fp64 for fp64 logits); the loss is returned in that compute dtype, the logits gradient
in the logits dtype. Only the [N] log-sum-exp is saved besides the inputs; the backward recomputes
softmax from it: dlogits = (softmax - onehot(target)) * valid / count * g.
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _CrossEntropy(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(logits_NV: torch.Tensor, targets_N: torch.Tensor, ignore_index: int):
        lf_NV = logits_NV.to(_compute_dtype(logits_NV.dtype))
        valid_N = targets_N != ignore_index
        safe_N = torch.where(valid_N, targets_N, torch.zeros_like(targets_N))
        lse_N = torch.logsumexp(lf_NV, dim=-1)
        picked_N = lf_NV.gather(-1, safe_N.unsqueeze(-1)).squeeze(-1)
        # No host sync: the count stays on device; an all-ignored batch gives loss 0 (and zero grads).
        count = valid_N.sum().clamp(min=1).to(lf_NV.dtype)
        loss = torch.where(valid_N, lse_N - picked_N, torch.zeros_like(lse_N)).sum() / count
        return loss, lse_N

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits_NV, targets_N, ignore_index = inputs
        _, lse_N = output
        ctx.save_for_backward(logits_NV, targets_N, lse_N)
        ctx.ignore_index = ignore_index
        ctx.mark_non_differentiable(lse_N)

    @staticmethod
    def backward(ctx, g, _g_lse):
        logits_NV, targets_N, lse_N = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        lf_NV = logits_NV.to(lse_N.dtype)
        valid_N = targets_N != ctx.ignore_index
        safe_N = torch.where(valid_N, targets_N, torch.zeros_like(targets_N))
        count = valid_N.sum().clamp(min=1).to(lse_N.dtype)
        p_NV = torch.exp(lf_NV - lse_N.unsqueeze(-1))
        onehot_NV = torch.nn.functional.one_hot(safe_N, lf_NV.shape[-1]).to(lse_N.dtype)
        d_NV = (p_NV - onehot_NV) * (valid_N.to(lse_N.dtype) * (g / count)).unsqueeze(-1)
        return d_NV.to(logits_NV.dtype), None, None


def cross_entropy(logits_NV: torch.Tensor, targets_N: torch.Tensor, ignore_index: int = -100, *,
                  check_range: bool = True) -> torch.Tensor:
    """Return the scalar mean cross-entropy over rows whose target != ignore_index (0 when none are).

    `logits_NV` floating [N, V]; `targets_N` integer [N] with values in [0, V) or ignore_index. With
    `check_range` (default) that is verified with one host sync, raising ValueError; pass False inside
    vmap or to skip the sync. The loss is fp32 (fp64 for fp64 logits); the gradient w.r.t. logits is
    (softmax - onehot) / count, in the logits dtype. No class weights.
    """
    if logits_NV.dim() != 2 or not logits_NV.is_floating_point():
        raise ValueError(f"cross_entropy: logits must be a floating [N, V] tensor, got {logits_NV.dtype} "
                         f"of shape {tuple(logits_NV.shape)}")
    if targets_N.shape != logits_NV.shape[:1]:
        raise ValueError(f"cross_entropy: targets must have shape ({logits_NV.shape[0]},), "
                         f"got {tuple(targets_N.shape)}")
    if targets_N.is_floating_point() or targets_N.is_complex() or targets_N.dtype == torch.bool:
        raise ValueError(f"cross_entropy: targets must be an integer tensor, got {targets_N.dtype}")
    if logits_NV.shape[1] == 0:
        raise ValueError("cross_entropy: logits need at least one class (V >= 1)")
    if check_range and targets_N.numel():
        bad = (targets_N != ignore_index) & ((targets_N < 0) | (targets_N >= logits_NV.shape[1]))
        if bool(bad.any()):  # the one host sync
            raise ValueError(f"cross_entropy: targets must lie in [0, {logits_NV.shape[1]}) or equal "
                             f"ignore_index={ignore_index}; got {targets_N[bad][:8].tolist()}")
    loss, _ = _CrossEntropy.apply(logits_NV, targets_N.long(), int(ignore_index))
    return loss
