"""The GPT under tensor parallelism on gloo ranks against one process (fp64): vocab-parallel embedding and
head with the vocab-parallel cross-entropy, a dense block and an MoE block sharded by fmoe/tp_layout.py,
TP extending EP for the routed experts, MTP (without sequence parallelism) and sequence parallelism.

Oracle: `fmoe.model.gpt_loss` with whole weights in one process (itself checked against a plain
composition in tests/test_moe_model.py), differentiated by torch.func.grad. Each rank's loss parts must
equal the oracle's and its gradients the oracle's, cut as its params are (`shard_gpt`, its experts).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import spawn

from fmoe._compat import keystr, tree_flatten_with_path
from fmoe.config import GPTConfig, MoEConfig
from fmoe.model import gpt_loss, init_gpt, init_gpt_state
from fmoe.parallel import CommGroup
from fmoe.parallel.alltoall import AllToAllDispatcher
from fmoe.parallel.context import ParallelContext
from fmoe.pipeline import gpt_program
from fmoe.schedule.options import ExecOptions
from fmoe.tp_layout import shard_gpt
from fmoe.transforms.testing import assert_close

DT = torch.float64
E = 4


def _cfg(mtp: bool, n_layers: int = 2) -> GPTConfig:
    moe = MoEConfig(d_model=8, d_ff=6, num_experts=E, top_k=2, num_shared_experts=1, aux_loss_coef=0.01,
                    seq_aux_loss_coef=0.02, z_loss_coef=0.001, bias_update_rate=0.1)
    return GPTConfig(vocab_size=12, d_model=8, n_layers=n_layers, n_heads=2, n_kv_heads=2, moe=moe,
                     num_dense_layers=1, d_ff_dense=8, mtp=mtp, mtp_loss_weight=0.3, qk_norm=True)


def _data(cfg: GPTConfig, S: int, B: int = 2) -> tuple:
    g = torch.Generator().manual_seed(7)
    params = init_gpt(cfg, g, DT)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    targets = ids.roll(-1, 1)
    targets[0, 1] = -100  # a position that takes no loss
    return params, ids, targets


def _mine(tree: dict, cfg: GPTConfig, rank: int, size: int) -> dict:
    """Rank `rank`'s part of a GPT tree: its tp shard and its E / size whole experts."""
    out = shard_gpt(tree, cfg, rank, size)
    L = E // size

    def experts(block: dict) -> dict:
        return {**block, "moe": {**block["moe"], "experts": {k: v[rank * L:(rank + 1) * L]
                                                            for k, v in block["moe"]["experts"].items()}}}

    out["layers"] = [experts(b) if "moe" in b else b for b in out["layers"]]
    if "mtp" in out:
        out["mtp"] = {**out["mtp"], "block": experts(out["mtp"]["block"])}
    return out


def _one(cfg: GPTConfig, params: dict, ids: torch.Tensor, targets: torch.Tensor, **kw) -> tuple:
    state = init_gpt_state(cfg)

    def f(p):
        loss, aux = gpt_loss(p, ids, targets, cfg, state, **kw)
        return loss, {"loss": loss.detach(), "main": aux.main_loss, "balance": aux.balance_loss,
                      "mtp": aux.mtp_loss, "bias": aux.new_state["layers"][1]["expert_bias_E"]}

    grads, parts = torch.func.grad(f, has_aux=True)(params)
    return {**parts, "grads": grads}


def _rank(rank: int, world: int, mtp: bool, sp: bool, S: int) -> dict:
    comm = CommGroup(torch.distributed.group.WORLD)
    cfg = _cfg(mtp)
    params, ids, targets = _data(cfg, S)
    par = ParallelContext(tp=comm, sequence_parallel=sp, dispatcher=AllToAllDispatcher(comm, E))
    got = _one(cfg, _mine(params, cfg, rank, world), ids, targets, parallel=par)
    return torch.utils._pytree.tree_map(lambda v: (tuple(v.shape), v.flatten().tolist()), got)


def _is_packed(v: object) -> bool:
    """A tensor as a rank returns it: (shape, values)."""
    return isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], list)


TP2_CASES = [(True, False, 5), (True, True, 4)]  # (mtp, sp, S) of the test below, on tp 2
PER_STEP_S = 4  # the sequence length of the replicated-weights test (test_replicated_weight_...)


def _tp2_rank(rank: int, world: int) -> dict:
    """This tp 2 rank's answers for the tp-only tests of this file (`_rank` per TP2_CASES case, then
    `_per_step_rank`): one start of the 2 ranks for them all."""
    return {"gpt": {case: _rank(rank, world, *case) for case in TP2_CASES},
            "per_step": _per_step_rank(rank, world, PER_STEP_S)}


@pytest.fixture(scope="module")
def tp2_runs() -> list[dict]:
    """Each tp 2 rank's `_tp2_rank` answer, by rank."""
    return [r.value for r in spawn(_tp2_rank, 2, timeout_s=240)]


