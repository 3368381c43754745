"""`fmoe.parallel.agree`: ranks that disagree on the config, the layout or the parameter shapes all raise
the same AgreementError naming who disagrees on what; ranks that agree pass.

Legend: P ranks. Without the check, a rank with a different num_experts makes the all-to-all dispatcher
abort inside gloo; the all-gather dispatcher now checks the expert count itself (it returned a wrong
answer without an error), and every rank raises. Each spawn runs several scenarios in a row: a
disagreement is found by gathers that succeed, so the group stays usable.
"""

from __future__ import annotations

import collections
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import spawn
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.config import MoEConfig
from fmoe.parallel import AgreementError, AllGatherDispatcher, CommGroup, ParallelLayout, Topology, agree
from fmoe.parallel.agreement import _explain, describe, digest

P = 4


def _cfg(num_experts: int = 8) -> MoEConfig:
    return MoEConfig(d_model=4, d_ff=6, num_experts=num_experts, top_k=2)


def _params(width: int = 6, dtype: torch.dtype = torch.float32) -> dict:
    return {"router": torch.zeros(4, 8), "experts": {"w_up": torch.zeros(2, 4, width, dtype=dtype),
                                                     "w_down": torch.zeros(2, width, 4)}}


def _error(fn) -> str | None:
    try:
        fn()
    except AgreementError as e:
        return str(e)
    return None


def _scenarios(rank: int, world: int) -> dict:
    topo = Topology(world, ranks_per_node=2)
    out: dict = {}
    t0 = time.perf_counter()
    # equal things pass, through both entry points; the layout is then usable
    out["equal"] = _error(lambda: agree(None, config=_cfg(), params=_params(), n=3))
    layout = ParallelLayout(ep=world, topology=topo, agree_on={"config": _cfg(), "params": _params()})
    comm = CommGroup(layout.group("expert"), topology=topo)
    out["equal_layout"] = _error(lambda: agree(comm, layout=layout, config=_cfg()))
    # rank 1 has a different num_experts
    e = 4 if rank == 1 else 8
    out["num_experts"] = _error(lambda: agree(None, config=_cfg(e)))
    out["num_experts_layout"] = _error(
        lambda: ParallelLayout(ep=world, topology=topo, agree_on={"config": _cfg(e)}))
    # parameter shapes: ranks 1 and 3 hold wider experts; rank 2 a float64 w_up
    width = 12 if rank in (1, 3) else 6
    out["shapes"] = _error(lambda: agree(comm, params=_params(width)))
    dtype = torch.float64 if rank == 2 else torch.float32
    out["dtype"] = _error(lambda: agree(comm, params=_params(dtype=dtype)))
    # the layout itself: rank 1 asks for ep 2 (dp 2) where the others ask for ep 4; nothing is built
    out["layout"] = _error(lambda: ParallelLayout(ep=2 if rank == 1 else world, topology=topo, agree_on={}))
    # a thing only some ranks pass, and one rank passing something that has no canonical form
    extra = {"params": _params()} if rank != 3 else {}
    out["missing"] = _error(lambda: agree(None, config=_cfg(), **extra))
    out["undescribable"] = _error(lambda: agree(None, x=object() if rank == 0 else 1))
    out["seconds"] = time.perf_counter() - t0
    # still a working group afterwards
    out["equal_after"] = _error(lambda: agree(None, config=_cfg()))
    x = torch.ones(1)
    dist.all_reduce(x)
    out["sum"] = float(x)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return [r.value for r in spawn(_scenarios, P, timeout_s=120, pg_timeout_s=30)]


def test_equal_things_pass(results) -> None:
    for r in results:
        assert r["equal"] is None and r["equal_layout"] is None and r["equal_after"] is None
        assert r["sum"] == P


def test_rank_with_other_num_experts_fails_everywhere(results) -> None:
    want = ("ranks [0, 2, 3] and [1] disagree on config:\n"
            "  config.num_experts: 8 on ranks [0, 2, 3], 4 on ranks [1]")
    for r in results:  # every rank raises, the same message
        assert r["num_experts"] == want
        assert r["num_experts_layout"] == want


