"""torch.func's and torch.compile's transforms over fmoe's public functions (docs/research.md, "Transforms").

Each transform against the plain computation: grad_and_value / vjp with aux = grad and the eager value,
vmap = a Python loop over the batch, compiled = eager (fullgraph, so a graph break fails). The grouped
products' library ops against a per-group loop (and torch.library.opcheck for their registrations).

Legend: T tokens, D model width, E experts, K experts per token, B a vmapped batch, M rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.func import grad, grad_and_value, vjp, vmap

from fmoe import GPTConfig, MoEAux, MoEConfig, gpt_loss, init_gpt, init_moe, moe
from fmoe._compat import tree_flatten, tree_map
from fmoe.block import init_block
from fmoe.model import GPTAux, block
from fmoe.ops import _grouped_op
from fmoe.transforms.pytree import pytree_dataclass

MODES = {
    "dropless": {},
    "drop": dict(capacity_factor=0.75, drop_policy="position"),
    "pad": dict(capacity_factor=1.0, drop_policy="position", pad_to_capacity=True),
    "shared": dict(num_shared_experts=1, z_loss_coef=1e-3),
}


def assert_close(actual, expected, *, rtol: float, atol: float) -> None:
    """Every leaf of two pytrees of one structure within rtol / atol (torch.testing's rule)."""
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    assert a_spec == e_spec
    for a, e in zip(a_leaves, e_leaves, strict=True):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol)


def moe_cfg(mode: str, E: int = 4, K: int = 2, D: int = 16) -> MoEConfig:
    return MoEConfig(d_model=D, d_ff=16, num_experts=E, top_k=K, aux_loss_coef=1e-2, **MODES[mode])


def gpt_cfg(mode: str = "dropless", E: int = 4, K: int = 2) -> GPTConfig:
    return GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, moe=moe_cfg(mode, E, K))


def stack(trees: list) -> object:
    return tree_map(lambda *leaves: torch.stack(leaves), *trees)


def moe_loss(params: dict, x_TD: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, MoEAux]:
    y_TD, aux = moe(params, x_TD, cfg)
    return y_TD.square().mean() + aux.loss, aux


# ---- aux outputs are pytrees ------------------------------------------------------------------------

def test_grad_and_value_with_aux_equals_grad_and_the_eager_value():
    cfg = gpt_cfg("shared")
    params = init_gpt(cfg, torch.Generator().manual_seed(0), dtype=torch.float64)
    ids_BS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss(p):
        return gpt_loss(p, ids_BS, ids_BS.roll(-1, 1), cfg)

    g, (value, aux) = grad_and_value(loss, has_aux=True)(params)
    eager_value, eager_aux = loss(params)
    assert isinstance(aux, GPTAux) and isinstance(aux.layers[0], MoEAux)
    assert_close(value, eager_value, rtol=1e-12, atol=0)  # torch.func's kernels vs tape autograd's
    assert_close(g, grad(lambda p: loss(p)[0])(params), rtol=0, atol=0)
    # every tensor of the aux, the static fields too, as the eager call returns them
    assert tree_flatten(aux)[1] == tree_flatten(eager_aux)[1]
    assert_close(tree_flatten(aux)[0], tree_flatten(eager_aux)[0], rtol=1e-12, atol=1e-15)
    assert aux.remat_layers == eager_aux.remat_layers


def test_vjp_with_aux_and_tree_map_over_the_aux():
    cfg = moe_cfg("drop")
    params = init_moe(cfg, torch.Generator().manual_seed(0), dtype=torch.float64)
    x_TD = torch.randn(8, 16, dtype=torch.float64)
    out, vjp_fn, aux = vjp(lambda p: moe_loss(p, x_TD, cfg), params, has_aux=True)
    (g,) = vjp_fn(torch.ones_like(out))
    assert_close(g, grad(lambda p: moe_loss(p, x_TD, cfg)[0])(params), rtol=0, atol=0)
    doubled = tree_map(lambda t: t * 2, aux)
    assert isinstance(doubled, MoEAux) and doubled.capacity == aux.capacity  # static fields kept
    assert torch.equal(doubled.tokens_per_expert_E, aux.tokens_per_expert_E * 2)


def test_pytree_dataclass_refuses_what_it_cannot_register():
    with pytest.raises(TypeError, match="not a dataclass"):
        pytree_dataclass(type("Plain", (), {}))
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Two:
        a: torch.Tensor
        n: int

    with pytest.raises(TypeError, match=r"no init field\(s\) \['m'\]"):
        pytree_dataclass(Two, static=("m",))


# ---- vmap = a loop -------------------------------------------------------------------------------------

