"""Chain.completed_at: when the last exchange that sent something completed, not when it was waited."""

from __future__ import annotations

import time

import pytest
import torch
from dist_utils import spawn

from fmoe.parallel import CommGroup, LinkModel, all_to_all_async
from fmoe.parallel.phased import Chain


class _Handle:
    """A handle without works: its wait returns at `finish` (a late peer) and not before `not_before`."""

    def __init__(self, finish: float, not_before: float = 0.0):
        self.finish, self.not_before = finish, not_before

    def wait(self) -> None:
        time.sleep(max(0.0, max(self.finish, self.not_before) - time.perf_counter()))


def _slow_rename(result: object) -> tuple[object, list]:
    time.sleep(0.1)  # a trailing step that issues nothing but takes time
    return result, []


def test_a_late_peer_sets_the_completion_and_a_trailing_step_does_not() -> None:
    t0 = time.perf_counter()
    chain = Chain((None, [_Handle(t0 + 0.05, not_before=t0 + 0.01)]), _slow_rename)
    chain.wait()
    assert chain.completed_at - t0 == pytest.approx(0.05, abs=0.03)  # the peer, not the model, nor +0.1


def test_the_link_model_completion_stands_when_it_is_later() -> None:
    t0 = time.perf_counter()
    chain = Chain((None, [_Handle(t0, not_before=t0 + 0.2)]), _slow_rename)
    chain.wait()
    assert chain.completed_at - t0 == pytest.approx(0.2, abs=0.03)  # not + 0.1 of the rename


def test_the_last_exchange_that_sent_something_counts() -> None:
    t0 = time.perf_counter()
    chain = Chain((None, [_Handle(t0 + 0.02)]), lambda r: (r, [_Handle(t0 + 0.08)]), _slow_rename)
    chain.wait()
    assert chain.completed_at - t0 == pytest.approx(0.08, abs=0.03)


def test_nothing_sent_has_no_completion() -> None:
    chain = Chain(({"x": 1}, []), lambda r: (r, []))
    assert chain.wait() == {"x": 1} and chain.completed_at is None


def _hidden_exchange(rank: int, world: int, latency: float) -> tuple[float, float]:
    link = LinkModel(intra_latency_s=latency) if latency else None
    comm = CommGroup(torch.distributed.group.WORLD, link_model=link)
    t0 = time.perf_counter()
    out, h = all_to_all_async(torch.ones(2, 3), comm)
    chain = Chain((out, [h]), lambda r: (r, []))
    time.sleep(0.3)  # compute that hides the exchange
    chain.wait()
    return chain.completed_at - t0, (h.not_before - t0) if latency else 0.0


def _hidden_exchanges(rank: int, world: int, latencies: tuple[float, ...]) -> list[tuple[float, float]]:
    """`_hidden_exchange` at each latency, one after the other on the same ranks."""
    return [_hidden_exchange(rank, world, latency) for latency in latencies]


def test_a_hidden_gloo_exchange_completes_when_its_works_finish_not_at_its_wait() -> None:
    latencies = (0.0, 0.05)
    for r in spawn(_hidden_exchanges, 2, latencies, timeout_s=60):  # one start of the ranks for both
        for completed, modelled in r.value:
            assert completed < 0.2, r.value  # long before the wait at 0.3 s
            assert completed >= modelled, r.value