def test_parameter_shapes_and_dtypes(results) -> None:
    shapes = ("ranks [0, 2] and [1, 3] disagree on params:\n"
              "  params['experts']['w_down']: Tensor[2, 6, 4] torch.float32 on ranks [0, 2], "
              "Tensor[2, 12, 4] torch.float32 on ranks [1, 3]\n"
              "  params['experts']['w_up']: Tensor[2, 4, 6] torch.float32 on ranks [0, 2], "
              "Tensor[2, 4, 12] torch.float32 on ranks [1, 3]")
    dtype = ("ranks [0, 1, 3] and [2] disagree on params:\n"
             "  params['experts']['w_up']: Tensor[2, 4, 6] torch.float32 on ranks [0, 1, 3], "
             "Tensor[2, 4, 6] torch.float64 on ranks [2]")
    for r in results:
        assert r["shapes"] == shapes
        assert r["dtype"] == dtype


def test_layout_disagreement_fails_before_building_groups(results) -> None:
    want = ("ranks [0, 2, 3] and [1] disagree on layout:\n"
            "  layout.ep: 4 on ranks [0, 2, 3], 2 on ranks [1]\n"
            "  layout.dp: 1 on ranks [0, 2, 3], 2 on ranks [1]")
    for r in results:
        assert r["layout"] == want
        assert r["seconds"] < 25  # every scenario failed at once, none waited for the 30 s group timeout


def test_missing_and_undescribable_things(results) -> None:
    missing = ("ranks [0, 1, 2] and [3] disagree on params:\n"
               "  params['experts']['w_down']: Tensor[2, 6, 4] torch.float32 on ranks [0, 1, 2], "
               "<not given> on ranks [3]")
    for r in results:
        assert r["missing"].startswith(missing)
        assert r["undescribable"] == ("rank 0 could not describe what it passed to agree: TypeError: agree: "
                                      "cannot describe x of type object; pass plain values, dataclasses, "
                                      "ParallelLayouts, tensors or dicts / lists / tuples of them")


# ---- what the check guards against, and the canonical form ----------------------------------------

def _value_error(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _dispatch_with_other_num_experts(rank: int, world: int) -> dict:
    """Rank 1 has 8 experts, rank 0 has 4. Before the dispatcher's own check, the row path aborted rank 0
    inside gloo; the token entry (permute-1 around the row path) meets the same check."""
    comm = CommGroup(dist.group.WORLD)
    e = 8 if rank == 1 else 4
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))
    ids, probs = torch.arange(10).reshape(5, 2) % 4, torch.full((5, 2), 0.5)
    rows_x, counts_E = torch.randn(e, 3), torch.ones(e, dtype=torch.int64)  # one row per expert
    tokens = _value_error(lambda: AllGatherDispatcher(comm, e).dispatch_tokens(x, ids, probs))
    rows = _value_error(lambda: AllGatherDispatcher(comm, e).dispatch(rows_x, counts_E))
    # the same number of experts everywhere, but rank 1 routes over 8 (its config) with 4 (the dispatcher's)
    routed = _value_error(lambda: AllGatherDispatcher(comm, 4).dispatch(rows_x, counts_E))
    return {"tokens": tokens, "rows": rows, "routed": routed,
            "agree": _error(lambda: agree(comm, config=_cfg(e)))}


def _dispatch_both(rank: int, world: int) -> dict:
    """`_dispatch_agreeing`, then `_dispatch_with_other_num_experts` (fresh dispatchers, each checking on
    its first call), on the same 2 ranks: one start of the ranks for both tests below."""
    return {"agreeing": _dispatch_agreeing(rank, world),
            "other": _dispatch_with_other_num_experts(rank, world)}


@pytest.fixture(scope="module")
def dispatch_results() -> list[dict]:
    """Each of the 2 ranks' `_dispatch_both` answer, by rank."""
    return [r.value for r in spawn(_dispatch_both, 2, timeout_s=90, pg_timeout_s=20)]


def test_ranks_with_other_expert_counts_fail_in_the_allgather_dispatcher_everywhere(
        dispatch_results: list[dict]) -> None:
    for r in (v["other"] for v in dispatch_results):
        assert r["tokens"] == r["rows"] == ("AllGatherDispatcher: the ranks of the expert group disagree on "
                                            "num_experts: 4 on group ranks [0], 8 on group ranks [1]")
        assert r["routed"] == ("AllGatherDispatcher: the ranks of the expert group disagree on the routed "
                               "experts (len(counts_E)): 4 on group ranks [0], 8 on group ranks [1]")
        assert r["agree"] == ("ranks [0] and [1] disagree on config:\n"
                              "  config.num_experts: 4 on ranks [0], 8 on ranks [1]")


