"""PEP 562 lazy exports: a package names what it exports and where, and loads a module on first use.

`import fmoe` then costs nothing beyond itself: `import fmoe.schedule` does not load the model, and
nothing imports hypothesis until a testing helper is asked for.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list]]:
    """Returns `(__getattr__, __dir__)` for `package`: attribute `name` is `exports[name]`'s attribute of
    the same name (a module path relative to `package`, for example ".layer"), imported on first access."""

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name], package), name)

    def __dir__() -> list:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
