"""The fused SwiGLU MLP products (fmoe/ops/_mlp_products.py) against float64 oracles.

swiglu_grouped_linear(g, u, w) == grouped_linear(swiglu(g, u), w) and grouped_linear_pair(x, wa, wb) ==
(grouped_linear(x, wa), grouped_linear(x, wb)) against per-row loops, and swiglu_packed_grouped_linear and
swiglu_packed (gate and up as one [M, 2F] input, the fused gate/up product's output) the same way;
swiglu_linear and linear_pair against
plain matmuls (leading dims kept): outputs, input gradients and (deferred) weight gradients, under
split_vjp with either engine and outside it.

Legend: M rows, D and F features, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.ops import (
    grouped_linear_pair,
    linear_pair,
    swiglu_grouped_linear,
    swiglu_linear,
    swiglu_packed,
    swiglu_packed_grouped_linear,
)
from fmoe.transforms import split_vjp
from fmoe.transforms.testing import assert_close


@dataclass
class Case:
    counts: list[int]
    D: int
    F: int
    dtype: torch.dtype
    backend: str | None
    engine: str
    seed: int = 0


@st.composite
def cases(draw: st.DrawFn) -> Case:
    E = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]))
    backends = ["loop"] if dtype == torch.float64 else ["loop", "grouped_mm", None]
    return Case(counts=draw(st.lists(st.integers(0, 5), min_size=E, max_size=E)),
                D=draw(st.sampled_from([8, 16])), F=draw(st.sampled_from([8, 16])), dtype=dtype,
                backend=draw(st.sampled_from(backends)),
                engine=draw(st.sampled_from(["func", "autograd", "none"])),
                seed=draw(st.integers(0, 2**31 - 1)))


EDGE = [
    Case([2, 0, 3], 8, 8, torch.float32, "grouped_mm", "func"),    # an expert with zero rows
    Case([4], 16, 8, torch.bfloat16, "grouped_mm", "autograd"),    # one expert
    Case([0, 5, 0], 8, 16, torch.float64, "loop", "autograd"),     # every row on one expert
    Case([0, 0], 8, 8, torch.float32, None, "func"),               # no rows at all
    Case([3, 1], 8, 8, torch.float32, None, "none"),               # outside split_vjp: the composition
]


def with_examples(fn):
    for c in EDGE:
        fn = example(case=c)(fn)
    return fn


def _loop(x_MD: torch.Tensor, w_EDF: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Per-row definition: y[m] = x[m] @ w[expert of row m]."""
    expert = [e for e, c in enumerate(counts) for _ in range(c)]
    rows = [x_MD[m] @ w_EDF[expert[m]] for m in range(x_MD.shape[0])]
    return torch.stack(rows) if rows else x_MD.new_zeros(0, w_EDF.shape[-1]) + 0 * w_EDF.sum()


def _grads(f, params: dict, args: tuple, ct, engine: str):
    """(out, dparams, dargs) of f(params, *args) by split_vjp(engine), or by tape autograd ("none")."""
    if engine == "none":
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        xs = [a.detach().requires_grad_() for a in args]
        out = f(leaves, *xs)
        outs = out if isinstance(out, tuple) else (out,)
        cts = ct if isinstance(ct, tuple) else (ct,)
        gs = torch.autograd.grad(outs, [*leaves.values(), *xs], cts, allow_unused=True)
        gs = [torch.zeros_like(t) if g is None else g for g, t in zip(gs, [*leaves.values(), *xs])]
        return out, dict(zip(leaves, gs[:len(leaves)])), tuple(gs[len(leaves):])
    out, vjp_dx = split_vjp(f, params, *args, engine=engine)
    dargs, vjp_dw = vjp_dx(ct)
    return out, vjp_dw(), dargs


def _make(case: Case, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    return {k: (torch.randn(s, generator=g, dtype=torch.float64) * 0.5).to(case.dtype)
            for k, s in shapes.items()}


def _oracle(f64, t: dict[str, torch.Tensor], names: list[str], ct):
    leaves = {k: t[k].double().requires_grad_() for k in names}
    out = f64(leaves)
    outs = out if isinstance(out, tuple) else (out,)
    cts = ct if isinstance(ct, tuple) else (ct,)
    gs = torch.autograd.grad(outs, list(leaves.values()), [c.double() for c in cts], allow_unused=True)
    return out, {k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), gs)}