@pytest.mark.parametrize(("mtp", "sp", "S"), TP2_CASES)
def test_gpt_under_tp_equals_one_process(mtp: bool, sp: bool, S: int, tp2_runs: list[dict]) -> None:
    world = 2
    cfg = _cfg(mtp)
    params, ids, targets = _data(cfg, S)
    want = _one(cfg, params, ids, targets)
    for rank, answer in enumerate(tp2_runs):
        got = torch.utils._pytree.tree_map(lambda v: torch.tensor(v[1], dtype=DT).reshape(v[0]),
                                           answer["gpt"][(mtp, sp, S)], is_leaf=_is_packed)
        for key in ("loss", "main", "balance", "mtp", "bias"):
            assert_close(got[key], want[key].to(DT), msg=f"{key} rank {rank}")
        assert_close(got["grads"], _mine(want["grads"], cfg, rank, world), msg=f"grads rank {rank}")


M = 4  # microbatches


def _paths(tree: dict) -> dict[str, torch.Tensor]:
    """The tensors of a gradient tree by path ("layers.1.moe.router.w"); None leaves (not held) left out."""
    leaves, _ = tree_flatten_with_path(tree)
    return {keystr(p): v for p, v in leaves if v is not None}


def _pp_rank(rank: int, world: int, mtp: bool, sp: bool, S: int, schedule: str,
             record: bool = False) -> dict:
    """pp 2 x tp 2 (ep 1: the expert group is the tp pair): the pipeline step with fb overlap; `record`:
    also every P2P op, collective and wait it issued (tests/nccl_rules.py)."""
    from contextlib import nullcontext

    from nccl_rules import recording

    from fmoe import schedule as sched
    from fmoe.parallel import ParallelLayout, Topology
    from fmoe.pipeline import gpt_pipeline_step

    layout = ParallelLayout(pp=2, tp=2, topology=Topology(world, world))
    tp = CommGroup(layout.group("tp"))
    cfg = _cfg(mtp, n_layers=4)  # four model chunks
    params, ids, targets = _data(cfg, S, B=2 * M)
    pp_group = layout.group("pp")
    pp_rank = torch.distributed.get_rank(pp_group)
    s = sched.build(schedule, 2, M)
    with recording() if record else nullcontext() as log:
        par = ParallelContext(tp=tp, sequence_parallel=sp,
                              dispatcher=AllToAllDispatcher(CommGroup(layout.group("expert")), E))
        step = gpt_pipeline_step(gpt_program(cfg, s, pp_rank, parallel=par), _mine(params, cfg, tp.rank, 2),
                                 init_gpt_state(cfg), list(zip(ids.chunk(M), targets.chunk(M))),
                                 group=pp_group, options=ExecOptions(overlap=True))
    if record:
        return {"log": log}
    held = {path: (tuple(v.shape), v.flatten().tolist()) for path, v in _paths(step.grads).items()}
    return {"tp_rank": tp.rank, "loss": float(step.loss), "grads": held}


# _pp_rank's arguments (mtp, sp, S, schedule, record) for both tests below, run on one start of the 4 ranks
EQUAL_CASES = [(True, False, 5, "dualpipev", False), (False, True, 4, "interleaved", False)]
ORDER_CASES = [(True, False, 5, "dualpipev", True), (False, True, 4, "dualpipev", True)]


def _pp_cases(rank: int, world: int, cases: list) -> dict:
    """`_pp_rank` for each of `cases`, one after the other on the same ranks: {case: its answer}."""
    return {case: _pp_rank(rank, world, *case) for case in cases}


@pytest.fixture(scope="module")
def pp_runs() -> dict:
    """{case: [each rank's RankResult, its value that case's answer]} for EQUAL_CASES and ORDER_CASES,
    from one start of the 4 ranks (each start costs seconds per rank)."""
    runs = spawn(_pp_cases, 4, EQUAL_CASES + ORDER_CASES, timeout_s=400)
    return {case: [dataclasses.replace(r, value=r.value[case]) for r in runs]
            for case in EQUAL_CASES + ORDER_CASES}


@pytest.mark.parametrize(("mtp", "sp", "S", "schedule"), [c[:4] for c in EQUAL_CASES])
def test_pipeline_with_tp_and_fb_overlap_equals_one_process(mtp: bool, sp: bool, S: int, schedule: str,
                                                             pp_runs: dict) -> None:
    """pp 2 x tp 2 on 4 ranks: DualPipeV with fb overlap (MTP, tp alone) and interleaved 1F1B (vpp 2,
    sequence parallel) against the mean over microbatches of the one-process loss."""
    cfg = _cfg(mtp, n_layers=4)
    params, ids, targets = _data(cfg, S, B=2 * M)
    state = init_gpt_state(cfg)

    def mean_loss(p):
        return sum(gpt_loss(p, i, t, cfg, state)[0] for i, t in zip(ids.chunk(M), targets.chunk(M))) / M

    want_loss = mean_loss(params)
    want = torch.func.grad(mean_loss)(params)
    for r in pp_runs[(mtp, sp, S, schedule, False)]:
        got = r.value
        assert got["loss"] == pytest.approx(float(want_loss), rel=1e-10), (schedule, r.rank)
        mine = _mine(want, cfg, got["tp_rank"], 2)
        expected = _paths(mine)
        assert got["grads"], (schedule, r.rank)  # every rank holds some of the model
        for path, (shape, values) in got["grads"].items():
            assert_close(torch.tensor(values, dtype=DT).reshape(shape), expected[path],
                         msg=f"{schedule} {path}")


