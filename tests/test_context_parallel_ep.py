"""The expert group carved from the data x context ranks in `fmoe train` (--expert-model-parallel-size,
Megatron's layout): the process groups against Megatron's rank arithmetic written out here, `fmoe train`
at cp 2 x ep 2 against the one-process run step by step, its checkpoints read at other layouts, and the
layouts it cannot run refused before launch."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
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


def test_fmoe_train_with_the_expert_group_over_cp_equals_one_process_and_its_checkpoints_load_anywhere(
        tmp_path) -> None:
    """`fmoe train --context-parallel-size 2 --expert-model-parallel-size 2` (2 ranks: the cp pair shares
    the experts) against the one-process run step by step (losses, gradient norm, expert loads); its step-2
    checkpoint resumed in one process, and the one-process run's read at dp 2 x cp 2 with ep 2 (experts
    reduced over the dp pair, ZeRO-1 over it), each equal to the uninterrupted run."""
    from test_train import _train

    steps = ("--mtp", "--pp", "1", "--steps", "3", "--dtype", "float64")  # fp64: see test_context_parallel
    ref = _train(tmp_path, "ref", *steps, "--ep", "1", "--save", str(tmp_path / "r"), "--save-interval", "2")
    carved = ("--context-parallel-size", "2", "--expert-model-parallel-size", "2")
    cp2_ep2 = _train(tmp_path, "cp2_ep2", *steps, *carved, "--save", str(tmp_path / "c"), "--save-interval", "2")
    cp1 = _train(tmp_path, "cp2_ep2->cp1", *steps, "--ep", "1", "--load", str(tmp_path / "c" / "step_00000002"))
    dp2 = _train(tmp_path, "cp1->dp2_cp2_ep2", *steps, *carved, "--dp", "2", "--use-distributed-optimizer",
                 "--load", str(tmp_path / "r" / "step_00000002"))
    for name, got, want in (("cp2_ep2", cp2_ep2, ref), ("cp2_ep2->cp1", cp1, ref[2:]),
                            ("cp1->dp2_cp2_ep2", dp2, ref[2:])):
        assert [m["step"] for m in got] == [m["step"] for m in want], name
        for w, h in zip(want, got, strict=True):
            for key in ("loss", "main_loss", "balance_loss", "mtp_loss", "grad_norm"):
                assert h[key] == pytest.approx(w[key], rel=2e-5, abs=1e-6), (name, w["step"], key)
            assert h["max_over_mean_load"] == pytest.approx(w["max_over_mean_load"], rel=1e-3), name


def test_fmoe_train_refuses_a_carved_expert_group_that_does_not_fit_before_launch() -> None:
    base = {"pp": 1, "context_parallel_size": 2}
    assert TrainConfig.from_sources(overrides={**base, "expert_model_parallel_size": 2}).problem() is None
    assert TrainConfig.from_sources(overrides={**base, "expert_model_parallel_size": 4, "dp": 2}).world_size == 4
    bad = TrainConfig.from_sources(overrides={**base, "expert_model_parallel_size": 4}).problem()
    assert "--expert-model-parallel-size (4) must divide --dp x --context-parallel-size (1 x 2 = 2)" in bad
    with pytest.raises(ValueError, match=r"--ep \(1\) and --expert-model-parallel-size \(2\) disagree"):
        TrainConfig.from_sources(overrides={**base, "ep": 1, "expert_model_parallel_size": 2})
    assert "leave --ep (2) at it" in TrainConfig(**base, expert_model_parallel_size=4, dp=2).problem()
    assert "must be a positive integer" in TrainConfig(**base, expert_model_parallel_size=0, ep=0).problem()
    assert "x --context-parallel-size 2 = 2 (the --expert-model-parallel-size 2 ranks carved" in TrainConfig.from_sources(
        overrides={**base, "expert_model_parallel_size": 2}).problem(world_size=4)
    # experts split over the carved group as over any: whole experts per rank
    assert "--num-experts (6) must be divisible by --ep (4)" in TrainConfig.from_sources(
        overrides={**base, "expert_model_parallel_size": 4, "dp": 2, "num_experts": 6}).problem()
