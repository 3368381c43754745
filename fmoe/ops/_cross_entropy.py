"""cross_entropy: mean over non-ignored rows of -log softmax(logits)[target], with a closed-form backward.

Legend (the package's, docs/moe.md): X rows, V classes (vocabulary).
Math in fp32 (fp64 for fp64 logits); the loss is returned in that compute dtype, the logits gradient
in the logits dtype. Only the [X] log-sum-exp is saved besides the inputs; the backward recomputes
softmax from it: dlogits = (softmax - onehot(target)) * valid / count * g. That Function serves the
torch.func transforms; under tape autograd aten's fused cross-entropy runs instead (3x faster at small
shapes), with the same sum-over-count reduction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fmoe._compat import Function, functorch_active, needs_grad
from fmoe.ops import _grouped_linear  # HOST_READS_FREE, read at call time (tests empty it)
from fmoe.ops._dtypes import compute_dtype


class _CrossEntropy(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(logits_XV: torch.Tensor, targets_X: torch.Tensor, ignore_index: int):
        lf_XV = logits_XV.to(compute_dtype(logits_XV.dtype))
        valid_X = targets_X != ignore_index
        safe_X = torch.where(valid_X, targets_X, torch.zeros_like(targets_X))
        lse_X = torch.logsumexp(lf_XV, dim=-1)
        picked_X = lf_XV.gather(-1, safe_X.unsqueeze(-1)).squeeze(-1)
        # No host sync: the count stays on device; an all-ignored batch gives loss 0 (and zero grads).
        count = valid_X.sum().clamp(min=1).to(lf_XV.dtype)
        loss = torch.where(valid_X, lse_X - picked_X, torch.zeros_like(lse_X)).sum() / count
        return loss, lse_X

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits_XV, targets_X, ignore_index = inputs
        _, lse_X = output
        ctx.save_for_backward(logits_XV, targets_X, lse_X)
        ctx.ignore_index = ignore_index
        ctx.mark_non_differentiable(lse_X)

    @staticmethod
    def backward(ctx, g, _g_lse):
        logits_XV, targets_X, lse_X = ctx.saved_tensors
        if not needs_grad(ctx)[0]:
            return None, None, None
        lf_XV = logits_XV.to(lse_X.dtype)
        valid_X = targets_X != ctx.ignore_index
        safe_X = torch.where(valid_X, targets_X, torch.zeros_like(targets_X))
        count = valid_X.sum().clamp(min=1).to(lse_X.dtype)
        p_XV = torch.exp(lf_XV - lse_X.unsqueeze(-1))
        # A comparison, not F.one_hot: one_hot reads the targets' range to the host, which vmap cannot.
        classes_V = torch.arange(lf_XV.shape[-1], device=lf_XV.device)
        onehot_XV = (safe_X.unsqueeze(-1) == classes_V).to(lse_X.dtype)
        d_XV = (p_XV - onehot_XV) * (valid_X.to(lse_X.dtype) * (g / count)).unsqueeze(-1)
        return d_XV.to(logits_XV.dtype), None, None


def cross_entropy(logits_XV: torch.Tensor, targets_X: torch.Tensor, ignore_index: int = -100, *,
                  check_range: bool = True) -> torch.Tensor:
    """Return the scalar mean cross-entropy over rows whose target != ignore_index (0 when none are).

    `logits_XV` floating [X, V]; `targets_X` integer [X] with values in [0, V) or ignore_index. With
    `check_range` (default) that is verified with one host sync, raising ValueError (on an accelerator
    with a device-side assert, no sync); pass False inside
    vmap or to skip the sync (under tape autograd on CPU aten's own bounds check stands in, at no cost,
    and a bad target still raises the ValueError). The loss is fp32 (fp64 for fp64 logits); the gradient
    w.r.t. logits is (softmax - onehot) / count, in the logits dtype. No class weights.
    """
    if logits_XV.dim() != 2 or not logits_XV.is_floating_point():
        raise ValueError(f"cross_entropy: logits must be a floating [X, V] tensor, got {logits_XV.dtype} "
                         f"of shape {tuple(logits_XV.shape)}")
    if targets_X.shape != logits_XV.shape[:1]:
        raise ValueError(f"cross_entropy: targets must have shape ({logits_XV.shape[0]},), "
                         f"got {tuple(targets_X.shape)}")
    if targets_X.is_floating_point() or targets_X.is_complex() or targets_X.dtype == torch.bool:
        raise ValueError(f"cross_entropy: targets must be an integer tensor, got {targets_X.dtype}")
    if logits_XV.shape[1] == 0:
        raise ValueError("cross_entropy: logits need at least one class (V >= 1)")
    V = logits_XV.shape[1]
    tape_autograd = not functorch_active()
    if check_range and not (tape_autograd and logits_XV.device.type == "cpu"):
        _check_targets(targets_X, V, ignore_index)
    if tape_autograd:
        # Tape autograd: aten's fused log-softmax + NLL and their backwards (the same gradient, no Python
        # per call), summed and divided by the kept count so that an all-ignored batch is 0, not NaN.
        # On CPU aten bounds-checks the targets itself; its IndexError becomes the ValueError below.
        lf_XV = logits_XV.to(compute_dtype(logits_XV.dtype))
        count = (targets_X != ignore_index).sum().clamp(min=1).to(lf_XV.dtype)
        try:
            total = F.cross_entropy(lf_XV, targets_X.long(), ignore_index=int(ignore_index), reduction="sum")
        except IndexError:
            _check_targets(targets_X, V, ignore_index)
            raise
        return total / count
    loss, _ = _CrossEntropy.apply(logits_XV, targets_X.long(), int(ignore_index))
    return loss


def _check_targets(targets_X: torch.Tensor, V: int, ignore_index: int) -> None:
    """Raise ValueError unless every target lies in [0, V) or equals ignore_index (one host sync). On an
    accelerator a device-side assert instead, so the host can run ahead."""
    if not targets_X.numel() or _grouped_linear.traced():
        return  # under vmap / compile no data to read: the gather's own bounds check raises instead
    if targets_X.device.type not in _grouped_linear.HOST_READS_FREE:
        ok = ((targets_X == ignore_index) | ((targets_X >= 0) & (targets_X < V))).all()
        torch._assert_async(ok, f"cross_entropy: targets must lie in [0, {V}) or equal ignore_index")
        return
    lo, hi = torch.aminmax(torch.where(targets_X == ignore_index, 0, targets_X))
    lo, hi = torch.stack([lo, hi]).tolist()  # both bounds of the kept targets at once
    if lo < 0 or hi >= V:
        bad = (targets_X != ignore_index) & ((targets_X < 0) | (targets_X >= V))
        raise ValueError(f"cross_entropy: targets must lie in [0, {V}) or equal "
                         f"ignore_index={ignore_index}; got {targets_X[bad][:8].tolist()}")
