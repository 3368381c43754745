"""split_vjp against the unsplit torch.func.vjp and float64 finite differences, and the checks that keep
its deferred work from trusting what it captured: in-place writes after vjp_dx, a wrong cotangent, tied
weights, vmap.

Legend: N rows, D model width, F hidden width, L depth.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import weakref

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from fmoe._compat import is_functorch_wrapped, tree_flatten
from fmoe.config import MoEConfig
from fmoe.layer import init_moe
from fmoe.model import moe
from fmoe.ops import linear
from fmoe.transforms import (
    CaptureModifiedError,
    WeightGradTape,
    active_tape,
    check_vjp,
    defer_weight_grad,
    split_vjp,
)
from fmoe.transforms.pytree import pytree_dataclass
from fmoe.transforms.split_vjp import ENGINES, PLAIN_OPS
from fmoe.transforms.tape import unwrapped
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


def split_as_vjp(f, *primals, engine="func"):
    """Adapter: split_vjp as a plain vjp (params first), for check_vjp and comparisons."""
    out, vjp_dx = split_vjp(f, *primals, engine=engine)

    def fn(ct):
        dargs, vjp_dw = vjp_dx(ct)
        return (vjp_dw(), *dargs)

    return out, fn


@SETTINGS
@given(depth=st.integers(1, 3), n=st.integers(1, 9), d=st.integers(1, 8), f=st.integers(1, 12),
       dtype=float_dtypes, seed=st.integers(0, 2**16), engine=st.sampled_from(ENGINES), defer=st.booleans(),
       plain_ops=st.sampled_from(PLAIN_OPS))
@example(depth=1, n=1, d=1, f=1, dtype=torch.float64, seed=0, engine="func", defer=True, plain_ops="dx")
@example(depth=1, n=1, d=1, f=1, dtype=torch.float64, seed=0, engine="autograd", defer=True, plain_ops="dx")
@example(depth=2, n=3, d=2, f=3, dtype=torch.float64, seed=0, engine="autograd", defer=False, plain_ops="dx")
@example(depth=2, n=3, d=2, f=3, dtype=torch.float64, seed=0, engine="func", defer=False, plain_ops="dx")
@example(depth=2, n=3, d=2, f=3, dtype=torch.float64, seed=0, engine="autograd", defer=True,
         plain_ops="defer")
def test_split_vjp_equals_unsplit_vjp(depth, n, d, f, dtype, seed, engine, defer, plain_ops):
    params = make_params(depth, d, f, dtype, seed)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)
    ct = torch.randn(n, d, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64).to(dtype)
    plain_ops = plain_ops if engine == "autograd" else "dx"  # "defer" walks the autograd graph
    out, vjp_dx = split_vjp(stack, params, x, engine=engine, defer=defer, plain_ops=plain_ops)
    (dx,), vjp_dw = vjp_dx(ct)
    dparams = vjp_dw()
    ref_out, ref_fn = torch.func.vjp(stack, params, x)
    ref_dparams, ref_dx = ref_fn(ct)
    # fp16 can overflow in the oracle itself (the norm's rsqrt backward): no finite answer to compare
    assume(all(bool(torch.isfinite(t).all()) for t in tree_flatten((ref_out, ref_dx, ref_dparams))[0]))
    scale = 4.0 * depth if dtype == torch.bfloat16 else 1.0
    assert_close(out, ref_out, scale=scale)
    assert_close(dx, ref_dx, scale=scale)
    assert_close(dparams, ref_dparams, scale=scale)
    assert torch.count_nonzero(dparams["unused_D"]) == 0


@settings(max_examples=15, deadline=None)
@given(depth=st.integers(1, 3), n=st.integers(1, 6), d=st.integers(1, 6), f=st.integers(1, 6),
       seed=st.integers(0, 2**16), engine=st.sampled_from(ENGINES))
def test_split_vjp_passes_finite_differences(depth, n, d, f, seed, engine):
    params = make_params(depth, d, f, torch.float64, seed)
    x = torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    check_vjp(stack, params, x, vjp=functools.partial(split_as_vjp, engine=engine),
              generator=torch.Generator().manual_seed(seed))


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@settings(max_examples=15, deadline=None)
@given(depth=st.integers(1, 3), n=st.integers(1, 16), d=st.integers(1, 16), f=st.integers(1, 16),
       seed=st.integers(0, 2**16), engine=st.sampled_from(ENGINES), defer=st.booleans())
@example(depth=1, n=1, d=1, f=1, seed=0, engine="autograd", defer=True)
@example(depth=1, n=1, d=1, f=1, seed=0, engine="autograd", defer=False)
def test_flops_of_dx_plus_dw_equal_full_backward(depth, n, d, f, seed, engine, defer):
    """No recompute: the two passes do the backward's FLOPs between them; with defer=False the dx pass
    does them all (vjp_dw only hands the gradients over)."""
    params = make_params(depth, d, f, torch.float32, seed)
    x = torch.randn(n, d).requires_grad_(False)
    ct = torch.ones(n, d)
    _, full_fn = torch.func.vjp(stack, params, x)
    full = flops(lambda: full_fn(ct))
    _, vjp_dx = split_vjp(stack, params, x, engine=engine, defer=defer)
    box = {}
    dx_flops = flops(lambda: box.setdefault("dw", vjp_dx(ct)[1]))
    dw_flops = flops(lambda: box["dw"]())
    assert dx_flops + dw_flops == full
    assert (dw_flops > 0) if defer else (dw_flops == 0)


@pytest.mark.parametrize("engine", ENGINES)
def test_each_pass_runs_once_and_in_order(engine):
    params = make_params(1, 3, 4, torch.float64, 0)
    x = torch.randn(2, 3, dtype=torch.float64)
    _, vjp_dx = split_vjp(stack, params, x, engine=engine)
    _, vjp_dw = vjp_dx(torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="vjp_dx was already called"):
        vjp_dx(torch.ones(2, 3, dtype=torch.float64))
    vjp_dw()
    with pytest.raises(RuntimeError, match="vjp_dw was already called"):
        vjp_dw()


@pytest.mark.parametrize("engine", ENGINES)
def test_nothing_is_held_after_dw(engine):
    """The activations of the forward die with the passes: a weakref to one must be dead after vjp_dw."""
    params = make_params(2, 4, 5, torch.float64, 0)
    x = torch.randn(3, 4, dtype=torch.float64)
    refs = []

    def f(p, x):
        h = torch.tanh(linear(x, p["blocks"][0]["w_in"]))
        refs.append(weakref.ref(unwrapped(h)))
        return linear(h, p["blocks"][0]["w_out"])

    _, vjp_dx = split_vjp(f, params, x, engine=engine)
    _, vjp_dw = vjp_dx(torch.ones(3, 4, dtype=torch.float64))
    del vjp_dx
    vjp_dw()
    del vjp_dw
    gc.collect()
    assert refs and refs[0]() is None


@pytest.mark.parametrize("engine", ENGINES)
def test_weight_used_twice_accumulates_and_int_args_pass_through(engine):
    w = torch.randn(3, 3, dtype=torch.float64)
    ids = torch.tensor([0, 2, 1])

    def f(p, x, ids):
        return linear(linear(x[ids], p["w"]), p["w"])

    x = torch.randn(3, 3, dtype=torch.float64)
    ct = torch.randn(3, 3, dtype=torch.float64)
    _, vjp_dx = split_vjp(f, {"w": w}, x, ids, engine=engine)
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


@pytree_dataclass(static=("k",))
@dataclasses.dataclass(frozen=True)
class Routed:
    total: torch.Tensor | None
    k: int


@pytest.mark.parametrize("engine", ENGINES)
def test_aux_comes_back_holding_no_graph(engine):
    """An aux tensor made under grad (a sum of the input), a view of an activation taken under no_grad
    (its _base holds the graph) and plain integer tensors: none comes back requiring grad or viewing a
    tensor that does, with the values f made; an aux with no graph comes back with its values as well."""
    def f(p, x):
        h = linear(x, p)
        with torch.no_grad():
            row = h[0]
        return h, {"info": Routed(h.sum(), 3), "row": row, "ids": [torch.arange(3)], "n": 2}

    w, x = torch.randn(2, 2, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    out, _, aux = split_vjp(f, w, x, has_aux=True, engine=engine)
    leaves = [aux["info"].total, aux["row"], aux["ids"][0]]
    assert aux["n"] == 2 and aux["info"].k == 3
    assert not any(t.requires_grad or (t._base is not None and t._base.requires_grad) for t in leaves)
    assert_close(aux["info"].total, (x @ w).sum())
    assert_close(aux["row"], (x @ w)[0])
    assert aux["ids"][0].tolist() == [0, 1, 2]
    _, _, plain = split_vjp(lambda p, x: (linear(x, p), {"ids": torch.arange(2), "k": Routed(None, 1)}), w, x,
                            has_aux=True, engine=engine)
    assert plain["ids"].tolist() == [0, 1] and plain["k"] == Routed(None, 1)


# ---- deferred work must not trust what it captured ------------------------------------------------

def captured_mix(p: dict, x_ND: torch.Tensor, extra: dict) -> dict:
    """Four deferred weight grads, each reading another input: x (w1), an activation and the cotangent
    (w2), extra['h'] (w3), the param u used as the input of a linear (w4)."""
    h_NF = torch.tanh(linear(x_ND, p["w1"]))
    return {"y": linear(h_NF, p["w2"]) + linear(extra["h"], p["w3"]) + linear(p["u"], p["w4"])}


def captured_mix_inputs(n: int, d: int, seed: int) -> tuple[dict, torch.Tensor, dict, dict]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float64)

    params = {"w1": r(d, d + 1), "w2": r(d + 1, d), "w3": r(2, d), "w4": r(3, d), "u": r(n, 3)}
    return params, r(n, d), {"h": r(n, 2)}, {"y": r(n, d)}


MUTATIONS = {
    "add": lambda t: t.add_(1.0),
    "neg": lambda t: t.neg_(),
    "same_values": lambda t: t.mul_(1.0),  # contents unchanged, still a write (tape autograd raises too)
    "view": lambda t: t[0].fill_(3.0),  # a write through a view bumps the shared version counter
}
# target -> (how the error names it, the weight whose deferred gradient reads it), None: not captured
TARGETS = {
    "x": (r"argument 0", r"params\['w1'\]"),
    "extra": (r"argument 1\['h'\]", r"params\['w3'\]"),
    "cotangent": (r"the cotangent\['y'\]", r"params\['w[234]'\]"),
    "u": (r"params\['u'\]", r"params\['w4'\]"),
    "w1": None,  # a weight: dw = x^T g does not read it, so writing it after vjp_dx is harmless
}


@settings(max_examples=25, deadline=None)
@given(target=st.sampled_from(sorted(TARGETS)), mutation=st.sampled_from(sorted(MUTATIONS)),
       n=st.integers(1, 4), d=st.integers(1, 4), seed=st.integers(0, 2**16))
@example(target="x", mutation="neg", n=2, d=3, seed=0)
@example(target="cotangent", mutation="view", n=1, d=1, seed=0)
@example(target="w1", mutation="add", n=2, d=2, seed=0)
def test_writing_a_captured_input_after_vjp_dx_raises_and_names_it(target, mutation, n, d, seed):
    params, x, extra, ct = captured_mix_inputs(n, d, seed)
    _, ref_fn = torch.func.vjp(captured_mix, params, x, extra)
    ref = ref_fn(ct)
    _, vjp_dx = split_vjp(captured_mix, params, x, extra)
    (dx, dextra), vjp_dw = vjp_dx(ct)
    assert_close((dx, dextra), ref[1:])
    victim = {"x": x, "extra": extra["h"], "cotangent": ct["y"], "u": params["u"], "w1": params["w1"]}[target]
    MUTATIONS[mutation](victim)
    if TARGETS[target] is None:
        assert_close(vjp_dw(), ref[0])
        return
    who, weight = TARGETS[target]
    pattern = f"{who} was modified in place after vjp_dx .* deferred weight gradient of {weight}"
    with pytest.raises(CaptureModifiedError, match=pattern):
        vjp_dw()
    with pytest.raises(CaptureModifiedError, match=pattern):  # the same error again, not "already called"
        vjp_dw()


def test_moe_under_split_vjp_refuses_an_input_written_after_vjp_dx():
    """The case that came out sign-flipped: a pipeline reusing x's buffer before the router's dw ran."""
    cfg = MoEConfig(d_model=4, d_ff=6, num_experts=4, top_k=2)
    g = torch.Generator().manual_seed(0)
    params = init_moe(cfg, g, dtype=torch.float64)
    x_TD = torch.randn(8, 4, generator=g, dtype=torch.float64)
    ct_TD = torch.randn(8, 4, generator=g, dtype=torch.float64)

    def f(p, x):
        return moe(p, x, cfg)[0]

    _, vjp_dx = split_vjp(f, params, x_TD)
    _, vjp_dw = vjp_dx(ct_TD)
    x_TD.neg_()
    with pytest.raises(CaptureModifiedError, match=r"argument 0 was modified in place after vjp_dx"):
        vjp_dw()
    # The same schedule with a copy handed over is fine and matches the unsplit vjp.
    x_TD.neg_()
    _, ref_fn = torch.func.vjp(f, params, x_TD)
    ref_dp, _ = ref_fn(ct_TD)
    _, vjp_dx = split_vjp(f, params, x_TD.clone())
    _, vjp_dw = vjp_dx(ct_TD)
    x_TD.neg_()
    assert_close(vjp_dw(), ref_dp)


def test_tape_checks_the_tensors_a_thunk_captured():
    w, x, g = torch.randn(3, 2), torch.randn(4, 3), torch.randn(4, 2)
    for captures in (None, (x, g)):  # None: found in the lambda's closure
        tape = WeightGradTape([w])
        with active_tape(tape):
            assert defer_weight_grad(w, lambda: x.t() @ g, captures) is not None
        x.add_(1.0)
        with pytest.raises(CaptureModifiedError, match=r"weight 0 \(shape \(3, 2\)\) was modified in place"):
            tape.run()
        assert len(tape) == 1  # nothing consumed
    tape = WeightGradTape([w])
    with active_tape(tape):
        defer_weight_grad(w, lambda: x.t() @ g)
    torch.testing.assert_close(tape.run()[0], x.t() @ g)


def test_the_tape_knows_its_placeholders_and_nothing_else():
    """split_vjp skips adding a placeholder to the deferred gradient, so a real gradient must never be
    taken for one: not a zero tensor, not a sum of placeholders, not another tape's, not a broadcast."""
    w, s_ = torch.randn(3, 2), torch.randn(())
    tape, other = WeightGradTape([w, s_]), WeightGradTape([w])
    with active_tape(tape):
        ph = defer_weight_grad(w, lambda: torch.ones(3, 2))
        ph_scalar = defer_weight_grad(s_, lambda: torch.ones(()))
    with active_tape(other):
        ph_other = defer_weight_grad(w, lambda: torch.ones(3, 2))
    assert ph.shape == w.shape and ph.stride() == (0, 0) and torch.count_nonzero(ph) == 0
    assert tape.is_placeholder(ph)
    for g in (torch.zeros(3, 2), ph + ph, ph.clone(), ph_other, torch.tensor(2.0).expand(3, 2), None):
        assert not tape.is_placeholder(g)
    ph_scalar.add_(1.0)  # a 0-dim placeholder is its own tensor: writing it reaches nothing else
    assert not tape.is_placeholder(ph_scalar) and torch.count_nonzero(ph) == 0


