"""remat against the same function without remat, under torch.func.vjp, split_vjp and tape autograd.

Legend: N rows, D model width, F hidden width.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from fmoe.ops import linear
from fmoe.transforms import (
    POLICIES,
    RecomputeError,
    checkpoint_name,
    dots_saveable,
    everything_saveable,
    nothing_saveable,
    remat,
    save_only_these_names,
    saved_residuals,
    split_vjp,
)
from fmoe.transforms.testing import assert_close, float_dtypes

ALL_POLICIES = [nothing_saveable, everything_saveable, dots_saveable, save_only_these_names("fc1"),
                save_only_these_names("fc1", "act", "count")]


def block(p: dict, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h_NF = checkpoint_name(linear(x_ND, p["w_fc1"]), "fc1")
    a_NF = checkpoint_name(torch.nn.functional.silu(h_NF) * p["s_F"], "act")
    count = checkpoint_name((h_NF > 0).sum(), "count")  # an integer output: no gradient
    return linear(a_NF, p["w_fc2"]) + x_ND, count


def params(d: int, f: int, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w_fc1": torch.randn(d, f, generator=g, dtype=torch.float64).to(dtype) / d**0.5,
            "s_F": torch.randn(f, generator=g, dtype=torch.float64).to(dtype),
            "w_fc2": torch.randn(f, d, generator=g, dtype=torch.float64).to(dtype) / f**0.5}


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 8), d=st.integers(1, 8), f=st.integers(1, 8), dtype=float_dtypes,
       policy=st.sampled_from(ALL_POLICIES), seed=st.integers(0, 2**16))
@example(n=1, d=1, f=1, dtype=torch.float64, policy=nothing_saveable, seed=0)
def test_remat_grads_equal_plain_grads(n, d, f, dtype, policy, seed):
    p = params(d, f, dtype, seed)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
    ct = torch.randn(n, d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)

    def plain_f(p, x):
        return block(p, x)[0]

    def remat_f(p, x):
        y, count = remat(block, policy)(p, x)
        return y

    ref_out, ref_fn = torch.func.vjp(plain_f, p, x)
    ref = ref_fn(ct)
    out, fn = torch.func.vjp(remat_f, p, x)
    assert_close(out, ref_out)
    assert_close(fn(ct), ref)
    # through split_vjp
    out, vjp_dx = split_vjp(remat_f, p, x)
    (dx,), vjp_dw = vjp_dx(ct)
    assert_close((vjp_dw(), dx), ref)


def test_split_vjp_recomputes_once_in_dx_and_never_in_dw():
    calls = []

    def counted(p, x):
        calls.append(1)
        return block(p, x)

    p, x = params(6, 7, torch.float32, 0), torch.randn(5, 6)
    out, vjp_dx = split_vjp(lambda p, x: remat(counted)(p, x)[0], p, x)
    assert len(calls) == 1
    with FlopCounterMode(display=False):
        _, vjp_dw = vjp_dx(torch.ones_like(out))
    assert len(calls) == 2
    with FlopCounterMode(display=False) as dw_counter:
        vjp_dw()
    assert len(calls) == 2
    # The dw of both matmuls went on the tape (deferred), the recompute's forward matmuls went to dx.
    assert dw_counter.get_total_flops() == 2 * (2 * 5 * 6 * 7)


def test_remat_under_tape_autograd():
    p = {k: v.requires_grad_() for k, v in params(4, 5, torch.float64, 1).items()}
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    remat(block)(p, x)[0].square().sum().backward()
    got = [p[k].grad.clone() for k in sorted(p)] + [x.grad.clone()]
    for t in [*p.values(), x]:
        t.grad = None
    block(p, x)[0].square().sum().backward()
    assert_close(got, [p[k].grad for k in sorted(p)] + [x.grad])


def test_saved_values_are_replayed_verbatim():
    """With a saving policy the recompute sees the forward's values, even if the inputs would now
    produce different ones (here: a function with a side channel that changes between calls)."""
    state = {"shift": 0.0}

    def f(x):
        h = checkpoint_name(x * 2 + state["shift"], "h")
        return h * x

    x = torch.randn(4, dtype=torch.float64)
    _, fn_saved = torch.func.vjp(remat(f, save_only_these_names("h")), x)
    _, fn_plain = torch.func.vjp(remat(f, nothing_saveable), x)
    state["shift"] = 100.0
    g_saved, = fn_saved(torch.ones(4, dtype=torch.float64))
    g_plain, = fn_plain(torch.ones(4, dtype=torch.float64))
    assert_close(g_saved, 4 * x)  # d/dx (2x) x = 4x, with h from the forward (shift 0)
    assert_close(g_plain, 4 * x + 100.0)


def _mlp(p, x_ND):
    return linear(torch.nn.functional.silu(x_ND @ p["w_fc1"]) * p["s_F"], p["w_fc2"]).sin()


@pytest.mark.parametrize("engine", ["autograd", "torch.func.vjp", "split_vjp"])
def test_dots_saveable_by_name_reuses_the_forwards_products(engine):
    """JAX's policy by its name: the gradients without remat, and the recompute runs no matrix product (the
    backward's flops are those of the backward alone: dx and dw of two products)."""
    p, x = params(6, 7, torch.float64, 0), torch.randn(5, 6, dtype=torch.float64)
    ct = torch.randn(5, 6, dtype=torch.float64)
    want = torch.func.vjp(_mlp, p, x)[1](ct)
    g = remat(_mlp, policy="dots_saveable")
    with FlopCounterMode(display=False) as counter:
        if engine == "autograd":
            pl = {k: v.clone().requires_grad_() for k, v in p.items()}
            xl = x.clone().requires_grad_()
            out = g(pl, xl)
            counter.__exit__(None, None, None)
            counter.__enter__()
            out.backward(ct)
            got = ({k: v.grad for k, v in pl.items()}, xl.grad)
        elif engine == "split_vjp":
            _, vjp_dx = split_vjp(g, p, x)
            counter.__exit__(None, None, None)
            counter.__enter__()
            (dx,), vjp_dw = vjp_dx(ct)
            got = (vjp_dw(), dx)
        else:
            _, fn = torch.func.vjp(g, p, x)
            counter.__exit__(None, None, None)
            counter.__enter__()
            got = fn(ct)
    assert_close(got, want)
    assert counter.get_total_flops() == 2 * 2 * (2 * 5 * 6 * 7)  # with nothing_saveable: 3 x that


