"""rms_norm against float64 tape autograd of the textbook formula; scale grad in the dx pass of split_vjp.

Legend: B batch, N rows, D features.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.ops import rms_norm
from fmoe.transforms.split_vjp import split_vjp
from fmoe.transforms.testing import assert_close, check_vjp, float_dtypes

shapes = st.tuples(st.lists(st.integers(0, 4), min_size=0, max_size=2).map(tuple), st.integers(1, 9))


def make(lead, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, D, generator=g, dtype=torch.float64) * 3).to(dtype)
    scale_D = (1 + 0.3 * torch.randn(D, generator=g, dtype=torch.float64)).to(dtype)
    ct = torch.randn(*lead, D, generator=g, dtype=torch.float64).to(dtype)
    return x, scale_D, ct


def oracle(x, scale_D, ct, eps):
    x64, s64 = x.double().requires_grad_(), scale_D.double().requires_grad_()
    y = x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / x64.shape[-1] + eps) * s64
    return (y.detach(), *torch.autograd.grad(y, (x64, s64), ct.double()))


@settings(max_examples=30, deadline=None)
@example(shape=((0,), 4), dtype=torch.float32, eps=1e-6, seed=0)
@example(shape=((), 1), dtype=torch.float64, eps=1e-6, seed=0)
@example(shape=((2, 3), 8), dtype=torch.bfloat16, eps=0.1, seed=3)
@given(shape=shapes, dtype=float_dtypes, eps=st.sampled_from([1e-6, 1e-2]), seed=st.integers(0, 2**31 - 1))
def test_matches_oracle_vjp_and_split(shape, dtype, eps, seed) -> None:
    lead, D = shape
    x, scale_D, ct = make(lead, D, dtype, seed)
    ref = oracle(x, scale_D, ct, eps)
    y, vjp_fn = torch.func.vjp(lambda x, s: rms_norm(x, s, eps), x, scale_D)
    assert y.dtype == dtype and y.shape == x.shape
    got = (y, *vjp_fn(ct))
    # bf16: y and dx are rounded once from fp32 math, dscale sums many rounded-input products.
    assert_close(got, ref, dtype=dtype, scale=2.0 if dtype == torch.bfloat16 else 1.0)

    y2, vjp_dx = split_vjp(lambda p, x: rms_norm(x, p["scale"], eps), {"scale": scale_D}, x)
    (dx,), vjp_dw = vjp_dx(ct)
    assert_close((y2, dx, vjp_dw()["scale"]), ref, dtype=dtype, scale=2.0 if dtype == torch.bfloat16 else 1.0)

    leaves = [t.clone().requires_grad_() for t in (x, scale_D)]  # tape autograd: aten's fused rms_norm
    y3 = rms_norm(*leaves, eps)
    assert y3.dtype == dtype
    grads = (torch.autograd.grad(y3, leaves, ct) if y3.numel()
             else (torch.zeros_like(x), torch.zeros_like(scale_D)))
    assert_close((y3.detach(), *grads), ref, dtype=dtype, scale=2.0 if dtype == torch.bfloat16 else 1.0)


def test_scale_grad_not_deferred() -> None:
    from fmoe.transforms.tape import WeightGradTape, active_tape

    x, scale_D, ct = make((3,), 4, torch.float64, 0)
    _, vjp_fn = torch.func.vjp(rms_norm, x, scale_D)
    tape = WeightGradTape([scale_D])
    with active_tape(tape):
        _, dscale = vjp_fn(ct)
    assert len(tape) == 0
    assert_close(dscale, oracle(x, scale_D, ct, 1e-6)[2])


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_finite_differences_float64(seed) -> None:
    x, scale_D, _ = make((3,), 5, torch.float64, seed)
    check_vjp(rms_norm, x, scale_D)


def test_vmap() -> None:
    x, scale_D, _ = make((2, 3), 4, torch.float64, 1)
    assert_close(torch.func.vmap(rms_norm, in_dims=(0, None))(x, scale_D), rms_norm(x, scale_D))


@pytest.mark.parametrize(
    ("x", "s", "match"),
    [
        (torch.zeros(2, 3), torch.zeros(4), "shape"),
        (torch.zeros(2, 3, dtype=torch.long), torch.zeros(3), "floating"),
        (torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), "floating"),
    ],
)
def test_errors(x, s, match) -> None:
    with pytest.raises(ValueError, match=match):
        rms_norm(x, s)
