"""The block's four stage functions: each under split_vjp, chained in the backward order of seed 000,
equal the unsplit vjp of the whole block; the block's output equals attention + the loop oracle.

Legend (docs/moe.md): B sequences, S positions, T = B * S tokens, D model width, E experts, K top-k slots,
R layout rows, M rows the experts receive.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_oracle import oracle_moe

from fmoe._compat import tree_map
from fmoe.block import attention, experts, finish, init_block, self_attention
from fmoe.config import GPTConfig, MoEConfig
from fmoe.model import block
from fmoe.ops import rms_norm
from fmoe.transforms import split_vjp
from fmoe.transforms.testing import assert_close

MODES = {
    "dropless": {},
    "pad": dict(capacity_factor=1.0, pad_to_capacity=True),
    "in_expert_shared": dict(probs_in_expert=True, num_shared_experts=1, shared_expert_gate=True),
    "losses_drop": dict(aux_loss_coef=0.1, seq_aux_loss_coef=0.1, z_loss_coef=0.01, capacity_factor=0.8),
    "remat": dict(adaptive_remat=True, remat_load_scale=0.5),
    "sigmoid_groups_bias": dict(score_func="sigmoid", topk_norm="before", topk_scale=2.0,
                                bias_update_rate=0.1, seq_aux_loss_coef=0.1),
    "dynamic_in_expert": dict(dynamic_capacity_window=2, probs_in_expert=True, num_shared_experts=1),
    "pad_position_in_expert": dict(capacity_factor=0.5, pad_to_capacity=True, drop_policy="position",
                                   probs_in_expert=True),
    "qk_norm": dict(qk_norm=True),  # a GPTConfig option: Qwen3's per-head q / k RMSNorm
}


def make(mode: str, B: int, S: int, E: int, K: int, dtype: torch.dtype, seed: int):
    kw = dict(MODES[mode])
    qk_norm = kw.pop("qk_norm", False)
    if mode == "sigmoid_groups_bias" and E % 2 == 0 and K <= E // 2:
        kw.update(num_groups=2, topk_groups=1)
    moe_cfg = MoEConfig(d_model=8, d_ff=8, num_experts=E, top_k=K, **kw)
    cfg = GPTConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, moe=moe_cfg,
                    qk_norm=qk_norm)
    g = torch.Generator().manual_seed(seed)
    params = tree_map(lambda t: t.to(dtype), init_block(cfg, g, torch.float64))
    x = torch.randn(B, S, 8, generator=g, dtype=torch.float64).to(dtype)
    return cfg, params, x


def staged_grads(params, x, cfg, ct_y, ct_loss):
    """Forward the phases under split_vjp (attention, experts, finish; the local exchanges are renames),
    then backward finish, experts, attention (dx), and finally every deferred dw; returns
    (y, loss, dx, dparams). Each phase's cotangent is the dict its successor's dx pass returned."""
    moe = params["moe"]
    acts, vjp_a, route = split_vjp(lambda p, x: attention(p, x, cfg), params, x, has_aux=True)
    # Exactly one form of the gate weights: probs_R (inside the experts) or probs_TK (at combine).
    in_expert = cfg.moe.probs_in_expert
    assert ("probs_R" in acts, "probs_TK" in acts) == (in_expert, not in_expert)
    loss = acts["loss"]
    counts_L = route.layout.counts if route.layout.counts is not None else route.layout.counts_E
    dispatched = {_to_m(k): v for k, v in acts.items() if k != "loss"}  # the local dispatch: a rename
    m, vjp_m = split_vjp(lambda p, a: experts(p, a, counts_L, cfg, route.remat), moe, dispatched)
    # experts() reads moe["experts"] / ["shared"]; its dw pass returns zeros for the router it ignores
    combined = {("rows_RD" if k == "rows_MD" else k): v for k, v in m.items()}  # the local combine
    y, vjp_f = split_vjp(lambda p, a: finish(a, route), {}, combined)
    (ct_f,), dw_f = vjp_f({"h_BSD": ct_y})
    ct_m = {("rows_MD" if k == "rows_RD" else k): v for k, v in ct_f.items()}
    (ct_d,), dw_m = vjp_m(ct_m)
    ct_a = {_to_r(k): v for k, v in ct_d.items()}
    (dx,), dw_a = vjp_a({**ct_a, "loss": ct_loss})
    dw_f()  # finish has no weights
    dparams = dw_a()  # the whole block's structure (the experts' entries zero: attention does not read them)
    dparams["moe"] = tree_map(lambda a, b: a + b, dparams["moe"], dw_m())
    return y["h_BSD"], loss, dx, dparams


def _to_m(key: str) -> str:
    return {"rows_RD": "rows_MD", "probs_R": "probs_M"}.get(key, key)


def _to_r(key: str) -> str:
    return {"rows_MD": "rows_RD", "probs_M": "probs_R"}.get(key, key)


# each stage is handed the whole block's params (a pipeline's phases are not): torch.func gives the weights a
# stage never reads zeros, which split_vjp's plain-ops warning names (telling them apart would need a sync)
@pytest.mark.filterwarnings("ignore:split_vjp. the dx pass computed:UserWarning")
@pytest.mark.parametrize("mode", list(MODES))
@settings(max_examples=5, deadline=None)
@given(B=st.integers(1, 2), S=st.integers(1, 5), E=st.integers(1, 5), k_frac=st.floats(0, 1),
       dtype=st.sampled_from([torch.float64, torch.float32]), seed=st.integers(0, 2**31 - 1))
def test_stages_equal_unsplit_vjp(mode, B, S, E, k_frac, dtype, seed) -> None:
    K = 1 + int(k_frac * (E - 1))
    cfg, params, x = make(mode, B, S, E, K, dtype, seed)
    g = torch.Generator().manual_seed(seed + 7)
    ct_y = torch.randn(B, S, 8, generator=g, dtype=torch.float64).to(dtype)
    ct_loss = torch.tensor(1.5, dtype=torch.float64 if dtype == torch.float64 else torch.float32)

    def whole(p, x):
        y, aux = block(p, x, cfg)
        return y, aux.loss

    (y0, l0), vjp_fn = torch.func.vjp(whole, params, x)
    dp0, dx0 = vjp_fn((ct_y, ct_loss))
    y, loss, dx, dp = staged_grads(params, x, cfg, ct_y, ct_loss)
    assert_close((y, loss, dx), (y0, l0, dx0), scale=2.0)
    assert_close(dp, dp0, scale=2.0)


@pytest.mark.parametrize("mode", ["dropless", "in_expert_shared", "losses_drop"])
def test_block_is_attention_plus_oracle(mode) -> None:
    cfg, params, x = make(mode, 2, 4, 4, 2, torch.float64, seed=11)
    y, aux = block(params, x, cfg)
    r = self_attention(params, x, cfg)
    h = rms_norm(r, params["mlp_norm"], cfg.norm_eps).reshape(8, 8)
    y_o, loss_o, info = oracle_moe(params["moe"], h, cfg.moe, seq_len=4)
    assert_close(y, r + y_o.reshape(2, 4, 8))
    assert_close(aux.loss, loss_o)
    assert int(aux.dropped) == info["dropped"]


def test_adaptive_remat_rematerialises_and_keeps_grads() -> None:
    cfg, params, x = make("remat", 2, 4, 4, 1, torch.float64, seed=2)
    from fmoe.experts import routed_experts
    calls = []

    def counted(*a, **k):  # the experts seam (fmoe/seams.py) counts the expert forwards
        calls.append(1)
        return routed_experts(*a, **k)

    cfg = dataclasses.replace(cfg, moe=cfg.moe.replace(experts=counted))
    cfg_never = GPTConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1,
                          moe=cfg.moe.replace(adaptive_remat=False))
    ct = torch.randn(2, 4, 8, dtype=torch.float64)

    def grads(c):
        calls.clear()
        flags = []

        def f(p, x):
            y, aux = block(p, x, c)
            flags.append(aux.remat)
            return y, aux.loss

        (y, loss), vjp_fn = torch.func.vjp(f, params, x)
        out = vjp_fn((ct, torch.ones_like(loss)))
        return flags[0], len(calls), out

    rec, n_rec, g_rec = grads(cfg)
    plain, n_plain, g_plain = grads(cfg_never)
    assert rec and not plain
    assert (n_rec, n_plain) == (2, 1)  # the forward is re-run once in the backward
    assert_close(g_rec, g_plain)


def test_remat_decision_follows_load() -> None:
    from fmoe.remat_policy import expert_policy, overloaded
    from fmoe.transforms import everything_saveable, nothing_saveable

    assert expert_policy(True) is nothing_saveable and expert_policy(False) is everything_saveable
    assert overloaded(torch.tensor([9, 1, 1, 1]), 2.0)
    assert not overloaded(torch.tensor([3, 3, 3, 3]), 2.0)
    assert not overloaded(torch.tensor([5, 3, 3, 3]), 2.0)
    assert not overloaded(torch.tensor([0, 0]), 2.0)
