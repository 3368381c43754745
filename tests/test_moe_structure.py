"""Params and state against their config (fmoe/structure.py): every entry point refuses a tree whose keys,
shapes or dtypes do not match the config, naming the leaf, and accepts exactly what the init functions build.

Legend: D model width, F expert width, E experts, L local experts, K top-k slots, T tokens, B sequences,
S positions, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe import schedule as S
from fmoe._compat import tree_flatten, tree_map
from fmoe.block import attention, dense_block, experts, self_attention
from fmoe.config import GPTConfig, MoEConfig
from fmoe.dispatch.local import LocalDispatcher
from fmoe.layer import expert_rows, init_moe, init_moe_state, plan_route, route_tokens, update_moe_state
from fmoe.model import block, gpt_loss, init_gpt, init_gpt_state, moe
from fmoe.parallel.context import ParallelContext
from fmoe.pipeline import gpt_pipeline_step, gpt_program, update_gpt_state
from fmoe.router import route
from fmoe.structure import check_gpt, check_moe

BASE = MoEConfig(d_model=8, d_ff=16, num_experts=4, top_k=2)


def raises(message: str):
    """pytest.raises(ValueError) whose message contains `message` (literally)."""
    return pytest.raises(ValueError, match=re.escape(message))


@st.composite
def moe_configs(draw: st.DrawFn, d_model: int | None = None) -> MoEConfig:
    """Any valid MoEConfig (small sizes), every structural option drawn."""
    E = draw(st.integers(1, 8))
    J = draw(st.sampled_from([j for j in range(1, E + 1) if E % j == 0]))
    topk_groups = draw(st.integers(1, J))
    K = draw(st.integers(1, topk_groups * (E // J)))
    shared = draw(st.integers(0, 2))
    window = draw(st.integers(0, 3))
    cf = None if window else draw(st.sampled_from([None, 0.5, 1.25]))
    return MoEConfig(d_model=d_model or draw(st.integers(1, 8)), d_ff=draw(st.integers(1, 8)), num_experts=E,
                     top_k=K, num_groups=J, topk_groups=topk_groups, num_shared_experts=shared,
                     shared_expert_gate=bool(shared) and draw(st.booleans()),
                     bias_update_rate=draw(st.sampled_from([0.0, 0.1])), dynamic_capacity_window=window,
                     capacity_factor=cf, pad_to_capacity=cf is not None and draw(st.booleans()))


@st.composite
def gpt_configs(draw: st.DrawFn) -> GPTConfig:
    """Any valid small GPTConfig."""
    n_heads = draw(st.integers(1, 3))
    kv = draw(st.sampled_from([g for g in range(1, n_heads + 1) if n_heads % g == 0]))
    D = draw(st.integers(1, 8))
    n_layers = draw(st.integers(1, 4))
    return GPTConfig(vocab_size=draw(st.integers(1, 10)), d_model=D, n_layers=n_layers, n_heads=n_heads,
                     n_kv_heads=kv, head_dim=draw(st.sampled_from([2, 4])),
                     d_ff_dense=draw(st.integers(1, 8)),
                     num_dense_layers=draw(st.integers(0, n_layers)), mtp=draw(st.booleans()),
                     qk_norm=draw(st.booleans()), moe=draw(moe_configs(d_model=D)))


def leaves(tree, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """(key path, tensor) of every leaf of a nested dict / list."""
    if isinstance(tree, dict):
        return [x for k, v in tree.items() for x in leaves(v, (*prefix, k))]
    if isinstance(tree, list):
        return [x for i, v in enumerate(tree) for x in leaves(v, (*prefix, str(i)))]
    return [(prefix, tree)]


def replace_at(tree, path: tuple[str, ...], value=None, delete: bool = False):
    """A copy of `tree` with the leaf at `path` replaced by `value` (or deleted)."""
    def node(t, p):
        if not p:
            return value
        if isinstance(t, list):
            return [node(v, p[1:]) if str(i) == p[0] else v for i, v in enumerate(t)]
        if delete and len(p) == 1:
            return {k: v for k, v in t.items() if k != p[0]}
        return {**t, p[0]: node(t.get(p[0]), p[1:])}  # a new key when p[0] is not in t
    return node(tree, path)


# --- the spec is the init functions' layout ----------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(cfg=gpt_configs(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_spec_accepts_exactly_what_init_builds(cfg: GPTConfig, dtype: torch.dtype) -> None:
    # init on the meta device (no memory, no RNG draws): every leaf and key it builds is in the spec, and
    # every required key of the spec is built (the check refuses both a missing and an unexpected key).
    with torch.device("meta"):
        params, moe_params = init_gpt(cfg, dtype=dtype), init_moe(cfg.moe, dtype=dtype)
    check_gpt(params, cfg, init_gpt_state(cfg, "meta"))
    check_moe(moe_params, cfg.moe, init_moe_state(cfg.moe, "meta"))
    check_gpt(params, cfg, {"layers": [None] * cfg.n_layers})  # None: a fresh layer state
    check_moe(moe_params, cfg.moe, {})  # {}: bias and capacity window start from init


@settings(max_examples=60, deadline=None)
@given(cfg=gpt_configs(), pick=st.integers(0, 10**6),
       change=st.sampled_from(["grow", "shrink_rank", "int_dtype", "not_tensor", "delete", "extra"]))
@example(cfg=GPTConfig(vocab_size=8, d_model=8, n_layers=2, n_heads=2, moe=BASE, num_dense_layers=1),
         pick=0, change="grow")
def test_any_changed_leaf_is_named(cfg: GPTConfig, pick: int, change: str) -> None:
    with torch.device("meta"):
        params = init_gpt(cfg)
    all_leaves = leaves(params)
    path, leaf = all_leaves[pick % len(all_leaves)]
    where = ".".join(path)
    if change == "grow":
        bad = replace_at(params, path, torch.empty(*leaf.shape[:-1], leaf.shape[-1] + 1, device="meta"))
        match = f"gpt params: {where} has shape"
    elif change == "shrink_rank":
        bad = replace_at(params, path, torch.empty(leaf.shape[1:], device="meta"))
        match = f"gpt params: {where} has shape"
    elif change == "int_dtype":
        bad = replace_at(params, path, torch.empty(leaf.shape, dtype=torch.int64, device="meta"))
        match = f"gpt params: {where} has dtype torch.int64"
    elif change == "not_tensor":
        bad = replace_at(params, path, 1.0)
        match = f"gpt params: {where} must be a tensor"
    elif change == "delete":
        bad = replace_at(params, path, delete=True)
        match = f"gpt params: {where} is missing"
    else:
        bad = replace_at(params, (*path[:-1], "w_extra"), leaf)
        match = "w_extra is not in the config"
    with raises(match):
        check_gpt(bad, cfg)


# --- the entry points, with the messages ---------------------------------------------------------------


def _moe(cfg: MoEConfig = BASE, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return init_moe(cfg, g), torch.randn(6, cfg.d_model, generator=g)


@pytest.mark.parametrize("w_shape", [(8, 6), (8, 3), (4, 4)])
def test_moe_refuses_a_router_for_another_expert_count(w_shape) -> None:
    params, x = _moe()
    params["router"]["w"] = torch.randn(w_shape)
    with raises(f"moe params: router.w has shape {w_shape}, config says [D=8, E=4]"):
        moe(params, x, BASE)


def test_moe_refuses_a_shared_expert_or_gate_the_config_lacks() -> None:
    _, x = _moe()
    params = init_moe(BASE.replace(num_shared_experts=1))
    with raises("moe params: shared is not in the config (num_shared_experts=0)"):
        moe(params, x, BASE)
    gated = init_moe(BASE.replace(num_shared_experts=1, shared_expert_gate=True))
    with raises("moe params: shared.w_out_gate is not in the config (shared_expert_gate=False)"):
        moe(gated, x, BASE.replace(num_shared_experts=1))
    with raises("moe params: shared is missing"):
        moe(init_moe(BASE), x, BASE.replace(num_shared_experts=1))


@pytest.mark.parametrize("bias_shape", [(3,), (1,), (4, 1), ()])
def test_moe_refuses_an_expert_bias_of_another_shape(bias_shape) -> None:
    cfg = BASE.replace(bias_update_rate=0.1)
    params, x = _moe(cfg)
    with raises(f"moe state: expert_bias_E has shape {bias_shape}, config says [E=4]"):
        moe(params, x, cfg, {"expert_bias_E": torch.zeros(bias_shape)})


def test_moe_state_rules() -> None:
    cfg = BASE.replace(dynamic_capacity_window=2)
    params, x = _moe(cfg)
    full = init_moe_state(cfg)
    with raises("moe state: capacity_misses is missing (dynamic_capacity_window=2"):
        moe(params, x, cfg, {"load_history_W": full["load_history_W"]})
    with raises("moe state: load_history_W has dtype torch.float32, expected an integer dtype"):
        moe(params, x, cfg, {**full, "load_history_W": torch.zeros(2)})
    with raises("moe state: load_history_W is not in the config (dynamic_capacity_window=0)"):
        moe(params, x, BASE, full)
    with raises("moe state: surprise is not in the config's layout"):
        moe(params, x, cfg, {"surprise": torch.zeros(1)})
    # A frozen bias (bias_update_rate 0) is a valid state: it shifts selection and stays as it is.
    y, aux = moe(params, x, BASE, {"expert_bias_E": torch.tensor([9.0, 0.0, 0.0, 0.0])})
    assert (aux.new_state["expert_bias_E"] == torch.tensor([9.0, 0.0, 0.0, 0.0])).all()


def test_moe_takes_the_local_expert_count_from_the_dispatcher() -> None:
    params, x = _moe()
    local = dict(params, experts={k: v[2:].clone() for k, v in params["experts"].items()})
    with raises("moe params: experts.w_gate_up has shape (2, 8, 32), config says [E=4, D=8, Z=32]"):
        moe(local, x, BASE)
    check_moe(local, BASE, num_local_experts=2)  # an expert-parallel rank's params: L = 2

    class TwoLocal:  # a dispatcher of an EP rank with 2 of the 4 experts (never reached: the check fails)
        num_local_experts = 2

    with raises("moe params: experts.w_down has shape (4, 16, 8), config says [L=2, F=16, D=8]"):
        moe({**params, "experts": {**params["experts"], "w_gate_up": local["experts"]["w_gate_up"]}}, x, BASE,
            dispatcher=TwoLocal())


def test_check_false_skips_and_changes_nothing() -> None:
    params, x = _moe()
    y1, a1 = moe(params, x, BASE)
    y2, a2 = moe(params, x, BASE, check=False)
    assert torch.equal(y1, y2) and torch.equal(a1.loss, a2.loss)
    assert torch.equal(a1.tokens_per_expert_E, a2.tokens_per_expert_E)
    # check=False is for trees that already passed: it does not look (a [D, 3] router runs, expert 3 unused).
    bad = dict(params, router={"w": params["router"]["w"][:, :3]})
    _, aux = moe(bad, x, BASE, check=False)
    assert aux.tokens_per_expert_E[3] == 0


def _gpt(n_layers: int = 4, mtp: bool = True):
    moe_cfg = BASE.replace(bias_update_rate=0.1)
    cfg = GPTConfig(vocab_size=16, d_model=8, n_layers=n_layers, n_heads=2, moe=moe_cfg, num_dense_layers=1,
                    mtp=mtp)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16, (2, 5), generator=g)
    return cfg, init_gpt(cfg, g), init_gpt_state(cfg), ids


def test_gpt_loss_refuses_fewer_layers_in_params_or_state() -> None:
    cfg, params, state, ids = _gpt()
    with raises("gpt params: layers has 3 blocks, config says n_layers=4"):
        gpt_loss({**params, "layers": params["layers"][:3]}, ids, ids, cfg, state)
    with raises("gpt state: layers has 2 entries, config says n_layers=4"):
        gpt_loss(params, ids, ids, cfg, {**state, "layers": state["layers"][:2]})
    with raises("gpt state: layers.0.expert_bias_E is not in the config (a dense layer, num_dense_layers=1)"):
        gpt_loss(params, ids, ids, cfg, {**state, "layers": [state["layers"][1]] * 4})
    with raises("gpt params: mtp is not in the config (mtp=False)"):
        gpt_loss(params, ids, ids, dataclasses.replace(cfg, mtp=False))
    bad = [dict(b) for b in params["layers"]]
    bad[2]["moe"] = {**bad[2]["moe"], "router": {"w": torch.zeros(8, 5)}}
    with raises("gpt params: layers.2.moe.router.w has shape (8, 5), config says [D=8, E=4]"):
        gpt_loss({**params, "layers": bad}, ids, ids, cfg, state)
    loss1, aux1 = gpt_loss(params, ids, ids, cfg, state)
    loss2, aux2 = gpt_loss(params, ids, ids, cfg, state, check=False)
    assert torch.equal(loss1, loss2) and len(aux1.layers) == len(aux2.layers) == 4  # 3 MoE blocks + MTP


def test_block_and_dense_block_and_stage_functions_check() -> None:
    cfg, params, state, ids = _gpt()
    x = torch.randn(2, 5, 8)
    moe_block, dense = params["layers"][1], params["layers"][0]
    with raises("block params: mlp is not in the config (an MoE block)"):
        block(dense, x, cfg)
    with raises("block params: mlp.w_up has shape (8, 3), config says [D=8, F=32]"):
        dense_block({**dense, "mlp": {**dense["mlp"], "w_up": torch.zeros(8, 3)}}, x, cfg)
    with raises("block params: moe is not in the config (a dense block)"):
        dense_block({**dense, "moe": moe_block["moe"]}, x, cfg)
    wq = {**moe_block, "w_q": torch.zeros(8, 6)}
    for fn in (lambda p: block(p, x, cfg), lambda p: attention(p, x, cfg),
               lambda p: self_attention(p, x, cfg)):
        with raises("block params: w_q has shape (8, 6), config says [D=8, H*d=8]"):
            fn(wq)
    with raises("moe state: expert_bias_E has shape"):
        block(moe_block, x, cfg, {"expert_bias_E": torch.zeros(3)})
    acts = {"rows_MD": torch.randn(4, 8), "normed_TD": torch.randn(2, 8)}
    with raises("moe params: experts.w_gate_up has shape (4, 8, 32), config says [L=2, D=8, Z=32]"):
        experts(moe_block["moe"], acts, [2, 2], cfg)  # two count entries: two local experts
    with raises("moe params: shared is not in the config"):
        experts({**moe_block["moe"], "shared": {}}, acts, [1, 1, 1, 1], cfg)


def test_layer_pieces_and_router_check() -> None:
    params, x = _moe()
    bad = dict(params, router={"w": torch.zeros(8, 3)})
    for fn in (lambda p: plan_route(p, x, BASE), lambda p: route_tokens(p, x, BASE)):
        with raises("moe params: router.w has shape (8, 3)"):
            fn(bad)
    with raises("router params: w has shape (8, 3), config says [D=8, E=4]"):
        route(bad["router"], x, BASE)
    with raises("moe params: experts.w_gate_up has shape (4, 8, 32), config says [L=3, D=8, Z=32]"):
        expert_rows(params["experts"], x, None, [2, 2, 2], BASE)


def test_update_moe_state_checks_state_and_load() -> None:
    cfg = BASE.replace(bias_update_rate=0.1)
    with raises("update_moe_state: tokens_per_expert_E has shape (1,), config says [E=4]"):
        update_moe_state(init_moe_state(cfg), cfg, torch.tensor([8]))  # [1] would broadcast over the bias
    with raises("moe state: expert_bias_E has shape (2,)"):
        update_moe_state({"expert_bias_E": torch.zeros(2)}, cfg, torch.tensor([1, 2, 3, 4]))


def test_pipeline_step_checks_what_its_rank_reads() -> None:
    cfg, params, state, ids = _gpt(n_layers=2)
    batches = [(ids, ids.roll(-1, 1))] * 2
    s = S.one_f_one_b(1, 2)
    bad = [dict(b) for b in params["layers"]]
    bad[1]["moe"] = {**bad[1]["moe"], "router": {"w": torch.zeros(8, 3)}}
    with raises("gpt params: layers.1.moe.router.w has shape (8, 3), config says [D=8, E=4]"):
        gpt_pipeline_step(gpt_program(cfg, s, 0), {**params, "layers": bad}, state, batches)
    with raises("gpt state: mtp.expert_bias_E has shape (3,)"):
        gpt_pipeline_step(gpt_program(cfg, s, 0), params, {**state, "mtp": {"expert_bias_E": torch.zeros(3)}},
                          batches)
    # An expert-parallel rank holds L = 2 of the 4 experts: the dispatcher's count is the one checked.
    local = tree_map(lambda t: t, params)
    for b in local["layers"][1:] + [local["mtp"]["block"]]:
        b["moe"] = {**b["moe"], "experts": {k: v[:2] for k, v in b["moe"]["experts"].items()}}
    gpt_program(cfg, s, 0, parallel=ParallelContext(dispatcher=LocalDispatcher(2))).check(local, state)
    with raises("gpt params: layers.1.moe.experts.w_gate_up has shape (2, 8, 32), config says "
                "[E=4, D=8, Z=32]"):
        gpt_program(cfg, s, 0).check(local, state)
    step = gpt_pipeline_step(gpt_program(cfg, s, 0), params, state, batches)
    with raises("gpt state: layers has 1 entries, config says n_layers=2"):
        update_gpt_state(cfg, {"layers": state["layers"][:1], "mtp": state["mtp"]}, step.loads)
    again = gpt_pipeline_step(gpt_program(cfg, s, 0), params, state, batches, check=False)
    assert torch.equal(step.loss, again.loss)
    assert all(torch.equal(a, b) for a, b in zip(tree_flatten(step.grads)[0], tree_flatten(again.grads)[0]))