def test_split_vjp_refuses_vmap():
    w = torch.randn(3, 4, dtype=torch.float64)
    xs = torch.randn(5, 2, 3, dtype=torch.float64)
    cts = torch.randn(5, 2, 4, dtype=torch.float64)

    def per_sample(x, ct):
        _, vjp_dx = split_vjp(lambda p, x: linear(x, p), w, x)
        return vjp_dx(ct)[1]()

    with pytest.raises(RuntimeError, match="split_vjp does not support torch.func.vmap"):
        torch.func.vmap(per_sample)(xs, cts)
    # vjp_dx under vmap (the forward outside) is refused too, and not used up by the refusal.
    _, vjp_dx = split_vjp(lambda p, x: linear(x, p), w, xs[0])
    with pytest.raises(RuntimeError, match="split_vjp does not support torch.func.vmap"):
        torch.func.vmap(lambda ct: vjp_dx(ct)[1]())(cts[:, 0])
    _, vjp_dw = vjp_dx(cts[0])
    assert_close(vjp_dw(), xs[0].t() @ cts[0])
    # What the message points to: torch.func.vjp inside vmap gives per-sample weight grads.
    per = torch.func.vmap(lambda x, ct: torch.func.vjp(lambda p: linear(x, p), w)[1](ct)[0])(xs, cts)
    assert_close(per, torch.einsum("snd,snf->sdf", xs, cts))


