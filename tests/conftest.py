"""Hypothesis profiles: `ci` (derandomized, so a CI run is reproducible) when CI is set, else `dev`.

Select one by hand with HYPOTHESIS_PROFILE=dev|ci. Example counts are set per test (`@settings`).
Fixture `no_launch`: for checks that must fail before any rank starts. The `local` cluster is a fixed
stand-in for the whole session (`local_cluster_file`), so no test calibrates this machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from fmoe.calibrate import machine
from fmoe.plan.specs import ClusterSpec, to_toml

# One intra-op thread in the test process, as every spawned rank has (fmoe.parallel.local_ranks): on a
# loaded 2-core machine two OpenMP threads waited on each other, and a one-process training step that
# takes 0.15 s took 2-3 s alone and 20-46 s in the suite.
torch.set_num_threads(1)

settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# A CPU machine as the calibration describes one (fmoe/calibrate/machine.py, measure_machine and fit_host),
# in round numbers: what the tests that plan for `--cluster local` need is a spec, not this machine's.
LOCAL_CLUSTER = ClusterSpec(name="local", devices_per_node=2, peak_flops={"fp32": 1e11}, mem_gib=8.0,
                            intra_bytes_per_s=3e9, inter_bytes_per_s=3e9, intra_latency_s=6e-5,
                            inter_latency_s=6e-5, gemm_eff=1.0, attn_eff=0.2, gemm_half_dim=90,
                            hbm_bytes_per_s=8e9, op_overhead_s=2e-4, comm_overhead_s=1e-4,
                            base_mem_gib=0.0, comm_hides=False)


@pytest.fixture(scope="session", autouse=True)
def local_cluster_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`LOCAL_CLUSTER` written where `--cluster local` reads this machine's calibration
    ($FMOE_LOCAL_CLUSTER), for every test and the processes they start. Without it a fresh machine
    (no ~/.cache/fmoe/local-cluster.toml) calibrates itself on first use: minutes of 16 live ranks,
    and a plan that depends on how loaded the machine was."""
    path = tmp_path_factory.mktemp("cluster") / "local-cluster.toml"
    # the first line names this torch and core count (machine._key): cluster_file keeps the file as it is
    path.write_text(to_toml(LOCAL_CLUSTER, machine._key()))
    def no_calibration() -> ClusterSpec:
        raise AssertionError("a test calibrated this machine (a stale local_cluster_file?)")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FMOE_LOCAL_CLUSTER", str(path))
        mp.setattr(machine, "calibrate", no_calibration)  # cluster_file calls it through the module
        yield path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tells tests/dist_utils.py which test modules run (their shared rank starts run their parts only),
    and gives the tests of modules with a shared part the time of that start: the first test to ask for a
    world size starts the ranks for every module's part (dist_utils.SHARED_TIMEOUT_S bounds a hang)."""
    import dist_utils

    dist_utils.COLLECTED = {item.module.__name__ for item in items if item.module is not None}
    sharing = {module for module, *_ in dist_utils._PARTS.values()}
    for item in items:
        if item.module is not None and item.module.__name__ in sharing:
            item.add_marker(pytest.mark.timeout(dist_utils.SHARED_TIMEOUT_S + 300))


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if anything starts a process or joins a process group (what `fmoe train` checks
    before launch must fail before either)."""
    def no_spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr("torch.multiprocessing.start_processes", no_spawn)
    monkeypatch.setattr("torch.distributed.init_process_group", no_spawn)
