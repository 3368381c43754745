"""permute / unpermute and capacity layouts against python loops; their backwards by finite differences.

Legend (docs/moe.md): T tokens, D features, E experts, K top-k slots, N = T * K pairs, R layout rows,
C capacity.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from fmoe.capacity import capacity_for, drop_layout, forecast_capacity, make_layout
from fmoe.config import MoEConfig
from fmoe.layer import init_moe, init_moe_state, update_moe_state
from fmoe.model import moe
from fmoe.ops import permute, permute_probs, sort_layout, unpermute
from fmoe.transforms.testing import assert_close, check_vjp


def draw_routing(T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.int64)
    probs_TK = torch.rand(T, K, generator=g, dtype=torch.float64)
    return ids_TK, probs_TK, g


def loop_layout(ids_TK, probs_TK, E, C, policy, pad):
    """Rows per expert in token order, after dropping by the policy: list of lists of (t, k)."""
    T, K = ids_TK.shape
    per = []
    for e in range(E):
        mine = [(t, k) for t in range(T) for k in range(K) if int(ids_TK[t, k]) == e]
        if C is not None:
            ranked = sorted(mine, key=lambda tk: -float(probs_TK[tk])) if policy == "probs" else mine
            kept = set(ranked[:C])
            mine = [tk for tk in mine if tk in kept]
        per.append(mine)
    return per


def loop_permute(x_TD, per, C, pad):
    rows = []
    for mine in per:
        rows += [x_TD[t] for t, _ in mine]
        if pad:
            rows += [x_TD.new_zeros(x_TD.shape[1])] * (C - len(mine))
    return torch.stack(rows) if rows else x_TD.new_zeros(0, x_TD.shape[1])


case = st.tuples(st.integers(0, 9), st.integers(1, 5), st.floats(0, 1), st.integers(0, 2**31 - 1))


@settings(max_examples=25, deadline=None)
@example(case=(0, 3, 0.5, 0), mode="dropless")
@example(case=(5, 1, 0.0, 1), mode="pad")
@example(case=(6, 4, 1.0, 2), mode="drop_probs")
@example(case=(6, 4, 1.0, 3), mode="dropless")
@given(case=case, mode=st.sampled_from(["dropless", "drop_probs", "drop_position", "pad", "pad_position"]))
def test_layout_permute_unpermute_match_loops(case, mode) -> None:
    T, E, kf, seed = case
    K = 1 + int(kf * (E - 1))
    ids_TK, probs_TK, g = draw_routing(T, E, K, seed)
    x_TD = torch.randn(T, 3, generator=g, dtype=torch.float64)
    if mode == "dropless":
        layout, C, pad, policy = sort_layout(ids_TK, E), None, False, "position"
    else:
        C = max(1, math.ceil(0.6 * T * K / E))
        pad = mode.startswith("pad")
        policy = "position" if mode.endswith("position") else "probs"
        layout, dropped = drop_layout(ids_TK, probs_TK, E, C, policy, pad)
    per = loop_layout(ids_TK, probs_TK, E, C, policy, pad)
    assert layout.counts_E.tolist() == ([C] * E if pad else [len(m) for m in per])
    x_RD = permute(x_TD, layout)
    assert_close(x_RD, loop_permute(x_TD, per, C, pad))
    # unpermute: probability-weighted sum over the kept slots of each token.
    y_RD = torch.randn(x_RD.shape[0], 3, generator=g, dtype=torch.float64)
    expect = torch.zeros(T, 3, dtype=torch.float64)
    row = 0
    for mine in per:
        for t, k in mine:
            expect[t] += probs_TK[t, k] * y_RD[row]
            row += 1
        if pad:
            row += C - len(mine)
    assert_close(unpermute(y_RD, probs_TK, layout), expect)
    p_R = permute_probs(probs_TK, layout)
    assert_close(p_R, loop_permute(probs_TK.reshape(-1, 1), [[(t * K + k, 0) for t, k in m] for m in per], C,
                                   pad).reshape(-1))
    if T:  # torch.func runs the gather-only Functions; plain autograd on CPU runs aten's index_select
        for vjp in (torch.func.vjp, autograd_vjp):
            check_vjp(lambda x: permute(x, layout), x_TD, vjp=vjp)
            check_vjp(lambda y, p: unpermute(y, p, layout), y_RD, probs_TK, vjp=vjp)
            check_vjp(lambda y: unpermute(y, None, layout), y_RD, vjp=vjp)
            check_vjp(lambda p: permute_probs(p, layout), probs_TK, vjp=vjp)


def autograd_vjp(f, *primals):
    """Adapter: plain tape autograd as a vjp (for check_vjp): (out, cotangent -> input grads)."""
    leaves = [p.detach().requires_grad_(True) for p in primals]
    out = f(*leaves)
    return out.detach(), lambda c: torch.autograd.grad(out, leaves, c, allow_unused=True)


def test_permute_is_a_stable_sort() -> None:
    ids_TK = torch.tensor([[2, 0], [0, 1], [2, 1]])
    layout = sort_layout(ids_TK, 3)
    assert layout.row_src_R.tolist() == [1, 2, 3, 5, 0, 4]
    assert layout.counts_E.tolist() == [2, 2, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("full", [True, False])
def test_every_pass_is_one_gather_or_one_bag_sum_and_no_scatter(dtype, full, monkeypatch) -> None:
    """On a device (the CPU standing in: no aten glue there), each forward and backward of permute /
    unpermute runs one row gather or one bag sum (no scatter, index_add or index_put: atomics on a device,
    nondeterministic), and no [T, K, D] product or fp32 copy of the rows; the values match the loop."""
    monkeypatch.setattr("fmoe.ops._host_bound.ATEN_GLUE_DEVICES", ())
    ids_TK = torch.tensor([[1, 0], [0, 1], [1, 0]])
    probs_TK = torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]], dtype=dtype)
    layout = sort_layout(ids_TK, 2) if full else drop_layout(ids_TK, probs_TK.float(), 2, 2, "position",
                                                            False)[0]
    x_TD = torch.randn(3, 4, dtype=dtype, requires_grad=True)
    p_TK = probs_TK.clone().requires_grad_(True)
    with OpNames() as fwd:
        x_RD = permute(x_TD, layout)
        y_TD = unpermute(x_RD * 2, p_TK, layout)
    with OpNames() as bwd:
        gx_TD, gp_TK = torch.autograd.grad(y_TD, (x_TD, p_TK), torch.ones_like(y_TD))
    moved = {"index_select", "_embedding_bag", "_embedding_bag_forward_only",
             "_embedding_bag_per_sample_weights_backward"}
    for ops in (fwd.names, bwd.names):
        assert not {n for n in ops if "scatter" in n or "index_add" in n or "index_put" in n}, ops
        assert {n for n in ops if n in moved}, ops
    assert "_embedding_bag_per_sample_weights_backward" in bwd.names
    assert "bmm" not in fwd.names | bwd.names
    kept_TK = layout.row_dst_N.view(3, 2) < layout.num_rows  # a dropped pair adds nothing
    expect_gx = 2 * (p_TK.detach().float() * kept_TK).sum(1, keepdim=True).expand(3, 4)
    torch.testing.assert_close(gx_TD.float(), expect_gx, rtol=1e-2, atol=1e-2)
    expect_gp = 2 * x_TD.detach().float().sum(1, keepdim=True) * kept_TK
    torch.testing.assert_close(gp_TK.float(), expect_gp, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernels", ["bags and their weight gradient", "bags only", "neither"])
def test_a_device_without_a_kernel_takes_the_gather_form_with_the_same_values(kernels, monkeypatch) -> None:
    """The rule of BAG_KERNELS / BAG_WEIGHT_GRAD_KERNELS (CUDA's per-sample-weight backward takes no bf16):
    where a table leaves a (device, dtype) out, its op never runs and the gather form gives the same
    values. Checked on CPU by taking CPU fp64 out of the tables (and the CPU out of the aten glue's)."""
    from fmoe.ops import _permute

    monkeypatch.setattr("fmoe.ops._host_bound.ATEN_GLUE_DEVICES", ())
    if kernels != "bags and their weight gradient":
        monkeypatch.setitem(_permute.BAG_WEIGHT_GRAD_KERNELS, "cpu", ())
    if kernels == "neither":
        monkeypatch.setitem(_permute.BAG_KERNELS, "cpu", ())
    ids_TK, probs_TK, g = draw_routing(7, 4, 3, 5)
    layout, _ = drop_layout(ids_TK, probs_TK, 4, 5, "probs", False)
    x_TD = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    p_TK = probs_TK.clone().requires_grad_(True)
    with OpNames() as ops:
        y_TD = unpermute(permute(x_TD, layout) * 3, p_TK, layout)
        grads = torch.autograd.grad(y_TD, (x_TD, p_TK), torch.ones_like(y_TD))
    assert ("_embedding_bag_per_sample_weights_backward" in ops.names) == (kernels == "bags and their weight "
                                                                           "gradient")
    assert any("embedding_bag" in n for n in ops.names) == (kernels != "neither")
    kept_TK = (layout.row_dst_N.view(7, 3) < layout.num_rows).double()
    assert_close(y_TD, 3 * (p_TK * kept_TK).sum(1, keepdim=True) * x_TD)
    assert_close(grads[0], 3 * (p_TK * kept_TK).sum(1, keepdim=True).expand(7, 3))
    assert_close(grads[1], 3 * x_TD.sum(1, keepdim=True) * kept_TK)


class OpNames(TorchDispatchMode):
    """The aten op names a block runs (`names`)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_dynamic_capacity_forecast_and_misses() -> None:
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=1, dynamic_capacity_window=3)
    state = init_moe_state(cfg)
    loads = [[4, 0, 0, 0], [2, 2, 0, 0], [1, 1, 1, 1], [3, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1],
             [2, 1, 1, 0]]
    expect_miss = [True, False, False, False, False, False, False, True]
    for load, miss in zip(loads, expect_miss):
        ids_TK = torch.tensor([e for e, c in enumerate(load) for _ in range(c)]).reshape(-1, 1)
        layout, info = make_layout(ids_TK, torch.ones(4, 1), cfg, state)
        assert info.missed == miss
        assert int(info.dropped) == 0  # dropless whatever the forecast
        assert info.capacity >= max(load) and layout.num_rows == 4 * info.capacity
        counts_E = torch.tensor(load)  # the window moves once per step, from the step's load
        state = update_moe_state(state, cfg, counts_E, counts_E.max(), info.missed)
    assert int(state["capacity_misses"]) == 2 and int(state["capacity_steps"]) == 8
    assert forecast_capacity(torch.tensor([3, 1, 2]), 1.5) == 5


def test_dynamic_capacity_rejects_a_partial_or_mis_sized_state() -> None:
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=1, dynamic_capacity_window=3)
    ids_TK, probs_TK = torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1)
    full = init_moe_state(cfg)
    partial = {"load_history_W": full["load_history_W"]}
    wrong_size = dict(full, load_history_W=torch.zeros(5, dtype=torch.int64))
    for bad in (partial, wrong_size):
        with pytest.raises(ValueError, match="dynamic-capacity state must hold load_history_W"):
            make_layout(ids_TK, probs_TK, cfg, bad)


def test_dynamic_capacity_layer_equals_dropless() -> None:
    base = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2)
    dyn = base.replace(dynamic_capacity_window=2, dynamic_capacity_margin=1.2)
    params = init_moe(base, torch.Generator().manual_seed(0))
    state = init_moe_state(dyn)
    misses = []
    for step in range(4):
        x = torch.randn(12, 8, generator=torch.Generator().manual_seed(step))
        y0, _ = moe(params, x, base)
        y1, aux = moe(params, x, dyn, state)
        assert_close(y1, y0)
        misses.append(aux.capacity_missed)
        state = aux.new_state
    assert misses[0] and int(state["capacity_misses"]) == sum(misses)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_drop_policy_keeps_the_right_pairs(policy) -> None:
    ids_TK = torch.tensor([[0], [0], [0], [1]])
    probs_TK = torch.tensor([[0.1], [0.9], [0.5], [0.3]])
    layout, dropped = drop_layout(ids_TK, probs_TK, 2, 2, policy)
    assert int(dropped) == 1
    kept = layout.row_src_R.tolist()
    assert kept == ([1, 2, 3] if policy == "probs" else [0, 1, 3])


@pytest.mark.parametrize("cf, T, K, E, expect", [
    (1.1, 100, 1, 1, 110), (1.1, 50, 2, 2, 55), (1.2, 100, 1, 1, 120), (0.7, 30, 1, 1, 21),
    (1.25, 7, 2, 4, 5), (0.1, 3, 1, 1, 1)])
def test_capacity_is_the_ceiling_of_the_decimal_product(cf, T, K, E, expect) -> None:
    # C = ceil(cf * T * K / E) for the factor as written: 1.1 * 100 is 110, not ceil(110.00000000000001).
    cfg = MoEConfig(d_model=4, d_ff=4, num_experts=E, top_k=K, capacity_factor=cf)
    assert capacity_for(cfg, T) == expect


def test_dynamic_forecast_is_the_ceiling_of_the_decimal_product() -> None:
    assert forecast_capacity(torch.tensor([100, 3]), 1.1) == 110
    assert forecast_capacity(torch.tensor([0, 0]), 1.5) == 0


@pytest.mark.parametrize("pad", [False, True])
def test_drop_by_probs_ties_keep_the_earliest_pairs(pad) -> None:
    # Pairs n = t * K + k. Expert 0: n = 0 (0.5), 2, 5, 6 (0.7 each): keep the earliest two of the tie.
    # Expert 1: n = 1 (0.5), 3, 4, 7 (0.3 each): keep 1, then the earliest of the tie, 3.
    ids_TK = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])
    probs_TK = torch.tensor([[0.5, 0.5], [0.7, 0.3], [0.3, 0.7], [0.7, 0.3]])
    layout, dropped = drop_layout(ids_TK, probs_TK, 2, 2, "probs", pad)
    assert int(dropped) == 2 + 2
    assert layout.row_src_R.tolist() == [2, 5, 1, 3]
