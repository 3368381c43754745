"""swiglu against float64 tape autograd of g * sigmoid(g) * u.

Legend: N rows (any leading dims), F features.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.ops import swiglu
from fmoe.transforms.testing import assert_close, check_vjp, float_dtypes

shapes = st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple)


def make(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype) for _ in range(3))


def oracle(gate, up, ct):
    a, u = gate.double().requires_grad_(), up.double().requires_grad_()
    y = a / (1 + torch.exp(-a)) * u
    return (y.detach(), *torch.autograd.grad(y, (a, u), ct.double()))


@settings(max_examples=30, deadline=None)
@example(shape=(0,), dtype=torch.float32, seed=0)
@example(shape=(1,), dtype=torch.float64, seed=0)
@example(shape=(2, 3, 4), dtype=torch.bfloat16, seed=2)
@given(shape=shapes, dtype=float_dtypes, seed=st.integers(0, 2**31 - 1))
def test_matches_oracle(shape, dtype, seed) -> None:
    gate, up, ct = make(shape, dtype, seed)
    y, vjp_fn = torch.func.vjp(swiglu, gate, up)
    assert y.dtype == dtype and y.shape == gate.shape
    assert_close((y, *vjp_fn(ct)), oracle(gate, up, ct), dtype=dtype, scale=2.0)
    leaves = [t.clone().requires_grad_() for t in (gate, up)]  # tape autograd: the native ops
    y2 = swiglu(*leaves)
    grads = (torch.autograd.grad(y2, leaves, ct) if y2.numel()
             else (torch.zeros_like(gate), torch.zeros_like(up)))
    assert_close((y2.detach(), *grads), oracle(gate, up, ct), dtype=dtype, scale=2.0)


def test_extreme_gate_values_finite() -> None:
    gate = torch.tensor([-100.0, -20.0, 0.0, 20.0, 100.0], dtype=torch.float64)
    up, ct = torch.ones_like(gate), torch.ones_like(gate)
    _, vjp_fn = torch.func.vjp(swiglu, gate, up)
    assert_close(vjp_fn(ct), oracle(gate, up, ct)[1:])


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_finite_differences_float64(seed) -> None:
    gate, up, _ = make((3, 4), torch.float64, seed)
    check_vjp(swiglu, gate, up)


def test_vmap() -> None:
    gate, up, _ = make((2, 3, 4), torch.float64, 1)
    assert_close(torch.func.vmap(swiglu)(gate, up), swiglu(gate, up))


def test_errors() -> None:
    with pytest.raises(ValueError, match="shape"):
        swiglu(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="dtype"):
        swiglu(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64))
