"""The exported testing tools: strategies build what they promise, check_vjp catches a wrong vjp."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe._compat import is_functorch_wrapped
from fmoe.ops import linear
from fmoe.transforms.testing import assert_close, check_vjp, param_pytrees, tensors


@settings(max_examples=20)
@given(p=param_pytrees({"w": (3, 4), "blocks": [{"norm": (3,)}, {"norm": (3,)}]}),
       x=tensors((5, 3)), scale=st.sampled_from([0.1, 1.0, 3.0]))
def test_strategies_follow_the_shape_spec_and_feed_check_vjp(p, x, scale):
    assert p["w"].shape == (3, 4) and [b["norm"].shape for b in p["blocks"]] == [(3,), (3,)]
    assert x.shape == (5, 3) and x.dtype == torch.float64

    def f(p, x):
        h = x * scale
        for b in p["blocks"]:
            h = torch.tanh(h * b["norm"])
        return linear(h, p["w"])

    check_vjp(f, p, x)


def _square_rule(offset: float = 0.0, slope: float = 2.0) -> type[torch.autograd.Function]:
    """A custom rule for x * x whose forward adds `offset` and whose backward is slope * g * x.

    The defaults make a right rule; another offset or slope makes a deliberately wrong one.
    """

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * x + offset

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return slope * g * x

    return Square


def test_check_vjp_rejects_a_wrong_gradient():
    with pytest.raises(AssertionError, match="finite difference"):
        check_vjp(_square_rule(slope=1.0).apply, torch.randn(6, dtype=torch.float64))  # should be 2 g x


@pytest.mark.parametrize("offset, ok", [(0.0, True), (0.5, False)])
def test_check_vjp_checks_the_primal_output_of_a_custom_rule(offset: float, ok: bool):
    rule = _square_rule(offset=offset)

    def f(x):
        # The rule serves only differentiated calls (as a fused kernel might): plain calls compute x * x,
        # so the finite difference alone cannot see a rule whose forward is wrong.
        return rule.apply(x) if is_functorch_wrapped(x) else x * x

    x = torch.randn(6, dtype=torch.float64)
    if ok:
        check_vjp(f, x)
    else:
        with pytest.raises(AssertionError, match="primal output"):
            check_vjp(f, x)


def test_assert_close_fails_on_nan_and_structure():
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(torch.tensor([float("nan")]), torch.tensor([0.0]))
    with pytest.raises(AssertionError, match="structures differ"):
        assert_close({"a": torch.zeros(1)}, {"b": torch.zeros(1)})
    with pytest.raises(AssertionError):
        assert_close(torch.ones(2, dtype=torch.bfloat16), torch.full((2,), 1.1, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.complex64])
def test_tensors_refuses_a_dtype_that_is_not_floating(dtype):
    """N(0, scale^2) draws cast to an integer dtype are mostly 0 (to bool all True): refused, not drawn."""
    with pytest.raises(TypeError, match=f"tensors: dtype must be a floating dtype, got {dtype}"):
        tensors((3,), dtype)
    with pytest.raises(TypeError, match=f"param_pytrees: dtype must be a floating dtype, got {dtype}"):
        param_pytrees({"w": (3,)}, dtype)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_tensors_refuses_a_scale_that_is_not_a_finite_number_at_least_0(scale):
    with pytest.raises(ValueError, match=f"tensors: scale must be a finite number >= 0, got {scale}"):
        tensors((3,), torch.float32, scale)
