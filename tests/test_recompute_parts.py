"""Selective recompute's "layernorm" and "mla_up_proj" parts (fmoe/recompute.py): the gradients of the
model without recompute, and the activation bytes the planner says each frees (`layer_costs.part_costs`).

Oracle for gradients: the same float64 model without recompute (a dense block, an MoE block and the MTP
block through `gpt_loss`), by tape autograd and by torch.func.vjp, GQA (with and without q/k norms) and
MLA (with and without a query latent), alone or with the other parts; under TP and SP (2 gloo ranks) the
same rank's run without recompute. Memory is counted, not timed: the bytes torch's allocator holds when a
block's forward has returned (its result alive), per token, in float32. What the planner frees per token
plus what it does not model (a CPU RMSNorm's own saved tensors beside its input: measured on a bare
`rms_norm`) must equal the measured drop exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import spawn
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from fmoe._compat import tree_flatten, tree_map
from fmoe.block import attention, dense_block, init_block, self_attention
from fmoe.config import GPTConfig, MoEConfig
from fmoe.model import gpt_loss, init_gpt, init_gpt_state
from fmoe.ops import rms_norm
from fmoe.parallel.context import ParallelContext
from fmoe.plan import layout as L
from fmoe.plan.layer_costs import part_costs
from fmoe.plan.specs import MODEL_PRESETS, ModelSpec
from fmoe.recompute import MODULES, Recompute

NEW = ("layernorm", "mla_up_proj")
OTHERS = ("core_attn", "mlp", "moe", "shared_experts")


def _cfg(mla: bool, Q: int, modules: tuple[str, ...] = (), qk_norm: bool = False, D: int = 8, H: int = 2,
         d: int = 4, r: int = 2, e: int = 3, C: int = 5, G: int = 1, f: int = 4, F: int = 6,
         **kw: Any) -> GPTConfig:
    moe = MoEConfig(d_model=D, d_ff=f, num_experts=4, top_k=2, num_shared_experts=1, aux_loss_coef=0.01)
    attn = (dict(q_lora_rank=Q, kv_lora_rank=C, qk_rope_head_dim=r, v_head_dim=e) if mla
            else dict(n_kv_heads=G, qk_norm=qk_norm))
    rc = Recompute("selective", modules=modules) if modules else Recompute()
    return GPTConfig(vocab_size=16, d_model=D, n_layers=2, n_heads=H, head_dim=d, moe=moe, norm_eps=1e-6,
                     d_ff_dense=F, recompute=rc, **attn, **kw)


def test_the_parts_are_megatrons_names() -> None:
    assert MODULES == (*OTHERS, *NEW)
    assert L.recompute_parts("layernorm+mla_up_proj") == NEW
    ladder = L.recompute_ladder(MODEL_PRESETS["deepseek-v3"])
    assert {"layernorm", "mla_up_proj"} <= set(ladder[-2].split("+")), ladder


# --- gradients -----------------------------------------------------------------------------------------


def _grads(cfg: GPTConfig, engine: str) -> list[torch.Tensor]:
    params = init_gpt(cfg, torch.Generator().manual_seed(0), torch.float64)
    g = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, cfg.vocab_size, (2, 5), generator=g) for _ in range(2))
    state = init_gpt_state(cfg)
    if engine == "autograd":
        params = tree_map(lambda t: t.requires_grad_(), params)
        gpt_loss(params, ids, targets, cfg, state)[0].backward()
        return [t.grad for t in tree_flatten(params)[0]]
    _, vjp = torch.func.vjp(lambda p: gpt_loss(p, ids, targets, cfg, state)[0], params)
    return tree_flatten(vjp(torch.ones((), dtype=torch.float64))[0])[0]


@settings(max_examples=8, deadline=None)
@given(mla=st.booleans(), Q=st.sampled_from([0, 6]), qk_norm=st.booleans(),
       new=st.sets(st.sampled_from(NEW), min_size=1), others=st.sets(st.sampled_from(OTHERS), max_size=2),
       engine=st.sampled_from(["autograd", "func"]))
@example(mla=True, Q=6, qk_norm=False, new={"layernorm", "mla_up_proj"}, others=set(), engine="func")
@example(mla=True, Q=0, qk_norm=False, new={"layernorm", "mla_up_proj"}, others={"core_attn"},
         engine="autograd")
@example(mla=True, Q=6, qk_norm=False, new={"mla_up_proj"}, others={"core_attn", "mlp"}, engine="func")
@example(mla=False, Q=0, qk_norm=True, new={"layernorm"}, others={"mlp"}, engine="autograd")
@example(mla=False, Q=0, qk_norm=False, new={"layernorm", "mla_up_proj"}, others={"shared_experts"},
         engine="func")
def test_each_part_gives_the_gradients_without_recompute(mla: bool, Q: int, qk_norm: bool, new: set[str],
                                                         others: set[str], engine: str) -> None:
    if not mla and engine == "func":
        # GQA's core_attn under torch.func.vjp fails in rope's table cache, recomputed or not by these parts
        others = others - {"core_attn"}
    modules = tuple(sorted(new | others))
    want = _grads(_cfg(mla, Q, qk_norm=qk_norm, num_dense_layers=1, mtp=True), engine)
    got = _grads(_cfg(mla, Q, modules, qk_norm=qk_norm, num_dense_layers=1, mtp=True), engine)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def _tp_rank(rank: int, world: int) -> dict[str, list[float]]:
    from fmoe.parallel import CommGroup
    from fmoe.tp_layout import shard_block

    comm = CommGroup(torch.distributed.group.WORLD)
    out = {}
    for mla, Q in ((False, 0), (True, 0), (True, 6)):
        g = torch.Generator().manual_seed(3)
        full = init_block(_cfg(mla, Q, G=2), g, torch.float64, dense=True)
        mine = shard_block(full, _cfg(mla, Q, G=2), rank, world)
        x = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
        ct = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
        for sp in (False, True):
            xs, cts = (x[:, 2 * rank:2 * rank + 2], ct[:, 2 * rank:2 * rank + 2]) if sp else (x, ct)
            for modules in ((), NEW, (*NEW, "mlp")):
                cfg = _cfg(mla, Q, modules, G=2)
                y, vjp = torch.func.vjp(lambda p, x_, cfg=cfg, sp=sp: dense_block(
                    p, x_, cfg, parallel=ParallelContext(tp=comm, sequence_parallel=sp)), mine, xs)
                flat = [y, *tree_flatten(vjp(cts))[0]]
                out[f"{mla}{Q}{sp}{modules}"] = [v for t in flat for v in t.flatten().tolist()]
    return out


def test_under_tp_and_sp_the_parts_give_the_gradients_without_recompute() -> None:
    """Under TP the latent norms run before the latents enter the TP region, GQA's norm before the gather:
    each recomputed alone, "mla_up_proj" starting at the entered latents."""
    for r in spawn(_tp_rank, 2, timeout_s=120):
        for key, got in r.value.items():
            want = r.value[key.split("(")[0] + "()"]
            assert got == pytest.approx(want, rel=1e-10, abs=1e-12), (r.rank, key)


# --- memory: the runtime frees what the planner says ---------------------------------------------------

B, S = 2, 16
T = B * S
SIZES = dict(D=64, H=4, d=16, r=8, e=12, C=24, G=2, f=32, F=48)


def _held(fn: Any) -> int:
    """The bytes allocated during fn() and still held when it returned (its result alive)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