ROLES = ("deferred", "plain", "sum", "unused")  # a weight-bearing primitive, plain matmul, expanded grad


def apply_role(h_ND: torch.Tensor, w_DD: torch.Tensor, role: str) -> torch.Tensor:
    if role == "deferred":
        return torch.tanh(linear(h_ND, w_DD))
    if role == "plain":
        return torch.tanh(h_ND @ w_DD)
    if role == "sum":
        return h_ND * w_DD.sum()  # its gradient is a stride-0 expanded scalar under torch.func.vjp
    return h_ND


@st.composite
def aliased_case(draw: st.DrawFn) -> dict:
    """Params (a nested dict) and a weight-like positional arg drawn from a few base tensors, so that one
    tensor object can sit under several keys (and be the arg too); each use gets a role."""
    d = draw(st.integers(1, 4))
    n_base = draw(st.integers(1, 3))
    keys = draw(st.lists(st.sampled_from(["a", "b", "blk.c", "blk.d", "e"]), min_size=1, max_size=5,
                         unique=True))
    which = {k: draw(st.integers(0, n_base - 1)) for k in [*keys, "arg"]}
    roles = {k: draw(st.sampled_from(ROLES)) for k in [*keys, "arg"]}
    return {"d": d, "n": draw(st.integers(1, 3)), "n_base": n_base, "which": which, "roles": roles,
            "seed": draw(st.integers(0, 2**16))}