def test_dots_saveable_recomputes_a_product_written_in_place():
    def f(x, w):
        h = x @ w
        h.mul_(2.0)  # the forward's product is gone: the recompute must run it again, not reuse 2 h
        return h.sin()

    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    ct = torch.ones(3, 2, dtype=torch.float64)
    assert_close(torch.func.vjp(remat(f, dots_saveable), x, w)[1](ct), torch.func.vjp(f, x, w)[1](ct))
    assert saved_residuals(f, "dots_saveable", x, w) == []


def test_remat_policy_names_resolve_and_an_unknown_one_lists_them():
    assert set(POLICIES) >= {"nothing_saveable", "everything_saveable", "dots_saveable"}
    assert remat(torch.sin, policy="everything_saveable") is torch.sin
    with pytest.raises(ValueError, match=r"unknown policy 'dots_savable' \(did you mean 'dots_saveable'\?\); "
                                         r"the policies by name are \['checkpoint_dots', 'dots_saveable'"):
        remat(torch.sin, policy="dots_savable")
    with pytest.raises(ValueError, match=r"pass save_only_these_names\('a', ...\)"):
        remat(torch.sin, policy="save_only_these_names")


def test_saved_residuals_lists_tags():
    p, x = params(3, 4, torch.float32, 0), torch.randn(2, 3)
    seen = saved_residuals(block, save_only_these_names("fc1"), p, x)
    assert seen == [("fc1", (2, 4), True), ("act", (2, 4), False), ("count", (), False)]


def dropout_block(p: dict, x_ND: torch.Tensor, rate: float) -> torch.Tensor:
    h_NF = checkpoint_name(linear(x_ND, p["w_fc1"]), "fc1")
    a_NF = torch.nn.functional.dropout(torch.nn.functional.silu(h_NF), rate, training=True) * p["s_F"]
    return linear(torch.nn.functional.dropout(a_NF, rate, training=True), p["w_fc2"]) + x_ND


