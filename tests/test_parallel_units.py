"""Single-process contracts of fmoe.parallel: row bookkeeping, topology, link model, counters, TP x EP.

Legend: A, B chunk axes, M rows, E experts, N rows.
"""

from __future__ import annotations

import functools
import gc
import weakref
from datetime import timedelta

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe._index import exclusive_cumsum
from fmoe.parallel import CommCounters, LinkModel, Topology, experts_per_rank
from fmoe.parallel.rows import chunk_transpose_index, expert_ids_of_rows
from fmoe.parallel.topology import INTER, INTRA
from fmoe.parallel.tp_extends_ep import local_expert_range

counts_XY = st.integers(1, 4).flatmap(lambda x: st.integers(1, 4).flatmap(
    lambda y: st.lists(st.integers(0, 3), min_size=x * y, max_size=x * y).map(
        lambda xs: torch.tensor(xs).reshape(x, y))))


@settings(max_examples=40, deadline=None)
@given(counts_XY)
@example(torch.zeros(2, 3, dtype=torch.int64))
@example(torch.tensor([[0, 5], [0, 0]]))
def test_chunk_transpose_index_matches_loop(c_XY):
    """Oracle: label every row with its (x, y) chunk and list the labels y-major with a python loop."""
    X, Y = c_XY.shape
    labels = [(x, y) for x in range(X) for y in range(Y) for _ in range(int(c_XY[x, y]))]
    expect = [i for y in range(Y) for x in range(X)
              for i, lab in enumerate(labels) if lab == (x, y)]
    idx = chunk_transpose_index(c_XY)
    assert chunk_transpose_index(c_XY, len(labels)).tolist() == expect  # host total: same index
    assert idx.tolist() == expect
    assert sorted(idx.tolist()) == list(range(len(labels)))  # a permutation: argsort inverts it


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=8))
def test_row_helpers(counts):
    c = torch.tensor(counts)
    assert exclusive_cumsum(c).tolist() == [sum(counts[:i]) for i in range(len(counts))]
    assert exclusive_cumsum(torch.stack([c, c]), dim=1).tolist() == [exclusive_cumsum(c).tolist()] * 2
    expect = [e for e, n in enumerate(counts) for _ in range(n)]
    assert expert_ids_of_rows(c).tolist() == expect
    assert expert_ids_of_rows(c, sum(counts)).tolist() == expect


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


# ---- c10d work handles order the streams (NCCL's rule), against a fake work / stream model ------------

class _Stream:
    """A device stream in the model: `after` holds every op it is ordered after."""

    def __init__(self, name: str):
        self.name, self.after = name, set()


class _NCCL:
    """ProcessGroupNCCL's rule (fmoe/parallel/async_comm.py): a collective runs on the group's internal
    stream, which waits on the current stream at issue; Work.wait() makes the current stream wait on it
    (host not blocked); Work.wait(timeout) also blocks the host until the collective completes."""

    def __init__(self):
        self.current, self.internal = _Stream("compute"), _Stream("nccl")
        self.host_blocked: list[str] = []

    def issue(self, name: str) -> _NcclWork:
        self.internal.after |= self.current.after  # syncStream: sees every write queued before it
        self.internal.after.add(name)
        return _NcclWork(self, name)


class _NcclWork:
    def __init__(self, pg: _NCCL, name: str):
        self.pg, self.name, self.waits = pg, name, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        self.pg.current.after |= self.pg.internal.after  # synchronize(): current waits on the end event
        if timeout is not None:
            self.pg.host_blocked.append(self.name)  # busy-waits the host until the work completes
        return True

    def is_completed(self):
        return False


def _comm(timeout=None):
    from fmoe.parallel.collectives import CommGroup

    comm = object.__new__(CommGroup)
    comm.group, comm.topology, comm.counters, comm.link_model = None, None, None, None
    comm.size, comm.rank, comm.global_ranks = 2, 0, [0, 1]
    comm.timeout = timeout
    return comm


def test_on_a_device_the_work_orders_the_compute_stream_and_the_host_runs_on() -> None:
    """A handle on device tensors (meta stands for CUDA) waits its work with no timeout: the compute stream
    is ordered after the collective (which ran on NCCL's own stream), the host never blocks, and the
    collective's buffers stay alive until then."""
    nccl = _NCCL()
    comm = _comm(timeout=timedelta(seconds=5))
    x, out = torch.empty(3, device="meta"), torch.empty(3, device="meta")
    x_ref = weakref.ref(x)
    h = comm._issue("a2a", [0, 12], lambda: nccl.issue("a2a"), x, out)
    assert "a2a" not in nccl.current.after  # compute queued now may overlap the collective
    del x
    gc.collect()
    assert x_ref() is not None, "the collective's input was freed before wait()"
    h.wait()
    assert "a2a" in nccl.current.after and nccl.host_blocked == []
    gc.collect()
    assert x_ref() is None, "wait() did not release the kept buffers"
    h.wait()  # idempotent


def test_wait_passes_a_timeout_on_cpu_only() -> None:
    """gloo blocks in wait() anyway and the timeout bounds it; NCCL / HCCL would busy-wait the host."""
    works = {}
    for device in ("meta", "cpu"):
        nccl = _NCCL()
        h = _comm(timeout=timedelta(seconds=5))._issue("op", [0, 12], functools.partial(nccl.issue, "op"),
                                                        torch.empty(3, device=device))
        h.wait()
        works[device] = (h._works[0].waits, nccl.host_blocked)
    assert works["meta"] == ([None], [])
    assert works["cpu"] == ([timedelta(seconds=5)], ["op"])


def test_a_dropped_device_handle_orders_the_stream_before_release() -> None:
    nccl = _NCCL()
    x = torch.empty(3, device="meta")
    x_ref = weakref.ref(x)
    h = _comm()._issue("op", [0, 12], lambda: nccl.issue("op"), x)
    work = h._works[0]
    del x, h
    gc.collect()
    assert work.waits == [None] and "op" in nccl.current.after and x_ref() is None


class _FailingWork:
    def wait(self, timeout=None):
        raise RuntimeError("Connection closed by peer")


def test_failed_collectives_name_themselves_at_issue_and_at_every_wait() -> None:
    from fmoe.parallel import CollectiveError

    comm = _comm()

    def launch():
        raise RuntimeError("Connection reset by peer")

    with pytest.raises(CollectiveError, match=r"collective .op. over ranks \[0, 1\] failed.*Connection"):
        comm._issue("op", [0, 12], launch, torch.ones(3))
    h = comm._issue("op2", [0, 12], _FailingWork, torch.ones(3))
    for _ in range(2):  # a failed handle fails again at every wait
        with pytest.raises(CollectiveError, match=r"collective 'op2'.*Connection closed by peer"):
            h.wait()
    assert not h.done
