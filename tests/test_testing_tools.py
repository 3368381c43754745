"""The exported testing tools: strategies build what they promise, check_vjp catches a wrong vjp."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe._compat import is_functorch_wrapped, tree_flatten
from fmoe.ops import linear
from fmoe.transforms.testing import assert_close, check_vjp, param_pytrees, seeded_tensor, tensors


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


# Shape specs for param_pytrees: up to 4 entries, some nested, shapes of rank 0-3 with size-0 axes allowed.
_shape = st.lists(st.integers(0, 3), max_size=3).map(tuple)
_nested = st.dictionaries(st.sampled_from("xy"), _shape, max_size=2)
_specs = st.dictionaries(st.sampled_from("abcd"), _shape | _nested, min_size=1, max_size=4)


@settings(max_examples=60, derandomize=True)
@given(shapes=_specs, dtype=st.sampled_from([torch.float64, torch.float32]), data=st.data())
def test_param_pytrees_draws_each_leaf_independently(shapes, dtype, data):
    """No two leaves of a draw share their leading values (equal leaves hid a w_gate / w_up swap): only
    a size-0 leaf, which has none, may. Before, each leaf drew its own seed, and hypothesis drew the same
    one for several leaves of 78 of 200 pytrees."""
    leaves = [t.flatten() for t in tree_flatten(data.draw(param_pytrees(shapes, dtype)))[0]]
    for i, a in enumerate(leaves):
        for j in range(i + 1, len(leaves)):
            n = min(a.numel(), leaves[j].numel())
            assert n == 0 or not torch.equal(a[:n], leaves[j][:n]), f"leaves {i} and {j} of {shapes}"


def test_check_vjp_rejects_a_wrong_gradient():
    with pytest.raises(AssertionError, match="finite difference"):
        check_vjp(_square_rule(slope=1.0).apply, torch.randn(6, dtype=torch.float64))  # should be 2 g x


def _vjp_wrong_on(leaf: str, scale: float = 2.0):
    """torch.func.vjp whose gradient for params[`leaf`] is `scale` times the true one (a deliberate bug)."""
    def vjp(f, *primals):
        out, fn = torch.func.vjp(f, *primals)

        def wrong(ct):
            dp, *rest = fn(ct)
            return ({**dp, leaf: dp[leaf] * scale}, *rest)

        return out, wrong

    return vjp


def _two_outputs(p, x):
    # output [0] reads only w_up, output [1] only w_gate: one wrong leaf is wrong in one direction
    return x @ p["w_up"], torch.tanh(x @ p["w_gate"]).sum()


def test_check_vjp_names_the_leaf_and_the_output_that_failed():
    g = torch.Generator().manual_seed(0)
    p = {"w_gate": torch.randn(3, 2, generator=g, dtype=torch.float64),
         "w_up": torch.randn(3, 2, generator=g, dtype=torch.float64)}
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    check_vjp(_two_outputs, p, x)  # the right vjp passes
    with pytest.raises(AssertionError) as e:
        check_vjp(_two_outputs, p, x, vjp=_vjp_wrong_on("w_gate"))
    msg = str(e.value)
    assert "output[1] / primals[0]['w_gate']" in msg  # cotangent on output [1], tangent on w_gate
    assert "w_up" not in msg and "output[0]" not in msg and "primals[1]" not in msg  # the right ones unnamed


def test_check_vjp_names_the_input_of_a_single_output():
    x, y = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    rule = _square_rule(slope=1.0)  # wrong: should be 2 g x
    with pytest.raises(AssertionError, match=r"output / primals\[1\]"):
        check_vjp(lambda x, y: torch.sin(x) + rule.apply(y), x, y)


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


def test_check_vjp_names_a_downcast_to_float32():
    """f leaves float64: the central difference is noise, and the message says why, not only "wrong"."""
    x = torch.randn(8, dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"f computes in float32 \(aten\._to_copy turned float64 inputs "
                                             r"into float32\).*no \.float\(\)"):
        check_vjp(lambda x: torch.sin(x.float() * 1e3).double(), x)


def test_a_failing_hypothesis_example_prints_the_seed_not_the_tensors():
    """A failing property test over 40 x 40 draws reports a short call per draw, which rebuilds it."""
    @settings(max_examples=2, database=None, deadline=None)
    @given(x=tensors((40, 40)), p=param_pytrees({"w": (30, 30), "b": {"c": (30,)}}))
    def always_fails(x, p):
        drawn.append(x)
        raise AssertionError("the property")

    drawn = []

    with pytest.raises(AssertionError, match="the property") as info:
        always_fails()
    report = "\n".join(getattr(info.value, "__notes__", []))
    assert len(report) < 1000, report
    flat = "".join(report.split())  # hypothesis breaks long calls over lines
    assert "seeded_tensor(shape=(40,40),dtype=torch.float64,scale=1.0,seed=" in flat
    assert "seeded_pytree(shapes={'w':(30,30),'b':{'c':(30,)}},dtype=torch.float64,scale=0.5" in flat
    seed = int(flat.split("seeded_tensor(")[1].split("seed=")[1].split(")")[0])
    assert torch.equal(seeded_tensor((40, 40), torch.float64, 1.0, seed), drawn[-1])  # the call rebuilds it