def build_aliased(case: dict) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    g = torch.Generator().manual_seed(case["seed"])
    d, n = case["d"], case["n"]
    bases = [torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5 for _ in range(case["n_base"])]
    params: dict = {}
    keys = [k for k in case["which"] if k != "arg"]
    for k in keys:
        node, *rest = k.split(".")
        if rest:
            params.setdefault(node, {})[rest[0]] = bases[case["which"][k]]
        else:
            params[k] = bases[case["which"][k]]
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    ct = torch.randn(n, d, generator=g, dtype=torch.float64)
    return params, x, bases[case["which"]["arg"]], ct, keys


def get_key(p: dict, key: str) -> torch.Tensor:
    node, *rest = key.split(".")
    return p[node][rest[0]] if rest else p[node]


@settings(max_examples=40, deadline=None)
@given(case=aliased_case())
@example(case={"d": 3, "n": 2, "n_base": 1, "which": {"a": 0, "b": 0, "arg": 0},
               "roles": {"a": "deferred", "b": "deferred", "arg": "unused"}, "seed": 0})  # the tied pair
@example(case={"d": 2, "n": 2, "n_base": 1, "which": {"a": 0, "arg": 0},
               "roles": {"a": "deferred", "arg": "deferred"}, "seed": 1})  # a param passed as an arg too
