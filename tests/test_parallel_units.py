"""Single-process contracts of fmoe.parallel: row bookkeeping, topology, link model, counters, TP x EP.

Legend: A, B chunk axes, M rows, E experts, N rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.parallel import CommCounters, LinkModel, Topology, experts_per_rank
from fmoe.parallel.mesh import INTER, INTRA
from fmoe.parallel.rows import chunk_transpose_index, exclusive_cumsum, expert_ids_of_rows
from fmoe.parallel.tp_extends_ep import local_expert_range

counts_AB = st.integers(1, 4).flatmap(lambda a: st.integers(1, 4).flatmap(
    lambda b: st.lists(st.integers(0, 3), min_size=a * b, max_size=a * b).map(
        lambda xs: torch.tensor(xs).reshape(a, b))))


@settings(max_examples=40, deadline=None)
@given(counts_AB)
@example(torch.zeros(2, 3, dtype=torch.int64))
@example(torch.tensor([[0, 5], [0, 0]]))
def test_chunk_transpose_index_matches_loop(c_AB):
    """Oracle: label every row with its (a, b) chunk and list the labels b-major with a python loop."""
    A, B = c_AB.shape
    labels = [(a, b) for a in range(A) for b in range(B) for _ in range(int(c_AB[a, b]))]
    expect = [i for b in range(B) for a in range(A)
              for i, lab in enumerate(labels) if lab == (a, b)]
    idx = chunk_transpose_index(c_AB)
    assert idx.tolist() == expect
    assert sorted(idx.tolist()) == list(range(len(labels)))  # a permutation: argsort inverts it


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=8))
def test_row_helpers(counts):
    c = torch.tensor(counts)
    assert exclusive_cumsum(c).tolist() == [sum(counts[:i]) for i in range(len(counts))]
    assert expert_ids_of_rows(c).tolist() == [e for e, n in enumerate(counts) for _ in range(n)]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 15), st.integers(0, 15))
def test_topology_link_class(nodes, per_node, a, b):
    topo = Topology(nodes * per_node, per_node)
    a, b = a % topo.world_size, b % topo.world_size
    assert topo.num_nodes == nodes
    assert topo.link_class(a, b) == (INTRA if a // per_node == b // per_node else INTER)
    assert topo.link_class(a, b) == topo.link_class(b, a)


def test_topology_rejects_uneven_nodes():
    with pytest.raises(ValueError, match="multiple"):
        Topology(6, 4)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10**9), st.integers(0, 10**9))
def test_link_model_duration(intra, inter):
    m = LinkModel(intra_latency_s=1e-5, intra_bytes_per_s=1e11, inter_latency_s=3e-5, inter_bytes_per_s=1e10)
    t = m.duration({INTRA: intra, INTER: inter})
    parts = [1e-5 + intra / 1e11] * (intra > 0) + [3e-5 + inter / 1e10] * (inter > 0)
    assert t == pytest.approx(max(parts, default=0.0))


def test_counters():
    c = CommCounters()
    c.add_sent("a", INTRA, 10)
    c.add_sent("a", INTER, 5)
    c.add_sent("b", INTER, 7)
    c.add_wait("a", 0.5)
    assert c.bytes_by_link() == {INTRA: 10, INTER: 12}
    assert c.as_dict()["sent"] == {"a/inter": 5, "a/intra": 10, "b/inter": 7}
    assert c.total_wait_s() == 0.5
    with pytest.raises(ValueError):
        c.add_sent("a", "pcie", 1)
    c.reset()
    assert c.bytes_by_link() == {INTRA: 0, INTER: 0}


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 64), st.integers(1, 4), st.integers(1, 4))
def test_tp_extends_ep_partition(E, tp, ep):
    if E % (tp * ep):
        with pytest.raises(ValueError, match="divisible"):
            experts_per_rank(E, tp, ep)
        return
    owned = [e for q in range(tp * ep) for e in local_expert_range(E, tp, ep, q)]
    assert owned == list(range(E))  # every expert owned once, whole