def _dispatch_agreeing(rank: int, world: int) -> float:
    comm = CommGroup(dist.group.WORLD)
    d = AllGatherDispatcher(comm, 4)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))
    err = 0.0
    for _ in range(2):  # the row path checks on its first call only; both calls must pass
        y_MD, _, _, meta = d.dispatch(x[:4], torch.ones(4, dtype=torch.int64))
        err = max(err, float((d.combine(y_MD, meta) - x[:4]).abs().max()))
        x_M, _, tmeta = d.dispatch_tokens(x, torch.arange(10).reshape(5, 2) % 4, torch.full((5, 2), 0.5))
        err = max(err, float((d.combine_tokens(x_M, tmeta) - x).abs().max()))
    return err


def test_agreeing_ranks_pass_the_allgather_dispatchers_check(dispatch_results: list[dict]) -> None:
    assert all(v["agreeing"] < 1e-6 for v in dispatch_results), dispatch_results


def test_describe_is_canonical() -> None:
    point = collections.namedtuple("point", "x y")
    got = describe({"b": [1, 2.0], "a": (torch.zeros(2, 3, dtype=torch.bfloat16), None), "c": point(1, "s"),
                    "d": {}, "e": []}, "t")
    assert got == [("t['a'][0]", "Tensor[2, 3] torch.bfloat16"), ("t['a'][1]", "None"), ("t['b'][0]", "1"),
                   ("t['b'][1]", "2.0"), ("t['c']", "<point>"), ("t['c'].x", "1"), ("t['c'].y", "'s'"),
                   ("t['d']", "{}"), ("t['e']", "[]")]
    cfg = describe(_cfg(), "config")
    assert cfg[0] == ("config", "<MoEConfig>") and ("config.num_experts", "8") in cfg
    assert digest(describe(_params(), "p")) == digest(describe(_params(), "p"))
    assert digest(describe(_params(), "p")) != digest(describe(_params(7), "p"))
    with pytest.raises(TypeError, match=r"cannot describe t\['f'\] of type object"):
        describe({"f": object()}, "t")


def test_agree_without_process_group_only_describes() -> None:
    assert not dist.is_initialized()
    assert agree(None, config=_cfg(), params=_params()) is None
    with pytest.raises(TypeError, match="cannot describe x of type object"):
        agree(None, x=object())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([4, 8, 16]), st.sampled_from([1, 2])), min_size=2, max_size=6))
@example([(8, 2), (4, 2)])
@example([(8, 2), (8, 1), (8, 2), (8, 1)])
@example([(4, 1), (8, 2), (16, 2), (4, 1)])
def test_explain_names_exactly_the_differing_entries(per_rank: list[tuple[int, int]]) -> None:
    # what every rank raises, from the descriptions it gathered (no processes needed)
    ranks = list(range(len(per_rank)))
    cfgs = [_cfg(e).replace(top_k=k) for e, k in per_rank]
    descs = [describe(c, "config") for c in cfgs]
    if len(set(per_rank)) == 1:
        assert len({digest(d) for d in descs}) == 1
        return
    lines = _explain("config", descs, ranks).splitlines()
    classes: dict[tuple[int, int], list[int]] = {}
    for r, key in enumerate(per_rank):
        classes.setdefault(key, []).append(r)
    parts = [str(c) for c in classes.values()]
    assert lines[0] == f"ranks {', '.join(parts[:-1])} and {parts[-1]} disagree on config:"
    want = [f for k, f in enumerate(("num_experts", "top_k")) if len({key[k] for key in per_rank}) > 1]
    assert [line.split(":")[0].strip() for line in lines[1:]] == [f"config.{f}" for f in want]
    for f, line in zip(want, lines[1:], strict=True):  # each value once, with exactly its ranks
        by_value: dict[int, list[int]] = {}
        for r, c in enumerate(cfgs):
            by_value.setdefault(getattr(c, f), []).append(r)
        assert line == f"  config.{f}: " + ", ".join(f"{v} on ranks {rs}" for v, rs in by_value.items())