def _block_bytes(cfg: GPTConfig, kind: str) -> float:
    """Bytes per token a float32 block's forward holds: an MoE block's first phase (attention, MLP norm,
    router, permutation), or a dense block."""
    p = tree_map(lambda t: t.requires_grad_(), init_block(cfg, torch.Generator().manual_seed(0),
                                                          dense=kind == "dense"))
    x = torch.randn(B, S, cfg.d_model, requires_grad=True)
    run = (lambda: dense_block(p, x, cfg)) if kind == "dense" else (lambda: attention(p, x, cfg)[0])
    run()  # warm-up: first-call caches (RoPE tables) are not the step's memory
    return _held(run) / T


def _norm_extra(width: int) -> float:
    """Bytes per token a CPU rms_norm saves besides its input and output (its fp32 working copies): the
    planner counts a norm as keeping its input only, the runtime frees these too when it recomputes it."""
    x, scale = torch.randn(T, width, requires_grad=True), torch.ones(width, requires_grad=True)
    rms_norm(x, scale)
    return _held(lambda: rms_norm(x, scale)) / T - 4 * width


def _spec(mla: bool, Q: int) -> ModelSpec:
    z = SIZES
    attn = (dict(q_lora_rank=Q, kv_lora_rank=z["C"], qk_rope_dim=z["r"], v_head_dim=z["e"]) if mla
            else dict(kv_heads=z["G"], v_head_dim=z["d"]))
    return ModelSpec(name="m", layers=2, hidden=z["D"], heads=z["H"], head_dim=z["d"], dense_layers=1,
                     dense_ffn=z["F"], routed_experts=4, shared_experts=1, top_k=2, expert_ffn=z["f"],
                     vocab=16, seq=S, dtype="fp32", **attn)  # type: ignore[arg-type]


