"""pytree_dataclass: a frozen dataclass that torch.func, torch.compile and `tree_map` see into.

    @pytree_dataclass(static=("capacity",))
    @dataclass(frozen=True)
    class Aux:
        loss: torch.Tensor
        capacity: int | None

Fields are children in declaration order (tensors, dicts, lists, other pytrees; None is an empty node),
except the `static` ones: Python ints, bools, strings or tuples of them, kept in the node's context the
way JAX's `static_argnames` / flax's `pytree_node=False` keep them. A transform never sees a static field,
so `vmap` can return the class (its outputs must all be tensors) and `torch.compile` guards on the value
instead of tracing it. Two nodes with different static values have different tree structures.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from fmoe._compat import GetAttrKey, register_pytree_node

T = TypeVar("T")


def pytree_dataclass(cls: type[T] | None = None, *, static: tuple[str, ...] = ()) -> Any:
    """Register dataclass `cls` as a pytree node (children: its non-static fields) and return it.

    Usable bare (`@pytree_dataclass`) or with `static=(field names)`. Raises TypeError when `cls` is not a
    dataclass or a static name is not one of its init fields.
    """
    def register(klass: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(klass):
            raise TypeError(f"pytree_dataclass: {klass.__name__} is not a dataclass "
                            "(put @dataclass below it)")
        names = [f.name for f in dataclasses.fields(klass) if f.init]
        unknown = [s for s in static if s not in names]
        if unknown:
            raise TypeError(f"pytree_dataclass: {klass.__name__} has no init field(s) {unknown}")
        children = tuple(n for n in names if n not in static)
        statics = tuple(n for n in names if n in static)

        def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
            return [getattr(obj, n) for n in children], tuple(getattr(obj, n) for n in statics)

        def unflatten(values: Any, context: tuple[Any, ...]) -> Any:
            fields = dict(zip(children, values, strict=True)) | dict(zip(statics, context, strict=True))
            return klass(**fields)

        def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
            values, context = flatten(obj)
            return [(GetAttrKey(n), v) for n, v in zip(children, values, strict=True)], context

        register_pytree_node(klass, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys,
                             serialized_type_name=f"{klass.__module__}.{klass.__qualname__}")
        return klass

    return register(cls) if cls is not None else register