@example(case={"d": 2, "n": 1, "n_base": 2, "which": {"a": 0, "b": 1, "arg": 1},
               "roles": {"a": "sum", "b": "unused", "arg": "sum"}, "seed": 2})  # expanded grads only
def test_aliased_leaves_get_their_own_gradients_as_real_tensors(case):
    params, x, w_arg, ct, keys = build_aliased(case)
    roles = case["roles"]

    def f(p, x, w_arg):
        h = x
        for k in keys:
            h = apply_role(h, get_key(p, k), roles[k])
        return apply_role(h, w_arg, roles["arg"])

    _, ref_fn = torch.func.vjp(f, params, x, w_arg)
    ref_dp, ref_dx, ref_dw_arg = ref_fn(ct)
    _, vjp_dx = split_vjp(f, params, x, w_arg)
    (dx, dw_arg), vjp_dw = vjp_dx(ct)
    dparams = vjp_dw()
    assert_close((dparams, dx, dw_arg), (ref_dp, ref_dx, ref_dw_arg))
    for grad in tree_flatten((dparams, dx, dw_arg))[0]:
        if grad.numel() > 1:
            assert all(s != 0 for s in grad.stride()), grad.stride()
        grad.add_(1.0)  # writable: no expanded placeholder


COTANGENT_MISTAKES = {
    "shape": ({"y": torch.ones(2, 5, dtype=torch.float64), "s": torch.ones((), dtype=torch.float64)},
              r"the cotangent\['y'\] is a torch.float64 tensor of shape \(2, 5\), but the output\['y'\] "
              r"is a torch.float64 tensor of shape \(2, 4\)"),
    "dtype": ({"y": torch.ones(2, 4, dtype=torch.float64), "s": torch.ones((), dtype=torch.float32)},
              r"the cotangent\['s'\] is a torch.float32 tensor of shape \(\), but the output\['s'\] is a "
              r"torch.float64 tensor of shape \(\)"),
    "none_leaf": ({"y": None, "s": torch.ones((), dtype=torch.float64)},
                  r"the cotangent\['y'\] is None, but the output\['y'\] is a torch.float64 tensor"),
    "missing_key": ({"y": torch.ones(2, 4, dtype=torch.float64)},
                    r"the cotangent must have the structure of the output"),
    "bare_tensor": (torch.ones(2, 4, dtype=torch.float64),
                    r"expected \{'y': Tensor, 's': Tensor\}, got Tensor"),
    "not_a_tensor": ({"y": torch.ones(2, 4, dtype=torch.float64), "s": 1.0},
                     r"the cotangent\['s'\] is a float, but the output\['s'\] is a torch.float64 tensor"),
}


