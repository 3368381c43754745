"""Import paths "package.module:attribute" for the model's seams (fmoe/seams.py): loading one, and the
check a config runs on a seam field when it is built. Imports nothing of fmoe, so the configs can use it
below the model modules that the seams' defaults live in.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any


@functools.cache
def load(path: str) -> Callable[..., Any]:
    """Return the callable at import path "package.module:attribute" (dots after the colon reach nested
    attributes); ValueError, one line, when the path is malformed, the import fails or it is not callable."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # any failure of the user's module: one line naming the path
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"cannot load {path!r}: {type(exc).__name__}: {first}") from None
    if not callable(obj):
        raise ValueError(f"{path!r} is a {type(obj).__name__}, not a callable")
    return obj


def check_seam(name: str, value: object) -> None:
    """Raise ValueError (naming the field `name`) unless `value` is None, a callable, or an import path
    that loads a callable (a config checks its seams when built, so a bad path fails before any run)."""
    if value is None or callable(value):
        return
    if not isinstance(value, str):
        raise ValueError(f"{name} must be None, a callable or an import path 'package.module:function', got "
                         f"{value!r}")
    try:
        load(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