@pytest.mark.parametrize(("sp", "S"), [(False, 5), (True, 4)])
def test_a_pipeline_step_with_tp_orders_its_communicators_alike_on_every_rank(sp: bool, S: int,
                                                                              pp_runs: dict) -> None:
    """NCCL's rules (tests/nccl_rules.py: tags ignored, one stream per communicator, rendezvous sends)
    and the stricter one-queue-per-device model: the TP collectives inside the compute phases, the EP
    all-to-alls and the pipeline's P2P of a pp 2 x tp 2 DualPipeV step with fb overlap neither deadlock
    nor mismatch."""
    from nccl_rules import replay

    runs = pp_runs[(not sp, sp, S, "dualpipev", True)]
    logs = {r.rank: r.value["log"] for r in runs}
    tp_pair = (0, 1)  # rank 0's tp group (pp is the outer dimension of the layout)
    assert any(op.kind == "coll" and op.comm == tp_pair for _, op in logs[0])  # the TP collectives ran
    assert replay(logs, "nccl") == []
    assert replay(logs, "device") == []


# ---- replicated weights' gradients summed once per step (issue 45) --------------------------------------

STEP_M = 2  # microbatches of the step

def _per_step_rank(rank: int, world: int, S: int) -> dict:
    """tp 2 over STEP_M microbatches, with and without sequence parallelism: each microbatch's gradient taken
    with the replicated weights' sums deferred (weight_grads_per_step), the microbatches' summed, then the
    partial ones summed over tp once (`sum_tp_partials` over the leaves `tp_partial` names)."""
    from fmoe.parallel.counters import CommCounters
    from fmoe.parallel.tensor import sum_tp_partials
    from fmoe.tp_layout import tp_partial

    cfg = _cfg(True)
    params, ids, targets = _data(cfg, S, B=STEP_M)
    mine = _mine(params, cfg, rank, world)
    out = {}
    for sp in (False, True):
        counters = CommCounters()
        comm = CommGroup(torch.distributed.group.WORLD, counters=counters, weight_grads_per_step=True)
        par = ParallelContext(tp=comm, sequence_parallel=sp, dispatcher=AllToAllDispatcher(comm, E))
        total = None
        for mb in range(STEP_M):
            g = _one(cfg, mine, ids[mb:mb + 1], targets[mb:mb + 1], parallel=par)["grads"]
            total = g if total is None else torch.utils._pytree.tree_map(torch.add, total, g)
        leaves, _ = tree_flatten_with_path(total)
        where = [tuple(k.key if hasattr(k, "key") else k.idx for k in p) for p, _ in leaves]
        sum_tp_partials([v for w, (_, v) in zip(where, leaves) if tp_partial(w, sp)], comm)
        calls = dict(counters.calls)
        weights = ("tp.weight.bwd", "tp.router.bwd", "tp.shared.bwd")  # tp_weight's sums in the backward
        out[sp] = {"grads": torch.utils._pytree.tree_map(lambda v: (tuple(v.shape), v.flatten().tolist()),
                                                         total),
                   "weight_sums": calls.get("tp.weight_grads", 0),
                   "in_backward": {k: n for k, n in calls.items() if k in weights}}
    return out


def test_replicated_weight_gradients_summed_once_per_step_equal_one_process(tp2_runs: list[dict]) -> None:
    """The router, shared expert, q / k norms (and under SP every replicated weight: norms, MTP's w_proj)
    keep partial gradients through STEP_M microbatches' backward, with no all-reduce there, and one flat sum
    over tp per step makes every gradient the one-process run's sum over the microbatches."""
    S, world = PER_STEP_S, 2
    cfg = _cfg(True)
    params, ids, targets = _data(cfg, S, B=STEP_M)
    want = None
    for mb in range(STEP_M):
        g = _one(cfg, params, ids[mb:mb + 1], targets[mb:mb + 1])["grads"]
        want = g if want is None else torch.utils._pytree.tree_map(torch.add, want, g)
    for rank, answer in enumerate(tp2_runs):
        for sp, got in answer["per_step"].items():
            assert got["weight_sums"] == 1 and got["in_backward"] == {}, (rank, sp, got["in_backward"])
            grads = torch.utils._pytree.tree_map(lambda v: torch.tensor(v[1], dtype=DT).reshape(v[0]),
                                                 got["grads"], is_leaf=_is_packed)
            assert_close(grads, _mine(want, cfg, rank, world), msg=f"rank {rank} sp {sp}")
