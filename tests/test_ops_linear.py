"""linear against plain float64 autograd of x @ w + b: outputs, dx, dw (vjp and split_vjp), FLOPs, errors.

Legend: B batch, N rows, D input features, F output features.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from fmoe.ops import _linear as lin_mod
from fmoe.ops import linear
from fmoe.transforms.split_vjp import split_vjp
from fmoe.transforms.testing import assert_close, check_vjp, float_dtypes


def make(lead: tuple[int, ...], D: int, F: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, D, generator=g, dtype=torch.float64).to(dtype)
    w_DF = (torch.randn(D, F, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    b_F = torch.randn(F, generator=g, dtype=torch.float64).to(dtype)
    ct = torch.randn(*lead, F, generator=g, dtype=torch.float64).to(dtype)
    return x, w_DF, b_F, ct


def oracle(x, w_DF, b_F, ct):
    """(y, dx, dw, db) in float64 by tape autograd on an explicit sum over the input dimension."""
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w_DF, b_F))
    y = (x64.unsqueeze(-1) * w64).sum(-2) + b64
    return (y.detach(), *torch.autograd.grad(y, (x64, w64, b64), ct.double()))


shapes = st.tuples(st.lists(st.integers(0, 4), min_size=1, max_size=2).map(tuple), st.integers(1, 6),
                   st.integers(1, 6))


@settings(max_examples=30, deadline=None)
@example(shape=((0,), 3, 2), dtype=torch.float32, seed=0)
@example(shape=((1,), 1, 1), dtype=torch.float64, seed=0)
@example(shape=((2, 3), 4, 5), dtype=torch.bfloat16, seed=1)
@given(shape=shapes, dtype=float_dtypes, seed=st.integers(0, 2**31 - 1))
def test_vjp_and_split_vjp_match_oracle(shape, dtype, seed) -> None:
    lead, D, F = shape
    x, w_DF, b_F, ct = make(lead, D, F, dtype, seed)
    y_ref, dx_ref, dw_ref, db_ref = oracle(x, w_DF, b_F, ct)
    y, vjp_fn = torch.func.vjp(linear, x, w_DF, b_F)
    assert_close((y, *vjp_fn(ct)), (y_ref, dx_ref, dw_ref, db_ref), dtype=dtype, scale=2.0)

    calls = []
    real = lin_mod._weight_grad
    with mock.patch.object(lin_mod, "_weight_grad", lambda *a: calls.append(1) or real(*a)):
        y2, vjp_dx = split_vjp(lambda p, x: linear(x, p["w"], p["b"]), {"w": w_DF, "b": b_F}, x)
        (dx,), vjp_dw = vjp_dx(ct)
        assert calls == []  # dw deferred out of the dx pass
        dp = vjp_dw()
        assert calls == [1]
    assert_close((y2, dx, dp["w"], dp["b"]), (y_ref, dx_ref, dw_ref, db_ref), dtype=dtype, scale=2.0)

    # Plain tape autograd, no tape and no split: the native matmul path, the same gradients.
    leaves = [t.clone().requires_grad_() for t in (x, w_DF, b_F)]
    y3 = linear(*leaves)
    assert y3.grad_fn is not None and "_Linear" not in type(y3.grad_fn).__name__
    assert_close((y3.detach(), *torch.autograd.grad(y3, leaves, ct)), (y_ref, dx_ref, dw_ref, db_ref),
                 dtype=dtype, scale=2.0)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_finite_differences_float64(seed: int) -> None:
    x, w_DF, b_F, _ = make((3,), 4, 2, torch.float64, seed)
    check_vjp(linear, x, w_DF, b_F)


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_flops_conserved_by_split() -> None:
    x, w_DF, _, ct = make((6,), 8, 5, torch.float32, 0)
    _, vjp_fn = torch.func.vjp(lambda w, x: linear(x, w), w_DF, x)
    full = _flops(lambda: vjp_fn(ct))
    _, vjp_dx = split_vjp(lambda p, x: linear(x, p), w_DF, x)
    held = {}
    dx_pass = _flops(lambda: held.update(dw=vjp_dx(ct)[1]))
    dw_pass = _flops(lambda: held["dw"]())
    assert dw_pass > 0
    assert dx_pass + dw_pass == full


def test_shape_error() -> None:
    with pytest.raises(ValueError, match="features"):
        linear(torch.zeros(2, 3), torch.zeros(4, 5))
