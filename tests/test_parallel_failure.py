"""When one rank raises, dies or hangs, the other ranks stop with a clear CollectiveError: no hang.

Legend: P ranks, D features. Each scenario is one spawn whose parent kills stragglers at a deadline, so
a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from dist_utils import spawn

from fmoe.parallel import CollectiveError, CommGroup, all_to_all, all_to_all_async, check_peers, fail_fast


def _wait_for(path: str, at_most_s: float) -> None:
    """Returns once `path` exists (a peer wrote it) or `at_most_s` has passed."""
    deadline = time.monotonic() + at_most_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _scenario(rank: int, world: int, how: str, gave_up: str) -> dict:
    """`gave_up`: a path rank 0 writes once its collective has failed (the hang: rank 1 hangs until then)."""
    comm = CommGroup(torch.distributed.group.WORLD)
    all_to_all(torch.ones(world, 2), comm)  # the group works
    t0 = time.perf_counter()
    if rank == 1:
        if how == "raise":
            with fail_fast():
                raise ValueError("deliberate failure on rank 1")
        if how == "die":
            os._exit(3)
        if how == "hang":
            # alive but never reaching the collective: until rank 0 gave up on it (its 5 s barrier), at most
            # 12 s (a rank 0 that waited for rank 1 instead of timing out would report 12 s or more)
            _wait_for(gave_up, 12)
            return {}
    try:
        if how == "hang" and rank == 0:
            check_peers(timeout_s=5)  # names the rank that did not arrive
        elif how == "die":  # through an async handle: wait() raises, and raises again if called again
            _, h = all_to_all_async(torch.ones(world, 2), comm)
            try:
                h.wait()
            except CollectiveError as first:
                try:
                    h.wait()
                except CollectiveError as again:
                    return {"error": str(first), "again": str(again), "done": h.done,
                            "seconds": time.perf_counter() - t0}
                raise AssertionError("a failed handle's second wait() returned") from first
        else:
            all_to_all(torch.ones(world, 2), comm)
    except CollectiveError as e:
        seconds = time.perf_counter() - t0
        if rank == 0:
            open(gave_up, "w").close()
        return {"error": str(e), "seconds": seconds}
    return {"error": None}


def _run(world: int, how: str, pg_timeout_s: float, tmp: Path) -> list:
    results = spawn(_scenario, world, how, str(tmp / "gave_up"), timeout_s=60, pg_timeout_s=pg_timeout_s,
                    check=False)
    for r in results:
        if r.rank == 1:
            continue
        assert r.error is None, f"rank {r.rank} did not stop cleanly:\n{r.error}"
        assert r.value["error"] is not None, f"rank {r.rank}: the collective succeeded without rank 1"
    return results


# A bound, not a benchmark: with a 45 s process-group timeout, peers of a rank that raised (fail_fast) or
# died must stop long before it, i.e. because the connections closed, not because the timeout expired.
PROMPT_S = 20.0


def test_rank_raises_others_stop(tmp_path: Path):
    results = _run(3, "raise", pg_timeout_s=45, tmp=tmp_path)
    assert "deliberate failure on rank 1" in results[1].error
    for r in (results[0], results[2]):
        assert f"rank {r.rank}: collective 'all_to_all' over ranks [0, 1, 2] failed" in r.value["error"]
        assert "peer rank raised, died or timed out" in r.value["error"]
        assert r.value["seconds"] < PROMPT_S, r.value


def test_rank_dies_others_stop(tmp_path: Path):
    results = _run(3, "die", pg_timeout_s=45, tmp=tmp_path)
    assert results[1].exitcode == 3
    for r in (results[0], results[2]):
        assert f"rank {r.rank}: collective 'all_to_all' over ranks [0, 1, 2] failed" in r.value["error"]
        assert "all_to_all" in r.value["again"] and not r.value["done"]
        assert r.value["seconds"] < PROMPT_S, r.value


def test_rank_hangs_others_time_out(tmp_path: Path):
    results = _run(2, "hang", pg_timeout_s=8, tmp=tmp_path)
    err = results[0].value["error"]
    assert "rank 0: collective 'monitored_barrier' over ranks [0, 1] failed" in err, err
    assert "Ranks 1 failed to pass monitoredBarrier" in err, err  # gloo names the missing rank
    # rank 1 hangs until rank 0 gave up, at most 12 s: rank 0 stopped at its 5 s barrier timeout, not when
    # rank 1 woke up
    assert results[0].value["seconds"] < 11.0, results[0].value


LAYOUT_TIMEOUT_S = 3.0
LATE_S = 9.0  # how late the stalled rank joins at most: past the layout's timeout plus slack


def _stalled_subgroup_peer(rank: int, world: int, gave_up: str) -> dict:
    """`gave_up`: a path rank 2 writes once its all-reduce failed (rank 0 stalls until then, at most LATE_S:
    with the layout's timeout not applied, rank 2 would wait for it and report LATE_S or more)."""
    from datetime import timedelta

    from fmoe.parallel import ParallelLayout, Topology

    # the world waits 60 s (spawn's pg_timeout_s), the layout's groups LAYOUT_TIMEOUT_S
    layout = ParallelLayout(pp=2, dp=2, topology=Topology(world, world),
                            timeout=timedelta(seconds=LAYOUT_TIMEOUT_S))
    backend = {n: layout.group(n)._get_backend(torch.device("cpu")) for n in ("pp", "dp", "tp", "expert")}
    timeouts = {n: b.options._timeout.total_seconds() for n, b in backend.items()}
    pp = layout.group("pp")  # ranks {0, 2} and {1, 3}
    if rank == 0:
        _wait_for(gave_up, LATE_S)  # stalled: reaches the collective after its peer gave up
    t0 = time.perf_counter()
    try:
        torch.distributed.all_reduce(torch.ones(2), group=pp)
    except RuntimeError as e:
        seconds = time.perf_counter() - t0
        if rank == 2:
            open(gave_up, "w").close()
        return {"timeouts": timeouts, "error": str(e).splitlines()[0], "seconds": seconds}
    return {"timeouts": timeouts, "error": None, "seconds": time.perf_counter() - t0}


def test_a_stalled_peer_in_a_subgroup_is_reported_within_the_layouts_timeout(tmp_path: Path) -> None:
    """Issue 45, C2: the layout's groups took torch's default timeout (30 min on gloo, 10 on NCCL), not
    --timeout; rank 2 waited for its stalled pp peer until it came."""
    results = spawn(_stalled_subgroup_peer, 4, str(tmp_path / "gave_up"), timeout_s=60, pg_timeout_s=60,
                    check=False)
    by_rank = {r.rank: r.value for r in results}
    for rank in (1, 3):  # their pp group is whole: it works
        assert by_rank[rank]["error"] is None, by_rank[rank]
    for value in by_rank.values():
        if value is not None:
            assert value["timeouts"] == {n: LAYOUT_TIMEOUT_S for n in ("pp", "dp", "tp", "expert")}, value
    waited = by_rank[2]
    assert waited["error"] is not None, f"rank 2's all-reduce waited {waited['seconds']:.1f} s for rank 0"
    assert waited["seconds"] < LAYOUT_TIMEOUT_S + 4, waited