def forward_draw_backward(vjp: str, f, p: dict, x: torch.Tensor, ct: torch.Tensor, seed: int):
    """Seed, forward, draw from the stream, backward, draw again: returns (out, grads, draws)."""
    torch.manual_seed(seed)
    if vjp == "split_vjp":
        out, vjp_dx = split_vjp(f, p, x)
        mid = torch.rand(3)
        (dx,), vjp_dw = vjp_dx(ct)
        grads = (vjp_dw(), dx)
    elif vjp == "tape":
        pg = {k: v.detach().requires_grad_() for k, v in p.items()}
        xg = x.detach().requires_grad_()
        out = f(pg, xg)
        mid = torch.rand(3)
        out.backward(ct)
        grads = ({k: v.grad for k, v in pg.items()}, xg.grad)
        out = out.detach()
    else:
        out, fn = torch.func.vjp(f, p, x)
        mid = torch.rand(3)
        grads = fn(ct)
    return out, grads, (mid, torch.rand(3))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 8), d=st.integers(1, 6), f=st.integers(1, 6), rate=st.sampled_from([0.1, 0.5, 0.9]),
       policy=st.sampled_from([nothing_saveable, save_only_these_names("fc1")]),
       vjp=st.sampled_from(["torch.func.vjp", "split_vjp", "tape"]), seed=st.integers(0, 2**16))
@example(n=4, d=3, f=5, rate=0.5, policy=nothing_saveable, vjp="torch.func.vjp", seed=0)
@example(n=1, d=1, f=1, rate=0.9, policy=nothing_saveable, vjp="split_vjp", seed=1)
def test_remat_replays_dropout_and_leaves_the_callers_stream_alone(n, d, f, rate, policy, vjp, seed):
    """The recompute draws the forward's dropout masks; the draws around it are those without remat."""
    p = params(d, f, torch.float64, seed)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ct = torch.randn(n, d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)

    def plain_f(p, x):
        return dropout_block(p, x, rate)

    def remat_f(p, x):
        return remat(dropout_block, policy)(p, x, rate)

    ref_out, ref_grads, ref_draws = forward_draw_backward(vjp, plain_f, p, x, ct, seed)
    out, grads, draws = forward_draw_backward(vjp, remat_f, p, x, ct, seed)
    assert_close(out, ref_out)
    assert_close(grads, ref_grads)
    assert_close(draws, ref_draws)


# ---- a recompute that would not reproduce its forward is refused (issue 34) --------------------------

def remat_vjp(f, policy, *args):
    """vjp of remat(f, policy) at args: returns the vjp function (the forward is run)."""
    return torch.func.vjp(remat(f, policy), *args)[1]


@pytest.mark.parametrize("policy", [nothing_saveable, save_only_these_names("h")])
def test_remat_refuses_a_recompute_whose_tags_differ(policy):
    """A branch on state that changed after the forward: the tagged value has another shape."""
    state = {"n": 4}

    def f(x):
        h = checkpoint_name(x[: state["n"]] * 2, "h")
        return (h * 3).sum() + x.sum()

    fn = remat_vjp(f, policy, torch.randn(4, dtype=torch.float64))
    state["n"] = 1
    with pytest.raises(RecomputeError, match=r"tag 0 was 'h' float64 \[4\].*'h' float64 \[1\]"):
        fn(torch.ones((), dtype=torch.float64))


def test_remat_refuses_a_recompute_that_passes_other_tags():
    state = {"branch": "a"}

    def f(x):
        if state["branch"] == "a":
            return checkpoint_name(x.sin(), "a")
        return checkpoint_name(x.cos(), "b") * checkpoint_name(x, "c")

    fn = remat_vjp(f, nothing_saveable, torch.randn(4, dtype=torch.float64))
    state["branch"] = "b"
    with pytest.raises(RecomputeError, match="tag 0 was 'a'.*'b'"):
        fn(torch.ones(4, dtype=torch.float64))


