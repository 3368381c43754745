"""split_vjp against the unsplit torch.func.vjp and float64 finite differences.

Legend: N rows, D model width, F hidden width, L depth.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from fmoe._compat import get_unwrapped, is_functorch_wrapped
from fmoe.ops import linear
from fmoe.transforms import check_vjp, split_vjp
from fmoe.transforms.testing import assert_close, float_dtypes

SETTINGS = settings(max_examples=30, deadline=None)


def make_params(depth: int, d: int, f: int, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g, dtype=torch.float64) / shape[0] ** 0.5).to(dtype)

    return {
        "blocks": [
            {"norm": 1 + 0.1 * r(d), "w_in": r(d, f), "b_in": 0.1 * r(f), "w_out": r(f, d)}
            for _ in range(depth)
        ],
        "unused_D": r(d),
    }


def stack(params: dict, x_ND: torch.Tensor) -> torch.Tensor:
    """Norm -> linear (+bias) -> tanh -> linear with residual, per block; a plain-torch norm on purpose
    (its scale is a parameter that no weight-bearing primitive consumes)."""
    for blk in params["blocks"]:
        h = x_ND * torch.rsqrt(x_ND.pow(2).mean(-1, keepdim=True) + 1e-6) * blk["norm"]
        x_ND = x_ND + linear(torch.tanh(linear(h, blk["w_in"], blk["b_in"])), blk["w_out"])
    return x_ND


def split_as_vjp(f, *primals):
    """Adapter: split_vjp as a plain vjp (params first), for check_vjp and comparisons."""
    out, vjp_dx = split_vjp(f, *primals)

    def fn(ct):
        dargs, vjp_dw = vjp_dx(ct)
        return (vjp_dw(), *dargs)

    return out, fn


@SETTINGS
@given(depth=st.integers(1, 3), n=st.integers(1, 9), d=st.integers(1, 8), f=st.integers(1, 12),
       dtype=float_dtypes, seed=st.integers(0, 2**16))
@example(depth=1, n=1, d=1, f=1, dtype=torch.float64, seed=0)
def test_split_vjp_equals_unsplit_vjp(depth, n, d, f, dtype, seed):
    params = make_params(depth, d, f, dtype, seed)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)
    ct = torch.randn(n, d, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64).to(dtype)
    out, vjp_dx = split_vjp(stack, params, x)
    (dx,), vjp_dw = vjp_dx(ct)
    dparams = vjp_dw()
    ref_out, ref_fn = torch.func.vjp(stack, params, x)
    ref_dparams, ref_dx = ref_fn(ct)
    scale = 4.0 * depth if dtype == torch.bfloat16 else 1.0
    assert_close(out, ref_out, scale=scale)
    assert_close(dx, ref_dx, scale=scale)
    assert_close(dparams, ref_dparams, scale=scale)
    assert torch.count_nonzero(dparams["unused_D"]) == 0


@settings(max_examples=15, deadline=None)
@given(depth=st.integers(1, 3), n=st.integers(1, 6), d=st.integers(1, 6), f=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_split_vjp_passes_finite_differences(depth, n, d, f, seed):
    params = make_params(depth, d, f, torch.float64, seed)
    x = torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    check_vjp(stack, params, x, vjp=split_as_vjp, generator=torch.Generator().manual_seed(seed))


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@settings(max_examples=15, deadline=None)
@given(depth=st.integers(1, 3), n=st.integers(1, 16), d=st.integers(1, 16), f=st.integers(1, 16),
       seed=st.integers(0, 2**16))
@example(depth=1, n=1, d=1, f=1, seed=0)
def test_flops_of_dx_plus_dw_equal_full_backward(depth, n, d, f, seed):
    params = make_params(depth, d, f, torch.float32, seed)
    x = torch.randn(n, d).requires_grad_(False)
    ct = torch.ones(n, d)
    _, full_fn = torch.func.vjp(stack, params, x)
    full = flops(lambda: full_fn(ct))
    _, vjp_dx = split_vjp(stack, params, x)
    box = {}
    dx_flops = flops(lambda: box.setdefault("dw", vjp_dx(ct)[1]))
    dw_flops = flops(lambda: box["dw"]())
    assert dx_flops + dw_flops == full
    assert dw_flops > 0


def test_each_pass_runs_once_and_in_order():
    params = make_params(1, 3, 4, torch.float64, 0)
    x = torch.randn(2, 3, dtype=torch.float64)
    _, vjp_dx = split_vjp(stack, params, x)
    _, vjp_dw = vjp_dx(torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="vjp_dx was already called"):
        vjp_dx(torch.ones(2, 3, dtype=torch.float64))
    vjp_dw()
    with pytest.raises(RuntimeError, match="vjp_dw was already called"):
        vjp_dw()


def test_nothing_is_held_after_dw():
    """The activations of the forward die with the passes: a weakref to one must be dead after vjp_dw."""
    params = make_params(2, 4, 5, torch.float64, 0)
    x = torch.randn(3, 4, dtype=torch.float64)
    refs = []

    def f(p, x):
        h = torch.tanh(linear(x, p["blocks"][0]["w_in"]))
        refs.append(weakref.ref(get_unwrapped(h)))
        return linear(h, p["blocks"][0]["w_out"])

    _, vjp_dx = split_vjp(f, params, x)
    _, vjp_dw = vjp_dx(torch.ones(3, 4, dtype=torch.float64))
    del vjp_dx
    vjp_dw()
    del vjp_dw
    gc.collect()
    assert refs and refs[0]() is None


def test_weight_used_twice_accumulates_and_int_args_pass_through():
    w = torch.randn(3, 3, dtype=torch.float64)
    ids = torch.tensor([0, 2, 1])

    def f(p, x, ids):
        return linear(linear(x[ids], p["w"]), p["w"])

    x = torch.randn(3, 3, dtype=torch.float64)
    ct = torch.randn(3, 3, dtype=torch.float64)
    _, vjp_dx = split_vjp(f, {"w": w}, x, ids)
    (dx, dids), vjp_dw = vjp_dx(ct)
    assert dids is None
    _, ref_fn = torch.func.vjp(lambda p, x: f(p, x, ids), {"w": w}, x)
    ref_dp, ref_dx = ref_fn(ct)
    assert_close(dx, ref_dx)
    assert_close(vjp_dw(), ref_dp)


@dataclasses.dataclass(frozen=True)
class Info:
    total: torch.Tensor
    k: int


def test_has_aux_returns_any_aux():
    w = torch.randn(2, 2, dtype=torch.float64)
    out, vjp_dx, aux = split_vjp(lambda p, x: (linear(x, p), {"n": x.shape[0], "info": Info(x.sum(), 3)}),
                                 w, torch.ones(4, 2, dtype=torch.float64), has_aux=True)
    assert aux["n"] == 4 and aux["info"].k == 3
    assert float(aux["info"].total) == 8.0
    assert not is_functorch_wrapped(aux["info"].total)
    (dx,), vjp_dw = vjp_dx(torch.ones_like(out))
    assert_close(vjp_dw(), torch.full((2, 2), 4.0, dtype=torch.float64))
