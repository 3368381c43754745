"""cross_entropy against float64 tape autograd of an explicit -log softmax mean with a python loop.

Legend: N rows, V classes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.ops import cross_entropy
from fmoe.transforms.testing import assert_close, check_vjp, float_dtypes


def make(N, V, dtype, ignore_frac, seed):
    g = torch.Generator().manual_seed(seed)
    logits_NV = (torch.randn(N, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    targets_N = torch.randint(0, V, (N,), generator=g)
    ignored = torch.rand(N, generator=g) < ignore_frac
    return logits_NV, torch.where(ignored, torch.full_like(targets_N, -100), targets_N)


def oracle(logits_NV, targets_N, ignore_index=-100):
    """(loss, dlogits) in float64: mean over kept rows of log(sum exp) - logit[target]."""
    l64 = logits_NV.double().requires_grad_()
    terms = [torch.log(torch.exp(l64[n]).sum()) - l64[n, t] for n, t in enumerate(targets_N.tolist())
             if t != ignore_index]
    loss = torch.stack(terms).mean() if terms else (l64 * 0).sum()
    return loss.detach(), torch.autograd.grad(loss, l64)[0]


@settings(max_examples=30, deadline=None)
@example(N=3, V=4, dtype=torch.float32, ignore_frac=1.0, seed=0)  # every row ignored: loss 0, grad 0
@example(N=0, V=3, dtype=torch.float64, ignore_frac=0.0, seed=0)
@example(N=1, V=1, dtype=torch.bfloat16, ignore_frac=0.0, seed=0)
@given(N=st.integers(0, 8), V=st.integers(1, 9), dtype=float_dtypes, ignore_frac=st.sampled_from([0.0, 0.3]),
       seed=st.integers(0, 2**31 - 1))
def test_matches_oracle(N, V, dtype, ignore_frac, seed) -> None:
    logits_NV, targets_N = make(N, V, dtype, ignore_frac, seed)
    loss_ref, d_ref = oracle(logits_NV, targets_N)
    loss, vjp_fn = torch.func.vjp(lambda lg: cross_entropy(lg, targets_N), logits_NV)
    assert loss.shape == () and loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # the loss is computed in fp32 from the (possibly bf16) logits: compare with fp32 tolerances
    assert_close(loss, loss_ref, dtype=torch.float64 if dtype == torch.float64 else torch.float32, scale=5.0)
    (d,) = vjp_fn(torch.tensor(1.7, dtype=loss.dtype))
    assert d.dtype == dtype
    assert_close(d, d_ref * 1.7, dtype=dtype)
    # plain tape autograd: aten's fused cross-entropy, summed over the kept rows / their count
    lg = logits_NV.detach().requires_grad_(True)
    loss_ag = cross_entropy(lg, targets_N)
    assert loss_ag.shape == () and loss_ag.dtype == loss.dtype
    assert_close(loss_ag, loss_ref, dtype=loss.dtype, scale=5.0)
    (d_ag,) = torch.autograd.grad(loss_ag, lg, torch.tensor(1.7, dtype=loss.dtype))
    assert d_ag.dtype == dtype
    assert_close(d_ag, d_ref * 1.7, dtype=dtype)


def test_matches_torch_and_large_logits() -> None:
    logits_NV = torch.tensor([[1000.0, 0.0, -1000.0], [5.0, 5.0, 5.0]], dtype=torch.float64)
    targets_N = torch.tensor([2, 1])
    loss, d = torch.func.grad_and_value(lambda lg: cross_entropy(lg, targets_N))(logits_NV)[::-1]
    expected = torch.nn.functional.cross_entropy(logits_NV, targets_N)
    assert_close(loss, expected)
    assert torch.isfinite(d).all()


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_finite_differences_float64(seed) -> None:
    logits_NV, targets_N = make(5, 4, torch.float64, 0.3, seed)
    check_vjp(lambda lg: cross_entropy(lg, targets_N), logits_NV)


def test_custom_ignore_index_and_vmap() -> None:
    logits_BNV = torch.randn(2, 4, 3, dtype=torch.float64)
    targets_N = torch.tensor([0, 7, 2, 1])
    got = torch.func.vmap(lambda lg: cross_entropy(lg, targets_N, ignore_index=7, check_range=False))(
        logits_BNV)
    ref = torch.stack([oracle(lg, targets_N, ignore_index=7)[0] for lg in logits_BNV])
    assert_close(got, ref)


@pytest.mark.parametrize(
    ("logits", "targets", "match"),
    [
        (torch.zeros(3), torch.zeros(3, dtype=torch.long), r"\[X, V\]"),
        (torch.zeros(3, 2), torch.zeros(2, dtype=torch.long), "shape"),
        (torch.zeros(3, 2), torch.zeros(3), "integer"),
        (torch.zeros(3, 2), torch.tensor([0, 2, 1]), r"\[0, 2\)"),
        (torch.zeros(3, 2), torch.tensor([0, -5, 1]), "ignore_index"),
        (torch.zeros(2, 0), torch.tensor([0, 0]), "V >= 1"),
    ],
)
def test_errors(logits, targets, match) -> None:
    with pytest.raises(ValueError, match=match):
        cross_entropy(logits, targets)


def test_range_error_under_torch_func() -> None:
    # The Function path (torch.func) checks the targets itself: the same ValueError as aten's path.
    with pytest.raises(ValueError, match="ignore_index"):
        torch.func.grad(lambda lg: cross_entropy(lg, torch.tensor([0, 2, 1])))(torch.zeros(3, 2))
