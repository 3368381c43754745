"""The exported testing tools: strategies build what they promise, check_vjp catches a wrong vjp."""

from __future__ import annotations

import pytest
import torch
from fmoe.transforms.testing import assert_close, check_vjp, param_pytrees, tensors
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe.ops import linear


@settings(max_examples=20)
@given(p=param_pytrees({"w_DF": (3, 4), "blocks": [{"scale_D": (3,)}, {"scale_D": (3,)}]}),
       x=tensors((5, 3)), scale=st.sampled_from([0.1, 1.0, 3.0]))
def test_strategies_follow_the_shape_spec_and_feed_check_vjp(p, x, scale):
    assert p["w_DF"].shape == (3, 4) and [b["scale_D"].shape for b in p["blocks"]] == [(3,), (3,)]
    assert x.shape == (5, 3) and x.dtype == torch.float64

    def f(p, x):
        h = x * scale
        for b in p["blocks"]:
            h = torch.tanh(h * b["scale_D"])
        return linear(h, p["w_DF"])

    check_vjp(f, p, x)


def test_check_vjp_rejects_a_wrong_gradient():
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * x

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x  # should be 2 g x

    with pytest.raises(AssertionError, match="finite difference"):
        check_vjp(Wrong.apply, torch.randn(6, dtype=torch.float64))


def test_assert_close_fails_on_nan_and_structure():
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(torch.tensor([float("nan")]), torch.tensor([0.0]))
    with pytest.raises(AssertionError, match="structures differ"):
        assert_close({"a": torch.zeros(1)}, {"b": torch.zeros(1)})
    with pytest.raises(AssertionError):
        assert_close(torch.ones(2, dtype=torch.bfloat16), torch.full((2,), 1.1, dtype=torch.bfloat16))
