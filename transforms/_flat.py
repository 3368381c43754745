"""Flatten and unflatten for the trees split_vjp sees on every call: plain dicts, lists and tuples.

`torch.utils._pytree` is general (registered node types, namedtuples, key paths) and costs tens of
microseconds per call in Python; split_vjp flattens five trees per call and a pipeline runs it for
every phase of every microbatch. Here a plain dict / list / tuple is walked directly; a tree holding any
other container torch's pytree knows (a namedtuple, an OrderedDict, torch.Size, a registered dataclass,
a subclass of the three) is flattened by torch's pytree instead, so the leaves are always the ones
`torch.utils._pytree.tree_flatten` gives, in the same order (dicts in insertion order, None a leaf).

    leaves, spec = flatten(tree)
    tree2 = unflatten(leaves, spec)        # same structure, leaves replaced
    num_leaves(spec), spec == other_spec   # structural equality
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils._pytree import SUPPORTED_NODES

from fmoe._compat import tree_flatten, tree_unflatten

_LEAF = "*"  # a leaf position in a spec
_CONTAINERS = (dict, list, tuple)


class _Fallback(Exception):
    """The tree holds a container only torch's pytree knows how to walk."""


class TorchSpec:
    """A spec from torch's pytree, for a tree the fast walk handed over (compares like TreeSpec)."""

    __slots__ = ("spec",)

    def __init__(self, spec: Any):
        self.spec = spec

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchSpec) and self.spec == other.spec

    def __hash__(self) -> int:
        return hash(str(self.spec))


def _walk(x: Any, leaves: list) -> Any:
    t = type(x)
    if t is dict:
        return (dict, tuple(x), tuple([_walk(v, leaves) for v in x.values()]))
    if t is list or t is tuple:
        return (t, len(x), tuple([_walk(v, leaves) for v in x]))
    if t in SUPPORTED_NODES or isinstance(x, _CONTAINERS):
        raise _Fallback
    leaves.append(x)
    return _LEAF


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """Returns (leaves, spec): the leaves in torch pytree order and a spec for `unflatten`."""
    leaves: list[Any] = []
    try:
        return leaves, _walk(tree, leaves)
    except _Fallback:
        leaves, spec = tree_flatten(tree)
        return leaves, TorchSpec(spec)


def _build(spec: Any, it: Iterator[Any]) -> Any:
    if spec is _LEAF:
        return next(it)
    kind, keys, children = spec
    if kind is dict:
        return dict(zip(keys, [_build(c, it) for c in children]))
    values = [_build(c, it) for c in children]
    return values if kind is list else tuple(values)


def unflatten(leaves: Iterable[Any], spec: Any) -> Any:
    """Returns the tree of `spec` with `leaves` in its leaf positions (in order)."""
    if isinstance(spec, TorchSpec):
        return tree_unflatten(list(leaves), spec.spec)
    return _build(spec, iter(leaves))


def num_leaves(spec: Any) -> int:
    """Returns how many leaves a tree of `spec` holds."""
    if isinstance(spec, TorchSpec):
        return spec.spec.num_leaves
    if spec is _LEAF:
        return 1
    return sum(num_leaves(c) for c in spec[2])


def torch_spec(spec: Any) -> Any:
    """Returns torch's TreeSpec of the same structure (for key paths in error messages)."""
    if isinstance(spec, TorchSpec):
        return spec.spec
    return tree_flatten(unflatten(range(num_leaves(spec)), spec))[1]
