"""The split backward as three compiled graphs (transforms/compiled.py) against split_vjp, the eager oracle.

forward -> (out, residuals), dx(residuals, ct) -> (dx, dw residuals), dw(dw residuals) -> dparams: each
pass equal to split_vjp's on the MoE layer and a GPT (backend None runs the three cut graph modules
themselves, which is what the cut must get right; "aot_eager" compiles them, fp32 to 1e-5 relative), one
trace for a structure plus one when its row counts change, host values that vary passed around the
trace, and the contract's refusals. The executor's use (`fmoe train --compile`) is in test_train_compile.py.

Legend: T tokens, D model width, E experts, K experts per token.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe import GPTConfig, MoEConfig, gpt_loss, init_gpt, init_moe, moe
from fmoe._compat import tree_flatten, tree_map
from fmoe.ops._grouped_linear import Counts
from fmoe.transforms import split_vjp
from fmoe.transforms.compiled import CompiledPhases, CompiledSplit

MODES = {
    "dropless": {},
    "drop": dict(capacity_factor=0.75, drop_policy="position"),
    "pad": dict(capacity_factor=1.0, drop_policy="position", pad_to_capacity=True),
    "shared": dict(num_shared_experts=1, z_loss_coef=1e-3),
}


def moe_fn(cfg: MoEConfig):
    def f(p, x_TD):
        y_TD, aux = moe(p, x_TD, cfg)
        return {"y": y_TD, "loss": aux.loss}, aux
    return f


def assert_trees_close(a, b, rtol: float, atol: float) -> None:
    la, sa = tree_flatten(a)
    lb, sb = tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
        else:
            assert x == y


def both(f, params, args, ct, backend=None, consts=(), split=None):
    """(compiled passes, split_vjp's passes): each (out, aux, dargs, dparams)."""
    split = split or CompiledSplit(f, backend)
    out, vjp_dx, aux = split(params, *args, consts=consts)
    dargs, vjp_dw = vjp_dx(ct)
    got = (out, aux, dargs, vjp_dw())
    out, vjp_dx, aux = split_vjp(lambda p, *a: f(p, *a, *consts), params, *args, has_aux=True,
                                 engine="autograd")
    dargs, vjp_dw = vjp_dx(ct)
    return got, (out, aux, dargs, vjp_dw())


@settings(max_examples=8, deadline=None)
@given(T=st.integers(1, 12), E=st.sampled_from([1, 2, 4]), k=st.integers(1, 4),
       mode=st.sampled_from(list(MODES)), seed=st.integers(0, 2**16))
@example(T=1, E=4, k=1, mode="dropless", seed=0)  # three zero-token experts
@example(T=5, E=1, k=1, mode="dropless", seed=1)  # one expert
@example(T=6, E=4, k=4, mode="drop", seed=2)  # top-k = E, rows dropped
@example(T=3, E=2, k=2, mode="pad", seed=3)
def test_the_three_graphs_equal_split_vjp_on_the_moe_layer(T: int, E: int, k: int, mode: str, seed: int):
    K = min(k, E)
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=E, top_k=K, aux_loss_coef=1e-2, **MODES[mode])
    g = torch.Generator().manual_seed(seed)
    params = init_moe(cfg, g, dtype=torch.float64)
    x_TD = torch.randn(T, 8, generator=g, dtype=torch.float64)
    ct = {"y": torch.randn(T, 8, generator=g, dtype=torch.float64),
          "loss": torch.tensor(0.7, dtype=torch.float64)}
    got, want = both(moe_fn(cfg), params, (x_TD,), ct)
    assert_trees_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_moe_layer_compiled_equals_eager_in_fp32():
    """The three graphs through torch.compile (dynamo and AOT autograd; inductor's kernels on the same
    graphs, 3.5e-7 from eager at D1024: benchmarks/compile_moe.py, kept out of the suite for its compile
    time on a cold cache)."""
    cfg = MoEConfig(d_model=16, d_ff=16, num_experts=2, top_k=1, aux_loss_coef=1e-2)
    g = torch.Generator().manual_seed(0)
    params = init_moe(cfg, g)
    x_TD = torch.randn(12, 16, generator=g)
    ct = {"y": torch.randn(12, 16, generator=g), "loss": torch.tensor(1.0)}
    got, want = both(moe_fn(cfg), params, (x_TD,), ct, backend="aot_eager")
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_gpt_equals_grad_of_gpt_loss():
    """The whole model as one phase (what a stage with nothing to overlap runs): token ids as consts."""
    cfg = GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2,
                    moe=MoEConfig(d_model=16, d_ff=16, num_experts=4, top_k=2, aux_loss_coef=1e-2))
    params = init_gpt(cfg, torch.Generator().manual_seed(0), dtype=torch.float64)
    ids_BS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))

    def f(p, ids, targets):
        loss, aux = gpt_loss(p, ids, targets, cfg)
        return {"loss": loss}, aux

    got, want = both(f, params, (), {"loss": torch.tensor(1.0, dtype=torch.float64)},
                     consts=(ids_BS, ids_BS.roll(-1, 1)))
    assert_trees_close(got, want, rtol=1e-12, atol=1e-12)


def test_each_cotangent_reaches_its_own_graph_input():
    """Two outputs whose cotangents both reach the dx pass and one the dw pass too: each graph input must
    be the cotangent it stands for (a cotangent the dw pass reads is not a dx output)."""
    def f(p, x_TD):
        return {"a": x_TD * 2, "b": x_TD @ p["w"]}, None

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 3, generator=g, dtype=torch.float64)}
    x_TD = torch.randn(4, 3, generator=g, dtype=torch.float64)
    ct = {"a": torch.randn(4, 3, generator=g, dtype=torch.float64),
          "b": torch.randn(4, 3, generator=g, dtype=torch.float64)}
    got, want = both(f, params, (x_TD,), ct)
    assert_trees_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[2][0], 2 * ct["a"] + ct["b"] @ params["w"].T)  # by hand


