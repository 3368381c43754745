"""`SharedGrads` (weights several pipeline ranks hold): the summed gradient against a plain sum of every
holder's gradient, the same bits on every holder, non-holders untouched, over a sequence of layouts
whose holder sets differ per rank. torch names a group that only its members create after how many
groups each member already has, so a process group per set hung here once rank 0 had built one with
rank 3 and rank 1 had not (the pp 4 pipeline test, DualPipeV with MTP alone after 1F1B with MTP)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import spawn

from fmoe.parallel.shared_grads import SharedGrads

# one step's holders per layout, run one after the other in the same processes
LAYOUTS = [
    {("embed",): (0, 3)},  # 1F1B with MTP: the embedding on the first and last rank
    {("head",): (0, 1), ("embed",): (0,)},  # DualPipeV pp 4 with MTP alone: the head on ranks 0 and 1
    {("head",): (1, 2, 3), ("embed",): (0, 3), ("norm",): (2,)},  # three holders, and two sets on rank 3
    {("head",): (0, 1, 2, 3)},  # the whole group: an all-reduce
]


def _grad(rank: int, path: tuple[str, ...], step: int) -> torch.Tensor:
    """Rank `rank`'s gradient for `path` at `step`: values no two ranks share, in float64."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + len(path[0]))
    return torch.randn(5, 3, generator=g, dtype=torch.float64)


def _rank(rank: int, world: int) -> list[dict[str, list]]:
    out = []
    for step, holders in enumerate(LAYOUTS):
        mine = [p for p, r in holders.items() if rank in r]
        grads = {p[0]: {"w": _grad(rank, p, step)} for p in mine}
        SharedGrads(holders, dist.group.WORLD).reduce(grads)
        out.append({k: v["w"].tolist() for k, v in grads.items()})
    return out


def _recorded(rank: int, world: int) -> dict:
    """`_rank`'s gradients, and every op it issued (tests/nccl_rules.py's recording)."""
    from nccl_rules import recording

    with recording() as log:
        grads = _rank(rank, world)
    return {"grads": grads, "log": log}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """Each of the 4 ranks' `_recorded` answer, by rank: one start of the ranks for both tests."""
    return [r.value for r in spawn(_recorded, 4, timeout_s=90, pg_timeout_s=20)]


def test_shared_gradients_are_summed_across_their_holders(runs: list[dict]) -> None:
    results = [run["grads"] for run in runs]
    for step, holders in enumerate(LAYOUTS):
        for path, ranks in holders.items():
            want = sum(_grad(r, path, step) for r in ranks)  # the oracle: a plain sum
            for r in ranks:
                got = torch.tensor(results[r][step][path[0]], dtype=torch.float64)
                torch.testing.assert_close(got, want, rtol=1e-15, atol=1e-15)
                first = torch.tensor(results[ranks[0]][step][path[0]], dtype=torch.float64)
                assert torch.equal(got, first), (step, path, r)  # the copies stay identical
            for r in set(range(4)) - set(ranks):
                assert path[0] not in results[r][step], (step, path, r)


def test_shared_gradient_sums_run_under_nccls_matching_rules(runs: list[dict]) -> None:
    """Every set's point-to-point copies and all-reduces, replayed under NCCL's rules (tests/nccl_rules.py):
    one stream per rank pair, a send done only with its receive; and one queue per device."""
    from nccl_rules import replay

    logs = dict(enumerate(run["log"] for run in runs))
    assert replay(logs, "nccl") == []
    assert replay(logs, "device") == []
