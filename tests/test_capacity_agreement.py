"""Dynamic capacity across ranks (seed 002): the ranks of one expert group pad to one capacity; each step
costs one all-reduce of the miss flag, and the max all-reduce happens only on a miss (counted). Two gloo
ranks (tests/dist_utils.py). Oracles: the capacity by hand (the forecast, or the largest load of any
rank), and the dropless layer without dynamic capacity for the output of the expert-parallel layer.

Legend: T tokens per rank, E experts, K top-k slots, W window.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_utils import spawn

from fmoe.capacity import capacity_agreement, make_layout
from fmoe.config import MoEConfig
from fmoe.layer import init_moe, update_moe_state
from fmoe.model import moe
from fmoe.parallel import AllToAllDispatcher, CommCounters, CommGroup
from fmoe.parallel.capacity_agreement import FITS_OP, MAX_OP, CapacityAgreement

E, W = 4, 2
CFG = MoEConfig(d_model=8, d_ff=4, num_experts=E, top_k=1, dynamic_capacity_window=W)
FORECAST = 5  # max of the window below


def _state() -> dict[str, torch.Tensor]:
    return {"load_history_W": torch.tensor([3, FORECAST]), "capacity_misses": torch.tensor(0),
            "capacity_steps": torch.tensor(0)}


def _ids(loads: list[int]) -> torch.Tensor:
    """ids_TK [T, 1] giving expert e loads[e] tokens."""
    return torch.cat([torch.full((n, 1), e) for e, n in enumerate(loads)]).to(torch.int64)


# per case, each rank's loads over the E experts: both fit / rank 1 misses (7 > 5) / both miss
CASES = {"fit": ([2, 3, 1, 0], [5, 1, 0, 2]), "one_misses": ([2, 3, 1, 0], [7, 1, 0, 0]),
         "both_miss": ([6, 0, 0, 0], [1, 8, 0, 0])}


def _agreement_rank(rank: int, world: int) -> dict:
    comm = CommGroup(dist.group.WORLD, counters=CommCounters())
    agree = CapacityAgreement(comm)
    out: dict = {}
    for name, loads in CASES.items():
        ids_TK = _ids(loads[rank])
        probs_TK = torch.ones(ids_TK.shape)
        before = dict(comm.counters.calls)
        with capacity_agreement(agree):
            layout, info = make_layout(ids_TK, probs_TK, CFG, _state())
        calls = {op: comm.counters.calls.get(op, 0) - before.get(op, 0) for op in (FITS_OP, MAX_OP)}
        alone = make_layout(ids_TK, probs_TK, CFG, _state())[1]  # outside the block: this rank alone
        out[name] = (info.capacity, info.missed, tuple(layout.counts_E.tolist()), calls, alone.capacity,
                     int(update_moe_state(_state(), CFG, torch.tensor(loads[rank]), max(loads[rank]),
                                          info.missed)["capacity_misses"]))
    # the expert-parallel layer under the agreement is still dropless: it equals the layer without
    # dynamic capacity (gate weights at combine; padding rows carry nothing back)
    g = torch.Generator().manual_seed(0)
    full = init_moe(CFG, g, torch.float64)
    L = E // world
    params = {"router": full["router"],
              "experts": {k: v[rank * L:(rank + 1) * L] for k, v in full["experts"].items()}}
    x_TD = torch.randn(6 + 3 * rank, CFG.d_model, generator=torch.Generator().manual_seed(rank),
                       dtype=torch.float64)
    dispatcher = AllToAllDispatcher(CommGroup(dist.group.WORLD), E)
    with capacity_agreement(agree):
        y_TD, aux = moe(params, x_TD, CFG, _state(), dispatcher=dispatcher)
    ref_TD, _ = moe(params, x_TD, CFG.replace(dynamic_capacity_window=0), {}, dispatcher=dispatcher)
    out["layer"] = (aux.capacity, float((y_TD - ref_TD).abs().max()))
    return out


def test_ranks_agree_on_one_capacity_and_reduce_the_max_only_on_a_miss() -> None:
    r0, r1 = (r.value for r in spawn(_agreement_rank, 2, timeout_s=120))
    for name, loads in CASES.items():
        want_missed = max(max(ld) for ld in loads) > FORECAST
        want = max(max(ld) for ld in loads) if want_missed else FORECAST
        for r, got in enumerate((r0[name], r1[name])):
            capacity, missed, counts_E, calls, alone, misses = got
            assert (capacity, missed, misses) == (want, want_missed, int(want_missed)), (name, r, got)
            assert counts_E == (want,) * E, (name, r)  # every expert padded to the agreed capacity
            assert calls == {FITS_OP: 1, MAX_OP: 1 if want_missed else 0}, (name, r, calls)
            assert alone == max(FORECAST, max(loads[r])), (name, r)  # deciding alone: its own load
    # the case that motivated it: alone, the rank that fitted and the rank that missed disagree
    assert r0["one_misses"][4] != r1["one_misses"][4]
    assert r0["layer"][0] == r1["layer"][0]
    assert r0["layer"][1] < 1e-12 and r1["layer"][1] < 1e-12, (r0["layer"], r1["layer"])
