"""Argument checks shared by fmoe's configs and constructors.

schedule/ keeps its own (`fmoe.schedule.gen_common.positive`): it never imports the rest of fmoe.

The config checkers return the value in its normal form, so one rule holds for every field:
- `integer`: any integral number (int, numpy integer) that is not a bool -> int; floats (8.0), bools,
  strings are refused.
- `real`: any real number (int, float, numpy floating, Fraction) that is not a bool, finite -> float;
  bools, strings, NaN and infinities are refused. Converting here means a numpy scalar never reaches code
  that assumes a Python number (e.g. `Fraction(repr(x))` in fmoe/capacity.py).
- `flag`: exactly True or False (a Python bool): the string "False" is truthy and numpy's bool_ is not a
  bool, so both are refused rather than guessed.
- `choice`: one of a tuple of options.
- `json_object`: a file that must hold a JSON object (a config.json, a checkpoint's meta.json).
All raise ValueError naming the field (the file).
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any


def positive(name: str, value: float) -> None:
    """Raise ValueError("`name` must be positive, got `value`") unless value > 0; returns None."""
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def integer(name: str, value: object, minimum: int = 1) -> int:
    """Return `value` as an int; ValueError unless it is an integral number (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    out = int(value)
    if out < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return out


def real(name: str, value: object, lower: float, strict: bool) -> float:
    """Return `value` as a float; ValueError unless it is a finite real number (not a bool) that is
    > `lower` (`strict`) or >= `lower`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (out <= lower) if strict else (out < lower):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {lower:g}, got {value!r}")
    return out


def flag(name: str, value: object) -> bool:
    """Return `value`; ValueError unless it is a Python bool (True or False)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def choice(name: str, value: object, options: tuple[object, ...]) -> None:
    """Raise ValueError unless `value` is one of `options`; returns None."""
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")


def json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in file `path`; ValueError naming the file when it is not JSON (where it breaks)
    or holds another value (a list, a number)."""
    import json

    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object ({{...}}), got a {type(value).__name__}")
    return value
