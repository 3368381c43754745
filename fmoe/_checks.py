"""Argument checks shared by fmoe's configs and constructors.

schedule/ keeps its own (`fmoe.schedule.gen_common.positive`): it never imports the rest of fmoe.
"""

from __future__ import annotations


def positive(name: str, value: float) -> None:
    """Raise ValueError("`name` must be positive, got `value`") unless value > 0; returns None."""
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
