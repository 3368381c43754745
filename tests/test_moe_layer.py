"""The MoE layer against the loop oracle (tests/moe_oracle.py): outputs and every gradient via split_vjp.

Legend: T tokens, D model width, F expert width, E experts, K experts per token.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from moe_oracle import oracle_moe

from fmoe._compat import tree_flatten, tree_map, tree_unflatten
from fmoe.config import MoEConfig
from fmoe.layer import init_moe, plan_route
from fmoe.model import moe
from fmoe.transforms import split_vjp
from fmoe.transforms.testing import assert_close

MODES = {
    "dropless": {},
    "sigmoid_before_scaled": dict(score_func="sigmoid", topk_norm="before", topk_scale=2.5),
    "softmax_before": dict(topk_norm="before"),
    "groups": dict(num_groups=2, topk_groups=1),
    "drop_probs": dict(capacity_factor=0.75, drop_policy="probs"),
    "drop_position": dict(capacity_factor=0.75, drop_policy="position"),
    "pad_probs": dict(capacity_factor=0.75, pad_to_capacity=True),
    "pad_position": dict(capacity_factor=1.25, pad_to_capacity=True, drop_policy="position"),
    "dynamic": dict(dynamic_capacity_window=2),
    "shared_gated_in_expert": dict(num_shared_experts=1, shared_expert_gate=True, probs_in_expert=True),
    "shared_drop_in_expert": dict(num_shared_experts=2, probs_in_expert=True, capacity_factor=0.5),
    "losses": dict(aux_loss_coef=0.1, seq_aux_loss_coef=0.2, z_loss_coef=0.01),
    "bias_sigmoid": dict(bias_update_rate=0.1, score_func="sigmoid", aux_loss_coef=0.05),
    "remat": dict(adaptive_remat=True, remat_load_scale=0.5),
}
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def make_cfg(mode: str, D: int, F: int, E: int, K: int, capacity_factor: float | None = None) -> MoEConfig:
    kw = dict(MODES[mode])
    if capacity_factor is not None and "capacity_factor" in kw:
        kw["capacity_factor"] = capacity_factor
    if mode == "groups":
        if E % 2 or K > E // 2:
            kw = {}
    return MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K, **kw)


def make_inputs(cfg: MoEConfig, T: int, dtype: torch.dtype, seed: int, scenario: str = "random"):
    g = torch.Generator().manual_seed(seed)
    params = init_moe(cfg, g, dtype=torch.float64)
    x_TD = torch.randn(T, cfg.d_model, generator=g, dtype=torch.float64)
    if scenario == "duplicates":
        # Pairs of identical tokens: equal gate weights, so drop-by-probs must break ties by position.
        # Inputs and router weights are quantised so that the router logits are exact in every dtype and
        # summation order (a BLAS kernel may round the same row differently at another batch position,
        # which would turn the tie into a near-tie that fp32 and the fp64 oracle break differently).
        x_TD = (x_TD * 2).round() / 2
        x_TD[1::2] = x_TD[0::2][: T // 2]
        params["router"]["w"] = (params["router"]["w"] * 8).round() / 8
    if scenario in ("empty_expert", "one_expert"):
        # A constant positive feature 0 and a router row that only sees it: expert 0 never (always) chosen.
        x_TD[:, 0] = 3.0
        params["router"]["w"][0] = 0.0
        params["router"]["w"][0, 0] = -10.0 if scenario == "empty_expert" else 10.0
    state = {}
    if cfg.bias_update_rate:
        state["expert_bias_E"] = torch.randn(cfg.num_experts, generator=g) * 0.3
    if cfg.dynamic_capacity_window:
        # A random load history, so that both a fitting forecast and a miss occur.
        W, cap = cfg.dynamic_capacity_window, T * cfg.top_k
        state["load_history_W"] = torch.randint(0, cap + 1, (W,), generator=g)
        state["capacity_misses"] = torch.randint(0, 3, (), generator=g)
        state["capacity_steps"] = state["capacity_misses"] + 3
    cast = tree_map(lambda t: t.to(dtype), params)
    return cast, x_TD.to(dtype), state


def run_split(params, x_TD, cfg, state, seq_len, backend, ct_TD, ct_loss):
    cfg = cfg.replace(backend=backend)

    def f(p, x):
        y, aux = moe(p, x, cfg, state, seq_len=seq_len)
        return (y, aux.loss), aux

    (y, loss), vjp_dx, aux = split_vjp(f, params, x_TD, has_aux=True)
    (dx,), vjp_dw = vjp_dx((ct_TD, ct_loss.to(loss.dtype)))
    return y, loss, dx, vjp_dw(), aux


def run_oracle(params, x_TD, cfg, state, seq_len, ct_TD, ct_loss):
    p64 = tree_map(lambda t: t.detach().double().requires_grad_(), params)
    x64 = x_TD.detach().double().requires_grad_()
    y, loss, info = oracle_moe(p64, x64, cfg, state, seq_len)
    leaves, spec = tree_flatten(p64)
    obj = (y * ct_TD.double()).sum() + loss * ct_loss.double()
    grads = torch.autograd.grad(obj, [x64, *leaves], allow_unused=True)
    dleaves = [torch.zeros_like(lf) if gr is None else gr for gr, lf in zip(grads[1:], leaves)]
    dparams = tree_unflatten(dleaves, spec)
    return y.detach(), loss.detach(), grads[0], dparams, info


def check_against_oracle(mode, T, D, F, E, K, dtype, seed, backend=None, scenario="random",
                         capacity_factor=None):
    cfg = make_cfg(mode, D, F, E, K, capacity_factor)
    aux = check_cfg(cfg, T, dtype, seed, backend, scenario)
    if mode == "remat":
        assert aux.remat
    return aux


def check_cfg(cfg, T, dtype, seed, backend=None, scenario="random"):
    """Compare `moe` under split_vjp with the oracle: y, loss, every gradient, counts, drops, capacity,
    the layout rows (padding included), the next state and the remat decision."""
    D = cfg.d_model
    params, x_TD, state = make_inputs(cfg, T, dtype, seed, scenario)
    seq_len = T // 2 if T % 2 == 0 else T
    g = torch.Generator().manual_seed(seed + 1)
    ct_TD = torch.randn(T, D, generator=g, dtype=torch.float64).to(dtype)
    ct_loss = torch.randn((), generator=g, dtype=torch.float64)
    y, loss, dx, dparams, aux = run_split(params, x_TD, cfg, state, seq_len, backend, ct_TD, ct_loss)
    y_o, loss_o, dx_o, dparams_o, info = run_oracle(params, x_TD, cfg, state, seq_len, ct_TD, ct_loss)
    scale = 4.0 if dtype == torch.bfloat16 else 2.0
    # Dropped pairs and counts are integers: exact.
    assert aux.tokens_per_expert_E.tolist() == info["counts"]
    assert int(aux.dropped) == info["dropped"]
    assert y.dtype == dtype and y.shape == (T, D)
    assert_close(y, y_o.to(dtype), dtype=dtype, scale=scale, msg=f"{cfg} y")
    assert_close(loss.double(), loss_o, dtype=torch.float32, scale=scale, msg=f"{cfg} loss")
    assert_close(dx, dx_o.to(dtype), dtype=dtype, scale=scale, msg=f"{cfg} dx")
    assert_close(dparams, tree_map(lambda t: t.to(dtype), dparams_o), dtype=dtype, scale=scale,
                 msg=f"{cfg} dparams")
    if "new_bias" in info:
        new_bias = torch.tensor(info["new_bias"], dtype=torch.float64)
        assert_close(aux.new_state["expert_bias_E"].double(), new_bias, dtype=torch.float32)
    assert aux.capacity == info["capacity"]
    assert aux.capacity_missed == info["missed"]
    for key, value in info["capacity_state"].items():
        assert aux.new_state[key].tolist() == value, key
    assert aux.remat == (cfg.adaptive_remat and info["overloaded"])
    _, _, meta = plan_route(params, x_TD, cfg, state, seq_len)
    assert meta.layout.row_src_R.tolist() == info["rows"]
    if scenario == "empty_expert":
        assert info["counts"][0] == 0
    return aux


sizes = st.tuples(st.integers(1, 10), st.sampled_from([4, 6, 8]), st.sampled_from([4, 8]), st.integers(1, 6))


@pytest.mark.parametrize("mode", list(MODES))
@settings(max_examples=8, deadline=None)
@given(sizes=sizes, k_frac=st.floats(0, 1), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1),
       backend=st.sampled_from([None, "loop"]), capacity_factor=st.sampled_from([0.25, 0.5, 0.75, 1.0, 2.0]))
def test_matches_oracle(mode, sizes, k_frac, dtype, seed, backend, capacity_factor) -> None:
    T, D, F, E = sizes
    K = 1 + int(k_frac * (E - 1))
    check_against_oracle(mode, T, D, F, E, K, dtype, seed, backend, capacity_factor=capacity_factor)


@st.composite
def any_config(draw):
    """Every option drawn independently: routing (score function, norm, scale, groups, bias), balancing
    losses, capacity mode (dropless, drop, drop-and-pad, dynamic) with both policies, shared experts
    (gated or not), probs in the expert, adaptive remat, and the backend (grouped_mm forced with
    sizes aligned for it). Returns (cfg, T, dtype)."""
    G = draw(st.sampled_from([1, 2, 3]))
    per = draw(st.integers(1, 3))
    topk_groups = draw(st.integers(1, G))
    K = draw(st.integers(1, topk_groups * per))
    backend = draw(st.sampled_from([None, "loop", "grouped_mm"]))
    if backend == "grouped_mm":
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
        D, F = 8, 8  # rows of 16 bytes in bf16, 32 in fp32: what the CPU kernel needs
    else:
        dtype = draw(st.sampled_from(DTYPES))
        D, F = draw(st.sampled_from([4, 6, 8])), draw(st.sampled_from([4, 8]))
    one_of = lambda *values: draw(st.sampled_from(values))  # noqa: E731
    kw = dict(score_func=one_of("softmax", "sigmoid"), topk_norm=one_of("before", "after"),
              topk_scale=one_of(1.0, 2.5), num_groups=G, topk_groups=topk_groups,
              aux_loss_coef=one_of(0.0, 0.1), seq_aux_loss_coef=one_of(0.0, 0.2),
              z_loss_coef=one_of(0.0, 0.01), bias_update_rate=one_of(0.0, 0.1),
              probs_in_expert=draw(st.booleans()), backend=backend)
    capacity = draw(st.sampled_from(["dropless", "drop", "pad", "dynamic"]))
    if capacity in ("drop", "pad"):
        kw.update(capacity_factor=draw(st.sampled_from([0.25, 0.5, 1.0, 1.1, 2.0])),
                  drop_policy=draw(st.sampled_from(["probs", "position"])), pad_to_capacity=capacity == "pad")
    elif capacity == "dynamic":
        kw.update(dynamic_capacity_window=draw(st.integers(1, 3)),
                  dynamic_capacity_margin=draw(st.sampled_from([1.0, 1.1, 1.5])))
    shared = draw(st.integers(0, 2))
    kw.update(num_shared_experts=shared, shared_expert_gate=shared > 0 and draw(st.booleans()))
    if draw(st.booleans()):
        kw.update(adaptive_remat=True, remat_load_scale=draw(st.sampled_from([0.5, 1.5])))
    cfg = MoEConfig(d_model=D, d_ff=F, num_experts=G * per, top_k=K, **kw)
    return cfg, draw(st.integers(1, 10)), dtype


@settings(max_examples=150, deadline=None)
@example(case=(MoEConfig(d_model=8, d_ff=8, num_experts=6, top_k=2, score_func="sigmoid", topk_norm="after",
                         topk_scale=2.5, num_groups=3, topk_groups=2, bias_update_rate=0.1,
                         capacity_factor=0.5, drop_policy="probs", pad_to_capacity=True, num_shared_experts=1,
                         shared_expert_gate=True, probs_in_expert=True, backend="grouped_mm"),
               8, torch.float32), seed=0, scenario="duplicates")
@example(case=(MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=1, capacity_factor=0.5, drop_policy="probs"),
               8, torch.float64), seed=1, scenario="duplicates")
@given(case=any_config(), seed=st.integers(0, 2**31 - 1), scenario=st.sampled_from(["random", "duplicates"]))
def test_any_config_matches_oracle(case, seed, scenario) -> None:
    cfg, T, dtype = case
    check_cfg(cfg, T, dtype, seed, cfg.backend, scenario)


@settings(max_examples=1, deadline=None)
@example(mode="dropless", T=7, E=4, K=2, scenario="empty_expert", dtype=torch.float32)
@example(mode="drop_probs", T=7, E=4, K=2, scenario="empty_expert", dtype=torch.float64)
@example(mode="pad_position", T=6, E=3, K=1, scenario="empty_expert", dtype=torch.float32)
@example(mode="dropless", T=5, E=1, K=1, scenario="random", dtype=torch.float64)
@example(mode="dropless", T=6, E=4, K=4, scenario="random", dtype=torch.float32)
@example(mode="shared_gated_in_expert", T=6, E=3, K=3, scenario="random", dtype=torch.float64)
@example(mode="dropless", T=8, E=4, K=1, scenario="one_expert", dtype=torch.float64)
@example(mode="drop_probs", T=8, E=4, K=1, scenario="one_expert", dtype=torch.float64)
@example(mode="pad_probs", T=8, E=4, K=1, scenario="one_expert", dtype=torch.float32)
@example(mode="dynamic", T=8, E=4, K=1, scenario="one_expert", dtype=torch.float32)
@given(mode=st.just("dropless"), T=st.just(4), E=st.just(2), K=st.just(1), scenario=st.just("random"),
       dtype=st.just(torch.float64))
def test_edge_cases(mode, T, E, K, scenario, dtype) -> None:
    aux = check_against_oracle(mode, T, 8, 8, E, K, dtype, seed=3, scenario=scenario)
    if scenario == "one_expert":
        assert aux.tokens_per_expert_E.tolist() == [T, 0, 0, 0]


@settings(max_examples=10, deadline=None)
@given(T=st.integers(1, 10), E=st.integers(1, 5), k_frac=st.floats(0, 1), seed=st.integers(0, 2**31 - 1),
       policy=st.sampled_from(["probs", "position"]), in_expert=st.booleans())
def test_large_capacity_pad_equals_dropless(T, E, k_frac, seed, policy, in_expert) -> None:
    K = 1 + int(k_frac * (E - 1))
    base = MoEConfig(d_model=8, d_ff=8, num_experts=E, top_k=K, probs_in_expert=in_expert)
    padded = base.replace(capacity_factor=float(E), pad_to_capacity=True, drop_policy=policy)
    params, x_TD, _ = make_inputs(base, T, torch.float64, seed)
    ct = torch.randn(T, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    one = torch.ones((), dtype=torch.float64)
    y0, _, dx0, dp0, _ = run_split(params, x_TD, base, {}, None, None, ct, one)
    y1, _, dx1, dp1, aux = run_split(params, x_TD, padded, {}, None, None, ct, one)
    assert int(aux.dropped) == 0 and aux.capacity == T * K
    assert_close((y1, dx1, dp1), (y0, dx0, dp0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_single_expert_is_dense_swiglu(dtype) -> None:
    cfg = MoEConfig(d_model=8, d_ff=12, num_experts=1, top_k=1)
    params, x_TD, _ = make_inputs(cfg, 9, dtype, seed=5)
    ex = params["experts"]

    def dense(w_gate_DF, w_up_DF, w_down_FD, x):
        return torch.nn.functional.silu(x @ w_gate_DF) * (x @ w_up_DF) @ w_down_FD

    gate_DF, up_DF = ex["w_gate_up"][0][:, :12], ex["w_gate_up"][0][:, 12:]  # gate | up
    y, aux = moe(params, x_TD, cfg)
    assert_close(y, dense(gate_DF, up_DF, ex["w_down"][0], x_TD))
    ct = torch.randn_like(y)
    _, vjp_fn = torch.func.vjp(lambda p, x: moe(p, x, cfg)[0], params, x_TD)
    dp, dx = vjp_fn(ct)
    _, vjp_dense = torch.func.vjp(dense, gate_DF, up_DF, ex["w_down"][0], x_TD)
    dg, du, dd, dx_d = vjp_dense(ct)
    assert_close((dp["experts"]["w_gate_up"][0], dp["experts"]["w_down"][0], dx),
                 (torch.cat([dg, du], -1), dd, dx_d))
    assert_close(dp["router"]["w"], torch.zeros_like(dp["router"]["w"]))


def test_oracle_can_fail() -> None:
    """A deliberately wrong layer (gate weights not renormalised) must be caught by the oracle comparison."""
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2)
    params, x_TD, _ = make_inputs(cfg, 6, torch.float64, seed=1)
    y, _ = moe(params, x_TD, cfg.replace(topk_norm="before"))
    y_o, _, _ = oracle_moe(params, x_TD, cfg)
    with pytest.raises(AssertionError):
        assert_close(y, y_o)


@settings(max_examples=15, deadline=None)
@given(case=any_config())
def test_zero_tokens(case) -> None:
    """T = 0 works in every mode: an empty [0, D] output, zero balancing loss, zero gradients."""
    cfg, _, dtype = case
    params, _, state = make_inputs(cfg, 1, dtype, seed=0)
    x_TD = torch.zeros(0, cfg.d_model, dtype=dtype)
    ct = torch.zeros(0, cfg.d_model, dtype=dtype)
    y, loss, dx, dparams, aux = run_split(params, x_TD, cfg, state, None, cfg.backend, ct,
                                          torch.ones((), dtype=torch.float64))
    assert y.shape == (0, cfg.d_model) and y.dtype == dtype and dx.shape == (0, cfg.d_model)
    assert float(loss) == 0.0 and int(aux.dropped) == 0
    assert aux.tokens_per_expert_E.tolist() == [0] * cfg.num_experts
    assert_close(dparams, tree_map(torch.zeros_like, params))


@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 12), seq_len=st.integers(-2, 14), coef=st.sampled_from([0.0, 0.2]))
@example(T=6, seq_len=0, coef=0.2)  # used to be read as one sequence of 6
@example(T=6, seq_len=4, coef=0.0)  # used to pass unnoticed (the loss that reads it is off)
@example(T=0, seq_len=3, coef=0.2)  # no tokens: zero sequences of 3
def test_seq_len_must_be_a_positive_divisor_of_the_tokens(T: int, seq_len: int, coef: float) -> None:
    cfg = MoEConfig(d_model=4, d_ff=4, num_experts=4, top_k=2, seq_aux_loss_coef=coef)
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    x_TD = torch.randn(T, 4, generator=torch.Generator().manual_seed(1))
    if seq_len <= 0 or T % seq_len:
        with pytest.raises(ValueError, match=f"seq_len .*must be a positive int that divides the {T} tokens"):
            moe(params, x_TD, cfg, seq_len=seq_len)
    else:
        _, aux = moe(params, x_TD, cfg, seq_len=seq_len)
        _, one = moe(params, x_TD, cfg, seq_len=T or None)
        if seq_len == T:  # one sequence, spelled either way
            assert torch.equal(aux.loss, one.loss)


@pytest.mark.parametrize("seq_len", [True, 2.0, "3"])
def test_seq_len_must_be_an_int(seq_len) -> None:
    cfg = MoEConfig(d_model=4, d_ff=4, num_experts=4, top_k=2, seq_aux_loss_coef=0.1)
    with pytest.raises(ValueError, match="seq_len"):
        moe(init_moe(cfg), torch.randn(6, 4), cfg, seq_len=seq_len)