@settings(max_examples=12)
@given(mode=st.sampled_from(sorted(MODES)), T=st.integers(1, 9), E=st.integers(1, 4), k_all=st.booleans(),
       seed=st.integers(0, 2**16))
@example(mode="dropless", T=1, E=1, k_all=True, seed=0)       # one expert, one token (S = 1)
@example(mode="dropless", T=3, E=4, k_all=True, seed=1)       # top-k = E
@example(mode="drop", T=2, E=4, k_all=False, seed=2)          # experts with zero tokens, drops
@example(mode="pad", T=5, E=3, k_all=False, seed=3)
def test_vmap_of_moe_over_params_and_over_token_sets_is_a_loop(mode, T, E, k_all, seed):
    cfg = moe_cfg(mode, E=E, K=E if k_all else min(2, E))
    gen = torch.Generator().manual_seed(seed)
    ps = [init_moe(cfg, gen, dtype=torch.float64) for _ in range(2)]
    xs_BTD = torch.randn(3, T, 16, generator=gen, dtype=torch.float64)

    def f(p, x_TD):
        return moe_loss(p, x_TD, cfg)

    over_params = vmap(f, (0, None))(stack(ps), xs_BTD[0])
    assert_close(over_params, stack([f(p, xs_BTD[0]) for p in ps]), rtol=1e-12, atol=1e-12)
    over_tokens = vmap(f, (None, 0))(ps[0], xs_BTD)
    assert_close(over_tokens, stack([f(ps[0], x) for x in xs_BTD]), rtol=1e-12, atol=1e-12)
    # per-example gradients: grad inside vmap
    loss_grad = grad(lambda p, x: f(p, x)[0])
    per_example = vmap(loss_grad, (None, 0))(ps[0], xs_BTD)
    assert_close(per_example, stack([loss_grad(ps[0], x) for x in xs_BTD]),
                 rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("over", ["params", "tokens"])
def test_vmap_of_block_and_gpt_loss_is_a_loop(over):
    cfg = gpt_cfg("shared")
    gen = torch.Generator().manual_seed(0)
    bps = [init_block(cfg, gen, dtype=torch.float64) for _ in range(2)]
    gps = [init_gpt(cfg, gen, dtype=torch.float64) for _ in range(2)]
    x_BBSD = torch.randn(2, 2, 8, 16, generator=gen, dtype=torch.float64)
    ids_BBS = torch.randint(0, 32, (2, 2, 8), generator=gen)

    def blk(p, x):
        return block(p, x, cfg)[0]

    def loss(p, ids):
        return gpt_loss(p, ids, ids.roll(-1, 1), cfg)[0]

    for f, ps, xs in ((blk, bps, x_BBSD), (loss, gps, ids_BBS)):
        if over == "params":
            got, want = vmap(f, (0, None))(stack(ps), xs[0]), torch.stack([f(p, xs[0]) for p in ps])
        else:
            got, want = vmap(f, (None, 0))(ps[0], xs), torch.stack([f(ps[0], x) for x in xs])
        assert_close(got, want, rtol=1e-12, atol=1e-12)
    if over == "tokens":  # per-sequence-batch gradients of the whole model
        got = vmap(grad(loss), (None, 0))(gps[0], ids_BBS)
        assert_close(got, stack([grad(loss)(gps[0], ids) for ids in ids_BBS]), rtol=1e-10, atol=1e-12)


# ---- the grouped products' library ops -------------------------------------------------------------

def _loop_product(x_MD, w_EDF, counts):
    out, start = [], 0
    for e, c in enumerate(counts):
        out.append(x_MD[start:start + c] @ w_EDF[e])
        start += c
    return torch.cat(out)


@settings(max_examples=10)
@given(counts_B=st.lists(st.lists(st.integers(0, 3), min_size=3, max_size=3), min_size=1, max_size=3),
       kernel=st.sampled_from(["grouped_mm", "loop"]), shared_w=st.booleans())
@example(counts_B=[[0, 0, 4]], kernel="grouped_mm", shared_w=True)
@example(counts_B=[[2, 0, 1], [0, 3, 0]], kernel="loop", shared_w=False)
def test_grouped_op_vmap_folds_the_batch_into_groups(counts_B, kernel, shared_w):
    """vmap over B row sets of M rows each (their own group sizes) = B separate products."""
    M = 4
    counts_B = [c[:-1] + [M - sum(c[:-1])] if sum(c[:-1]) <= M else [M, 0, 0] for c in counts_B]
    B = len(counts_B)
    x_BMD = torch.randn(B, M, 16)
    w = torch.randn(3, 16, 16) if shared_w else torch.randn(B, 3, 16, 16)
    offs_BE = torch.tensor(counts_B).cumsum(1).to(torch.int32)
    y = vmap(lambda x, ww, o: _grouped_op.product(x, ww, o, kernel), (0, None if shared_w else 0, 0))(
        x_BMD, w, offs_BE)
    want = torch.stack([_loop_product(x_BMD[b], w if shared_w else w[b], counts_B[b]) for b in range(B)])
    assert_close(y, want, rtol=1e-5, atol=1e-5)
    g_BMF = torch.randn(B, M, 16)
    dw = vmap(lambda x, g, o: _grouped_op.product_dw(x, g, o, kernel))(x_BMD, g_BMF, offs_BE)
    want_dw = torch.stack([torch.stack([x_BMD[b][sum(c[:e]):sum(c[:e + 1])].t() @ g_BMF[b][sum(c[:e]):
                                                                                         sum(c[:e + 1])]
                                        for e in range(3)]) for b, c in enumerate(counts_B)])
    assert_close(dw, want_dw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
def test_grouped_ops_pass_opcheck(kernel):
    x_MD, w_EDF = torch.randn(6, 16), torch.randn(3, 16, 16)
    offs_E = torch.tensor([2, 2, 6], dtype=torch.int32)
    torch.library.opcheck(torch.ops.fmoe.grouped_mm, (x_MD, w_EDF, offs_E, kernel),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.fmoe.grouped_mm_dw, (x_MD, torch.randn(6, 16), offs_E, kernel),
                          test_utils=("test_schema", "test_faketensor"))


def test_grouped_product_gradient_of_gradient_against_float64_differences():
    x_MD = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    w_EDF = torch.randn(2, 16, 16, dtype=torch.float64, requires_grad=True)
    offs_E = torch.tensor([3, 5], dtype=torch.int32)
    assert torch.autograd.gradgradcheck(lambda x, w: _grouped_op.product(x, w, offs_E, "loop"), (x_MD, w_EDF))


# ---- torch.compile(fullgraph=True) = eager ------------------------------------------------------------

class CountingBackend:
    """A torch.compile backend that counts the graphs it is handed, then runs them as aot_eager."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)


@pytest.fixture(autouse=False)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_moe_is_eager_and_compiles_once_for_three_routings(fresh_dynamo):
    cfg = moe_cfg("shared")
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    backend = CountingBackend()
    compiled = torch.compile(lambda p, x: moe_loss(p, x, cfg), fullgraph=True, backend=backend)
    for seed in range(3):  # three batches, each routed differently
        x_TD = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
        got, got_aux = compiled(params, x_TD)
        want, want_aux = moe_loss(params, x_TD, cfg)
        assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(got_aux.tokens_per_expert_E, want_aux.tokens_per_expert_E)
    assert backend.graphs <= 2


def test_compiled_gpt_loss_and_its_backward_equal_eager(fresh_dynamo):
    """fp32: compile the loss, autograd (torch.compile's AOT autograd) through the grouped library ops."""
    cfg = gpt_cfg("drop")
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    ids_BS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    leaves = tree_map(lambda t: t.clone().requires_grad_(), params)
    compiled = torch.compile(lambda p: gpt_loss(p, ids_BS, ids_BS.roll(-1, 1), cfg)[0], fullgraph=True,
                             backend="aot_eager")
    loss = compiled(leaves)
    loss.backward()
    want_g, want = grad_and_value(lambda p: gpt_loss(p, ids_BS, ids_BS.roll(-1, 1), cfg)[0])(params)
    assert_close(loss.detach(), want, rtol=1e-5, atol=1e-6)
    assert_close(tree_map(lambda t: t.grad, leaves), want_g, rtol=1e-5, atol=1e-5)


def test_compiled_grad_of_block_in_bf16_equals_eager_grad(fresh_dynamo):
    cfg = gpt_cfg("dropless")
    params = init_block(cfg, torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    x_BSD = torch.randn(2, 8, 16, dtype=torch.bfloat16)

    def loss(p):
        return block(p, x_BSD, cfg)[0].float().square().mean()

    got = torch.compile(grad(loss), fullgraph=True, backend="aot_eager")(params)
    assert_close(got, grad(loss)(params), rtol=1e-2, atol=1e-2)
    assert all(t.abs().sum() > 0 for t in tree_flatten(got)[0])  # no weight silently left at zero


def test_compiled_grad_in_fp32_is_refused_in_one_line_not_zero(fresh_dynamo):
    cfg = moe_cfg("dropless")
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    x_TD = torch.randn(8, 16)
    with pytest.raises(Exception) as err:
        torch.compile(grad(lambda p: moe_loss(p, x_TD, cfg)[0]), fullgraph=True, backend="eager")(params)
    assert "runs in bfloat16 only" in str(err.value) + str(err.value.__cause__)


def test_compiled_grad_keeps_the_weight_gradient_of_a_linear_on_a_computed_input(fresh_dynamo):
    """torch 2.13's trace of func.grad reports needs_input_grad False for such a weight (fmoe._compat
    .needs_grad): without the workaround its gradient is silently zero."""
    from fmoe.ops import linear, rms_norm

    x_BD = torch.randn(4, 16)
    params = {"n": torch.ones(16), "w": torch.randn(16, 16)}

    def loss(p):
        return linear(rms_norm(x_BD, p["n"]), p["w"]).square().sum()

    got = torch.compile(grad(loss), fullgraph=True, backend="eager")(params)
    assert_close(got, grad(loss)(params), rtol=1e-5, atol=1e-5)
    assert got["w"].abs().sum() > 0


# ---- split_vjp on plain torch code ---------------------------------------------------------------------

def _plain_mlp(p, x_BD):
    return torch.nn.functional.linear(torch.relu(x_BD @ p["w1"]), p["w2"].t()).square().sum() * p["s"]


def test_split_vjp_names_the_plain_weights_its_dx_pass_computed_and_stays_quiet_on_fmoe():
    import warnings

    from fmoe.transforms import split_vjp

    p = {"w1": torch.randn(8, 8, dtype=torch.float64), "w2": torch.randn(8, 8, dtype=torch.float64),
         "s": torch.tensor(2.0, dtype=torch.float64)}
    x_BD = torch.randn(3, 8, dtype=torch.float64)
    out, dx = split_vjp(_plain_mlp, p, x_BD)
    with pytest.warns(UserWarning, match=r"params\['w1'\], params\['w2'\] \(plain torch ops"):
        _, dw = dx(torch.ones_like(out))
    assert_close(dw(), grad(_plain_mlp)(p, x_BD), rtol=1e-12, atol=1e-12)  # gradients unchanged

    cfg = gpt_cfg("shared")
    params = init_gpt(cfg, torch.Generator().manual_seed(0), dtype=torch.float64)
    ids_BS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    out, dx = split_vjp(lambda q: gpt_loss(q, ids_BS, ids_BS.roll(-1, 1), cfg)[0], params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dx(torch.ones_like(out))[1]()


def test_deferral_report_describes_split_vjps_default_call():
    import inspect

    from fmoe.transforms import deferral_report, split_vjp

    report_defaults = {k: v.default for k, v in inspect.signature(deferral_report).parameters.items()}
    vjp_defaults = {k: v.default for k, v in inspect.signature(split_vjp).parameters.items()}
    assert report_defaults["engine"] == vjp_defaults["engine"]
    assert report_defaults["plain_ops"] == vjp_defaults["plain_ops"]


# ---- the ops, and the cells that are refused ------------------------------------------------------------

def _op_cases():
    from fmoe import ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 16, generator=g, dtype=torch.float64)  # [B, T, D]: B the vmapped axis
    w = torch.randn(16, 16, generator=g, dtype=torch.float64)
    t = torch.randint(0, 16, (4, 8), generator=g)
    return {
        "linear": (lambda xx: ops.linear(xx, w), x),
        "rms_norm": (lambda xx: ops.rms_norm(xx, w[0]), x),
        "swiglu": (lambda xx: ops.swiglu(xx, xx.flip(-1)), x),
        "attention": (lambda xx: ops.attention(*(xx.view(8, 2, 8),) * 3), x),
        "cross_entropy": (lambda tt: ops.cross_entropy(x[0] @ w, tt), t),
        "embedding": (lambda tt: ops.embedding(tt, w), t),
        "grouped_linear": (lambda xx: ops.grouped_linear(xx, w.expand(2, 16, 16), torch.tensor([3, 5])), x),
    }


@pytest.mark.parametrize("name", sorted(_op_cases()))
def test_each_op_under_vmap_and_grad_is_a_loop(name):
    f, xs = _op_cases()[name]
    assert_close(vmap(f)(xs), torch.stack([f(x) for x in xs]), rtol=1e-12, atol=1e-12)
    if xs.is_floating_point():
        per_example = vmap(grad(lambda x: f(x).square().sum()))(xs)
        assert_close(per_example, torch.stack([grad(lambda x: f(x).square().sum())(x) for x in xs]),
                     rtol=1e-10, atol=1e-12)


def test_jvp_is_refused_in_one_line_naming_the_op():
    from fmoe.ops import linear

    w = torch.randn(4, 4)
    with pytest.raises(NotImplementedError, match=r"_linear\._Linear has no forward-mode rule.*jacrev"):
        torch.func.jvp(lambda x: linear(x, w), (torch.randn(2, 4),), (torch.ones(2, 4),))