@settings(max_examples=25, deadline=None)
@with_examples
@given(case=cases())
def test_swiglu_grouped_linear_matches_the_loop_oracle(case: Case) -> None:
    M, E = sum(case.counts), len(case.counts)
    t = _make(case, {"gate": (M, case.F), "up": (M, case.F), "w": (E, case.F, case.D), "ct": (M, case.D)})

    def f(p, gate, up):
        return swiglu_grouped_linear(gate, up, p["w"], case.counts, case.backend)

    y, dp, (dgate, dup) = _grads(f, {"w": t["w"]}, (t["gate"], t["up"]), t["ct"], case.engine)
    y_ref, ref = _oracle(lambda q: _loop(torch.nn.functional.silu(q["gate"]) * q["up"], q["w"], case.counts),
                         t, ["gate", "up", "w"], t["ct"])
    assert y.dtype == case.dtype and y.shape == (M, case.D)
    assert_close(y, y_ref, dtype=case.dtype, msg="y")
    assert_close(dgate, ref["gate"], dtype=case.dtype, scale=2.0, msg="dgate")
    assert_close(dup, ref["up"], dtype=case.dtype, scale=2.0, msg="dup")
    assert_close(dp["w"], ref["w"], dtype=case.dtype, scale=2.0, msg="dw")


@pytest.mark.parametrize("down", [True, False])
@settings(max_examples=15, deadline=None)
@with_examples
@given(case=cases())
def test_swiglu_packed_matches_the_loop_oracle(case: Case, down: bool) -> None:
    """gate | up in one [M, 2F] input: the output, the one [M, 2F] input gradient (both halves) and the
    down weight's (deferred) gradient; `down`: with the down product fused, else swiglu_packed alone."""
    M, E, F = sum(case.counts), len(case.counts), case.F
    t = _make(case, {"gu": (M, 2 * F), "w": (E, F, case.D), "ct": (M, case.D if down else F)})

    def f(p, gu):
        return swiglu_packed_grouped_linear(gu, p["w"], case.counts, case.backend) if down else \
            swiglu_packed(gu) + 0 * p["w"].sum()

    def f64(q):
        h = torch.nn.functional.silu(q["gu"][:, :F]) * q["gu"][:, F:]
        return _loop(h, q["w"], case.counts) if down else h

    y, dp, (dgu,) = _grads(f, {"w": t["w"]}, (t["gu"],), t["ct"], case.engine)
    y_ref, ref = _oracle(f64, t, ["gu", "w"], t["ct"])
    assert y.dtype == case.dtype and dgu.shape == (M, 2 * F)
    assert_close(y, y_ref, dtype=case.dtype, msg="y")
    assert_close(dgu, ref["gu"], dtype=case.dtype, scale=2.0, msg="dgate | dup")
    assert_close(dp["w"], ref["w"], dtype=case.dtype, scale=2.0, msg="dw")


@settings(max_examples=25, deadline=None)
@with_examples
@given(case=cases())
def test_grouped_linear_pair_matches_the_loop_oracle(case: Case) -> None:
    M, E = sum(case.counts), len(case.counts)
    t = _make(case, {"x": (M, case.D), "wa": (E, case.D, case.F), "wb": (E, case.D, case.F),
                     "ca": (M, case.F), "cb": (M, case.F)})

    def f(p, x):
        return grouped_linear_pair(x, p["wa"], p["wb"], case.counts, case.backend)

    params = {"wa": t["wa"], "wb": t["wb"]}
    (ya, yb), dp, (dx,) = _grads(f, params, (t["x"],), (t["ca"], t["cb"]), case.engine)
    (ya_ref, yb_ref), ref = _oracle(lambda q: (_loop(q["x"], q["wa"], case.counts),
                                               _loop(q["x"], q["wb"], case.counts)),
                                    t, ["x", "wa", "wb"], (t["ca"], t["cb"]))
    assert_close(ya, ya_ref, dtype=case.dtype, msg="ya")
    assert_close(yb, yb_ref, dtype=case.dtype, msg="yb")
    assert_close(dx, ref["x"], dtype=case.dtype, scale=2.0, msg="dx")
    assert_close(dp["wa"], ref["wa"], dtype=case.dtype, scale=2.0, msg="dwa")
    assert_close(dp["wb"], ref["wb"], dtype=case.dtype, scale=2.0, msg="dwb")