@pytest.mark.parametrize("mistake", sorted(COTANGENT_MISTAKES))
def test_a_wrong_cotangent_is_named_and_does_not_use_up_vjp_dx(mistake):
    w = torch.randn(3, 4, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)

    def f(p, x):
        y = linear(x, p)
        return {"y": y, "s": y.square().sum()}

    bad, pattern = COTANGENT_MISTAKES[mistake]
    _, vjp_dx = split_vjp(f, w, x)
    with pytest.raises(ValueError, match=pattern):
        vjp_dx(bad)
    ct = {"y": torch.randn(2, 4, dtype=torch.float64), "s": torch.tensor(0.5, dtype=torch.float64)}
    (dx,), vjp_dw = vjp_dx(ct)  # the retry works
    _, ref_fn = torch.func.vjp(f, w, x)
    assert_close((vjp_dw(), dx), ref_fn(ct))


def test_vjp_dw_does_not_hold_inputs_its_thunks_do_not_read():
    """The weak references kept for naming a modified input must not keep that input alive until dw."""
    w = torch.randn(3, 4, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)
    _, vjp_dx = split_vjp(lambda p, x: linear(torch.tanh(x), p), w, x)  # dw reads tanh(x), not x
    _, vjp_dw = vjp_dx(torch.ones(2, 4, dtype=torch.float64))
    ref = weakref.ref(x)
    del x, vjp_dx
    gc.collect()
    assert ref() is None
    assert vjp_dw().shape == (3, 4)


