"""fmoe.parallel.traffic against the dispatchers' real CommCounters, a per-row loop, and exact expectations.

Legend: P ranks of the expert group, I ranks per node, A = P / I nodes, E experts, L = E / P, T tokens
per rank, K top-k, D width.

Oracles: (1) one gloo spawn, 2 nodes x 2 ranks, runs AllToAllDispatcher and HierarchicalDispatcher on
seeded routings and returns every rank's counters; the parent regenerates the routings and predicts
every counted op (dispatch, combine, counts, ids, probs) to the byte. (2) A plain per-(token, k) loop
that follows the dispatchers' description, for other (P, I). (3) Expectations: every rank holding all
C(E, K) expert subsets once is uniform routing exactly, so the exact bytes / T must equal the closed
form; and a Monte-Carlo average of seeded uniform routings must be within a Hoeffding bound of it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from dist_utils import spawn
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.parallel import (
    AllToAllDispatcher,
    CommCounters,
    CommGroup,
    HierarchicalDispatcher,
    ParallelLayout,
    Topology,
)
from fmoe.parallel.topology import INTER, INTRA
from fmoe.parallel.traffic import (
    alltoall_combine_bytes,
    alltoall_dispatch_bytes,
    expected_alltoall_bytes,
    expected_hierarchical_bytes,
    hierarchical_combine_bytes,
    hierarchical_dispatch_bytes,
)

WORLD, RPN, E_SPAWN, D = 4, 2, 8, 3
ROW_BYTES = D * 4  # float32 rows; the probs are float32 too (4 bytes each)


# ---- routing ------------------------------------------------------------------------------------

def _subsets(n: int, k: int, T: int, g: torch.Generator) -> torch.Tensor:
    """T rows of k distinct experts out of n, uniformly (a random permutation's first k)."""
    return torch.rand(T, n, generator=g).argsort(1)[:, :k]


def spawn_cases() -> list[dict]:
    """Routings of the 4 ranks for each spawned case (E = 8, L = 2): tokens per rank, K, ids per rank."""
    cases = []
    g = torch.Generator().manual_seed(7)
    # random, unequal token counts
    cases.append([_subsets(E_SPAWN, 2, T, g) for T in (64, 50, 64, 37)])
    # expert 3 and rank 2's experts (4, 5) get nothing; rank 1 has no tokens
    allowed = torch.tensor([0, 1, 2, 6, 7])
    cases.append([allowed[_subsets(5, 2, T, g)] for T in (40, 0, 33, 21)])
    # K = E: every token to every expert
    cases.append([_subsets(E_SPAWN, E_SPAWN, T, g) for T in (9, 5, 7, 3)])
    # K = 1, every token to rank 3 (node 1): imbalanced, node 0 receives nothing
    cases.append([6 + _subsets(2, 1, T, g) for T in (20, 11, 15, 8)])
    return cases


def _tensors(ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ids.shape[0], D, generator=g), torch.rand(ids.shape[0], ids.shape[1], generator=g)


# ---- the spawned ranks -----------------------------------------------------------------------------

def _rank_counters(rank: int, world: int) -> list[dict[str, dict[str, int]]]:
    """Every case's counters (`sent` of CommCounters.as_dict) for three dispatch/combine round trips."""
    topo = Topology(world, RPN)
    layout = ParallelLayout(ep=world, topology=topo)
    counters = CommCounters()

    def cg(name: str) -> CommGroup:
        return CommGroup(layout.group(name), topology=topo, counters=counters)

    a2a = AllToAllDispatcher(cg("expert"), E_SPAWN)
    hier = HierarchicalDispatcher(cg("expert_inter"), cg("expert_intra"), E_SPAWN)
    out = []
    for c, ids_per_rank in enumerate(spawn_cases()):
        ids = ids_per_rank[rank]
        x_TD, probs_TK = _tensors(ids, 100 * c + rank)
        rec = {}
        # the layer's path (token level): alltoall.counts, .dispatch, .combine
        counters.reset()
        x_MD, _, meta = a2a.dispatch_tokens(x_TD, ids, probs_TK)
        a2a.combine_tokens(x_MD, meta)
        rec["a2a_tokens"] = counters.as_dict()["sent"]
        # the row level with probs: adds alltoall.probs
        counters.reset()
        order_R = torch.argsort(ids.reshape(-1), stable=True)
        a2a.dispatch(x_TD.index_select(0, order_R // ids.shape[1]), torch.bincount(ids.reshape(-1),
                     minlength=E_SPAWN), probs_TK.reshape(-1).index_select(0, order_R))
        rec["a2a_rows"] = counters.as_dict()["sent"]
        counters.reset()
        x_MD, _, meta = hier.dispatch_tokens(x_TD, ids, probs_TK)
        hier.combine_tokens(x_MD, meta)
        rec["hier"] = counters.as_dict()["sent"]
        out.append(rec)
    return out


def _ops(**by_op: dict[str, int]) -> dict[str, int]:
    """Counter keys "op/link" -> bytes, leaving out zeros (the counters record only bytes that moved)."""
    return {f"{op.replace('_', '.')}/{link}": n for op, d in by_op.items() for link, n in d.items() if n}


def test_exact_bytes_match_dispatcher_counters():
    results = spawn(_rank_counters, WORLD, timeout_s=120)
    P, I, L, A = WORLD, RPN, E_SPAWN // WORLD, WORLD // RPN
    for c, ids_per_rank in enumerate(spawn_cases()):
        K = ids_per_rank[0].shape[1]
        a2a = alltoall_dispatch_bytes(ids_per_rank, E_SPAWN, RPN, ROW_BYTES)
        a2a_back = alltoall_combine_bytes(ids_per_rank, E_SPAWN, RPN, ROW_BYTES)
        hier = hierarchical_dispatch_bytes(ids_per_rank, E_SPAWN, RPN, ROW_BYTES)
        hier_back = hierarchical_combine_bytes(ids_per_rank, E_SPAWN, RPN, ROW_BYTES)
        for r in range(WORLD):
            got = results[r].value[c]
            tag = f"case {c} rank {r}"
            # count exchanges: L int64 to every peer (one per other node across nodes in hierarchical)
            counts = {INTRA: (I - 1) * L * 8, INTER: (P - I) * L * 8}
            assert got["a2a_tokens"] == _ops(alltoall_counts=counts, alltoall_dispatch=a2a[r],
                                             alltoall_combine=a2a_back[r]), tag
            rows = {k: n // ROW_BYTES for k, n in a2a[r].items()}
            assert got["a2a_rows"] == _ops(alltoall_counts=counts, alltoall_dispatch=a2a[r],
                                           alltoall_probs={k: n * 4 for k, n in rows.items()}), tag
            crossings = hier[r][INTER] // ROW_BYTES  # tokens sent across nodes
            assert got["hier"] == _ops(
                hier_inter_counts={INTER: (A - 1) * 8}, hier_inter_dispatch={INTER: hier[r][INTER]},
                hier_inter_ids={INTER: crossings * K * 8}, hier_inter_probs={INTER: crossings * K * 4},
                hier_intra_counts={INTRA: (I - 1) * L * 8}, hier_intra_dispatch={INTRA: hier[r][INTRA]},
                hier_intra_combine={INTRA: hier_back[r][INTRA]},
                hier_inter_combine={INTER: hier_back[r][INTER]}), tag
    # the cases do what they claim: K = E crosses every token to the other node; in case 3 node 1 sends
    # back the tokens of node 0 (20 from rank 0, 11 from rank 1) and node 0 received nothing to return
    k_eq_e = hierarchical_dispatch_bytes(spawn_cases()[2], E_SPAWN, RPN, 1)
    assert [d[INTER] for d in k_eq_e] == [9, 5, 7, 3]
    assert [d[INTER] for d in hierarchical_combine_bytes(spawn_cases()[3], E_SPAWN, RPN, 1)] == [0, 0, 20, 11]


# ---- a per-row loop, for other group shapes ------------------------------------------------------------

def loop_oracle(ids_per_rank: list[torch.Tensor], E: int, rpn: int, rb: int) -> dict[str, list[dict]]:
    """Bytes per rank of each op, by walking every (token, k) row as the dispatchers' docstrings say."""
    P = len(ids_per_rank)
    L, I = E // P, min(rpn, P)
    out = {op: [{INTRA: 0, INTER: 0} for _ in range(P)] for op in ("a2a", "a2a_back", "hier", "hier_back")}

    def link(p: int, q: int) -> str:
        return INTRA if p // I == q // I else INTER

    for p, ids in enumerate(ids_per_rank):
        for token in ids.tolist():
            for e in token:
                q = e // L
                if q != p:
                    out["a2a"][p][link(p, q)] += rb
                    out["a2a_back"][q][link(q, p)] += rb
                relay = (q // I) * I + p % I  # the token's copy on q's node sits at position p % I
                if q != relay:
                    out["hier"][relay][INTRA] += rb
                    out["hier_back"][q][INTRA] += rb
            for a in {e // (L * I) for e in token} - {p // I}:  # once per other node
                out["hier"][p][INTER] += rb
                out["hier_back"][a * I + p % I][INTER] += rb
    return out


group_shapes = st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (4, 8), (8, 2), (8, 4)])


@settings(max_examples=25, deadline=None)
@given(shape=group_shapes, L=st.integers(1, 3), k_frac=st.floats(0, 1), seed=st.integers(0, 2**16))
@example(shape=(4, 2), L=1, k_frac=0.0, seed=0)  # one expert per rank
@example(shape=(4, 2), L=2, k_frac=1.0, seed=1)  # K = E
@example(shape=(4, 4), L=2, k_frac=0.3, seed=2)  # P = I: one node
@example(shape=(4, 1), L=2, k_frac=0.3, seed=3)  # I = 1: every other rank is remote
def test_exact_bytes_match_row_loop(shape, L, k_frac, seed):
    (P, rpn), E = shape, shape[0] * L
    K = 1 + round(k_frac * (E - 1))
    g = torch.Generator().manual_seed(seed)
    T_P = torch.randint(0, 9, (P,), generator=g).tolist()
    ids = [_subsets(E, K, T, g) for T in T_P]
    want = loop_oracle(ids, E, rpn, 5)
    a2a = alltoall_dispatch_bytes(ids, E, rpn, 5)
    hier = hierarchical_dispatch_bytes(ids, E, rpn, 5)
    assert a2a == want["a2a"]
    assert alltoall_combine_bytes(ids, E, rpn, 5) == want["a2a_back"]
    assert hier == want["hier"]
    assert hierarchical_combine_bytes(ids, E, rpn, 5) == want["hier_back"]
    for a, h in zip(a2a, hier):  # a node is crossed to at most once per token: never more than K rows
        assert h[INTER] <= a[INTER]
    if rpn >= P:  # one node: nothing crosses, and both dispatchers move the same rows inside it
        assert all(d[INTER] == 0 for d in a2a + hier) and a2a == hier


# ---- expectations ------------------------------------------------------------------------------------

def _all_subsets(E: int, K: int) -> torch.Tensor:
    return torch.tensor(list(itertools.combinations(range(E), K)), dtype=torch.int64).reshape(-1, K)


@settings(max_examples=25, deadline=None)
@given(shape=group_shapes, L=st.integers(1, 2), k_frac=st.floats(0, 1), seed=st.integers(0, 2**16))
@example(shape=(8, 2), L=1, k_frac=0.2, seed=0)  # one expert per rank
@example(shape=(4, 2), L=2, k_frac=1.0, seed=1)  # K = E: every token on every node
@example(shape=(4, 4), L=2, k_frac=0.5, seed=2)  # P = I: inter bytes 0
@example(shape=(4, 1), L=2, k_frac=0.5, seed=3)  # I = 1: the all-to-all is all inter
@example(shape=(4, 8), L=1, k_frac=0.5, seed=4)  # group smaller than a node
def test_expectations_exact_and_monte_carlo(shape, L, k_frac, seed):
    (P, rpn), E = shape, shape[0] * L
    K = 1 + round(k_frac * (E - 1))
    want_a2a = expected_alltoall_bytes(1, K, E, P, rpn, 1.0)
    want_hier = expected_hierarchical_bytes(1, K, E, P, rpn, 1.0)
    # exact: every rank holds each K-subset once, which is the uniform law itself
    full = _all_subsets(E, K)
    T = full.shape[0]
    for name, got, want in (("a2a", alltoall_dispatch_bytes([full] * P, E, rpn, 1), want_a2a),
                            ("hier", hierarchical_dispatch_bytes([full] * P, E, rpn, 1), want_hier)):
        for d in got:
            for link in (INTRA, INTER):
                assert math.isclose(d[link] / T, want[link], rel_tol=1e-9, abs_tol=1e-12), (name, link, d)
    # Monte-Carlo: each token's rows summed over all ranks' sends lie in [0, K], tokens are independent,
    # so the rank-mean rows per token is within K * sqrt(ln(2/delta) / 2N) of the mean (delta = 1e-6).
    T = 40_000 // P
    g = torch.Generator().manual_seed(seed)
    ids = [_subsets(E, K, T, g) for _ in range(P)]
    tol = K * math.sqrt(math.log(2e6) / (2 * P * T))
    for name, got, want in (("a2a", alltoall_dispatch_bytes(ids, E, rpn, 1), want_a2a),
                            ("hier", hierarchical_dispatch_bytes(ids, E, rpn, 1), want_hier)):
        for link in (INTRA, INTER):
            mean = sum(d[link] for d in got) / (P * T)
            assert abs(mean - want[link]) <= tol, (name, link, mean, want[link], tol)
    # basic relations of the closed forms
    assert want_hier[INTER] <= want_a2a[INTER] + 1e-12
    if rpn >= P:
        assert want_a2a[INTER] == want_hier[INTER] == 0 and math.isclose(want_a2a[INTRA], want_hier[INTRA])
    if rpn == 1:
        assert want_a2a[INTRA] == want_hier[INTRA] == 0


def test_expectation_values_by_hand():
    """E = 8, K = 2 on 2 nodes x 2 ranks, 10 tokens of 4 bytes: numbers worked out on paper."""
    a2a = expected_alltoall_bytes(10, 2, 8, 4, 2, 4.0)
    assert a2a == {INTRA: 10 * 2 * 1 / 4 * 4, INTER: 10 * 2 * 2 / 4 * 4}
    hier = expected_hierarchical_bytes(10, 2, 8, 4, 2, 4.0)
    # a token misses the other node iff both experts are among this node's 4: C(4, 2) / C(8, 2) = 6 / 28
    assert math.isclose(hier[INTER], 10 * (1 - 6 / 28) * 4)
    assert math.isclose(hier[INTRA], 10 * 2 * 1 / 2 * 4)
    # Monte-Carlo at a realistic size, within 2 %
    g = torch.Generator().manual_seed(11)
    E, K, P, rpn, T = 64, 8, 16, 8, 4000
    ids = [_subsets(E, K, T, g) for _ in range(P)]
    for got, want in ((alltoall_dispatch_bytes(ids, E, rpn, 1), expected_alltoall_bytes(T, K, E, P, rpn, 1)),
                      (hierarchical_dispatch_bytes(ids, E, rpn, 1),
                       expected_hierarchical_bytes(T, K, E, P, rpn, 1))):
        for link in (INTRA, INTER):
            assert math.isclose(sum(d[link] for d in got) / P, want[link], rel_tol=0.02), (link, want)


# ---- bad inputs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [expected_alltoall_bytes, expected_hierarchical_bytes])
def test_expected_rejects_bad_shapes(fn):
    with pytest.raises(ValueError, match="multiple of the expert group"):
        fn(10, 2, 6, 4, 2, 1.0)  # E = 6 on P = 4
    with pytest.raises(ValueError, match="whole nodes"):
        fn(10, 2, 12, 6, 4, 1.0)  # P = 6 over nodes of 4
    with pytest.raises(ValueError, match="top_k"):
        fn(10, 9, 8, 4, 2, 1.0)  # K > E
    with pytest.raises(ValueError, match="top_k"):
        fn(10, 0, 8, 4, 2, 1.0)


@pytest.mark.parametrize("fn", [alltoall_dispatch_bytes, alltoall_combine_bytes, hierarchical_dispatch_bytes,
                                hierarchical_combine_bytes])
def test_exact_rejects_bad_inputs(fn):
    ids = [torch.zeros(3, 2, dtype=torch.int64)] * 4
    with pytest.raises(ValueError, match="multiple of the expert group"):
        fn(ids, 6, 2, 1)
    with pytest.raises(ValueError, match="whole nodes"):
        fn(ids[:3], 6, 2, 1)
    with pytest.raises(ValueError, match="top_k"):
        fn([torch.zeros(3, 9, dtype=torch.int64)] * 4, 8, 2, 1)
    with pytest.raises(ValueError, match="expert ids"):
        fn([torch.full((3, 2), 8)] * 4, 8, 2, 1)
    with pytest.raises(ValueError, match="one K"):
        fn(ids[:3] + [torch.zeros(3, 1, dtype=torch.int64)], 8, 2, 1)
    with pytest.raises(ValueError, match="got none"):
        fn([], 8, 2, 1)
