"""Deferral of plain torch ops' weight gradients under split_vjp(engine="autograd", plain_ops="defer").

The fmoe primitives defer their weight gradients through the tape (`tape.py`); a plain op
(`torch.nn.functional.linear`, `layer_norm`, a bias add) knows no tape. This module splits their backward
by walking the autograd graph after the forward, in the spirit of torch.distributed.pipelining's
`stage_backward_input` / `stage_backward_weight`:

- The *input region* I: the graph nodes through which an argument reaches an output. The *parameter
  region* P: the nodes a parameter reaches (walking towards the outputs) before it meets I; only
  parameters (and constants) flow into them.
- A *branch node* N is a node of I with a child in P (`mm(x, w.t())`: the mm, its child the transpose):
  there the weight path leaves the input path. D(N) is the part of P below N's children.
- The dx pass is `torch.autograd.grad` w.r.t. the arguments only; a pre-hook on each deferred branch node
  keeps the cotangents flowing into it. The autograd engine computes only the outputs of a built-in node
  that lead to a requested input, so the mm computes `g @ w` and not `x^T g`.
- The dw pass runs, per deferred branch node, `torch.autograd.grad` from the node (a GradientEdge, its
  kept cotangents) to the parameters in D(N): the node runs again computing only its weight outputs, then
  P below it. Nothing of the input chain runs twice: a path from N's input side to D(N) would have to
  leave I at another branch node N2 with D(N2) meeting D(N).
- An output that only parameters reach (I is empty when no argument is differentiable: a first stage fed
  token ids) is a branch of its own: the dw pass starts from it with the output's cotangent.

Not deferred (their gradients are made in the dx pass, as without plain_ops="defer"):
- parameters below a Python `autograd.Function` node of I (fmoe's primitives, a researcher's Function):
  such a node computes every gradient its forward's `needs_input_grad` asks for, so running it again in
  the dw pass would recompute its dx. fmoe's primitives defer their own weights through the tape there.
- parameters below two branch nodes at once (a tied weight used in two layers, `w` and `w.T` both): the
  dw pass from the later node would run the input chain down to the earlier one.
- all of them when no branch node is a product (mm, addmm, bmm, conv: `_is_product`), only norm scales
  and biases: deferring those would save a reduction and cost a retained graph (below).

Memory: the dx pass retains the graph (`retain_graph=True`, as pipelining's stage_backward_input does)
when a branch node is deferred, since the dw pass runs it again; the input chain's saved tensors then live
until the dw pass instead of being freed as the dx pass passes them.
`deferral_report` (report.py) counts what each pass computes, in FLOPs.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from fmoe.transforms.tape import WeightGradTape, tensors_in


def _is_python(node: Node) -> bool:
    return isinstance(node, BackwardCFunction)


_PRODUCTS = ("mm", "mv", "dot", "conv", "linear", "matmul", "einsum")


def _is_product(node: Node) -> bool:
    """Whether a built-in node's weight gradient is a product (mm, addmm, bmm, conv, ...): what deferring
    is for. A norm scale's or a bias's is a reduction of the cotangent, cheap next to retaining the graph."""
    name = type(node).__name__.lower()
    return any(p in name for p in _PRODUCTS)


def _saved_tensors(node: Node) -> list[torch.Tensor]:
    """The tensors a built-in node saved for its backward (its `_saved_*` attributes), for version checks."""
    found: list[torch.Tensor] = []
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            found += tensors_in(getattr(node, name))
        except RuntimeError:  # already freed
            continue
    return found


def _fresh(grads: Sequence[torch.Tensor | None], read: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Return `grads` with every one that shares memory with a tensor of `read` (a cotangent passed through
    unchanged) or with an earlier one copied: each may then be added into in place."""
    seen = {t.untyped_storage().data_ptr() for t in read}
    out: list[torch.Tensor | None] = []
    for g in grads:
        if g is not None:
            ptr = g.untyped_storage().data_ptr()
            if ptr in seen:
                g = g.clone()
                ptr = g.untyped_storage().data_ptr()
            seen.add(ptr)
        out.append(g)
    return out


