"""Flatten and unflatten for the trees split_vjp sees on every call: dicts, lists, tuples and every node
type torch's pytree knows (registered dataclasses, namedtuples, OrderedDict, torch.Size, ...).

`torch.utils._pytree` is general (key paths, TreeSpec objects that count their leaves as they are built)
and costs tens of microseconds per call in Python; split_vjp flattens five trees per call, one of them a
phase's aux (routing layouts: frozen dataclasses), and a pipeline runs it for every phase of every
microbatch. Here a plain dict / list / tuple is walked directly and any other node through the flatten
and unflatten functions torch's registry holds for its type (`SUPPORTED_NODES`, looked up the way torch
looks it up: every namedtuple under `namedtuple`), so the leaves are always the ones
`torch.utils._pytree.tree_flatten` gives, in the same order (dicts in insertion order, None a leaf), and
`unflatten` rebuilds what torch's `tree_unflatten` rebuilds.

    leaves, spec = flatten(tree)
    tree2 = unflatten(leaves, spec)        # same structure, leaves replaced
    num_leaves(spec), spec == other_spec   # structural equality (node types and contexts, as torch's)
    any_leaf(tree, pred)                   # whether a leaf satisfies pred (no spec built)
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fmoe._compat import SUPPORTED_NODES, TreeSpec, is_namedtuple_class, treespec_leaf

_LEAF = "*"  # a leaf position in a spec
# type -> the key of its node in SUPPORTED_NODES (namedtuple for every namedtuple class), None for a leaf;
# emptied when a registration changes the registry's size (a type registered after it was met as a leaf)
_KINDS: dict[type, Any] = {}
_KINDS_OF: list[int] = [-1]  # len(SUPPORTED_NODES) when _KINDS was filled
_UNSEEN = object()


def _kind(t: type) -> Any:
    """Returns the SUPPORTED_NODES key torch's pytree flattens a `t` by (None: a leaf), and remembers it."""
    kind = _KINDS[t] = namedtuple if is_namedtuple_class(t) else t if t in SUPPORTED_NODES else None
    return kind


def _fresh_kinds() -> None:
    """Forgets the remembered kinds when the registry changed (called once per walk, not per node)."""
    if len(SUPPORTED_NODES) != _KINDS_OF[0]:
        _KINDS.clear()
        _KINDS_OF[0] = len(SUPPORTED_NODES)


def _walk(x: Any, leaves: list) -> Any:
    t = type(x)
    if t is dict:
        head: tuple = (dict, tuple(x))
        children: Any = x.values()
    elif t is list or t is tuple:
        head, children = (t, len(x)), x
    else:
        kind = _KINDS.get(t, _UNSEEN)
        if kind is _UNSEEN:
            kind = _kind(t)
        if kind is None:
            leaves.append(x)
            return _LEAF
        children, context = SUPPORTED_NODES[kind].flatten_fn(x)
        head = (kind, context)
    specs = []
    for c in children:
        if _KINDS.get(type(c), _UNSEEN) is None:  # a leaf of a type met before: taken here, no call
            leaves.append(c)
            specs.append(_LEAF)
        else:
            specs.append(_walk(c, leaves))
    return (*head, tuple(specs))


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """Returns (leaves, spec): the leaves in torch pytree order and a spec for `unflatten`."""
    _fresh_kinds()
    leaves: list[Any] = []
    return leaves, _walk(tree, leaves)


def any_leaf(tree: Any, pred: Callable[[Any], bool]) -> bool:
    """Returns whether a leaf of `tree` (as `flatten` finds them) satisfies `pred`, walking no further than
    the first that does and building no spec."""
    _fresh_kinds()
    return _any(tree, pred)


def _any(x: Any, pred: Callable[[Any], bool]) -> bool:
    t = type(x)
    if t is dict:
        children: Any = x.values()
    elif t is list or t is tuple:
        children = x
    else:
        kind = _KINDS.get(t, _UNSEEN)
        if kind is _UNSEEN:
            kind = _kind(t)
        if kind is None:
            return pred(x)
        children = SUPPORTED_NODES[kind].flatten_fn(x)[0]
    for c in children:  # a loop, not any(generator): no generator frame per node
        if _KINDS.get(type(c), _UNSEEN) is None:  # a leaf of a type met before: asked here, no call
            if pred(c):
                return True
        elif _any(c, pred):
            return True
    return False


def _build(spec: Any, it: Iterator[Any]) -> Any:
    if spec is _LEAF:
        return next(it)
    kind, context, children = spec
    values = [next(it) if c is _LEAF else _build(c, it) for c in children]
    if kind is dict:
        return dict(zip(context, values))
    if kind is list:
        return values
    if kind is tuple:
        return tuple(values)
    return SUPPORTED_NODES[kind].unflatten_fn(values, context)


def unflatten(leaves: Iterable[Any], spec: Any) -> Any:
    """Returns the tree of `spec` with `leaves` in its leaf positions (in order)."""
    return _build(spec, iter(leaves))


def num_leaves(spec: Any) -> int:
    """Returns how many leaves a tree of `spec` holds."""
    if spec is _LEAF:
        return 1
    return sum(num_leaves(c) for c in spec[2])


def torch_spec(spec: Any) -> Any:
    """Returns torch's TreeSpec of the same structure (for key paths in error messages)."""
    if spec is _LEAF:
        return treespec_leaf()
    kind, context, children = spec
    if kind is dict:
        context = list(context)
    elif kind is list or kind is tuple:
        context = None
    return TreeSpec(kind, context, [torch_spec(c) for c in children])
