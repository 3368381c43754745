"""transforms/_flat.py against torch's pytree (the oracle): the same leaves in the same order for any
tree, a round trip that rebuilds the tree, and specs that compare equal exactly when torch's do."""

from __future__ import annotations

import collections

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe._compat import tree_flatten, tree_unflatten
from fmoe.transforms._flat import TorchSpec, flatten, num_leaves, torch_spec, unflatten

Pair = collections.namedtuple("Pair", "a b")

leaves = st.one_of(st.integers(-3, 3), st.none(), st.text(max_size=2),
                   st.integers(0, 3).map(lambda n: torch.arange(float(n))))
keys = st.text(alphabet="abcxyz", min_size=1, max_size=2)


def _containers(children):
    return st.one_of(
        st.lists(children, max_size=3), st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.tuples(children, children).map(lambda t: Pair(*t)),                       # torch-only nodes
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


def test_plain_trees_take_the_fast_walk_and_others_torchs() -> None:
    assert not isinstance(flatten({"a": [torch.ones(1), (None, 2)]})[1], TorchSpec)
    assert isinstance(flatten({"a": Pair(1, 2)})[1], TorchSpec)