def test_new_row_counts_trace_once_more_and_then_never():
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=1e-2)
    params = init_moe(cfg, torch.Generator().manual_seed(0), dtype=torch.float64)
    split = CompiledSplit(moe_fn(cfg), None)
    traces = []
    for T in (6, 9, 13, 6, 20):  # 6: the first trace, static; 9: dim 0 symbolic; then none
        x_TD = torch.randn(T, 8, dtype=torch.float64)
        ct = {"y": torch.randn(T, 8, dtype=torch.float64), "loss": torch.tensor(1.0, dtype=torch.float64)}
        got, want = both(moe_fn(cfg), params, (x_TD,), ct, split=split)
        assert_trees_close(got, want, rtol=1e-12, atol=1e-12)
        traces.append(split.compiles)
    assert traces == [1, 2, 2, 2, 2]


def test_defer_false_gives_the_same_gradients_and_into_adds_into_the_sums():
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2)
    params = init_moe(cfg, torch.Generator().manual_seed(0), dtype=torch.float64)
    x_TD = torch.randn(5, 8, dtype=torch.float64)
    ct = {"y": torch.randn(5, 8, dtype=torch.float64), "loss": torch.tensor(1.0, dtype=torch.float64)}
    split = CompiledSplit(moe_fn(cfg), None)
    _, vjp_dx, _ = split(params, x_TD)
    (dx_deferred,), vjp_dw = vjp_dx(ct)
    deferred = vjp_dw()
    _, vjp_dx, _ = split(params, x_TD, defer=False)
    (dx_now,), vjp_dw = vjp_dx(ct)
    now = vjp_dw()
    assert_trees_close((dx_now, now), (dx_deferred, deferred), rtol=0, atol=0)
    sums = tree_map(torch.ones_like, params)
    _, vjp_dx, _ = split(params, x_TD)
    _, vjp_dw = vjp_dx(ct)
    added = vjp_dw(into=sums)
    for a, s, d in zip(tree_flatten(added)[0], tree_flatten(sums)[0], tree_flatten(deferred)[0], strict=True):
        assert a is s  # the sum itself, added into in place
        torch.testing.assert_close(a, 1 + d, rtol=1e-12, atol=1e-12)


def test_each_pass_runs_once_and_a_wrong_cotangent_is_refused():
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=2, top_k=1)
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    x_TD = torch.randn(4, 8)
    _, vjp_dx, _ = CompiledSplit(moe_fn(cfg), None)(params, x_TD)
    with pytest.raises(ValueError, match="cotangent leaf 1 is"):
        vjp_dx({"y": torch.ones(4, 8), "loss": torch.tensor([1.0])})
    with pytest.raises(ValueError, match="structure"):
        vjp_dx({"y": torch.ones(4, 8)})
    _, vjp_dw = vjp_dx({"y": torch.ones(4, 8), "loss": torch.tensor(1.0)})  # not used up by the refusals
    with pytest.raises(RuntimeError, match="vjp_dx was already called"):
        vjp_dx({"y": torch.ones(4, 8), "loss": torch.tensor(1.0)})
    vjp_dw()
    with pytest.raises(RuntimeError, match="vjp_dw was already called"):
        vjp_dw()


def test_host_counts_are_passed_around_the_trace_and_come_back_as_given():
    """A Counts' host ints vary per call and only exchanges read them: they neither key a trace nor are
    baked into it (its traced view holds the device counts), and a meta that passes it through hands the
    caller's own object back."""
    def f(p, x_TD, meta):
        counts = meta["counts"]
        return {"y": x_TD * p["w"]}, {"counts": counts, "rows": counts.dev_E.sum()}

    split = CompiledSplit(f, None)
    params = {"w": torch.tensor(2.0)}
    for host in ((3, 1), (0, 4), (2, 2)):
        counts = Counts(host, torch.tensor(host))
        out, vjp_dx, aux = split(params, torch.ones(4, 3), consts=({"counts": counts},))
        assert aux["counts"] is counts and int(aux["rows"]) == 4
        (dx,), vjp_dw = vjp_dx({"y": torch.ones(4, 3)})
        assert float(vjp_dw()["w"]) == 12.0 and torch.equal(dx, torch.full((4, 3), 2.0))
    assert split.compiles == 1


def test_a_number_computed_from_a_changing_size_is_refused_not_baked():
    def f(p, x_TD):
        return {"y": x_TD * p["w"]}, {"rows": x_TD.shape[0]}

    split = CompiledSplit(f, None)
    params = {"w": torch.tensor(2.0)}
    assert split(params, torch.ones(4, 3))[2] == {"rows": 4}  # static: the trace holds for 4 rows only
    with pytest.raises(TypeError, match="return it as a tensor"):
        split(params, torch.ones(5, 3))


def test_a_non_tensor_leaf_that_cannot_key_a_trace_is_refused():
    class Opaque:
        pass

    split = CompiledSplit(lambda p, x, m: ({"y": x * p["w"]}, {}), None)
    with pytest.raises(TypeError, match="of type Opaque"):
        split({"w": torch.tensor(1.0)}, torch.ones(2), consts=(Opaque(),))


def test_the_phases_of_a_run_are_traced_once_each():
    phases = CompiledPhases(None)
    f = moe_fn(MoEConfig(d_model=8, d_ff=8, num_experts=2, top_k=1))
    assert phases.split(("phase", 0), f) is phases.split(("phase", 0), f)
    assert phases.split(("phase", 1), f) is not phases.split(("phase", 0), f)
    assert len(phases) == 2 and phases.compiles == 0
