"""fmoe.ops.local_experts: a local layer's routed experts with permute and unpermute inside, one expert's
rows at a time, against a float64 loop over tokens and slots (values and all four gradients), with the
three-step layer (permute, routed_experts, unpermute) and the loop oracle of the whole layer; the rule that
picks it (`local_experts_pay`) and the MoE phases that run it.

Legend (docs/moe.md): T tokens, D width, F expert width, Z = 2 F, E experts, K slots, R = T K rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from moe_oracle import oracle_moe

import fmoe.phases as phases
from fmoe import GPTConfig, gpt_loss, init_gpt
from fmoe.capacity import drop_layout
from fmoe.config import MoEConfig
from fmoe.layer import init_moe
from fmoe.model import moe
from fmoe.ops import local_experts, local_experts_pay, sort_layout
from fmoe.transforms import split_vjp
from fmoe.transforms.testing import assert_close


@pytest.fixture
def rows_fault(monkeypatch):
    """New buffers of any size count as faulting (fmoe.ops._donate.ALWAYS_MAPPED_BYTES, 32 MiB on the CPU):
    the rule then picks the op at these tests' shapes."""
    monkeypatch.setattr("fmoe.ops._donate.ALWAYS_MAPPED_BYTES", 0)


def loop_oracle(x_TD, probs_TK, w_gate_up, w_down, ids_TK):
    """y_TD in float64, one token and slot at a time (a zero term in every input: each takes a gradient,
    zero where it reaches nothing)."""
    F = w_down.shape[1]
    zero = (x_TD.sum() + probs_TK.sum() + w_gate_up.sum() + w_down.sum()) * 0
    rows = []
    for t in range(x_TD.shape[0]):
        acc = x_TD[t] * 0
        for k, e in enumerate(ids_TK[t].tolist()):
            gate_up = x_TD[t] @ w_gate_up[e]
            h = torch.nn.functional.silu(gate_up[:F]) * gate_up[F:]
            acc = acc + probs_TK[t, k] * (h @ w_down[e])
        rows.append(acc)
    return (torch.stack(rows) if rows else x_TD * 0) + zero


