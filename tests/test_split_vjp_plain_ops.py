"""split_vjp on code written with plain torch ops (issue 31): plain_ops="defer" (engine "autograd") against
the unsplit torch.func.vjp in float64, the FLOPs of each pass against plain torch.autograd.grad (no
recompute, the dx pass at the input-only minimum), its composition with the tape, `into=`, the
capture-modified checks and tied keys, and `deferral_report`.

Legend: N rows, D model width, F hidden width, L depth, V vocabulary.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from fmoe._compat import tree_flatten
from fmoe.ops import linear
from fmoe.transforms import CaptureModifiedError, deferral_report, split_vjp
from fmoe.transforms.testing import assert_close

F64 = torch.float64
V = 7


def r(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=F64) / max(shape[-1], 1) ** 0.5


def make_params(net: str, depth: int, d: int, f: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    layers = [{"ln_w": 1 + 0.1 * r(g, d), "ln_b": 0.1 * r(g, d), "w_in": r(g, f, d), "b_in": 0.1 * r(g, f),
               "w_out": r(g, d, f)} for _ in range(depth)]
    if net == "view":  # stored [in, out]: the net uses w.T
        for blk in layers:
            blk["w_in"] = blk["w_in"].T.contiguous()
    return {"layers": layers, "table": r(g, V, d), "sq": r(g, d, d), "unused": r(g, 3), "b": 0.1 * r(g, d)}


def layer(blk: dict, x: torch.Tensor, w_in: torch.Tensor, fmoe_out: bool = False) -> torch.Tensor:
    h = F.layer_norm(x, x.shape[-1:], blk["ln_w"], blk["ln_b"])
    h = F.silu(F.linear(h, w_in, blk["b_in"]))
    return x + (linear(h, blk["w_out"].T) if fmoe_out else F.linear(h, blk["w_out"]))


def net_fn(net: str):
    """The nets, f(params, x): each an edge case of the graph split."""
    def mlp(p, x):  # LayerNorm -> F.linear -> SiLU -> F.linear, residual; own params per layer
        for blk in p["layers"]:
            x = layer(blk, x, blk["w_in"])
        return x

    def tied(p, x):  # every layer uses layer 0's params: each weight below several branch points
        for _ in p["layers"]:
            x = layer(p["layers"][0], x, p["layers"][0]["w_in"])
        return x

    def view(p, x):  # w_in used only through a view (w.T)
        for blk in p["layers"]:
            x = layer(blk, x, blk["w_in"].T)
        return x

    def fmoe_mix(p, x):  # fmoe.ops.linear on a leaf (the tape defers it) and on a view (w.T: not deferred)
        x = linear(x, p["sq"])
        for blk in p["layers"]:
            x = layer(blk, x, blk["w_in"], fmoe_out=True)
        return linear(x, p["table"].T)

    def bias_only(p, x):
        return x + p["b"]

    def no_params(p, x):  # params exist, none reaches the output
        return torch.tanh(x) * 2

    def ids(p, ids_N):  # no differentiable argument: the whole backward is weight work
        return mlp(p, p["table"][ids_N])

    def param_out(p, x):  # a second output that only parameters reach, one returning a leaf as it is
        return mlp(p, x), p["b"] * 3, p["unused"]

    return {"mlp": mlp, "tied": tied, "view": view, "fmoe_mix": fmoe_mix, "bias_only": bias_only,
            "no_params": no_params, "ids": ids, "param_out": param_out}[net]


NETS = ["mlp", "tied", "view", "fmoe_mix", "bias_only", "no_params", "ids", "param_out"]


def inputs(net: str, n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    if net == "ids":
        return torch.randint(0, V, (n,), generator=g)
    return torch.randn(n, d, generator=g, dtype=F64)


def ones_ct(out):
    return tuple(torch.randn_like(o) for o in out) if isinstance(out, tuple) else torch.randn_like(out)


def flops(fn) -> tuple[int, object]:
    with FlopCounterMode(display=False) as counter:
        res = fn()
    return counter.get_total_flops(), res


def reference(f, params, x, ct):
    """The unsplit torch.func.vjp: (out, dparams, dx or None)."""
    if x.is_floating_point():
        out, fn = torch.func.vjp(f, params, x)
        dp, dx = fn(ct)
        return out, dp, dx
    out, fn = torch.func.vjp(lambda p: f(p, x), params)
    return out, fn(ct)[0], None


def plain_grads(f, params, x, ct, wrt_params: bool) -> tuple[int, int]:
    """FLOPs of plain torch.autograd.grad w.r.t. x (and the params when `wrt_params`, else constants)."""
    leaves, spec = tree_flatten(params)
    ps = [t.detach().requires_grad_(wrt_params) for t in leaves]
    xs = x.detach().requires_grad_() if x.is_floating_point() else x
    out = f(torch.utils._pytree.tree_unflatten(ps, spec), xs)
    outs, cts = tree_flatten(out)[0], tree_flatten(ct)[0]
    pairs = [(o, c) for o, c in zip(outs, cts) if o.requires_grad]
    wrt = ([xs] if x.is_floating_point() else []) + (ps if wrt_params else [])
    if not pairs or not wrt:
        return 0
    return flops(lambda: torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs],
                                             allow_unused=True))[0]


def run_split(f, params, x, ct, **kw):
    """split_vjp's two passes with their FLOPs: (out, dparams, dx, dx FLOPs, dw FLOPs)."""
    out, vjp_dx = split_vjp(f, params, x, **kw)
    dx_flops, ((dx,), vjp_dw) = flops(lambda: vjp_dx(ct))
    dw_flops, dparams = flops(vjp_dw)
    return out, dparams, dx, dx_flops, dw_flops


