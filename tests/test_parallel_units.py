"""Single-process contracts of fmoe.parallel: row bookkeeping, topology, link model, counters, TP x EP.

Legend: A, B chunk axes, M rows, E experts, N rows.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe._index import exclusive_cumsum
from fmoe.parallel import CommCounters, LinkModel, Topology, experts_per_rank
from fmoe.parallel.mesh import INTER, INTRA
from fmoe.parallel.rows import chunk_transpose_index, expert_ids_of_rows
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


# ---- the CUDA / NPU stream path, against fake streams (no accelerator here) ------------------------

class _FakeEvent:
    def __init__(self, name: str):
        self.name, self.device = name, torch.device("cuda", 0)


class _FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def record_event(self):
        ev = _FakeEvent(f"ev{len(self.log)}@{self.name}")
        self.log.append(("record_event", self.name, ev.name))
        return ev

    def wait_event(self, ev):
        self.log.append(("wait_event", self.name, ev.name))


def _fake_comm(monkeypatch, log: list):
    """A CommGroup of 2 ranks on a fake device with a fake comm stream; the accelerator API is faked."""
    from fmoe.parallel.async_comm import CommStream
    from fmoe.parallel.collectives import CommGroup

    compute = _FakeStream("compute", log)
    current = [compute]
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: current[0])

    def set_stream(s):
        log.append(("set_stream", s.name))
        current[0] = s

    monkeypatch.setattr(torch.accelerator, "set_stream", set_stream)
    cs = object.__new__(CommStream)
    cs.device, cs.stream = torch.device("cuda", 0), _FakeStream("comm", log)
    comm = object.__new__(CommGroup)
    comm.group, comm.topology, comm.counters, comm.link_model, comm.stream = None, None, None, None, cs
    comm.size, comm.rank, comm.global_ranks = 2, 0, [0, 1]
    return comm, current


class _FakeWork:
    def __init__(self, log: list, fail: bool = False):
        self.log, self.fail = log, fail

    def wait(self):
        self.log.append(("work.wait",))
        if self.fail:
            raise RuntimeError("Connection closed by peer")


def test_stream_path_orders_streams_and_keeps_buffers(monkeypatch):
    """Issue: comm waits compute, launch with comm current, event on comm after it, compute restored.
    wait(): works, then current and issuing stream wait on that event, then the buffers are released."""
    log: list = []
    comm, current = _fake_comm(monkeypatch, log)
    x, out = torch.ones(3), torch.empty(3)
    x_ref = weakref.ref(x)

    def launch():
        log.append(("launch", current[0].name))
        return _FakeWork(log)

    h = comm._issue("op", [0, 12], launch, x, out)
    ev = log[3][2]
    assert log == [("wait_stream", "comm", "compute"), ("set_stream", "comm"), ("launch", "comm"),
                   ("record_event", "comm", ev), ("set_stream", "compute")]
    assert current[0].name == "compute"
    del x
    gc.collect()
    assert x_ref() is not None, "the collective's input was freed before wait()"
    log.clear()
    h.wait()
    assert log == [("work.wait",), ("wait_event", "compute", ev), ("wait_event", "compute", ev)]
    gc.collect()
    assert x_ref() is None, "wait() did not release the kept buffers"
    h.wait()  # idempotent
    assert len(log) == 3


def test_stream_path_dropped_handle_orders_before_release(monkeypatch):
    log: list = []
    comm, _ = _fake_comm(monkeypatch, log)
    x = torch.ones(3)
    x_ref = weakref.ref(x)
    h = comm._issue("op", [0, 12], lambda: _FakeWork(log), x)
    (ev,) = [e[2] for e in log if e[0] == "record_event"]
    log.clear()
    del x, h
    gc.collect()
    assert log == [("wait_event", "compute", ev)] and x_ref() is None


def test_stream_path_failure_restores_stream_and_names_collective(monkeypatch):
    from fmoe.parallel import CollectiveError

    log: list = []
    comm, current = _fake_comm(monkeypatch, log)

    def launch():
        raise RuntimeError("Connection reset by peer")

    with pytest.raises(CollectiveError, match=r"collective .op. over ranks \[0, 1\] failed.*Connection"):
        comm._issue("op", [0, 12], launch, torch.ones(3))
    assert current[0].name == "compute"
    h = comm._issue("op2", [0, 12], lambda: _FakeWork(log, fail=True), torch.ones(3))
    for _ in range(2):  # a failed handle fails again at every wait
        with pytest.raises(CollectiveError, match=r"collective 'op2'.*Connection closed by peer"):
            h.wait()
    assert not h.done