@pytest.mark.parametrize("mla, Q", [(False, 0), (True, 0), (True, 20)])
@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_the_runtime_frees_what_the_planner_says(mla: bool, Q: int, kind: str) -> None:
    z, spec = SIZES, _spec(mla, Q)
    costs = part_costs(spec, kind)

    def held(*modules: str) -> float:
        return _block_bytes(_cfg(mla, Q, modules, **SIZES), kind)

    none = held()
    # layernorm: every norm of the block recomputed (each frees its own working copies), the outputs the
    # planner counts (MLA's normed input with a query latent, a dense MLP's normed input) freed
    norms = [z["D"], z["D"]] + ([Q, z["C"]] if mla and Q else [z["C"]] if mla else [])
    ln = held("layernorm")
    assert none - ln == pytest.approx(costs["layernorm"][1] + sum(map(_norm_extra, norms)), abs=1e-9)
    if not mla:
        assert "mla_up_proj" not in costs and held("mla_up_proj") == none  # GQA has no up projection
        return
    # mla_up_proj over core_attn (both recompute the attention core, whose CPU kernel saves more than the
    # planner's flash one): the normed latents, q, k and the kv up projection's output are freed
    core = held("core_attn")
    # remat keeps its inputs only: the core's output (which w_o reads through a copy) is not held by it,
    # so recomputing the core never holds more than not recomputing it
    assert core <= none
    up = held("core_attn", "mla_up_proj")
    assert held("mla_up_proj") == up  # it includes the attention core
    latents = [Q, z["C"]] if Q else [z["C"]]
    planner = costs["mla_up_proj"][1] - costs["core_attn"][1]  # the softmax statistics: core_attn's too
    assert core - up == pytest.approx(planner + sum(map(_norm_extra, latents)), abs=1e-9)
    both = held("layernorm", "mla_up_proj")
    assert both < min(ln, up) < none
    print(f"{kind} Q={Q}: bytes/token none {none:.0f}, layernorm {ln:.0f}, mla_up_proj {up:.0f}, "
          f"both {both:.0f}")


def test_self_attention_output_is_unchanged_by_the_parts() -> None:
    for mla, Q in ((True, 0), (True, 20), (False, 0)):
        g = torch.Generator().manual_seed(2)
        p = init_block(_cfg(mla, Q, **SIZES), g, dense=True)
        x = torch.randn(B, S, SIZES["D"], generator=g)
        want = self_attention(p, x, _cfg(mla, Q, **SIZES))
        for modules in (("layernorm",), ("mla_up_proj",), NEW):
            torch.testing.assert_close(self_attention(p, x, _cfg(mla, Q, modules, **SIZES)), want)


def test_the_attention_core_inside_a_part_is_named_for_its_price() -> None:
    from fmoe.plan.layer_costs import PART_GEMM_GROUP, part_attn_flops

    for mla in (False, True):
        spec = _spec(mla, 20 if mla else 0)
        for kind in ("moe", "dense", "head"):
            for name, (flops, freed) in part_costs(spec.replace(mtp=1), kind).items():
                assert name in PART_GEMM_GROUP and freed >= 0
                assert 0 <= part_attn_flops(spec.replace(mtp=1), kind, name) <= flops
