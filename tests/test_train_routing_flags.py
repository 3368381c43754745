"""`fmoe train`'s group-limited routing and dynamic-capacity flags (issue 34): they reach the layer's
config, bad values fail before launch naming the flag, and a 2-rank expert-parallel run agrees on one
capacity per layer and microbatch, reducing the maximum load only on a miss.

The router's group-limited selection itself is checked against a plain-loop oracle in
tests/test_moe_router.py (fmoe/router.py had it; the flags are new).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import spawn

from fmoe.parallel import ParallelLayout
from fmoe.parallel.capacity_agreement import FITS_OP, MAX_OP
from fmoe.train.config import TrainConfig
from fmoe.train.loop import Trainer, World


def test_the_flags_reach_the_layer_config() -> None:
    tc = TrainConfig(moe_router_num_groups=4, moe_router_group_topk=2, moe_dynamic_capacity_window=3,
                     moe_dynamic_capacity_margin=1.25)
    moe = tc.model().moe
    assert (moe.num_groups, moe.topk_groups) == (4, 2)
    assert (moe.dynamic_capacity_window, moe.dynamic_capacity_margin) == (3, 1.25)
    assert (TrainConfig().model().moe.num_groups, TrainConfig().model().moe.dynamic_capacity_window) == (1, 0)


@pytest.mark.parametrize("flags, needle", [
    ({"moe_router_num_groups": 4}, "go together"),
    ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "must divide --num-experts (8)"),
    ({"moe_router_num_groups": 4, "moe_router_group_topk": 5}, "--moe-router-group-topk must lie in"),
    ({"moe_router_num_groups": 8, "moe_router_group_topk": 1}, "exceeds the 1 experts of 1 groups"),
    ({"moe_dynamic_capacity_window": 2, "moe_expert_capacity_factor": 1.0}, "leave out --moe-expert"),
    ({"moe_dynamic_capacity_window": -1}, "--moe-dynamic-capacity-window must be >= 0"),
    ({"moe_dynamic_capacity_window": 2, "moe_dynamic_capacity_margin": 0.5},
     "--moe-dynamic-capacity-margin must be >= 1"),
    ({"moe_dynamic_capacity_margin": 1.5}, "applies to --moe-dynamic-capacity-window > 0 only"),
])
def test_bad_routing_flags_fail_before_launch(flags: dict, needle: str) -> None:
    problem = TrainConfig(**flags).problem()
    assert problem is not None and needle in problem, (flags, problem)


def _run_rank(rank: int, world: int) -> dict:
    tc = TrainConfig(pp=1, ep=2, dp=1, steps=2, progress=False, moe_dynamic_capacity_window=2,
                     moe_router_num_groups=4, moe_router_group_topk=2)
    trainer = Trainer(tc, World(rank, world, ParallelLayout(pp=1, ep=2, dp=1), torch.device("cpu")))
    steps = []
    for _ in range(tc.steps):
        before = dict(trainer.capacity_agreement.comm.counters.calls)
        metrics = trainer.step()
        calls = trainer.capacity_agreement.comm.counters.calls
        steps.append({"loss": metrics["loss"], "dropped": metrics["dropped"],
                      **{op: calls.get(op, 0) - before.get(op, 0) for op in (FITS_OP, MAX_OP)}})
    misses = [int(s["capacity_misses"]) for s in trainer.state["layers"] if s]
    return {"steps": steps, "misses": misses, "microbatches": tc.microbatches,
            "moe_layers": tc.num_layers - tc.first_k_dense}


def test_expert_parallel_ranks_agree_on_the_capacity_each_step() -> None:
    r0, r1 = (r.value for r in spawn(_run_rank, 2, timeout_s=180))
    assert r0["misses"] == r1["misses"]  # the same state on both ranks
    per_step = r0["moe_layers"] * r0["microbatches"]  # one agreement per layer and microbatch
    for s0, s1 in zip(r0["steps"], r1["steps"], strict=True):
        assert s0 == s1, (s0, s1)  # same loss, no drops, and the same collectives on both ranks
        assert s0["dropped"] == 0 and s0[FITS_OP] == per_step and 0 <= s0[MAX_OP] <= per_step
    first = r0["steps"][0]
    assert first[MAX_OP] == per_step  # an empty window forecasts 0: every microbatch misses at first
    assert all(1 <= m <= len(r0["steps"]) for m in r0["misses"])  # step 1 missed in every layer
    assert r0["steps"][1][MAX_OP] < per_step  # then the window's forecast fits some microbatches