@pytest.mark.parametrize("engine", ["func", "autograd"])
def test_pair_with_one_output_unused_gives_that_weight_a_zero_gradient(engine: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g)
    wa, wb = torch.randn(2, 8, 8, generator=g), torch.randn(2, 8, 8, generator=g)

    def f(p, x):
        return grouped_linear_pair(x, p["wa"], p["wb"], [2, 3])[0].sum()

    _, vjp_dx = split_vjp(f, {"wa": wa, "wb": wb}, x, engine=engine)
    (dx,), vjp_dw = vjp_dx(torch.tensor(1.0))
    dp = vjp_dw()
    assert torch.equal(dp["wb"], torch.zeros_like(wb))
    expected = torch.cat([torch.ones(2, 8) @ wa[0].t(), torch.ones(3, 8) @ wa[1].t()])
    torch.testing.assert_close(dx, expected)


def test_shapes_and_dtypes_are_checked() -> None:
    x, w = torch.randn(3, 8), torch.randn(1, 8, 8)
    with pytest.raises(ValueError, match="swiglu_grouped_linear: gate"):
        swiglu_grouped_linear(x, x[:, :4], w, [3])
    with pytest.raises(ValueError, match="grouped_linear_pair: the weights"):
        grouped_linear_pair(x, w, w.double(), [3])
    with pytest.raises(ValueError, match="swiglu_grouped_linear: sum"):
        split_vjp(lambda p, x: swiglu_grouped_linear(x, x, p, [2]), w, x)


@settings(max_examples=25, deadline=None)
@example(lead=(3,), D=8, F=8, dtype=torch.float32, engine="func", seed=0)
@example(lead=(2, 3), D=8, F=16, dtype=torch.float64, engine="autograd", seed=1)  # [B, S, D] input
@example(lead=(0,), D=8, F=8, dtype=torch.float32, engine="autograd", seed=2)     # no rows
@given(lead=st.sampled_from([(1,), (5,), (2, 3)]), D=st.sampled_from([8, 16]), F=st.sampled_from([8, 16]),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
       engine=st.sampled_from(["func", "autograd", "none"]), seed=st.integers(0, 2**31 - 1))
def test_dense_products_match_the_matmul_oracle(lead: tuple[int, ...], D: int, F: int, dtype: torch.dtype,
                                                engine: str, seed: int) -> None:
    case = Case([1], D, F, dtype, None, engine, seed)
    t = _make(case, {"x": (*lead, D), "wg": (D, F), "wu": (D, F), "wd": (F, D), "ct": (*lead, D)})

    def f(p, x):
        return swiglu_linear(*linear_pair(x, p["wg"], p["wu"]), p["wd"])

    params = {k: t[k] for k in ("wg", "wu", "wd")}
    y, dp, (dx,) = _grads(f, params, (t["x"],), t["ct"], engine)
    def mlp(q):
        return (torch.nn.functional.silu(q["x"] @ q["wg"]) * (q["x"] @ q["wu"])) @ q["wd"]

    y_ref, ref = _oracle(mlp, t, ["x", "wg", "wu", "wd"], t["ct"])
    assert y.dtype == dtype and y.shape == (*lead, D)
    assert_close(y, y_ref, dtype=dtype, scale=2.0, msg="y")
    assert_close(dx, ref["x"], dtype=dtype, scale=4.0, msg="dx")
    for k in params:
        assert_close(dp[k], ref[k], dtype=dtype, scale=4.0, msg=k)


def test_dense_shapes_and_dtypes_are_checked() -> None:
    x, w = torch.randn(3, 8), torch.randn(8, 8)
    with pytest.raises(ValueError, match="swiglu_linear: gate"):
        swiglu_linear(x, x[:, :4], w)
    with pytest.raises(ValueError, match="linear_pair: the weights"):
        linear_pair(x, w, w.double())
    with pytest.raises(ValueError, match="linear_pair: x has 8 features"):
        split_vjp(lambda p, x: linear_pair(x, p, p)[0], torch.randn(4, 8), x)