class _Branch:
    """One deferred start of the dw pass: a built-in branch node of I (cotangents kept by a pre-hook in the
    dx pass) or an output only parameters reach (its cotangent), and the parameter leaves below it."""

    def __init__(self, leaves: list[int], node: Node | None = None, out_index: int | None = None):
        self.leaves = leaves  # positions in the flat list of leaves
        self.node, self.out_index = node, out_index
        self.root: torch.Tensor | None = None  # the output, for a branch that starts there
        self.tensors: list[torch.Tensor] = []  # the parameter leaves of `leaves`
        self.grads: tuple[torch.Tensor | None, ...] | None = None
        self.result: list[torch.Tensor] | None = None

    def hook(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        self.grads = tuple(grad_outputs)

    def run(self, j: int) -> torch.Tensor:
        """The weight gradient of the branch's j-th leaf; the branch's backward runs once, for all of them."""
        if self.result is None:
            assert self.grads is not None
            starts = [(GradientEdge(self.node, i) if self.node is not None else self.root, g)
                      for i, g in enumerate(self.grads) if g is not None]
            got: Sequence[torch.Tensor | None] = [None] * len(self.tensors)
            if starts:
                cts = [g for _, g in starts]
                with torch.enable_grad():
                    got = _fresh(torch.autograd.grad([s for s, _ in starts], self.tensors, cts,
                                                     allow_unused=True), cts)
            self.result = [torch.zeros_like(t) if g is None else g for g, t in zip(got, self.tensors)]
            self.node = self.grads = self.root = None
        return self.result[j]


class PlainSplit:
    """The graph analysis of one forward: which parameter leaves the dx pass must differentiate (`eager`)
    and which branches the dw pass runs later (`branches`)."""

    def __init__(self, outs: list[torch.Tensor], leaves: list[torch.Tensor], is_param: list[bool]):
        acc: dict[Node, int] = {}
        for i, leaf in enumerate(leaves):
            acc[get_gradient_edge(leaf).node] = i
        roots: list[tuple[int, Node]] = [(k, get_gradient_edge(o).node) for k, o in enumerate(outs)]
        # reverse edges (child -> parents) of the whole graph below the outputs
        parents: dict[Node, list[Node]] = collections.defaultdict(list)
        seen: set[Node] = set()
        seen.update(n for _, n in roots)
        queue = collections.deque(seen)
        while queue:
            node = queue.popleft()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                parents[child].append(node)
                if child not in seen:
                    seen.add(child)
                    queue.append(child)
        # I: what the differentiable arguments reach
        region_i: set[Node] = set()
        queue.extend(n for n, i in acc.items() if not is_param[i] and n in seen)
        region_i.update(queue)
        while queue:
            for p in parents[queue.popleft()]:
                if p not in region_i:
                    region_i.add(p)
                    queue.append(p)
        # P: what the parameters reach before I; branch nodes: the nodes of I they meet
        region_p: set[Node] = set()
        branch_nodes: dict[Node, None] = {}
        queue.extend(n for n, i in acc.items() if is_param[i] and n in seen)
        region_p.update(queue)
        while queue:
            for p in parents[queue.popleft()]:
                if p in region_i:
                    branch_nodes[p] = None
                elif p not in region_p:
                    region_p.add(p)
                    queue.append(p)

        def below(starts: list[Node]) -> set[Node]:
            d: set[Node] = set(starts)
            q = collections.deque(starts)
            while q:
                for child, _ in q.popleft().next_functions:
                    if child is not None and child in region_p and child not in d:
                        d.add(child)
                        q.append(child)
            return d

        # every start of a weight path: (its part of P, a branch node or an output index)
        starts: list[tuple[set[Node], Node | None, int | None]] = []
        for node in branch_nodes:
            starts.append((below([c for c, _ in node.next_functions if c is not None and c in region_p]),
                           node, None))
        for k, root in roots:
            if root in region_p:
                starts.append((below([root]), None, k))
        owners: dict[Node, int] = collections.Counter()
        for d, _, _ in starts:
            for n in d:
                owners[n] += 1
        self.eager: list[int] = []  # parameter leaves the dx pass differentiates
        self.branches: list[_Branch] = []
        for d, node, k in starts:
            mine = sorted(acc[n] for n in d if n in acc)
            if not mine:
                continue
            shared = any(owners[n] > 1 for n in d)
            if shared or (node is not None and _is_python(node)):
                self.eager.extend(mine)
            else:
                self.branches.append(_Branch(mine, node, k))
        if not any(b.node is not None and _is_product(b.node) for b in self.branches):
            # no product to defer: the cheap branches (norm scales, biases) stay in the dx pass, which then
            # need not retain the graph (the branches that start at an output need no graph kept)
            self.eager.extend(i for b in self.branches if b.node is not None for i in b.leaves)
            self.branches = [b for b in self.branches if b.node is None]
        eager = set(self.eager)
        self.eager = sorted(eager)
        assert not eager.intersection(i for b in self.branches for i in b.leaves)

    def deferred_leaves(self) -> list[int]:
        return sorted(i for b in self.branches for i in b.leaves)


def split_backward(outs: list[torch.Tensor], cts: list[torch.Tensor], leaves: list[torch.Tensor],
                   is_param: list[bool], tape: WeightGradTape) -> list[torch.Tensor | None]:
    """The dx pass of plain_ops="defer": returns one gradient or None per leaf.

    Arguments and the parameters that cannot be deferred get their gradients; the deferred parameters
    get None, their weight gradients recorded on `tape` (which must defer them: split_vjp's tape is built
    on the parameter leaves), each entry reading its branch's kept cotangents and the branch node's saved
    tensors, whose version counters the tape checks before it runs.
    """
    split = PlainSplit(outs, leaves, is_param)
    asked = [i for i, p in enumerate(is_param) if not p] + split.eager
    handles = []
    for b in split.branches:
        b.tensors = [leaves[i] for i in b.leaves]
        if b.node is not None:
            handles.append(b.node.register_prehook(b.hook))
        else:
            b.root, b.grads = outs[b.out_index], (cts[b.out_index],)
    retain = any(b.node is not None for b in split.branches)  # the dw pass runs the branch nodes again
    try:
        got = torch.autograd.grad(outs, [leaves[i] for i in asked], cts, allow_unused=True,
                                  retain_graph=retain) if asked else ()
    finally:
        for h in handles:
            h.remove()
    grads: list[torch.Tensor | None] = [None] * len(leaves)
    for i, g in zip(asked, got):
        grads[i] = g
    for b in split.branches:
        if b.grads is None:  # the dx pass never ran the node (no cotangent reaches it)
            b.grads = ()
        reads = [g for g in b.grads if g is not None]
        if b.node is not None:
            reads += _saved_tensors(b.node)
        for j, t in enumerate(b.tensors):
            tape.record(t, (lambda b=b, j=j: b.run(j)), reads)
    return grads
