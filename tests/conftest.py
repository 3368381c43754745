"""Hypothesis profiles: `ci` (derandomized, so a CI run is reproducible) when CI is set, else `dev`.

Select one by hand with HYPOTHESIS_PROFILE=dev|ci. Example counts are set per test (`@settings`).
Fixture `no_launch`: for checks that must fail before any rank starts.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if anything starts a process or joins a process group (what `fmoe train` checks
    before launch must fail before either)."""
    def no_spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr("torch.multiprocessing.start_processes", no_spawn)
    monkeypatch.setattr("torch.distributed.init_process_group", no_spawn)
