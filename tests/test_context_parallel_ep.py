"""The expert group carved from the data x context ranks in `fmoe train` (--expert-model-parallel-size,
Megatron's layout): the process groups against Megatron's rank arithmetic written out here, and the
layouts it cannot run refused before launch. `fmoe train` at dp 2 x cp 2 with ep 2 carved from them
against the one-process run, and its checkpoint read in one process: tests/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from dist_utils import spawn
from torch.testing._internal.distributed.fake_pg import FakeStore

from fmoe.parallel import ParallelLayout, Topology
from fmoe.train.config import TrainConfig


def _megatron_groups(rank: int, *, pp: int, dp: int, cp: int, tp: int, ep: int) -> dict[str, list[int]]:
    """The groups of `rank` as Megatron-core's rank generators lay them out (order tp-cp-dp-pp for the
    dense ranks; ep carved from the dp x cp ranks, cp fastest: etp(=tp)-ep-edp-pp for the experts), by
    plain enumeration of the coordinates."""
    coords = {}  # rank -> (pp, dp, cp, tp)
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    coords[t + tp * (c + cp * (d + dp * p))] = (p, d, c, t)
    p0, d0, c0, t0 = coords[rank]
    i0 = d0 * cp + c0  # this rank's index among the dp x cp ranks, cp fastest

    def ranks(keep) -> list[int]:
        return sorted(r for r, (p, d, c, t) in coords.items() if keep(p, d, c, t, d * cp + c))

    return {
        "cp": ranks(lambda p, d, c, t, i: (p, d, t) == (p0, d0, t0)),
        "data": ranks(lambda p, d, c, t, i: (p, c, t) == (p0, c0, t0)),
        "data_cp": ranks(lambda p, d, c, t, i: (p, t) == (p0, t0)),
        "ep": ranks(lambda p, d, c, t, i: (p, t) == (p0, t0) and i // ep == i0 // ep),
        "expert": ranks(lambda p, d, c, t, i: p == p0 and i // ep == i0 // ep),
        "dp_cp": ranks(lambda p, d, c, t, i: (p, t) == (p0, t0) and i % ep == i0 % ep),
        "pp": ranks(lambda p, d, c, t, i: (d, c, t) == (d0, c0, t0)),
        "tp": ranks(lambda p, d, c, t, i: (p, d, c) == (p0, d0, c0)),
    }


# (pp, dp, cp, tp, ep): ep inside a cp group, ep spanning dp, ep the whole of dp x cp, with tp and pp
@pytest.mark.parametrize("sizes", [(1, 1, 4, 2, 2), (2, 2, 2, 1, 4), (1, 2, 2, 2, 2), (1, 3, 2, 1, 6)])
def test_the_carved_layouts_groups_are_megatrons(sizes: tuple[int, ...]) -> None:
    """Each rank alone over torch's fake process group: every group it is handed holds the ranks Megatron
    puts in it."""
    pp, dp, cp, tp, ep = sizes
    world = pp * dp * cp * tp
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            layout = ParallelLayout(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, ep_over_cp=True,
                                    topology=Topology(world, world))
            want = _megatron_groups(rank, pp=pp, dp=dp, cp=cp, tp=tp, ep=ep)
            for name, ranks in want.items():
                assert sorted(dist.get_process_group_ranks(layout.group(name))) == ranks, (sizes, rank, name)
            assert layout.group("dp") == layout.group("dp_cp")  # the expert replicas
        finally:
            dist.destroy_process_group()


def test_fmoe_train_refuses_a_carved_expert_group_that_does_not_fit_before_launch() -> None:
    base = {"pp": 1, "context_parallel_size": 2}
    assert TrainConfig.from_sources(overrides={**base, "expert_model_parallel_size": 2}).problem() is None
    four = TrainConfig.from_sources(overrides={**base, "expert_model_parallel_size": 4, "dp": 2})
    assert (four.problem(), four.world_size, four.data_ranks, four.expert_replicas) == (None, 4, 2, 1)
    bad = TrainConfig.from_sources(overrides={**base, "expert_model_parallel_size": 4}).problem()
    assert "--expert-model-parallel-size (4) must divide --dp x --context-parallel-size (1 x 2 = 2)" in bad
    with pytest.raises(ValueError, match=r"--ep \(1\) and --expert-model-parallel-size \(2\) disagree"):
        TrainConfig.from_sources(overrides={**base, "ep": 1, "expert_model_parallel_size": 2})
    assert "leave --ep (2) at it" in TrainConfig(**base, expert_model_parallel_size=4, dp=2).problem()
    assert "must be a positive integer" in TrainConfig(**base, expert_model_parallel_size=0, ep=0).problem()
    carved = TrainConfig.from_sources(overrides={**base, "expert_model_parallel_size": 2})
    torchrun = carved.problem(world_size=4)
    assert "x --context-parallel-size 2 = 2 (the --expert-model-parallel-size 2 ranks carved" in torchrun
    # experts split over the carved group as over any: whole experts per rank
    assert "--num-experts (6) must be divisible by --ep (4)" in TrainConfig.from_sources(
        overrides={**base, "expert_model_parallel_size": 4, "dp": 2, "num_experts": 6}).problem()


# ---- pp 2 with ep 2 carved from dp x cp on 8 ranks ------------------------------------------------------

M = 4  # microbatches per data rank (DualPipeV's least at pp 2)
S_8 = 8  # positions per sequence: 4 chunks of 2 at cp 2, 8 of 1 at cp 4
# (dp, cp) at pp 2 and ep 2: the expert group each cp pair (experts summed over the dp pair), and two
# consecutive ranks of a cp 4 group (experts summed over the other pair of the same cp group)
LAYOUTS_8 = ((2, 2), (1, 4))


def _model_and_batches() -> tuple:
    """The 8-rank test's model (a dense and three MoE layers, MTP; 4 experts), its weights, and up to 2
    data ranks x M microbatches of one sequence each."""
    import dataclasses

    from test_context_parallel import _gpt_cfg
    from test_tensor_parallel_gpt import _data

    cfg = dataclasses.replace(_gpt_cfg(True, 1), n_layers=4)
    params, ids, targets = _data(cfg, S_8, B=2 * M)
    return cfg, params, list(zip(ids.chunk(2 * M), targets.chunk(2 * M)))


def _pp_ep_over_cp_rank(rank: int, world: int) -> dict:
    """For each (dp, cp) of LAYOUTS_8: a DualPipeV step with fb overlap on pp 2 x dp x cp, the expert group
    (ep 2) carved from the dp x cp ranks as Megatron does, recorded (tests/nccl_rules.py); then the
    gradients reduced as `fmoe train` reduces them: dense over dp x cp, experts over their replicas, each
    divided by the data ranks."""
    from nccl_rules import recording
    from test_context_parallel import _held

    from fmoe import init_gpt_state
    from fmoe import schedule as sched
    from fmoe._compat import keystr, tree_flatten_with_path
    from fmoe.parallel import CommGroup, ParallelContext
    from fmoe.parallel.alltoall import AllToAllDispatcher
    from fmoe.pipeline import gpt_pipeline_step, gpt_program
    from fmoe.schedule.options import ExecOptions

    cfg, params, batches = _model_and_batches()
    E = cfg.moe.num_experts
    out = []
    for dp, cp in LAYOUTS_8:
        layout = ParallelLayout(pp=2, dp=dp, cp=cp, ep=2, ep_over_cp=True, topology=Topology(world, world))
        d, expert_rank = layout.local_rank("data"), layout.local_rank("expert")
        parallel = ParallelContext(cp=CommGroup(layout.group("cp")),
                                   dispatcher=AllToAllDispatcher(CommGroup(layout.group("expert")), E))
        pp_group = layout.group("pp")
        with recording() as log:
            program = gpt_program(cfg, sched.build("dualpipev", 2, M), dist.get_rank(pp_group),
                                  parallel=parallel)
            mine = _held(params, cfg, 0, 1, expert_rank, E // 2)
            step = gpt_pipeline_step(program, mine, init_gpt_state(cfg), batches[d * M:(d + 1) * M],
                                     group=pp_group, options=ExecOptions(overlap=True))
        grads = {}
        for path, g in tree_flatten_with_path(step.grads)[0]:
            if g is None:
                continue
            name = keystr(path)
            dist.all_reduce(g, group=layout.group("dp_cp" if "['experts']" in name else "data_cp"))
            grads[name] = (tuple(g.shape), (g / dp).flatten().tolist())
        out.append({"log": log, "loss": float(step.loss), "data_rank": d, "expert_rank": expert_rank,
                    "grads": grads})
    return out


def test_a_pipeline_with_the_expert_group_over_cp_equals_one_process() -> None:
    """8 gloo ranks, fp64, one spawn: pp 2 (DualPipeV, fb overlap, MTP) x dp 2 x cp 2 and pp 2 x cp 4, each
    with ep 2 carved from dp x cp (the ring's shifts and the all-to-alls inside the attention and MoE phases
    of paired microbatches): each rank's loss the one-process mean over its data rank's microbatches,
    every gradient it holds the one-process gradient of the mean over all of them; and each step's
    communicators ordered alike on every rank under NCCL's rules and the one-queue-per-device model."""
    import torch
    from nccl_rules import replay
    from test_context_parallel import _held

    from fmoe import gpt_loss, init_gpt_state
    from fmoe._compat import keystr, tree_flatten_with_path
    from fmoe.transforms.testing import assert_close

    cfg, params, batches = _model_and_batches()
    state = init_gpt_state(cfg)

    def mean_loss(p: dict, part: list) -> torch.Tensor:
        return sum(gpt_loss(p, i, t, cfg, state)[0] for i, t in part) / len(part)

    runs = spawn(_pp_ep_over_cp_rank, 8, timeout_s=300)
    for case, (dp, cp) in enumerate(LAYOUTS_8):
        used = batches[:dp * M]
        whole = torch.func.grad(lambda p, used=used: mean_loss(p, used))(params)
        for rank, r in enumerate(runs):
            got, where = r.value[case], f"dp {dp} x cp {cp} rank {rank}"
            d = got["data_rank"]
            want_loss = float(mean_loss(params, used[d * M:(d + 1) * M]))
            assert got["loss"] == pytest.approx(want_loss, rel=1e-10), where
            want = {keystr(p): v for p, v in tree_flatten_with_path(
                _held(whole, cfg, 0, 1, got["expert_rank"], cfg.moe.num_experts // 2))[0]}
            assert any("['experts']" in k for k in got["grads"]), where  # every pipeline rank holds experts
            for path, (shape, values) in got["grads"].items():
                assert_close(torch.tensor(values, dtype=torch.float64).reshape(shape), want[path],
                             msg=f"{where} {path}")
        logs = {r.rank: r.value[case]["log"] for r in runs}
        assert replay(logs, "nccl") == [], (dp, cp)
        assert replay(logs, "device") == [], (dp, cp)