# nets whose every weight path starts at a built-in op of the input path, below no other: all deferred
ALL_DEFERRED = {"mlp", "view", "bias_only", "no_params", "ids", "param_out"}


@settings(max_examples=40, deadline=None)
@given(net=st.sampled_from(NETS), depth=st.integers(1, 3), n=st.integers(1, 5), d=st.integers(1, 6),
       f=st.integers(1, 6), seed=st.integers(0, 2**16))
@example(net="mlp", depth=2, n=3, d=4, f=5, seed=0)
@example(net="tied", depth=2, n=3, d=4, f=5, seed=0)
@example(net="view", depth=2, n=3, d=4, f=5, seed=0)
@example(net="fmoe_mix", depth=2, n=3, d=4, f=5, seed=0)
@example(net="bias_only", depth=1, n=3, d=4, f=5, seed=0)
@example(net="no_params", depth=1, n=3, d=4, f=5, seed=0)
@example(net="ids", depth=2, n=3, d=4, f=5, seed=0)
@example(net="param_out", depth=1, n=1, d=1, f=1, seed=0)
def test_plain_defer_equals_unsplit_vjp_with_no_recompute(net, depth, n, d, f, seed):
    """Gradients as the unsplit vjp's (float64), every gradient real and writable, unused leaves zero; the
    two passes do the full backward's FLOPs between them (no recompute), and where every weight path is
    deferrable the dx pass does the input-only minimum."""
    fn, params, x = net_fn(net), make_params(net, depth, d, f, seed), inputs(net, n, d, seed)
    ref_out, ref_dp, ref_dx = reference(fn, params, x, ct := ones_ct(fn(params, x)))
    out, dparams, dx, dx_flops, dw_flops = run_split(fn, params, x, ct, engine="autograd", plain_ops="defer")
    assert_close(out, ref_out)
    assert_close(dparams, ref_dp)
    if ref_dx is not None:
        assert_close(dx, ref_dx)
    assert torch.count_nonzero(dparams["unused"]) == 0 or net == "param_out"
    cts = tree_flatten(ct)[0]
    for g in tree_flatten(dparams)[0]:  # safe to add into in place: no cotangent's memory
        assert all(g.untyped_storage().data_ptr() != c.untyped_storage().data_ptr() for c in cts)
    full, least = plain_grads(fn, params, x, ct, True), plain_grads(fn, params, x, ct, False)
    assert dx_flops + dw_flops == full
    if net in ALL_DEFERRED:
        assert dx_flops == least
    if net in ("mlp", "ids", "view"):
        assert dw_flops > 0


