"""The seams (fmoe/seams.py): a router, experts or attention function carried by the config reaches every
caller (moe, block, gpt_loss, the pipeline's phases), and the example routers' gradients
(fmoe/examples/routers.py) match float64 finite differences, edge cases included.

Legend (docs/moe.md): T tokens, D model width, E experts, K top-k slots, B sequences, S positions.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from dist_utils import spawn
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe import GPTConfig, MoEConfig, gpt_loss, init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.examples.routers import expert_choice, make_expert_choice, make_temperature, temperature
from fmoe.experts import routed_experts
from fmoe.hf.checkpoint import gpt_config_dict, gpt_config_of
from fmoe.layer import init_moe
from fmoe.model import moe
from fmoe.ops import attention
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.router import Routing, route
from fmoe.seams import attention_of, experts_of, router_of
from fmoe.train.config import TrainConfig
from fmoe.train.rank_agreement import compared_config
from fmoe.transforms.testing import assert_close, check_vjp

DT = torch.float64
EC = "fmoe.examples.routers:expert_choice"


def _gpt(router=None, experts=None, attn=None, **moe_kw) -> GPTConfig:
    moe_cfg = MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=1e-2, num_shared_experts=1,
                        router=router, experts=experts, **moe_kw)
    return GPTConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, moe=moe_cfg, num_dense_layers=1,
                     mtp=True, attention=attn)


def _batch(B: int = 2, S_: int = 5, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(0, 32, (B, S_ + 1), generator=torch.Generator().manual_seed(seed))
    return seq[:, :-1], seq[:, 1:]


# ---- resolution and plumbing ------------------------------------------------------------------------


def test_defaults_and_paths_resolve_to_the_functions() -> None:
    cfg = _gpt()
    assert router_of(cfg.moe) is route and experts_of(cfg.moe) is routed_experts
    assert attention_of(cfg) is attention
    cfg = _gpt(router=EC, experts="fmoe.experts:routed_experts", attn="fmoe.ops:attention")
    assert router_of(cfg.moe) is expert_choice and experts_of(cfg.moe) is routed_experts
    assert attention_of(cfg) is attention


@pytest.mark.parametrize("value,words", [
    ("no_such_module_31:f", "ModuleNotFoundError"), ("fmoe.router:no_such", "AttributeError"),
    ("fmoe.router", "not an import path"), ("fmoe.config:SCORE_FUNCS", "not a callable"), (3, "must be None"),
])
def test_bad_seams_fail_when_the_config_is_built(value, words) -> None:
    with pytest.raises(ValueError, match="MoEConfig.router") as e:
        MoEConfig(d_model=4, d_ff=4, num_experts=2, top_k=1, router=value)
    assert words in str(e.value) and len(str(e.value).splitlines()) == 1
    with pytest.raises(ValueError, match="GPTConfig.attention"):
        _gpt(attn=value)


def test_a_config_with_paths_stays_plain_data() -> None:
    cfg = _gpt(router=EC, attn="fmoe.ops:attention")
    d = json.loads(json.dumps(gpt_config_dict(cfg)))  # what a checkpoint's meta.json records
    assert d["moe"]["router"] == EC and gpt_config_of(d) == cfg


def _counting(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(fn.__name__)
        return fn(*args, **kwargs)
    return wrapped


def test_gpt_loss_calls_the_functions_the_config_carries() -> None:
    calls: list[str] = []
    spies = {"router": _counting(route, calls), "experts": _counting(routed_experts, calls),
             "attn": _counting(attention, calls)}
    cfg0, cfg = _gpt(), _gpt(**spies)
    params = init_gpt(cfg, torch.Generator().manual_seed(0), DT)
    ids, tg = _batch()
    loss0, _ = gpt_loss(params, ids, tg, cfg0)
    loss, _ = gpt_loss(params, ids, tg, cfg)
    assert torch.equal(loss, loss0)  # the defaults, passed by value, compute the same
    # 3 layers + the MTP block attend; the 2 MoE layers + MTP route and run their experts
    assert sorted(calls) == sorted(["attention"] * 4 + ["route"] * 3 + ["routed_experts"] * 3)


def test_a_temperature_of_one_is_the_default_router() -> None:
    cfg0, cfg1 = _gpt(topk_norm="before"), _gpt(router=make_temperature(1.0), topk_norm="before")
    params = init_gpt(cfg0, torch.Generator().manual_seed(0), DT)
    ids, tg = _batch()
    assert_close(gpt_loss(params, ids, tg, cfg1)[0], gpt_loss(params, ids, tg, cfg0)[0])
    loss2 = gpt_loss(params, ids, tg, _gpt(router=temperature, topk_norm="before"))[0]
    assert not torch.equal(loss2, gpt_loss(params, ids, tg, cfg0)[0])  # t = 2 routes differently


def test_a_router_returning_wrong_shapes_is_named() -> None:
    def bad(params, x_TD, cfg, state=None, seq_len=None) -> Routing:
        r = route(params, x_TD, cfg, state, seq_len)
        return dataclasses.replace(r, ids_TK=r.ids_TK[:, :1])
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, router=bad)
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"router .*bad.* ids_TK torch.int64 \[5, 1\]"):
        moe(params, torch.randn(5, 8), cfg)


def test_a_router_returning_a_tuple_is_named() -> None:
    def as_tuple(params, x_TD, cfg, state=None, seq_len=None):
        r = route(params, x_TD, cfg, state, seq_len)
        return r.ids_TK, r.probs_TK, r.counts_E, r.losses, r.loss
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, router=as_tuple)
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match=r"router '.*as_tuple' returned a tuple; it must return a "
                                        r"fmoe.router.Routing\(ids_TK, probs_TK"):
        moe(params, torch.randn(5, 8), cfg)


@pytest.mark.parametrize("wrong_id", [4, -1, 1000])
def test_a_router_returning_expert_ids_outside_the_experts_is_named(wrong_id) -> None:
    def off(params, x_TD, cfg, state=None, seq_len=None) -> Routing:
        r = route(params, x_TD, cfg, state, seq_len)
        return dataclasses.replace(r, ids_TK=r.ids_TK.clone().index_fill_(0, torch.tensor([2]), wrong_id))
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, router=off)
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    words = rf"router '.*off' returned expert ids outside \[0, 4\).*: {wrong_id} at token 2"
    with pytest.raises(ValueError, match=words):
        torch.func.vjp(lambda p: moe(p, torch.randn(5, 8), cfg)[0], params)


def _pipeline_rank(rank: int, world: int, router: str) -> tuple[float, dict]:
    cfg = _gpt(router=router)
    s = S.build("1f1b", world, 2)
    params = init_gpt(cfg, torch.Generator().manual_seed(0), DT)
    step = gpt_pipeline_step(gpt_program(cfg, s, rank), params, init_gpt_state(cfg),
                             [_batch(seed=i) for i in range(2)])
    return float(step.loss), _flat(step.grads)


def _flat(tree, prefix: str = "") -> dict[str, list]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _flat(sub, f"{prefix}{i}.").items()}
    return {} if tree is None else {prefix[:-1]: tree.tolist()}


def test_the_pipeline_phases_route_with_the_configs_router() -> None:
    """pp 2 over gloo with expert choice by path: the loss and gradients of gpt_loss run one microbatch
    after the other (torch.func.vjp), so the phases called the router gpt_loss calls."""
    cfg = _gpt(router=EC)
    params = init_gpt(cfg, torch.Generator().manual_seed(0), DT)
    batches = [_batch(seed=i) for i in range(2)]
    loss, vjp = torch.func.vjp(lambda p: sum(gpt_loss(p, i, t, cfg)[0] for i, t in batches) / 2, params)
    want = _flat(vjp(torch.ones((), dtype=DT))[0])
    default_loss = sum(gpt_loss(params, i, t, _gpt())[0] for i, t in batches) / 2
    assert not torch.allclose(loss, default_loss)  # expert choice is not the default routing here
    held: dict[str, list] = {}
    for r in spawn(_pipeline_rank, 2, EC, timeout_s=180):
        assert r.value[0] == pytest.approx(float(loss), rel=1e-12)
        held.update(r.value[1])
    assert held.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(torch.tensor(held[k]), torch.tensor(want[k]), rtol=1e-9, atol=1e-12,
                                   msg=k)


def test_train_config_carries_the_paths_into_the_model_and_the_rank_agreement() -> None:
    tc = TrainConfig.from_sources("tiny", overrides={"router": EC, "attention": "fmoe.ops:attention"})
    cfg = tc.model()
    assert cfg.moe.router == EC and cfg.attention == "fmoe.ops:attention" and cfg.moe.experts is None
    assert compared_config(tc)["router"] == EC  # ranks given another router fail the agreement
    bad = TrainConfig.from_sources("tiny", overrides={"router": "no_such_module_31:f"})
    assert bad.problem().startswith("--router: cannot load 'no_such_module_31:f': ModuleNotFoundError")
    bad = TrainConfig.from_sources("tiny", overrides={"experts": "fmoe.config:SCORE_FUNCS"})
    assert bad.problem() == "--experts: 'fmoe.config:SCORE_FUNCS' is a tuple, not a callable"


# ---- the example routers' gradients -----------------------------------------------------------------


@st.composite
def router_cases(draw):
    E = draw(st.integers(1, 6))
    K = draw(st.integers(1, E))
    T = draw(st.integers(0, 9))
    kind = draw(st.sampled_from(["temperature", "expert_choice"]))
    knob = draw(st.sampled_from([0.5, 1.0, 2.0, 3.0]))  # t, or experts per token
    return kind, knob, E, K, T, draw(st.integers(0, 2**31 - 1)), draw(st.booleans())


def _router(kind: str, knob: float):
    return make_temperature(knob) if kind == "temperature" else make_expert_choice(knob)


@settings(max_examples=60, deadline=None)
@example(case=("temperature", 2.0, 1, 1, 6, 0, False))        # one expert
@example(case=("expert_choice", 1.0, 1, 1, 6, 0, False))
@example(case=("temperature", 0.5, 4, 4, 5, 1, False))        # top-k = E
@example(case=("expert_choice", 2.0, 4, 4, 5, 1, False))      # top-k = E: exact expert choice
@example(case=("temperature", 1.0, 4, 2, 6, 2, True))         # zero-token experts: all go to 0 and 1
@example(case=("expert_choice", 1.0, 5, 1, 2, 3, False))      # 2 tokens, 5 experts: 3 get no row
@example(case=("expert_choice", 1.0, 3, 2, 0, 4, False))      # no tokens
@given(case=router_cases())
def test_example_router_gradients_match_finite_differences(case) -> None:
    kind, knob, E, K, T, seed, skewed = case
    cfg = MoEConfig(d_model=4, d_ff=4, num_experts=E, top_k=K, aux_loss_coef=0.1, z_loss_coef=0.01)
    g = torch.Generator().manual_seed(seed)
    w_DE, x_TD = torch.randn(4, E, generator=g, dtype=DT), torch.randn(T, 4, generator=g, dtype=DT)
    skewed = skewed and E >= 3
    if skewed:  # every token prefers experts 0 and 1 by a wide margin: token choice leaves the rest empty
        x_TD[:, 0] = x_TD[:, 0].abs() + 1.0
        w_DE[0] = torch.tensor([8.0, 7.0] + [-8.0] * (E - 2), dtype=DT)
    router = _router(kind, knob)

    def f(w_DE, x_TD):
        r = router({"w": w_DE}, x_TD, cfg)
        return r.probs_TK, r.loss

    r = router({"w": w_DE}, x_TD, cfg)
    assert r.ids_TK.shape == (T, K) and r.probs_TK.shape == (T, K) and r.counts_E.sum() == T * K
    assert r.counts_E.tolist() == torch.bincount(r.ids_TK.flatten(), minlength=E).tolist()
    if skewed and kind == "temperature" and K <= 2:
        assert r.counts_E[2:].sum() == 0
    if kind == "expert_choice" and K == E:  # every pick fits: each expert gates exactly its C tokens
        gates_TE = torch.zeros(T, E, dtype=DT).scatter(1, r.ids_TK, r.probs_TK.detach())
        assert ((gates_TE > 0).sum(0) == min(T, math.ceil(knob * T / E))).all()
    check_vjp(f, w_DE, x_TD, eps=1e-6, rtol=1e-6)


@settings(max_examples=8, deadline=None)
@example(kind="expert_choice", seed=0)
@example(kind="temperature", seed=0)
@given(kind=st.sampled_from(["temperature", "expert_choice"]), seed=st.integers(0, 2**31 - 1))
def test_the_layer_with_an_example_router_matches_finite_differences(kind, seed) -> None:
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=0.1,
                    router=temperature if kind == "temperature" else expert_choice)
    params = init_moe(cfg, torch.Generator().manual_seed(seed), DT)
    x_TD = torch.randn(7, 8, generator=torch.Generator().manual_seed(seed + 1), dtype=DT)

    def f(params, x_TD):
        y_TD, aux = moe(params, x_TD, cfg)
        return y_TD, aux.loss

    check_vjp(f, params, x_TD, eps=1e-6, rtol=1e-6)


def test_research_doc_example_runs(capsys) -> None:
    text = (Path(__file__).resolve().parents[1] / "docs/research.md").read_text()
    start = text.index("```python") + len("```python")
    exec(compile(text[start:text.index("```", start)], "docs/research.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["None", "temperature", "expert_choice", EC]