def test_remat_refuses_a_recompute_whose_outputs_differ():
    state = {"n": 4}

    def f(x):
        return x[: state["n"]] * 2

    fn = remat_vjp(f, nothing_saveable, torch.randn(4, dtype=torch.float64))
    state["n"] = 2
    with pytest.raises(RecomputeError, match=r"output 0.*\[4\].*\[2\]"):
        fn(torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("engine", ["torch.func.vjp", "split_vjp"])
def test_remat_refuses_an_input_modified_in_place_before_the_backward(engine):
    x = torch.randn(4, dtype=torch.float64)
    idx = torch.tensor([0, 1])

    def f(p, x):
        return remat(lambda x, idx: x[idx] * p["s"])(x, idx)

    p = {"s": torch.ones(())}
    if engine == "split_vjp":
        out, fn = split_vjp(f, p, x)
    else:
        out, fn = torch.func.vjp(lambda x: f(p, x), x)
    idx[0] = 3  # a reused index buffer: the recompute would scatter the gradient to other rows
    with pytest.raises(RecomputeError, match=r"argument \[1\].*modified in place"):
        fn(torch.ones(2, dtype=torch.float64))


def test_remat_refuses_a_float_input_modified_in_place_under_vjp():
    x = torch.randn(4, dtype=torch.float64)
    _, fn = torch.func.vjp(remat(torch.sin), x)
    x.add_(1.0)  # torch.func.vjp itself does not check: the gradient would be cos of the new x
    with pytest.raises(RecomputeError, match=r"argument \[0\].*modified in place"):
        fn(torch.ones(4, dtype=torch.float64))


def test_remat_refuses_a_closed_over_tensor_modified_in_place():
    w = torch.randn(4, dtype=torch.float64)

    def f(x):
        return x * w.sin()

    fn = remat_vjp(f, nothing_saveable, torch.randn(4, dtype=torch.float64))
    w.add_(1.0)
    with pytest.raises(RecomputeError, match="'w'.*modified in place"):
        fn(torch.ones(4, dtype=torch.float64))



SCALE_4 = torch.randn(4, dtype=torch.float64)  # a module-level tensor a remat region reads
_OUT_BUF = torch.empty(4, dtype=torch.float64)  # a module-level buffer a remat region only writes
_TABLE = {"rows": torch.randn(4, dtype=torch.float64)}


def _reads_a_global(x):
    return x * SCALE_4.sin()


def _calls_a_reader(x):
    return _reads_the_table(x) * 2  # the tensor is read two calls down: no closure or global of f holds it


def _reads_the_table(x):
    return x * _TABLE["rows"].cos()


@pytest.mark.parametrize("engine", ["autograd", "torch.func.vjp", "split_vjp"])
def test_remat_refuses_a_global_tensor_modified_in_place(engine):
    """A module-level tensor changed in place between the forward and the backward: the recompute would
    read the new values (a gradient of another forward), so the backward raises, naming the global."""
    x = torch.randn(4, dtype=torch.float64)
    g = remat(_reads_a_global)
    if engine == "autograd":
        xl = x.clone().requires_grad_()
        out = g(xl)
        fn = lambda ct: out.backward(ct)  # noqa: E731
    elif engine == "split_vjp":
        fn = split_vjp(lambda p, x: g(x), {}, x)[1]
    else:
        fn = torch.func.vjp(g, x)[1]
    before = SCALE_4.clone()
    try:
        SCALE_4.mul_(3.0)
        with pytest.raises(RecomputeError, match=r"global 'SCALE_4' \(float64 \[4\].*modified in place"):
            fn(torch.ones(4, dtype=torch.float64))
    finally:
        SCALE_4.copy_(before)


def test_remat_refuses_a_tensor_read_by_a_called_function_modified_in_place():
    fn = remat_vjp(_calls_a_reader, nothing_saveable, torch.randn(4, dtype=torch.float64))
    before = _TABLE["rows"].clone()
    try:
        _TABLE["rows"].add_(1.0)
        with pytest.raises(RecomputeError, match="not its argument nor closed over.*modified in place"):
            fn(torch.ones(4, dtype=torch.float64))
    finally:
        _TABLE["rows"].copy_(before)


def test_remat_accepts_a_buffer_the_forward_only_writes():
    """An out= buffer outside f is written, not read, by the forward: changing it later changes nothing
    the recompute reads, and the gradient is the one without remat."""
    def f(x):
        torch.mul(x.detach(), 2.0, out=_OUT_BUF)
        return x.sin() * _OUT_BUF

    x = torch.randn(4, dtype=torch.float64)
    fn = torch.func.vjp(remat(f), x)[1]
    _OUT_BUF.zero_()  # the recompute writes it again before reading it
    (dx,) = fn(torch.ones(4, dtype=torch.float64))
    assert_close(dx, x.cos() * 2 * x)



# ---- the region holds its inputs only: its outputs go with their readers -----------------------------

@pytest.mark.parametrize("engine", ["autograd", "torch.func.vjp", "split_vjp"])
def test_remat_holds_no_output_once_its_readers_are_done(engine):
    """y = remat(f)(x) read by an op that saves nothing of it (a sum): y is freed after the forward, as
    without remat, and the backward (which recomputes y) gives the gradients without remat (float64)."""
    import gc
    import weakref

    produced = []

    def f(p, x):
        y = x @ p["w"] + p["b"]  # the matmul saves its inputs, the add nothing: y is held by no op
        produced.append(weakref.ref(y))
        return {"y": y, "n": 3}  # a plain leaf beside it: returned as the forward computed it

    def loss(p, x, g):
        out = g(p, x)
        return (out["y"].sum() * out["n"]) * (x ** 2).sum()

    gen = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(5, 4, generator=gen, dtype=torch.float64),
         "b": torch.randn(4, generator=gen, dtype=torch.float64)}
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    ct = torch.tensor(1.5, dtype=torch.float64)
    _, ref_fn = torch.func.vjp(lambda p, x: loss(p, x, f), p, x)
    want = ref_fn(ct)
    produced.clear()
    g = remat(f, preserve_rng_state=False)
    if engine == "autograd":
        pl = {k: v.clone().requires_grad_() for k, v in p.items()}
        xl = x.clone().requires_grad_()
        z = loss(pl, xl, g)
    elif engine == "torch.func.vjp":
        _, fn = torch.func.vjp(lambda p, x: loss(p, x, g), p, x)
    else:
        _, fn = split_vjp(lambda p, x: loss(p, x, g), p, x)
    gc.collect()
    assert len(produced) == 1 and produced[0]() is None, "remat kept its output alive until the backward"
    if engine == "autograd":
        z.backward(ct)
        got = ({k: v.grad for k, v in pl.items()}, xl.grad)
    elif engine == "torch.func.vjp":
        got = fn(ct)
    else:
        (dx,), vjp_dw = fn(ct)
        got = (vjp_dw(), dx)
    assert len(produced) == 2  # the backward recomputed y
    assert_close(got, want)


@pytest.mark.parametrize("was, now, match", [
    (True, False, "output leaf 0 was a Tensor in the forward, a float in the recompute"),
    (False, True, "output leaf 0 was a float in the forward, a Tensor in the recompute"),
])
def test_remat_refuses_a_recompute_whose_output_leaves_change_kind(was, now, match):
    state = {"tensor": was}

    def f(x):
        s = x.sum() if state["tensor"] else 2.0
        return s, x * 3

    _, fn = torch.func.vjp(lambda x: remat(f)(x)[1], torch.randn(4, dtype=torch.float64))
    state["tensor"] = now
    with pytest.raises(RecomputeError, match=match):
        fn(torch.ones(4, dtype=torch.float64))


def test_remat_refuses_a_recompute_whose_plain_output_differs():
    state = {"n": 3}

    def f(x):
        return x * state["n"], state["n"]

    _, fn = torch.func.vjp(lambda x: remat(f)(x)[0], torch.randn(4, dtype=torch.float64))
    state["n"] = 4
    with pytest.raises(RecomputeError, match="output leaf 1 was 3 in the forward, 4 in the recompute"):
        fn(torch.ones(4, dtype=torch.float64))
