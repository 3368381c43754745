"""vjp_dw(into=sums): the deferred weight-gradient pass adding straight into the caller's sums (a GEMM
with beta = 1, a scatter-add) against the unsplit torch.func.vjp with the sums added by hand; and the
tape's `run(into=...)` contract for thunks with and without an accumulating form.

Legend: N tokens, D model width, F hidden width, E experts, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe._compat import tree_flatten, tree_unflatten
from fmoe.ops import (
    embedding,
    grouped_linear,
    grouped_linear_pair,
    linear,
    linear_pair,
    rms_norm,
    swiglu_grouped_linear,
    swiglu_linear,
)
from fmoe.transforms import WeightGradTape, active_tape, split_vjp, weight_grad_or_defer
from fmoe.transforms.testing import assert_close


def _params(V: int, D: int, F: int, E: int, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g, dtype=torch.float64) / shape[-2] ** 0.5).to(dtype)

    return {"table": r(V, D), "norm": 1 + 0.1 * r(1, D)[0], "w_q": r(D, D), "w_gate": r(D, F),
            "w_up": r(D, F), "w_down": r(F, D), "e_gate": r(E, D, F), "e_up": r(E, D, F),
            "e_down": r(E, F, D), "e_single": r(E, D, D), "unused": r(D, D)}


def _model(counts: list[int]):
    """Every primitive with a deferrable weight gradient, a norm scale (whose gradient comes from the dx
    pass) and weights used twice: w_q in two products, the table as embedding and tied head."""

    def f(p: dict, ids_N: torch.Tensor) -> torch.Tensor:
        x = embedding(ids_N, p["table"])
        h = rms_norm(x, p["norm"])
        x = x + linear(torch.tanh(linear(h, p["w_q"])), p["w_q"])
        x = x + swiglu_linear(*linear_pair(x, p["w_gate"], p["w_up"]), p["w_down"])
        gate, up = grouped_linear_pair(x, p["e_gate"], p["e_up"], counts)
        y = swiglu_grouped_linear(gate, up, p["e_down"], counts)
        y = y + grouped_linear(x, p["e_single"], counts)
        return linear(y, p["table"].t())  # the tied head: a transpose, so its gradient comes in the dx pass

    return f


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=4),
       engine=st.sampled_from(["autograd", "func"]), mask=st.integers(0, 2**11 - 1), fp32=st.booleans(),
       seed=st.integers(0, 2**16))
@example(counts=[3, 0, 2], engine="autograd", mask=0, fp32=False, seed=0)  # an expert with no token, no sum
@example(counts=[4], engine="func", mask=2**11 - 1, fp32=True, seed=1)  # one expert, a sum for every leaf
@example(counts=[0, 0], engine="autograd", mask=2**11 - 1, fp32=False, seed=2)  # no token at all
def test_vjp_dw_into_adds_each_gradient_into_its_sum(counts, engine, mask, fp32, seed):
    """Each given sum comes back as itself with this pass's gradient added; a leaf without one gets a fresh
    gradient that aliases nothing of the caller's. fp32 takes the grouped_mm backend, float64 the loop."""
    dtype = torch.float32 if fp32 else torch.float64
    V, D, F, E = 11, 8, 12, len(counts)
    params = _params(V, D, F, E, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (sum(counts),), generator=g)
    ct = torch.randn(sum(counts), V, generator=g, dtype=torch.float64).to(dtype)
    leaves, spec = tree_flatten(params)
    sums = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype) if mask >> k & 1 else None
            for k, t in enumerate(leaves)]
    before = [None if s is None else s.clone() for s in sums]
    f = _model(counts)
    ref = tree_flatten(torch.func.vjp(lambda p: f(p, ids), params)[1](ct)[0])[0]
    _, vjp_dx = split_vjp(f, params, ids, engine=engine)
    _, vjp_dw = vjp_dx(ct)
    got = tree_flatten(vjp_dw(into=tree_unflatten(sums, spec)))[0]
    caller = [ct, *leaves, *(s for s in sums if s is not None)]
    for k, (s, b, r, t) in enumerate(zip(sums, before, ref, got)):
        if s is None:
            assert_close(t, r, msg=f"leaf {k}")
            assert all(t.untyped_storage().data_ptr() != c.untyped_storage().data_ptr() for c in caller), k
        else:
            assert t is s, f"leaf {k}: the sum must come back as itself"
            assert_close(t, b + r, msg=f"leaf {k}")


def test_vjp_dw_into_refuses_a_pass_without_a_tape_and_sums_that_do_not_fit():
    params = _params(5, 4, 4, 2, torch.float64, 0)
    ids, f = torch.tensor([0, 3, 4]), _model([2, 1])
    ct = torch.randn(3, 5, dtype=torch.float64)
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    _, vjp_dx = split_vjp(f, params, ids, engine="autograd", defer=False)
    _, vjp_dw = vjp_dx(ct)
    with pytest.raises(ValueError, match=r"vjp_dw\(into=...\) needs split_vjp\(defer=True\)"):
        vjp_dw(into=zeros)
    _, vjp_dx = split_vjp(f, params, ids, engine="autograd")
    _, vjp_dw = vjp_dx(ct)
    with pytest.raises(ValueError, match="structure of params"):
        vjp_dw(into={"table": zeros["table"]})
    with pytest.raises(ValueError, match="its sum is"):
        vjp_dw(into={**zeros, "w_q": torch.zeros(4, 4, dtype=torch.float32)})
    got = vjp_dw(into=zeros)  # the refusals did not use the pass up
    assert got["w_q"] is zeros["w_q"]
    assert_close(got, torch.func.vjp(lambda p: f(p, ids), params)[1](ct)[0])


def test_tape_run_into_copies_a_result_that_may_alias_and_adds_one_without_an_accumulating_form():
    """A thunk with no `accumulate` form may return something the caller holds: with no sum its result is
    copied (so the caller may add into it), with a sum it is added; an accumulating one adds in place."""
    w, held = torch.randn(3, 3), torch.randn(3, 3)
    x, gr = torch.randn(4, 3), torch.randn(4, 3)
    tape = WeightGradTape([w, w.view_as(w)])
    with active_tape(tape):
        tape.record(w, lambda: held, captures=(held,))  # returns a tensor the caller still holds
        weight_grad_or_defer(tape._weights[1], lambda a, b: a.t() @ b, x, gr,
                             accumulate=lambda out, a, b: out.addmm_(a.t(), b))
    keep = held.clone()
    first, second = tape.run(into=[None, None])
    assert first.untyped_storage().data_ptr() != held.untyped_storage().data_ptr()
    assert_close(first, keep)
    assert_close(second, x.t() @ gr)
    sums = [torch.ones(3, 3), torch.ones(3, 3)]
    with active_tape(tape := WeightGradTape([w, w.view_as(w)])):
        tape.record(w, lambda: held, captures=(held,))
        weight_grad_or_defer(tape._weights[1], lambda a, b: a.t() @ b, x, gr,
                             accumulate=lambda out, a, b: out.addmm_(a.t(), b))
    got = tape.run(into=sums)
    assert got[0] is sums[0] and got[1] is sums[1]
    assert_close(got[0], 1 + keep)
    assert_close(got[1], 1 + x.t() @ gr)
    assert_close(held, keep)  # the aliasing result itself was not written
    with pytest.raises(ValueError, match="2 sums for 1 weights"):
        WeightGradTape([w]).run(into=[None, None])
