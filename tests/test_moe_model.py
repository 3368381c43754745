"""The small GPT: loss composition (main + balance + weighted MTP), gradients against finite differences.

Legend: B sequences, S positions, V vocabulary, D model width.
"""

from __future__ import annotations

import torch
from gpt_oracle import oracle_gpt_loss
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe._compat import tree_flatten, tree_map, tree_unflatten
from fmoe.config import GPTConfig, MoEConfig
from fmoe.model import gpt_loss, init_gpt, init_gpt_state
from fmoe.transforms import split_vjp
from fmoe.transforms.testing import assert_close, check_vjp


def make(mtp=True, dtype=torch.float64, mtp_loss_weight=0.5, aux_loss_coef=0.01, seed=0, S=5, **moe_kw):
    moe_kw.setdefault("top_k", 2)
    moe_cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, aux_loss_coef=aux_loss_coef, **moe_kw)
    cfg = GPTConfig(vocab_size=12, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, moe=moe_cfg,
                    num_dense_layers=1, d_ff_dense=16, mtp=mtp, mtp_loss_weight=mtp_loss_weight)
    g = torch.Generator().manual_seed(seed)
    params = init_gpt(cfg, g, dtype)
    ids = torch.randint(0, 12, (2, S), generator=g)
    return cfg, params, ids, ids.roll(-1, 1)


def test_loss_composition_and_state() -> None:
    cfg, params, ids, tg = make(num_shared_experts=1, bias_update_rate=0.1)
    loss, aux = gpt_loss(params, ids, tg, cfg, init_gpt_state(cfg))
    assert len(aux.layers) == 2  # one main MoE layer + the MTP block
    assert_close(loss, aux.main_loss + aux.balance_loss + 0.5 * aux.mtp_loss)
    assert aux.mtp_loss > 0 and aux.balance_loss > 0
    assert aux.new_state["layers"][0] == {}
    assert aux.new_state["layers"][1]["expert_bias_E"].shape == (4,)
    assert "expert_bias_E" in aux.new_state["mtp"]


def test_mtp_weight_scales_only_the_mtp_module() -> None:
    cfg0, params, ids, tg = make(mtp_loss_weight=0.0, aux_loss_coef=0.0)
    grads = torch.func.grad(lambda p: gpt_loss(p, ids, tg, cfg0)[0])(params)
    # With weight 0 and no balancing loss, nothing reaches the MTP module's own parameters.
    assert all(float(t.abs().max()) == 0.0 for t in tree_flatten(grads["mtp"])[0])
    cfg1, *_ = make(mtp_loss_weight=1.0, aux_loss_coef=0.0)
    grads1 = torch.func.grad(lambda p: gpt_loss(p, ids, tg, cfg1)[0])(params)
    assert float(grads1["mtp"]["w_proj"].abs().max()) > 0


def test_gradients_match_finite_differences() -> None:
    cfg, params, ids, tg = make(num_shared_experts=1)
    # eps small enough that no top-k choice flips along the random direction (routing is piecewise smooth).
    check_vjp(lambda p: gpt_loss(p, ids, tg, cfg)[0], params, rtol=1e-6, eps=1e-7)


def test_split_vjp_equals_grad_and_remat_is_reported() -> None:
    cfg, params, ids, tg = make(adaptive_remat=True, remat_load_scale=0.5)

    def f(p):
        loss, aux = gpt_loss(p, ids, tg, cfg)
        return loss, aux

    loss, vjp_dx, aux = split_vjp(f, params, has_aux=True)
    _, vjp_dw = vjp_dx(torch.ones_like(loss))
    dp = vjp_dw()
    ref = torch.func.grad(lambda p: gpt_loss(p, ids, tg, cfg)[0])(params)
    assert_close(dp, ref)
    assert aux.remat_layers == [0, 1]
    assert all(torch.isfinite(t).all() for t in tree_flatten(tree_map(lambda t: t, dp))[0])


@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), mtp=st.booleans(), shared=st.integers(0, 1), top_k=st.integers(1, 4),
       S=st.integers(1, 4))
@example(seed=0, mtp=True, shared=1, top_k=4, S=1)  # top-k = E; MTP with no position to predict
@example(seed=1, mtp=True, shared=0, top_k=1, S=2)  # one slot: experts with no token
def test_gpt_loss_and_its_gradients_equal_a_plain_composition(seed, mtp, shared, top_k, S) -> None:
    """gpt_loss (the phases of fmoe/phases.py through run_phases) against tests/gpt_oracle.py: the
    embedding, plain norms and MLPs, the loop oracle for every MoE layer, torch's cross-entropy; fp64,
    with the expert bias in the state, dense and MoE layers, MTP and a shared expert."""
    cfg, params, ids, tg = make(mtp=mtp, num_shared_experts=shared, top_k=top_k, bias_update_rate=0.1,
                                seq_aux_loss_coef=0.01, seed=seed, S=S)
    state = init_gpt_state(cfg)
    state["layers"][1]["expert_bias_E"] = torch.tensor([0.3, -0.2, 0.0, 0.1])
    loss, aux = gpt_loss(params, ids, tg, cfg, state)
    want = oracle_gpt_loss(params, ids, tg, cfg, state)
    assert_close((loss, aux.main_loss, aux.balance_loss, aux.mtp_loss),
                 (want["loss"], want["main"], want["balance"], want["mtp"]))
    grads = torch.func.grad(lambda p: gpt_loss(p, ids, tg, cfg, state)[0])(params)
    leaves, spec = tree_flatten(params)
    copies = [t.detach().clone().requires_grad_(True) for t in leaves]
    oracle_loss = oracle_gpt_loss(tree_unflatten(copies, spec), ids, tg, cfg, state)["loss"]
    want_grads = torch.autograd.grad(oracle_loss, copies, allow_unused=True)
    got = tree_flatten(grads)[0]
    for g, w in zip(got, want_grads, strict=True):
        assert_close(g, torch.zeros_like(g) if w is None else w)
