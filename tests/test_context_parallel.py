"""Context parallelism (fmoe/parallel/context_parallel.py) against one process: the load-balanced split,
and attention over the split (ring and all-gather) equal to `fmoe.ops.attention` on the whole sequence in
fp64 (output and the gradients of q, k, v, summed over the ranks that hold them), GQA included, on 2 and 4
gloo ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from dist_utils import RankResult, share_ranks, shared_ranks
from test_tensor_parallel_gpt import _data as _gpt_data  # params, ids, targets (one ignored)

from fmoe import GPTConfig, MoEConfig, gpt_loss, init_gpt_state
from fmoe._compat import keystr, tree_flatten_with_path
from fmoe.ops import attention
from fmoe.parallel import CommGroup, ParallelContext
from fmoe.parallel.context_parallel import check_split, cp_attention, cp_positions, take_positions
from fmoe.transforms.testing import assert_close

DT = torch.float64


def test_positions_balance_the_causal_work_and_cover_the_sequence() -> None:
    for N in (1, 2, 3, 4):
        S = 4 * N
        held = [cp_positions(S, r, N) for r in range(N)]
        assert sorted(torch.cat(held).tolist()) == list(range(S))  # every position once
        pairs = [int(sum(p + 1 for p in pos.tolist())) for pos in held]  # keys each rank's queries see
        assert len(set(pairs)) == 1, (N, pairs)
    assert cp_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="6 positions do not split; use a multiple of 4"):
        check_split(6, 2)


def _qkv(B: int, S: int, H: int, G: int, d: int, e: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, S, n, w, generator=g, dtype=DT) for n, w in ((H, d), (G, d), (G, e)))


def _whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotated: bool) -> torch.Tensor:
    """The oracle on the whole sequence: `fmoe.ops.attention` (RoPE at 0 .. S-1), or for q and k that come
    rotated (values of their own width, as MLA's) torch's causal sdpa with nothing rotated."""
    if not rotated:
        return attention(q, k, v, rope_theta=100.0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return sdpa(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)


# per world size: (form, (B, S, H, G, d, e, rotated)); GQA (G < H), one position per chunk, MLA's shapes
ATTN_CASES = {2: [(kind, shape) for kind in ("p2p", "all_gather") for shape in (
                      (2, 8, 4, 2, 4, 4, False), (1, 4, 1, 1, 2, 2, False), (1, 8, 2, 2, 4, 3, True))],
              4: [(kind, shape) for kind in ("p2p", "all_gather")
                  for shape in ((1, 16, 2, 2, 4, 4, False), (2, 8, 2, 1, 6, 3, True))]}


def _cp_rank(rank: int, world: int) -> list:
    from fmoe.parallel import context_parallel

    whole = context_parallel.ROW_TILE
    context_parallel.ROW_TILE = 1  # the ring's blocks a query row at a time (chunks of 1 and 2 rows here;
    # the GPT tests run whole blocks: one tile, put back below)
    try:
        return _attention_cases(rank, world)
    finally:
        context_parallel.ROW_TILE = whole


def _attention_cases(rank: int, world: int) -> list:
    comm = CommGroup(torch.distributed.group.WORLD)
    out = []
    for kind, (B, S, H, G, d, e, rotated) in ATTN_CASES[world]:
        q, k, v = _qkv(B, S, H, G, d, e, 0)
        ct = torch.randn(B, S, H, e, generator=torch.Generator().manual_seed(1), dtype=DT)
        pos = cp_positions(S, rank, world)
        mine = [take_positions(t, pos).requires_grad_(True) for t in (q, k, v)]
        o = cp_attention(*mine, pos, comm, rope_theta=100.0, kind=kind, rotated=rotated)
        (o * take_positions(ct, pos)).sum().backward()
        full = [torch.zeros_like(t).index_copy(1, pos, m.grad) for t, m in zip((q, k, v), mine)]
        for t in full:  # each rank holds the gradient its queries gave every key: the sum is the whole's
            torch.distributed.all_reduce(t)
        # plain lists: a tensor would cross to the parent by a shared file descriptor, gone once the rank
        # exits
        out.append({"o": torch.zeros(B, S, H, e, dtype=DT).index_copy(1, pos, o.detach()).tolist(),
                    "grads": [t.tolist() for t in full]})
    return out


def _all_parts(rank: int, world: int) -> dict:
    """This rank's answers for every spawned test of this file at `world` ranks (2 or 4), by part, one
    after the other: one start of the ranks for them all (a rank's start costs seconds)."""
    out = {"attention": _cp_rank(rank, world)}
    if world == 4:
        out["gpt"] = _cases_rank(rank, world)
        for schedule in PP_SCHEDULES:
            out[schedule] = _pp_cp_rank(rank, world, 8, schedule)
        out["recorded"] = _pp_cp_rank(rank, world, 8, "dualpipev", True)
    return out


# on the session's shared starts of the ranks (tests/dist_utils.py)
share_ranks("context_parallel", (2, 4), _all_parts)


@pytest.fixture(scope="module")
def ranks_at() -> Callable[[int, str], list[RankResult]]:
    """`ranks_at(world, part)`: each rank's RankResult of `_all_parts` at `world` ranks, its value the
    answer for `part`."""
    return lambda world, part: shared_ranks(world, "context_parallel", part)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_equals_one_process(world: int, ranks_at: Callable) -> None:
    """Both forms, GQA, one position per chunk, and q, k given rotated with values of their own width
    (MLA's), in one spawned run per world size."""
    runs = [r.value for r in ranks_at(world, "attention")]
    for i, (kind, (B, S, H, G, d, e, rotated)) in enumerate(ATTN_CASES[world]):
        q, k, v = (t.requires_grad_(True) for t in _qkv(B, S, H, G, d, e, 0))
        ct = torch.randn(B, S, H, e, generator=torch.Generator().manual_seed(1), dtype=DT)
        o = _whole(q, k, v, rotated)
        want = torch.autograd.grad((o * ct).sum(), (q, k, v))
        got, case = [r[i] for r in runs], f"{kind} {B, S, H, G, d, e, rotated}"
        o_sum = sum(torch.tensor(r["o"], dtype=DT) for r in got)  # each rank filled its positions
        assert_close(o_sum, o.detach(), dtype=DT, msg=case)
        for r in got:
            for a, b in zip(r["grads"], want):
                assert_close(torch.tensor(a, dtype=DT), b, dtype=DT, msg=case)


# ---- the GPT under context parallelism -------------------------------------------------------------------

def _gpt_cfg(mtp: bool, kv_heads: int) -> GPTConfig:
    moe = MoEConfig(d_model=8, d_ff=6, num_experts=4, top_k=2, num_shared_experts=1, aux_loss_coef=0.01,
                    seq_aux_loss_coef=0.02, z_loss_coef=0.001, bias_update_rate=0.1)
    return GPTConfig(vocab_size=12, d_model=8, n_layers=2, n_heads=2, n_kv_heads=kv_heads, moe=moe,
                     num_dense_layers=1, d_ff_dense=8, mtp=mtp, mtp_loss_weight=0.3, qk_norm=True)


def _gpt_parts(cfg: GPTConfig, params: dict, ids: torch.Tensor, targets: torch.Tensor,
               parallel: ParallelContext | None = None) -> dict:
    state = init_gpt_state(cfg)

    def f(p: dict) -> tuple:
        loss, aux = gpt_loss(p, ids, targets, cfg, state, parallel=parallel)
        return loss, {"loss": loss.detach(), "main": aux.main_loss, "balance": aux.balance_loss,
                      "mtp": aux.mtp_loss, "bias": aux.new_state["layers"][1]["expert_bias_E"]}

    grads, parts = torch.func.grad(f, has_aux=True)(params)
    return {**parts, "grads": grads}


def _cfg_of(attn: str) -> GPTConfig:
    """The cases' models, each with a dense block and an MoE block: "gqa" (H 2, G 2, qk-norm, MTP),
    "gqa_kv1" (G 1), "gqa_no_mtp", or "mla" (head dim 4, RoPE part 2, value dim 3, latents 5 and 6, MTP)."""
    if attn != "mla":
        return _gpt_cfg(attn != "gqa_no_mtp", 1 if attn == "gqa_kv1" else 2)
    return dataclasses.replace(_gpt_cfg(True, 2), qk_norm=False, head_dim=4, qk_rope_head_dim=2, v_head_dim=3,
                               kv_lora_rank=5, q_lora_rank=6, n_kv_heads=None)


# (model, tp, sequence parallel, cp ranks, cp form, expert group, S) on 4 ranks (cp-major, tp-minor): the
# expert group "local" is every expert on each rank (replicated over cp), "tp" the tp pair (TP extends EP;
# replicated over cp), "all" every rank: the expert group laid over the context (and tensor) ranks, as
# Megatron carves EP from dp x cp. S 4 at cp 2: one position per chunk.
CASES = {"gqa_kv1_cp2_p2p": ("gqa_kv1", 1, False, 2, "p2p", "local", 8),
         "gqa_no_mtp_cp2_all_gather": ("gqa_no_mtp", 1, False, 2, "all_gather", "local", 4),
         "gqa_cp4_p2p": ("gqa", 1, False, 4, "p2p", "local", 8),
         "gqa_tp2_sp_p2p": ("gqa", 2, True, 2, "p2p", "tp", 16),
         "mla_tp2_all_gather_ep_over_cp": ("mla", 2, False, 2, "all_gather", "all", 16),
         "mla_cp4_p2p_ep_over_cp": ("mla", 1, False, 4, "p2p", "all", 16)}


def _held(tree: dict, cfg: GPTConfig, tp_rank: int, tp_size: int, expert_rank: int, local: int) -> dict:
    """A rank's part of a GPT tree: its tp shard and its `local` experts (expert_rank's)."""
    from fmoe.tp_layout import shard_gpt

    out = shard_gpt(tree, cfg, tp_rank, tp_size) if tp_size > 1 else dict(tree)

    def experts(block: dict) -> dict:
        whole = block["moe"]["experts"]
        mine = {k: v[expert_rank * local:(expert_rank + 1) * local] for k, v in whole.items()}
        return {**block, "moe": {**block["moe"], "experts": mine}}

    out["layers"] = [experts(b) if "moe" in b else b for b in out["layers"]]
    if "mtp" in out:
        out["mtp"] = {**out["mtp"], "block": experts(out["mtp"]["block"])}
    return out


def _ranks_of(case: str, rank: int) -> tuple[int, int, int, int]:
    """(tp rank, tp size, expert rank, experts per rank) of world rank `rank` (of 4) in `case`."""
    _, tp, _, _, _, group, _ = CASES[case]
    tp_rank = rank % tp
    experts = {"local": (0, E_CASES), "tp": (tp_rank, E_CASES // tp), "all": (rank, E_CASES // 4)}[group]
    return (tp_rank, tp, *experts)


E_CASES = 4  # experts (_gpt_cfg's)


def _cases_rank(rank: int, world: int) -> dict:
    """Every case of CASES on this rank: its loss parts, and its gradients summed over its cp group (the
    experts' only where the expert group does not span the cp ranks: there each rank's are whole)."""
    from fmoe.parallel.alltoall import AllToAllDispatcher

    dist = torch.distributed
    everyone = CommGroup(dist.group.WORLD)
    # every rank builds every group, in one order
    tp_pairs = [CommGroup(dist.new_group([0, 1])), CommGroup(dist.new_group([2, 3]))]
    cp_pairs = [CommGroup(dist.new_group([0, 2])), CommGroup(dist.new_group([1, 3]))]
    out = {}
    for case, (attn, tp_size, sp, cp_size, kind, group, S) in CASES.items():
        cfg = _cfg_of(attn)
        tp = tp_pairs[rank // 2] if tp_size > 1 else None
        cp = cp_pairs[rank % 2] if cp_size == 2 else everyone
        tp_rank, _, expert_rank, local = _ranks_of(case, rank)
        experts = {"local": None, "tp": tp, "all": everyone}[group]
        par = ParallelContext(tp=tp, sequence_parallel=sp, cp=cp, cp_comm_type=kind,
                              dispatcher=None if experts is None else AllToAllDispatcher(experts, E_CASES))
        params, ids, targets = _gpt_data(cfg, S)
        got = _gpt_parts(cfg, _held(params, cfg, tp_rank, tp_size, expert_rank, local), ids, targets, par)
        grads = {}
        for path, g in tree_flatten_with_path(got.pop("grads"))[0]:
            name = keystr(path)
            if "['experts']" not in name or group != "all":  # each cp rank: its positions' part
                dist.all_reduce(g, group=cp.group)
            grads[name] = (tuple(g.shape), g.flatten().tolist())
        out[case] = {"parts": {k: float(v) if v.dim() == 0 else v.tolist() for k, v in got.items()},
                     "grads": grads}
    return out


def test_gpt_under_cp_equals_one_process(ranks_at: Callable) -> None:
    """On 4 gloo ranks, fp64, each case of CASES against the one-process model (loss parts, the next expert
    bias and every gradient, cut as the rank holds them and summed over the cp ranks, as a data-parallel
    reduction over dp x cp sums them): cp 2 and 4 in both forms, GQA with G < H; cp 2 x tp 2 with sequence
    parallelism and TP extending EP; MLA (value width 3, RoPE part 2 of 6) under cp 2 x tp 2 with one expert
    group over all 4 ranks, and under cp 4 with the expert group the cp group. Dense and MoE blocks, MTP
    across the chunks' boundaries, aux, sequence-wise aux and z losses."""
    runs = ranks_at(4, "gpt")
    for case, (attn, *_rest, S) in CASES.items():
        cfg = _cfg_of(attn)
        want = _gpt_parts(cfg, *_gpt_data(cfg, S))
        for rank, r in enumerate(runs):
            got = r.value[case]
            for k in ("loss", "main", "balance", "mtp", "bias"):
                assert_close(torch.tensor(got["parts"][k], dtype=DT), want[k].to(DT), dtype=DT,
                             msg=f"{case} rank {rank} {k}")
            held = {keystr(p): v for p, v in tree_flatten_with_path(
                _held(want["grads"], cfg, *_ranks_of(case, rank)))[0]}
            assert sorted(got["grads"]) == sorted(held), case
            for path, (shape, values) in got["grads"].items():
                assert_close(torch.tensor(values, dtype=DT).reshape(shape), held[path], dtype=DT,
                             msg=f"{case} rank {rank} {path}")


M = 4  # microbatches
PP_SCHEDULES = ("dualpipev", "1f1b")


def _pp_cp_rank(rank: int, world: int, S: int, schedule: str, record: bool = False) -> dict:
    """pp 2 x cp 2 on 4 ranks (the layout's innermost pair of ranks is the cp group): the pipeline step
    with fb overlap, MTP on the last chunk; `record`: also every P2P op, collective and wait it issued
    (tests/nccl_rules.py)."""
    from contextlib import nullcontext

    from nccl_rules import recording

    from fmoe import schedule as sched
    from fmoe.parallel import ParallelLayout, Topology
    from fmoe.pipeline import gpt_pipeline_step, gpt_program
    from fmoe.schedule.options import ExecOptions

    layout = ParallelLayout(pp=2, tp=2, topology=Topology(world, world))  # "tp": the innermost pair
    cp = CommGroup(layout.group("tp"))
    cfg = dataclasses.replace(_gpt_cfg(True, 1), n_layers=4)
    params, ids, targets = _gpt_data(cfg, S, B=2 * M)
    pp_group = layout.group("pp")
    s = sched.build(schedule, 2, M)
    with recording() if record else nullcontext() as log:
        program = gpt_program(cfg, s, torch.distributed.get_rank(pp_group), parallel=ParallelContext(cp=cp))
        batches = list(zip(ids.chunk(M), targets.chunk(M)))
        step = gpt_pipeline_step(program, params, init_gpt_state(cfg), batches, group=pp_group,
                                 options=ExecOptions(overlap=True))
    if record:
        return {"log": log}
    grads = {keystr(p): v for p, v in tree_flatten_with_path(step.grads)[0] if v is not None}
    for g in grads.values():  # summed over the cp pair, as the data-parallel reduction over dp x cp does
        torch.distributed.all_reduce(g, group=cp.group)
    held = {k: (tuple(v.shape), v.flatten().tolist()) for k, v in grads.items()}
    return {"loss": float(step.loss), "grads": held}


@pytest.mark.parametrize("schedule", PP_SCHEDULES)
def test_a_pipeline_under_cp_equals_one_process(schedule: str, ranks_at: Callable) -> None:
    """pp 2 x cp 2: the ring's messages inside the attention phases of a pipeline with fb overlap (DualPipeV
    with MTP), against the mean over microbatches of the one-process loss."""
    S = 8
    cfg = dataclasses.replace(_gpt_cfg(True, 1), n_layers=4)
    params, ids, targets = _gpt_data(cfg, S, B=2 * M)
    state = init_gpt_state(cfg)

    def mean_loss(p: dict) -> torch.Tensor:
        return sum(gpt_loss(p, i, t, cfg, state)[0] for i, t in zip(ids.chunk(M), targets.chunk(M))) / M

    want_loss = mean_loss(params)
    want = {keystr(p): v for p, v in tree_flatten_with_path(torch.func.grad(mean_loss)(params))[0]}
    for r in ranks_at(4, schedule):  # S 8, as _all_parts runs it
        got = r.value
        assert got["loss"] == pytest.approx(float(want_loss), rel=1e-10)
        assert got["grads"]  # every rank holds some of the model
        for path, (shape, values) in got["grads"].items():
            assert_close(torch.tensor(values, dtype=DT).reshape(shape), want[path], msg=path)


def test_a_pipeline_step_under_cp_orders_its_communicators_alike_on_every_rank(ranks_at: Callable) -> None:
    """NCCL's rules (tests/nccl_rules.py) and the one-queue-per-device model: the ring's shifts inside the
    attention phases and the pipeline's P2P of a pp 2 x cp 2 DualPipeV step with fb overlap neither
    deadlock nor mismatch."""
    from nccl_rules import replay

    runs = ranks_at(4, "recorded")
    logs = {r.rank: r.value["log"] for r in runs}
    assert replay(logs, "nccl") == []
    assert replay(logs, "device") == []


def test_fmoe_train_under_cp_equals_one_process_and_its_checkpoints_load_at_other_cp_sizes(tmp_path) -> None:
    """`fmoe train --context-parallel-size 2` (MTP on) against the one-process run, step by step (losses, the
    gradient norm, the expert loads); its step-2 checkpoint resumed in one process, at cp 4, at ep 2 x cp 2
    and at tp 2 (sequence parallel) x cp 2, each equal to the uninterrupted run. Parameters are replicated
    over cp, so a checkpoint is the same at any size. The expert group carved from the data x context ranks
    (--expert-model-parallel-size 2, Megatron's layout) at dp 2 x cp 2: the cp pair shares the experts,
    their gradients summed over the dp pair, ZeRO-1 over it; equal to the one-process run too, and its
    step-2 checkpoint resumed in one process."""
    from test_train import _train

    # fp64, as tests/test_train.py's layouts: the ring sums a softmax in another order, and in fp32 that
    # rounding (3e-5 of the loss by step 2) can flip a token whose top-k scores nearly tie
    steps = ("--mtp", "--pp", "1", "--steps", "4", "--dtype", "float64")
    ref = _train(tmp_path, "ref", *steps, "--ep", "1")
    cp2 = _train(tmp_path, "cp2", *steps, "--ep", "1", "--context-parallel-size", "2", "--save",
                 str(tmp_path / "c2"), "--save-interval", "2")
    step2 = str(tmp_path / "c2" / "step_00000002")
    cp1 = _train(tmp_path, "cp2->cp1", *steps, "--ep", "1", "--load", step2)
    cp4 = _train(tmp_path, "cp2->cp4", *steps, "--ep", "1", "--context-parallel-size", "4", "--cp-comm-type",
                 "all_gather", "--load", step2)
    # with expert parallelism beside cp: each cp rank's tokens go to the experts of its own ep group
    ep2_cp2 = _train(tmp_path, "cp2->ep2_cp2", *steps, "--ep", "2", "--context-parallel-size", "2",
                     "--load", step2)
    # with tensor and sequence parallelism: the heads over tp, a cp rank's positions split over its tp pair
    tp2_cp2 = _train(tmp_path, "cp2->tp2_sp_cp2", *steps, "--ep", "1", "--tp", "2", "--sequence-parallel",
                     "--context-parallel-size", "2", "--load", step2)
    carved = _train(tmp_path, "dp2_cp2_ep2", *steps, "--dp", "2", "--context-parallel-size", "2",
                    "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--save",
                    str(tmp_path / "e2"), "--save-interval", "2")
    carved_cp1 = _train(tmp_path, "dp2_cp2_ep2->cp1", *steps, "--ep", "1", "--load",
                        str(tmp_path / "e2" / "step_00000002"))
    for name, got, want in (("cp2", cp2, ref), ("cp2->cp1", cp1, ref[2:]), ("cp2->cp4", cp4, ref[2:]),
                            ("cp2->ep2_cp2", ep2_cp2, ref[2:]), ("cp2->tp2_sp_cp2", tp2_cp2, ref[2:]),
                            ("dp2_cp2_ep2", carved, ref), ("dp2_cp2_ep2->cp1", carved_cp1, ref[2:])):
        assert [m["step"] for m in got] == [m["step"] for m in want], name
        for w, h in zip(want, got, strict=True):
            for key in ("loss", "main_loss", "balance_loss", "mtp_loss", "grad_norm"):
                assert h[key] == pytest.approx(w[key], rel=2e-5, abs=1e-6), (name, w["step"], key)
            assert h["max_over_mean_load"] == pytest.approx(w["max_over_mean_load"], rel=1e-3), name


def test_fmoe_train_refuses_what_cp_cannot_run_before_launch() -> None:
    from fmoe.train.config import TrainConfig

    base = {"pp": 1, "ep": 1, "context_parallel_size": 2}
    assert TrainConfig(**base).problem() is None
    assert "--seq-length (62) must divide by 4" in TrainConfig(**base, seq_length=62).problem()
    assert TrainConfig(**base, tp=2, sequence_parallel=True, seq_length=64).problem() is None
    assert TrainConfig(**base, multi_latent_attention=True).problem() is None
    assert "--seq-length / --context-parallel-size (6) must be divisible by --tp (4)" in TrainConfig(
        **base, tp=4, num_experts=8, sequence_parallel=True, seq_length=12).problem()
    assert "with --attention is not built yet" in TrainConfig(**base, attention="m:f").problem()
    bad = TrainConfig(**base, cp_comm_type="a2a").problem()
    assert "--cp-comm-type must be one of p2p, all_gather" in bad
