"""Context parallelism (fmoe/parallel/context_parallel.py) against one process: the load-balanced split,
and attention over the split (ring and all-gather) equal to `fmoe.ops.attention` on the whole sequence in
fp64 (output and the gradients of q, k, v, summed over the ranks that hold them), GQA included, on 2 and 4
gloo ranks."""

from __future__ import annotations

import pytest
import torch
from dist_utils import spawn

from fmoe.ops import attention
from fmoe.parallel import CommGroup
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


def _qkv(B: int, S: int, H: int, G: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, S, n, d, generator=g, dtype=DT) for n in (H, G, G))


def _cp_rank(rank: int, world: int, kind: str, shape: tuple[int, ...]) -> dict:
    B, S, H, G, d = shape
    comm = CommGroup(torch.distributed.group.WORLD)
    q, k, v = _qkv(B, S, H, G, d, 0)
    ct = torch.randn(B, S, H, d, generator=torch.Generator().manual_seed(1), dtype=DT)
    pos = cp_positions(S, rank, world)
    mine = [take_positions(t, pos).requires_grad_(True) for t in (q, k, v)]
    o = cp_attention(*mine, pos, comm, rope_theta=100.0, kind=kind)
    (o * take_positions(ct, pos)).sum().backward()
    full = [torch.zeros_like(t).index_copy(1, pos, m.grad) for t, m in zip((q, k, v), mine)]
    for t in full:  # each rank holds the gradient its queries gave every key: the sum is the whole's
        torch.distributed.all_reduce(t)
    # plain lists: a tensor would cross to the parent by a shared file descriptor, gone once the rank exits
    return {"o": torch.zeros(B, S, H, d, dtype=DT).index_copy(1, pos, o.detach()).tolist(),
            "grads": [t.tolist() for t in full]}


@pytest.mark.parametrize("kind", ["p2p", "all_gather"])
@pytest.mark.parametrize("world, shape", [(2, (2, 8, 4, 2, 4)), (4, (1, 16, 2, 2, 4)), (2, (1, 4, 1, 1, 2))])
def test_cp_attention_equals_one_process(kind: str, world: int, shape: tuple[int, ...]) -> None:
    B, S, H, G, d = shape
    q, k, v = (t.requires_grad_(True) for t in _qkv(B, S, H, G, d, 0))
    ct = torch.randn(B, S, H, d, generator=torch.Generator().manual_seed(1), dtype=DT)
    o = attention(q, k, v, rope_theta=100.0)
    want = torch.autograd.grad((o * ct).sum(), (q, k, v))
    got = [r.value for r in spawn(_cp_rank, world, kind, shape)]
    o_sum = sum(torch.tensor(r["o"], dtype=DT) for r in got)  # each rank filled its positions
    assert_close(o_sum, o.detach(), dtype=DT)
    for r in got:
        for a, b in zip(r["grads"], want):
            assert_close(torch.tensor(a, dtype=DT), b, dtype=DT)