def routed(T, E, K, seed, empty):
    """(ids_TK, probs_TK): K distinct experts per token (expert `empty` never chosen when not None)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    if empty is not None:
        scores[:, empty] = -1.0
    ids_TK = scores.topk(K, dim=-1).indices
    return ids_TK, torch.rand(T, K, generator=g, dtype=torch.float64)


@settings(max_examples=25, deadline=None)
@example(T=5, E=3, K=1, D=4, F=3, dtype=torch.float32, seed=0, empty=1, wants="all")  # a zero-token expert
@example(T=4, E=1, K=1, D=3, F=2, dtype=torch.float64, seed=1, empty=None, wants="all")  # one expert
@example(T=3, E=3, K=3, D=2, F=4, dtype=torch.float64, seed=2, empty=None, wants="all")  # top-k = E
@example(T=0, E=2, K=2, D=3, F=2, dtype=torch.float32, seed=3, empty=None, wants="all")  # no tokens
@example(T=6, E=4, K=2, D=5, F=3, dtype=torch.float64, seed=4, empty=0, wants="weights")
@example(T=6, E=4, K=2, D=5, F=3, dtype=torch.float64, seed=5, empty=None, wants="x")
@example(T=6, E=4, K=2, D=5, F=3, dtype=torch.float32, seed=6, empty=None, wants="probs")
@given(T=st.integers(0, 8), E=st.integers(1, 4), K=st.integers(1, 4), D=st.integers(1, 6),
       F=st.integers(1, 5), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**31 - 1), empty=st.none() | st.integers(0, 3),
       wants=st.sampled_from(["all", "x", "probs", "weights"]))
def test_local_experts_match_a_loop_over_tokens_and_slots(T, E, K, D, F, dtype, seed, empty, wants) -> None:
    K = min(K, E)
    empty = empty if empty is not None and empty < E and K < E else None
    ids_TK, probs64 = routed(T, E, K, seed, empty)
    g = torch.Generator().manual_seed(seed + 1)
    x64 = torch.randn(T, D, generator=g, dtype=torch.float64)
    wgu64 = torch.randn(E, D, 2 * F, generator=g, dtype=torch.float64)
    wdn64 = torch.randn(E, F, D, generator=g, dtype=torch.float64)
    ct64 = torch.randn(T, D, generator=g, dtype=torch.float64)
    layout = sort_layout(ids_TK, E)
    counts = tuple(layout.counts_E.tolist())
    grads = {"all": (True,) * 4, "x": (True, False, False, False), "probs": (False, True, False, False),
             "weights": (False, False, True, True)}[wants]
    ins = [t.to(dtype).requires_grad_(w) for t, w in zip((x64, probs64, wgu64, wdn64), grads)]
    y = local_experts(*ins, layout, counts)
    got = torch.autograd.grad(y, [t for t in ins if t.requires_grad], ct64.to(dtype))
    refs = [t.clone().requires_grad_(w) for t, w in zip((x64, probs64, wgu64, wdn64), grads)]
    y_ref = loop_oracle(*refs, ids_TK)
    want = torch.autograd.grad(y_ref, [t for t in refs if t.requires_grad], ct64, allow_unused=True)
    assert y.dtype == dtype and y.shape == (T, D)
    assert_close(y, y_ref.to(dtype))
    for a, b, t in zip(got, want, [t for t in ins if t.requires_grad]):
        assert a.dtype == t.dtype and a.shape == t.shape
        assert_close(a, torch.zeros_like(t) if b is None else b.to(dtype))
    if empty is not None and grads[2]:  # an expert with no rows: its weights' gradients exactly zero
        assert not got[-2][empty].any() and not got[-1][empty].any()


def layer_grads(params, x_TD, cfg, fused, monkeypatch):
    """fmoe.moe's output and gradients (x's, then the params' leaves) under tape autograd, with the phases'
    rule as it is (`fused`) or refusing local_experts; asserts whether it ran."""
    calls = []
    real = phases.local_experts

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(phases, "local_experts", spy)
    if not fused:
        monkeypatch.setattr(phases, "local_experts_pay", lambda *a: False)
    leaves = [x_TD.requires_grad_()] + [v.requires_grad_() for d in params.values() for v in d.values()]
    y, aux = moe(params, x_TD, cfg)
    ct = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
    grads = torch.autograd.grad((y * ct).sum() + aux.loss, leaves)
    monkeypatch.undo()
    monkeypatch.setattr("fmoe.ops._donate.ALWAYS_MAPPED_BYTES", 0)
    assert bool(calls) == fused
    return y, grads, ct


@pytest.mark.parametrize("shared", [0, 1])
def test_the_layer_runs_them_and_matches_the_three_steps_and_the_loop_oracle(shared, rows_fault,
                                                                              monkeypatch) -> None:
    cfg = MoEConfig(d_model=6, d_ff=5, num_experts=5, top_k=2, aux_loss_coef=0.01, num_shared_experts=shared)
    params = init_moe(cfg, torch.Generator().manual_seed(0), dtype=torch.float64)
    x_TD = torch.randn(9, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y1, g1, ct = layer_grads(params, x_TD.clone(), cfg, True, monkeypatch)
    y3, g3, _ = layer_grads(params, x_TD.clone(), cfg, False, monkeypatch)
    assert_close(y1, y3)
    for a, b in zip(g1, g3):
        assert_close(a, b)
    x64 = x_TD.clone().requires_grad_()
    p64 = {k: {n: v.detach().clone().requires_grad_() for n, v in d.items()} for k, d in params.items()}
    y_o, loss_o, _ = oracle_moe(p64, x64, cfg)
    leaves = [x64] + [v for d in p64.values() for v in d.values()]
    want = torch.autograd.grad((y_o * ct).sum() + loss_o, leaves)
    assert_close(y1, y_o)
    for a, b in zip(g1, want):
        assert_close(a, b)


@pytest.mark.parametrize("change", ["remat", "probs_in_expert", "drops", "bf16", "split_vjp", "small"])
def test_the_layer_keeps_the_three_steps_where_the_rule_says_no(change, monkeypatch) -> None:
    """Remat (its recompute reads the rows again), gate weights in the expert, a capacity that drops,
    half precision, a split backward (its dw pass reads the rows later) and rows below the size that
    faults all run the three steps."""
    if change != "small":
        monkeypatch.setattr("fmoe.ops._donate.ALWAYS_MAPPED_BYTES", 0)
    kw = {"probs_in_expert": dict(probs_in_expert=True), "drops": dict(capacity_factor=0.5)}.get(change, {})
    cfg = MoEConfig(d_model=6, d_ff=5, num_experts=4, top_k=2, **kw)
    dtype = torch.bfloat16 if change == "bf16" else torch.float32
    params = init_moe(cfg, torch.Generator().manual_seed(0), dtype=dtype)
    x_TD = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    monkeypatch.setattr(phases, "local_experts", None)  # calling it would fail
    if change == "split_vjp":
        y, vjp_dx = split_vjp(lambda p, x: moe(p, x, cfg)[0], params, x_TD)[:2]
        vjp_dx(torch.ones_like(y))
        return
    y, _ = moe(params, x_TD.requires_grad_(), cfg, remat=True if change == "remat" else None)
    y.sum().backward()
    assert x_TD.grad is not None


def test_the_rule(rows_fault) -> None:
    ids_TK, _ = routed(6, 4, 2, 0, None)
    dropless = sort_layout(ids_TK, 4)
    x_TD = torch.randn(6, 3)
    assert local_experts_pay(x_TD, dropless)
    assert local_experts_pay(x_TD.double(), dropless)
    assert not local_experts_pay(x_TD.bfloat16(), dropless)
    assert not local_experts_pay(torch.randn(3, 6).t(), dropless)  # not contiguous
    dropped, _ = drop_layout(ids_TK, torch.rand(6, 2), 4, 2, "probs", False)
    assert not local_experts_pay(x_TD, dropped)
    seen = []
    torch.func.grad(lambda x: seen.append(local_experts_pay(x, dropless)) or x.sum())(x_TD)
    assert seen == [False]  # torch.func


def test_the_rule_wants_rows_that_fault() -> None:
    from fmoe.ops._donate import ALWAYS_MAPPED_BYTES

    ids_TK, _ = routed(64, 4, 2, 0, None)
    layout = sort_layout(ids_TK, 4)  # R = 128 rows
    width = ALWAYS_MAPPED_BYTES // (4 * 128)
    assert local_experts_pay(torch.empty(64, width), layout)
    assert not local_experts_pay(torch.empty(64, width - 1), layout)


def test_a_retained_graph_backwards_again_to_the_same_gradients(rows_fault) -> None:
    """Gate | up takes its gradient over its own memory only where autograd frees the graph."""
    ids_TK, probs = routed(7, 3, 2, 0, None)
    layout = sort_layout(ids_TK, 3)
    g = torch.Generator().manual_seed(2)
    ins = [torch.randn(7, 4, generator=g), probs.float(), torch.randn(3, 4, 6, generator=g),
           torch.randn(3, 3, 4, generator=g)]
    ins = [t.requires_grad_() for t in ins]
    y = local_experts(*ins, layout, tuple(layout.counts_E.tolist()))
    first = torch.autograd.grad(y.sum(), ins, retain_graph=True)
    second = torch.autograd.grad(y.sum(), ins)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_it_saves_gate_up_and_no_rows_or_hidden_rows(rows_fault) -> None:
    """Of the layer's [R, *] tensors only gate | up [R, 2F] is saved (and the rows' gate weights [R, 1]): no
    permuted rows, no y, no h."""
    cfg = MoEConfig(d_model=4, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=0.0)  # R 12, 2F 16
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    x_TD = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dim() == 2 and t.shape[0] == 12 and t.shape[1] > 1:
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y_TD, _ = moe(params, x_TD, cfg)
    y_TD.sum().backward()
    assert shapes == [(12, 16)], shapes


def test_a_gpt_block_runs_them_with_the_same_loss_and_gradients(rows_fault, monkeypatch) -> None:
    """gpt_loss under tape autograd (residual, norms, a shared expert): the same loss and gradients with
    the op as with the three steps."""
    cfg = GPTConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, n_kv_heads=2,
                    moe=MoEConfig(d_model=8, d_ff=6, num_experts=4, top_k=2, num_shared_experts=1))
    params = init_gpt(cfg, torch.Generator().manual_seed(0), dtype=torch.float64)
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))

    def run(pay):
        monkeypatch.setattr(phases, "local_experts_pay", pay)
        leaves = [v.detach().requires_grad_() for v in torch.utils._pytree.tree_leaves(params)]
        p = torch.utils._pytree.tree_unflatten(leaves, torch.utils._pytree.tree_structure(params))
        loss = gpt_loss(p, ids[:, :-1], ids[:, 1:], cfg)[0]
        return loss, torch.autograd.grad(loss, leaves)

    calls = []
    real_pay = phases.local_experts_pay
    loss1, g1 = run(lambda *a: calls.append(1) or real_pay(*a))
    loss3, g3 = run(lambda *a: False)
    assert calls and all(calls)
    assert_close(loss1, loss3)
    for a, b in zip(g1, g3):
        assert_close(a, b)


def test_bad_inputs_are_refused() -> None:
    ids_TK, probs = routed(5, 3, 2, 0, None)
    layout = sort_layout(ids_TK, 3)
    counts = tuple(layout.counts_E.tolist())
    x, wgu, wdn = torch.randn(5, 4), torch.randn(3, 4, 6), torch.randn(3, 3, 4)
    p = probs.float()
    with pytest.raises(ValueError, match="dropless"):
        local_experts(x.bfloat16(), p, wgu.bfloat16(), wdn.bfloat16(), layout, counts)
    with pytest.raises(ValueError, match="do not fit"):
        local_experts(x[:4], p, wgu, wdn, layout, counts)
    with pytest.raises(ValueError, match="do not fit"):
        local_experts(x, p, wgu, torch.randn(3, 2, 4), layout, counts)
    with pytest.raises(ValueError, match="do not fit"):
        local_experts(x, p, wgu, wdn, layout, counts[:2])
    with pytest.raises(ValueError, match="cast"):
        local_experts(x, p, wgu.double(), wdn, layout, counts)


def test_the_benchmark_runs_and_its_two_sides_agree(rows_fault, capsys) -> None:
    """benchmarks/local_experts.py at a small shape (every buffer counted as faulting, so the rule picks
    the op): it checks both sides agree before timing them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import local_experts as bench

    calls = []
    real = phases.local_experts
    phases.local_experts = lambda *a: calls.append(1) or real(*a)
    try:
        assert bench.main(["--shapes", "8,6,3,2,10", "--rounds", "1", "--no-memory"]) == 0
    finally:
        phases.local_experts = real
        phases.local_experts_pay = bench.RULE
    assert calls and "fused / 3 steps" in capsys.readouterr().out



def test_torch_func_gets_one_line_naming_the_three_steps() -> None:
    """Its blocks write with out=, which torch.func cannot differentiate: a clear error, not aten's."""
    ids_TK, probs = routed(5, 3, 2, 0, None)
    layout = sort_layout(ids_TK, 3)
    counts = tuple(layout.counts_E.tolist())
    x, wgu, wdn = torch.randn(5, 4), torch.randn(3, 4, 6), torch.randn(3, 3, 4)
    for transform in (torch.func.grad, lambda f: torch.func.vmap(lambda x: f(x))):
        with pytest.raises(RuntimeError, match="permute, routed_experts and unpermute"):
            transform(lambda x: local_experts(x, probs.float(), wgu, wdn, layout, counts).sum())(x)