def test_plain_mlp_flops_dx_is_input_only_and_dx_mode_is_unchanged():
    """The issue's case: an MLP of F.linear + LayerNorm + SiLU. "defer": the dx pass does the input-only
    FLOPs, the dw pass the rest; "dx" (the default): the dx pass does the full backward, as before."""
    fn, params, x = net_fn("mlp"), make_params("mlp", 3, 16, 32, 0), inputs("mlp", 8, 16, 0)
    ct = ones_ct(fn(params, x))
    full, least = plain_grads(fn, params, x, ct, True), plain_grads(fn, params, x, ct, False)
    assert 0 < least < full
    *_, dx_flops, dw_flops = run_split(fn, params, x, ct, engine="autograd", plain_ops="defer")
    assert (dx_flops, dw_flops) == (least, full - least)
    for kw in ({"engine": "autograd"}, {"engine": "func"}, {"engine": "autograd", "plain_ops": "defer",
                                                           "defer": False}):
        *_, dx_flops, dw_flops = run_split(fn, params, x, ct, **kw)
        assert (dx_flops, dw_flops) == (full, 0), kw


def test_fmoe_primitives_keep_the_tape():
    """fmoe.ops.linear on a leaf: deferred by the tape (its dw FLOPs in the dw pass once, not twice), with
    plain_ops "dx" and "defer" alike."""
    def f(p, x):
        return linear(torch.tanh(linear(x, p["w1"])), p["w2"])

    g = torch.Generator().manual_seed(0)
    params, x = {"w1": r(g, 6, 8), "w2": r(g, 8, 6)}, r(g, 5, 6)
    ct = torch.randn(5, 6, dtype=F64, generator=g)
    _, ref_dp, ref_dx = reference(f, params, x, ct)
    full = plain_grads(f, params, x, ct, True)
    for plain_ops in ("dx", "defer"):
        _, dparams, dx, dx_flops, dw_flops = run_split(f, params, x, ct, engine="autograd",
                                                       plain_ops=plain_ops)
        assert_close(dparams, ref_dp)
        assert_close(dx, ref_dx)
        assert dx_flops + dw_flops == full and dw_flops == 2 * 5 * 6 * 8 * 2


def test_into_accumulates_deferred_plain_gradients():
    fn, params, x = net_fn("mlp"), make_params("mlp", 2, 4, 5, 0), inputs("mlp", 3, 4, 0)
    ct = ones_ct(fn(params, x))
    _, ref_dp, _ = reference(fn, params, x, ct)
    sums = torch.utils._pytree.tree_map(lambda t: torch.ones_like(t), params)
    sums["layers"][1] = {k: None for k in sums["layers"][1]}
    _, vjp_dx = split_vjp(fn, params, x, engine="autograd", plain_ops="defer")
    _, vjp_dw = vjp_dx(ct)
    got = vjp_dw(into=sums)
    assert got["layers"][0]["w_in"] is sums["layers"][0]["w_in"]
    expected = torch.utils._pytree.tree_map(lambda t: t + 1, ref_dp)
    expected["layers"][1] = ref_dp["layers"][1]
    assert_close(got, expected)


def test_input_modified_after_dx_is_refused_by_name():
    fn, params, x = net_fn("mlp"), make_params("mlp", 1, 4, 5, 0), inputs("mlp", 3, 4, 0)
    _, vjp_dx = split_vjp(fn, params, x, engine="autograd", plain_ops="defer")
    _, vjp_dw = vjp_dx(torch.ones(3, 4, dtype=F64))
    x.add_(1.0)  # the first branch point (layer_norm) saved x
    with pytest.raises(CaptureModifiedError, match="argument 0"):
        vjp_dw()


def test_cotangent_modified_after_dx_is_refused_by_name():
    """ids net: the dw pass starts from the output's cotangent itself."""
    fn, params, ids = net_fn("ids"), make_params("ids", 1, 4, 5, 0), inputs("ids", 3, 4, 0)
    ct = torch.ones(3, 4, dtype=F64)
    _, vjp_dx = split_vjp(fn, params, ids, engine="autograd", plain_ops="defer")
    _, vjp_dw = vjp_dx(ct)
    ct.mul_(2.0)
    with pytest.raises(CaptureModifiedError, match="the cotangent"):
        vjp_dw()