@settings(max_examples=30, deadline=None)
@given(depth=st.integers(1, 3), n=st.integers(1, 9), d=st.integers(1, 8), f=st.integers(1, 12),
       seed=st.integers(0, 2**16), mask=st.integers(0, 2**13 - 1))
@example(depth=1, n=1, d=1, f=1, seed=0, mask=0)  # no sums: every gradient fresh
@example(depth=2, n=3, d=2, f=3, seed=0, mask=2**13 - 1)  # a sum for every leaf, the unused one too
def test_into_adds_each_gradient_into_its_sum(depth, n, d, f, seed, mask):
    """vjp_dx(ct, into=sums): each given sum gets this pass's gradient added in place and comes back as
    itself; a leaf without one gets a fresh gradient that aliases nothing of the caller's. Oracle: the
    unsplit torch.func.vjp, added to the sums by hand."""
    params = make_params(depth, d, f, torch.float64, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    ct = torch.randn(n, d, generator=g, dtype=torch.float64)
    leaves, spec = tree_flatten(params)
    sums = [torch.randn(t.shape, generator=g, dtype=t.dtype) if mask >> k & 1 else None
            for k, t in enumerate(leaves)]
    before = [None if s is None else s.clone() for s in sums]
    into = torch.utils._pytree.tree_unflatten(sums, spec)
    _, ref_fn = torch.func.vjp(stack, params, x)
    ref_dparams, ref_dx = ref_fn(ct)
    ref = tree_flatten(ref_dparams)[0]
    caller = [ct, x, *leaves, *(s for s in sums if s is not None)]
    out, vjp_dx = split_vjp(stack, params, x, engine="autograd", defer=False)
    (dx,), vjp_dw = vjp_dx(ct, into=into)
    got = tree_flatten(vjp_dw())[0]
    assert_close(dx, ref_dx)
    for k, (s, b, r, t) in enumerate(zip(sums, before, ref, got)):
        if s is None:
            assert_close(t, r)
            assert all(t.untyped_storage().data_ptr() != c.untyped_storage().data_ptr() for c in caller), k
        else:
            assert t is s, f"leaf {k}: the sum must come back as itself"
            assert_close(t, b + r)


def test_into_refuses_modes_and_sums_that_do_not_fit():
    params = make_params(1, 2, 3, torch.float64, 0)
    x, ct = torch.randn(2, 2, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    zeros = torch.utils._pytree.tree_map(torch.zeros_like, params)
    for engine, defer in (("func", False), ("autograd", True)):
        _, vjp_dx = split_vjp(stack, params, x, engine=engine, defer=defer)
        with pytest.raises(ValueError, match="engine='autograd', defer=False"):
            vjp_dx(ct, into=zeros)
    _, vjp_dx = split_vjp(stack, params, x, engine="autograd", defer=False)
    with pytest.raises(ValueError, match="structure of params"):
        vjp_dx(ct, into={"blocks": zeros["blocks"]})
    wrong = {**zeros, "unused_D": torch.zeros(5, dtype=torch.float64)}
    with pytest.raises(ValueError, match="its sum is"):
        vjp_dx(ct, into=wrong)
    (dx,), vjp_dw = vjp_dx(ct, into=zeros)  # the refusals did not use the pass up
    assert_close(vjp_dw(), torch.func.vjp(stack, params, x)[1](ct)[0])
