"""Hypothesis profiles: `ci` (derandomized, so a CI run is reproducible) when CI is set, else `dev`.

Select one by hand with HYPOTHESIS_PROFILE=dev|ci. Example counts are set per test (`@settings`).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