def test_tied_keys_get_one_gradient_each():
    """One tensor under two keys: each key its own gradient, as torch.func.vjp gives it."""
    g = torch.Generator().manual_seed(0)
    w = r(g, 4, 4)

    def f(p, x):
        return F.linear(torch.tanh(F.linear(x, p["a"])), p["b"])

    x, ct = r(g, 3, 4), r(g, 3, 4)
    _, ref_dp, ref_dx = reference(f, {"a": w, "b": w}, x, ct)
    _, dparams, dx, dx_flops, dw_flops = run_split(f, {"a": w, "b": w}, x, ct, engine="autograd",
                                                   plain_ops="defer")
    assert_close(dparams, ref_dp)
    assert_close(dx, ref_dx)
    assert dw_flops == 2 * (2 * 3 * 4 * 4)  # both weight products deferred


def test_nothing_is_held_after_dw():
    refs = []

    def f(p, x):
        h = torch.tanh(F.linear(x, p["w1"]))
        refs.append(weakref.ref(h))
        return F.linear(h, p["w2"])

    g = torch.Generator().manual_seed(0)
    _, vjp_dx = split_vjp(f, {"w1": r(g, 4, 4), "w2": r(g, 4, 4)}, r(g, 3, 4), engine="autograd",
                          plain_ops="defer")
    _, vjp_dw = vjp_dx(torch.ones(3, 4, dtype=F64))
    del vjp_dx
    vjp_dw()
    del vjp_dw
    gc.collect()
    assert refs and refs[0]() is None


def test_plain_defer_needs_the_autograd_engine():
    with pytest.raises(ValueError, match="engine='autograd'"):
        split_vjp(lambda p, x: x * p, torch.ones(2), torch.ones(2), engine="func", plain_ops="defer")
    with pytest.raises(ValueError, match="plain_ops must be one of"):
        split_vjp(lambda p, x: x * p, torch.ones(2), torch.ones(2), engine="autograd", plain_ops="later")


# ---- deferral_report ---------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["func", "autograd"])
def test_report_flags_fmoe_linear_on_a_view(engine):
    """fmoe.ops.linear(h, w.T): the tape sees a view, not the leaf: w's weight gradient stays in the dx pass,
    and the report says so; v (a leaf) is deferred."""
    def f(p, x):
        return linear(torch.tanh(linear(x, p["w"].T)), p["v"])

    g = torch.Generator().manual_seed(0)
    params, x = {"w": r(g, 8, 6), "v": r(g, 8, 6)}, r(g, 5, 6)
    rep = deferral_report(f, params, x, engine=engine)
    w, v = rep.per_param["params['w']"], rep.per_param["params['v']"]
    assert w.weight_grad_flops == v.weight_grad_flops == 2 * 5 * 6 * 8
    assert w.not_deferred_flops == w.weight_grad_flops and not w.deferred
    assert v.deferred
    assert rep.not_deferred == ["params['w']"]
    assert rep.not_deferred_flops == w.weight_grad_flops
    assert rep.dx_flops + rep.dw_flops == rep.full_backward_flops
    assert "params['w']" in str(rep)


@pytest.mark.parametrize(("engine", "plain_ops", "deferred"),
                         [("func", "dx", False), ("autograd", "dx", False), ("autograd", "defer", True)])
def test_report_on_plain_ops(engine, plain_ops, deferred):
    fn, params, x = net_fn("mlp"), make_params("mlp", 2, 4, 6, 0), inputs("mlp", 3, 4, 0)
    rep = deferral_report(fn, params, x, engine=engine, plain_ops=plain_ops)
    assert rep.dx_flops + rep.dw_flops == rep.full_backward_flops
    assert (rep.not_deferred_flops == 0) == deferred
    assert (rep.not_deferred == []) == deferred
    w_in = rep.per_param["params['layers'][0]['w_in']"]
    assert w_in.weight_grad_flops == 2 * 3 * 4 * 6
    assert w_in.deferred == deferred
    assert rep.per_param["params['unused']"] == type(w_in)(0, 0)


def test_research_doc_example_runs(capsys):
    """docs/research.md, "Plain torch ops under split_vjp": the example runs and does what it says."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs/research.md").read_text()
    start = text.index("```python", text.index("## Plain torch ops under split_vjp")) + len("```python")
    namespace: dict = {}
    exec(compile(text[start:text.index("```", start)], "docs/research.md", "exec"), namespace)
    assert "params['w']" in capsys.readouterr().out
    rep = deferral_report(namespace["f"], namespace["params"], namespace["x"], engine="autograd",
                          plain_ops="defer")
    assert rep.not_deferred == ["params['w']"]
