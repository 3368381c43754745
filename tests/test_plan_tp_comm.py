"""The planner's tensor-parallel communication against the runtime's: one block, forward and backward, on 2
gloo ranks (tp 2, TP extending EP), with a `CommCounters` on the tp group; the bytes counted per "tp.*"
collective must equal `fmoe.plan.layer_costs.tp_collectives`' per op, for a dense and an MoE block, GQA
and MLA (with and without a query latent), and a whole GPT (embedding, a dense and an MoE block, head and
loss, one MTP module: the sum of the planner's four layer kinds), with sequence parallelism (what the
planner charges) and without. One spawn runs every case (a module fixture).

Both sides take their bytes from fmoe.parallel.counters' formulas, so this checks the list of collectives
(which ones, what size, how many): a collective the planner drops, adds or sizes differently changes its
op's bytes and fails the comparison (a forgotten weight-gradient sum, a gather charged at T/tp tokens).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import spawn

from fmoe import init_gpt, init_gpt_state
from fmoe.block import dense_block, init_block
from fmoe.config import GPTConfig, MoEConfig
from fmoe.layer import init_moe_state
from fmoe.model import block, gpt_loss
from fmoe.parallel import CommGroup
from fmoe.parallel.alltoall import AllToAllDispatcher
from fmoe.parallel.context import ParallelContext
from fmoe.parallel.counters import CommCounters
from fmoe.plan.layer_costs import tp_bytes, tp_collectives
from fmoe.plan.specs import ModelSpec
from fmoe.tp_layout import shard_block, shard_gpt

TP, B, S, E = 2, 2, 4, 4  # S: the group's positions per sequence


# attention kinds: GQA with q / k norms; MLA with a query latent (Q 6, C 5, rope 2); MLA without one
_MLA = {"head_dim": 4, "kv_lora_rank": 5, "qk_rope_head_dim": 2, "v_head_dim": 3}
ATTENTION = {"gqa": {"n_kv_heads": 2, "qk_norm": True}, "mla": {**_MLA, "q_lora_rank": 6}, "mla-noq": _MLA}


def _cfg(attn: str, gpt: bool = False) -> GPTConfig:
    """A block's config; `gpt`: a whole GPT of a dense and an MoE block with one MTP module."""
    moe = MoEConfig(d_model=8, d_ff=6, num_experts=E, top_k=2, num_shared_experts=1)
    whole = {"n_layers": 2, "num_dense_layers": 1, "mtp": True} if gpt else {"n_layers": 1}
    return GPTConfig(vocab_size=16, d_model=8, n_heads=2, d_ff_dense=12, moe=moe, **whole, **ATTENTION[attn])


