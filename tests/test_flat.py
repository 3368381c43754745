"""transforms/_flat.py against torch's pytree (the oracle): the same leaves in the same order for any
tree, a round trip that rebuilds the tree, and specs that compare equal exactly when torch's do."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe._compat import tree_flatten, tree_unflatten
from fmoe.transforms._flat import any_leaf, flatten, num_leaves, torch_spec, unflatten
from fmoe.transforms.pytree import pytree_dataclass

Pair = collections.namedtuple("Pair", "a b")


@pytree_dataclass(static=("n",))
@dataclass(frozen=True)
class Node:
    """A registered dataclass with a static field: its value is part of the structure, not a leaf."""

    a: object
    n: int
    b: object = None

leaves = st.one_of(st.integers(-3, 3), st.none(), st.text(max_size=2),
                   st.integers(0, 3).map(lambda n: torch.arange(float(n))))
keys = st.text(alphabet="abcxyz", min_size=1, max_size=2)


def _containers(children):
    return st.one_of(
        st.lists(children, max_size=3), st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.tuples(children, children).map(lambda t: Pair(*t)),                       # registered nodes
        st.tuples(children, st.integers(0, 1), children).map(lambda t: Node(*t)),
        st.dictionaries(keys, children, max_size=2).map(collections.OrderedDict),
        st.lists(st.integers(0, 4), max_size=2).map(torch.Size))


trees = st.recursive(leaves, _containers, max_leaves=12)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@settings(max_examples=200, deadline=None)
@given(tree=trees, other=trees)
@example(tree=None, other=[None])
@example(tree={"a": [1, (2, None)], "b": {}}, other={"b": {}, "a": [1, (2, None)]})
@example(tree=[Pair(1, 2)], other=[(1, 2)])
@example(tree=torch.Size([2, 3]), other=(2, 3))
@example(tree=Node([1], 0, None), other=Node([1], 1, None))
@example(tree={"r": Node(torch.ones(2), 1, {"x": (None,)})}, other={"r": Node(torch.ones(2), 1, {"x": (3,)})})
def test_flatten_matches_torch_pytree(tree, other) -> None:
    got_leaves, spec = flatten(tree)
    want_leaves, want_spec = tree_flatten(tree)
    assert len(got_leaves) == len(want_leaves) == num_leaves(spec)
    assert all(g is w for g, w in zip(got_leaves, want_leaves))
    assert _same(unflatten(got_leaves, spec), tree_unflatten(want_leaves, want_spec))  # torch.Size -> tuple
    assert torch_spec(spec) == want_spec
    marks = list(range(len(got_leaves)))
    assert _same(unflatten(marks, spec), tree_unflatten(marks, want_spec))
    other_spec = flatten(other)[1]
    assert (spec == other_spec) == (want_spec == tree_flatten(other)[1])
    preds = (lambda x: isinstance(x, torch.Tensor), lambda x: x is None, lambda x: type(x) is int and x > 0)
    for pred in preds:
        assert any_leaf(tree, pred) == any(pred(x) for x in want_leaves)


def test_registered_nodes_are_rebuilt_by_their_own_unflatten() -> None:
    tree = {"route": Node(torch.ones(2), 3, [Pair(None, "s")]), "size": torch.Size([4])}
    leaves, spec = flatten(tree)
    assert [type(x) for x in leaves] == [torch.Tensor, type(None), str, int]
    back = unflatten(leaves, spec)
    assert type(back["route"]) is Node and back["route"].n == 3 and type(back["route"].b[0]) is Pair
    other_static = {**tree, "route": Node(torch.ones(2), 2, [Pair(None, "s")])}
    assert back["size"] == (4,) and spec != flatten(other_static)[1]