def _spec(cfg: GPTConfig) -> ModelSpec:
    """The ModelSpec of `cfg` as the planner reads it (fp32: the run's dtype)."""
    mla = {"q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
           "qk_rope_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim}
    attention = mla if cfg.mla else {"kv_heads": cfg.n_kv_heads}
    return ModelSpec(name="tp-comm", layers=cfg.n_layers, hidden=cfg.d_model, heads=cfg.n_heads,
                     head_dim=cfg.head_dim, vocab=cfg.vocab_size, seq=S, routed_experts=E,
                     top_k=cfg.moe.top_k,
                     expert_ffn=cfg.moe.d_ff, dense_ffn=cfg.d_ff_dense, dense_layers=cfg.num_dense_layers,
                     mtp=int(cfg.mtp),
                     shared_experts=cfg.moe.num_shared_experts, dtype="fp32", **attention)


def _counted(counters: CommCounters) -> dict[str, int]:
    """{op: bytes sent} of the "tp.*" collectives, summed over link classes."""
    out: dict[str, int] = {}
    for (op, _), n in counters.sent.items():
        if op.startswith("tp.") and n:
            out[op] = out.get(op, 0) + n
    return out


def _run(rank: int, world: int, cfg: GPTConfig, kind: str, sequence_parallel: bool) -> dict[str, int]:
    """One forward and backward of a `kind` block on this rank's shard; returns its counted tp bytes."""
    counters = CommCounters()
    tp = CommGroup(torch.distributed.group.WORLD, counters=counters)
    g = torch.Generator().manual_seed(1)
    params = shard_block(init_block(cfg, g, torch.float32, dense=kind == "dense"), cfg, rank, world)
    x = torch.randn(B, S, cfg.d_model, generator=g)
    if sequence_parallel:
        x = x[:, rank * S // world:(rank + 1) * S // world]
    if kind == "gpt":  # embedding, the dense and the MoE block, the head and loss, the MTP module
        params = shard_gpt(init_gpt(cfg, g), cfg, rank, world)
        L = E // world
        for b in (params["layers"][1], params["mtp"]["block"]):
            experts = {k: v[rank * L:(rank + 1) * L] for k, v in b["moe"]["experts"].items()}
            b["moe"] = {**b["moe"], "experts": experts}
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
        dispatcher = AllToAllDispatcher(CommGroup(torch.distributed.group.WORLD), E)  # not counted
        torch.func.grad(lambda p: gpt_loss(p, ids, ids.roll(-1, 1), cfg, init_gpt_state(cfg),
                                           parallel=ParallelContext(tp=tp,
                                                                    sequence_parallel=sequence_parallel,
                                                                    dispatcher=dispatcher))[0])(params)
        return _counted(counters)
    if kind == "dense":
        def f(p, x_):
            return dense_block(p, x_, cfg,
                               parallel=ParallelContext(tp=tp, sequence_parallel=sequence_parallel))
    else:
        L = E // world  # TP extends EP: this rank's whole experts
        experts = params["moe"]["experts"]
        params["moe"]["experts"] = {k: v[rank * L:(rank + 1) * L] for k, v in experts.items()}
        dispatcher = AllToAllDispatcher(CommGroup(torch.distributed.group.WORLD), E)  # not counted

        def f(p, x_):
            return block(p, x_, cfg, init_moe_state(cfg.moe),
                         parallel=ParallelContext(tp=tp, sequence_parallel=sequence_parallel,
                                                  dispatcher=dispatcher))[0]
    y, vjp = torch.func.vjp(f, params, x)
    vjp(torch.ones_like(y))
    return _counted(counters)


CASES = (("dense", "gqa"), ("moe", "gqa"), ("moe", "mla"), ("dense", "mla-noq"), ("gpt", "gqa"))
GPT_KINDS = ("embed", "dense", "moe", "head")  # the planner's layer kinds of the "gpt" case


def _rank(rank: int, world: int) -> dict[tuple[str, str, bool], dict[str, int]]:
    """{(kind, attention, sequence_parallel): counted tp bytes} of every case (one spawn for all)."""
    torch.manual_seed(0)
    return {(kind, attn, sp): _run(rank, world, _cfg(attn, kind == "gpt"), kind, sp)
            for kind, attn in CASES for sp in (True, False)}


@pytest.fixture(scope="module")
def counted() -> list:
    return spawn(_rank, TP, timeout_s=90.0)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
@pytest.mark.parametrize("kind, attn", CASES)
def test_planner_tp_bytes_equal_the_runtimes_counters(counted: list, kind: str, attn: str,
                                                      sequence_parallel: bool) -> None:
    cfg = _cfg(attn, kind == "gpt")
    kinds = GPT_KINDS if kind == "gpt" else (kind,)
    colls = sum((tp_collectives(_spec(cfg), k, B * S, sequence_parallel=sequence_parallel,
                                qk_norm=cfg.qk_norm, weight_sums="microbatch") for k in kinds), ())
    want = tp_bytes(colls, TP)
    for r in counted:
        got = r.value[(kind, attn, sequence_parallel)]
        assert got == want, f"rank {r.rank}: counted {got}, planner {want}"
