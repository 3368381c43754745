"""split_vjp: a vjp whose backward runs in two calls, dx now and dw later, with no recompute.

    out, vjp_dx = split_vjp(f, params, *args)
    dargs, vjp_dw = vjp_dx(cotangent)      # input grads; weight grads of primitives are deferred
    dparams = vjp_dw()                     # weight grads, with the pytree structure of params

Built on `torch.func.vjp` (engine "func") or tape autograd (engine "autograd"). During `vjp_dx` a
`WeightGradTape` over the parameter leaves is active: weight-bearing primitives (`fmoe.ops.linear`,
`grouped_linear`, ...) return dx only and record their weight-grad thunks there. Parameters that no such
primitive consumes as the leaf itself (plain torch ops: `F.linear`, norm scales, biases; an fmoe primitive
given a view such as `w.T`) get their gradients in the dx pass by default (`plain_ops="dx"`); `vjp_dw`
returns them together with the deferred ones. With engine "autograd", `plain_ops="defer"` defers the plain
ops' weight gradients too, by walking the autograd graph (transforms/_plain_defer.py: the dx pass keeps the
cotangents where a weight path branches off, the dw pass runs from there; no recompute; what stays in the
dx pass is listed there). `deferral_report` (transforms/report.py) counts in FLOPs what each pass computes
and what was not deferred, per parameter leaf. Unused leaves get zeros; a weight used twice accumulates.
Every returned gradient is a real tensor (no stride-0 expanded one), safe to accumulate into in place.

What is checked, so that deferred work never trusts what it captured without asking:
- A tensor that a deferred thunk reads (an input, a param, the cotangent, an activation) modified in
  place between `vjp_dx` and `vjp_dw` (a reused receive buffer): `vjp_dw` raises `CaptureModifiedError`
  naming it (`argument 0`, `params['w']`, `the cotangent['y']`), from version counters, no copies.
- The cotangent's structure, shapes and dtypes against the output, before `vjp_dx` is used up: a
  mismatch raises ValueError naming the leaf, and `vjp_dx` can be called again with the right one.
- One tensor under several keys (tied weights): each key gets its own gradient, as `torch.func.vjp`
  gives it (the tape tells the keys apart by giving each repeat its own alias, a view: no copy).
- `torch.func.vmap`: refused (RuntimeError), since the deferred thunks run outside it and would give
  every sample the whole batch's weight gradient.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, overload

import torch

from fmoe._compat import (
    keystr,
    tensor_version,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
    under_vmap,
)
from fmoe.transforms._flat import any_leaf, flatten, num_leaves, torch_spec, unflatten
from fmoe.transforms._plain_defer import split_backward
from fmoe.transforms.tape import CaptureModifiedError, WeightGradTape, active_tape, recording, unwrapped

VMAP_MESSAGE = (
    "split_vjp does not support torch.func.vmap: its deferred weight gradients run outside the vmap, so "
    "every sample would get the whole batch's weight gradient. Call split_vjp outside vmap on the batched "
    "tensors (weight gradients summed over the batch), or use torch.func.vjp inside vmap for per-sample "
    "gradients."
)


def _split_tensors(tree: Any, found: list[torch.Tensor]) -> Any:
    """Replace every tensor in `tree` (dicts, lists, tuples, dataclasses) by its index in `found`."""
    if isinstance(tree, torch.Tensor):
        found.append(tree)
        return _Slot(len(found) - 1)
    if isinstance(tree, dict):
        return {k: _split_tensors(v, found) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_split_tensors(v, found) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {f.name: _split_tensors(getattr(tree, f.name), found) for f in dataclasses.fields(tree)}
        return dataclasses.replace(tree, **changes) if _has_init_fields(tree) else tree
    return tree


def _has_init_fields(obj: Any) -> bool:
    return all(f.init for f in dataclasses.fields(obj))


def _fill_tensors(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of `_split_tensors`."""
    if isinstance(tree, _Slot):
        return tensors[tree.index]
    if isinstance(tree, dict):
        return {k: _fill_tensors(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_fill_tensors(v, tensors) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type) and _has_init_fields(tree):
        return dataclasses.replace(
            tree, **{f.name: _fill_tensors(getattr(tree, f.name), tensors) for f in dataclasses.fields(tree)}
        )
    return tree


@dataclasses.dataclass(frozen=True)
class _Slot:
    index: int


def _is_diff(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


def _distinct(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Return `tensors` with every repeat of an object replaced by its own alias (a view, no copy).

    The tape tells weights apart by object identity; a tensor under two keys (tied weights) would
    otherwise give one key both keys' deferred gradients and the other none.
    """
    if len({id(t) for t in tensors}) == len(tensors):  # the usual case: no repeat, nothing to alias
        return list(tensors)
    seen: set[int] = set()
    out = list(tensors)
    for k, t in enumerate(out):
        if id(t) in seen:
            out[k] = t.view_as(t)
        else:
            seen.add(id(t))
    return out


def _zeros(meta: tuple[torch.Size, torch.dtype, torch.device]) -> torch.Tensor:
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


def _accumulators(into: Any, p_spec: Any, diff_pos: list[int], n_param_leaves: int,
                  leaf_meta: list[tuple], supported: bool, who: str = "vjp_dx") -> list[torch.Tensor | None]:
    """Returns `who`'s (vjp_dx's or vjp_dw's) `into` as one sum or None per differentiable leaf (None for
    the arguments); raises ValueError unless `supported` and `into` matches params."""
    if not supported:
        raise ValueError("vjp_dx(into=...) needs split_vjp(engine='autograd', defer=False) and "
                         "vjp_dw(into=...) needs split_vjp(defer=True): in the other modes that pass does "
                         "not make the weight gradients")
    i_leaves, i_spec = flatten(into)
    if i_spec != p_spec:
        raise ValueError(f"{who}(into=...): `into` must have the structure of params (None where there is "
                         "no sum yet)")
    acc: list[torch.Tensor | None] = [None] * len(diff_pos)  # the arguments' stay None
    for k, i in enumerate(diff_pos):
        if i >= n_param_leaves:  # diff_pos is sorted: the params' come first
            break
        t = acc[k] = i_leaves[i]
        if t is not None:
            shape, dtype, device = leaf_meta[k]
            if not (isinstance(t, torch.Tensor) and t.shape == shape and t.dtype == dtype
                    and t.device == device):
                got = (tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{who}(into=...): params leaf {i} is {tuple(shape)} {dtype} on {device}, "
                                 f"its sum is {got}")
    return acc


def _writable(g: Any) -> Any:
    """Return `g`, materialised when it is an expanded tensor (stride 0 along a dim of size > 1).

    torch.func.vjp can hand back expanded gradients (the backward of a sum, the tape's zero placeholder);
    a caller that accumulates into a gradient in place needs one element per memory location.
    """
    if not isinstance(g, torch.Tensor) or g.is_contiguous():  # most are: one call, not a walk of strides
        return g
    return g.contiguous() if any(st == 0 and n > 1 for st, n in zip(g.stride(), g.shape)) else g


def _paths(spec: Any) -> list[tuple[Any, ...]] | None:
    """Return the key path of every leaf of `spec`, in flattening order, or None when a node of it has no
    key paths (a custom pytree node registered without them). For error messages only."""
    try:
        ts = torch_spec(spec)
        return [p for p, _ in tree_flatten_with_path(tree_unflatten(list(range(ts.num_leaves)), ts))[0]]
    except Exception:  # the message falls back to leaf numbers; never mask the error being reported
        return None


def _describe_leaf(x: Any) -> str:
    """Return `x` in words for an error message: its dtype and shape, or its type."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return "None" if x is None else f"a {type(x).__name__}"


class _Kind:
    """A leaf of a structure sketch in an error message: prints as its kind (`Tensor`, `int`, ...)."""

    def __init__(self, x: Any):
        self.name = "Tensor" if isinstance(x, torch.Tensor) else type(x).__name__

    def __repr__(self) -> str:
        return self.name


def _check_cotangent(cotangent: Any, out_spec: Any, out_meta: Sequence[tuple[torch.Size, torch.dtype]]
                     ) -> list[torch.Tensor]:
    """Return the cotangent's leaves; raise ValueError naming the first leaf whose structure, shape or
    dtype differs from the output's (torch.func.vjp would fail only after vjp_dx was used up, or cast)."""
    leaves, spec = flatten(cotangent)
    if spec != out_spec:
        expected = unflatten([_Kind(torch.empty(()))] * num_leaves(out_spec), out_spec)
        got = unflatten([_Kind(x) for x in leaves], spec)
        raise ValueError(
            "split_vjp: vjp_dx: the cotangent must have the structure of the output: expected "
            f"{expected!r}, got {got!r} "
            "(vjp_dx was not used up: call it again with a matching cotangent)")
    for k, (c, (shape, dtype)) in enumerate(zip(leaves, out_meta)):
        if not isinstance(c, torch.Tensor) or c.shape != shape or c.dtype != dtype:
            paths = _paths(out_spec)
            path = keystr(paths[k]) if paths is not None else f" (leaf {k})"
            raise ValueError(
                f"split_vjp: vjp_dx: the cotangent{path} is {_describe_leaf(c)}, but the output{path} is a "
                f"{dtype} tensor of shape {tuple(shape)} (vjp_dx was not used up: call it again with a "
                "matching cotangent)")
    return leaves


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Return the address of `t`'s storage (shared by its views and detaches), or None if it has none."""
    try:
        ptr = unwrapped(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


def _modified_message(err: CaptureModifiedError, candidates: Sequence[tuple[str, torch.Tensor | None]],
                      weight: str) -> str:
    """Return split_vjp's message for `err`: which input (of `candidates`, label and tensor) was modified
    in place (the one sharing the captured tensor's storage, preferring one at its current version)."""
    ptr = _storage_ptr(err.tensor)
    same = [(label, t) for label, t in candidates if t is not None and ptr is not None
            and _storage_ptr(t) == ptr]
    exact = [label for label, t in same if tensor_version(t) == err.current]
    who = exact[0] if exact else same[0][0] if same else (
        f"a tensor of shape {tuple(err.tensor.shape)} (no input or cotangent of this split_vjp shares its "
        "memory; an activation the function kept?)")
    return (f"split_vjp: {who} was modified in place after vjp_dx (version {err.recorded} -> {err.current}), "
            f"but the deferred weight gradient of {weight} reads it and would silently use the new contents. "
            "Call vjp_dw before writing to it, or hand split_vjp / vjp_dx a tensor nobody writes to (a "
            "copy of a reused buffer).")


class _Once:
    """Guards a pass that may run only once, in order."""

    def __init__(self, name: str):
        self.name = name
        self.done = False

    def claim(self) -> None:
        if self.done:
            raise RuntimeError(f"{self.name} was already called: each split_vjp backward pass runs once")
        self.done = True


class DwFn(Protocol):
    """The weight-grad pass `vjp_dw() -> dparams` returned by a `DxFn`.

    `dparams` has the pytree structure of `params` (one gradient per float leaf, zeros for unused ones,
    None for non-float leaves), every gradient a real (not expanded) tensor. Callable once; afterwards
    neither activations nor tape entries are held. Raises `CaptureModifiedError`, naming the tensor and the
    weight, when a tensor a deferred weight gradient reads was modified in place after `vjp_dx` (and
    again on every call: it is not used up by the refusal).

    `into` (defer=True only): a pytree like `params` holding, per leaf, a gradient sum to add this pass's
    gradient into, or None (a sum for a non-float leaf, which has no gradient, is ignored: None comes
    back). A given sum comes back as itself, the gradient added in place: the deferred
    products add straight into it where the primitive can (a GEMM with beta = 1, a scatter-add), so no
    gradient tensor is made and no pass adds it. For a None, a fresh gradient nothing else holds, which
    the caller may keep as its sum. Raises ValueError when the structure differs from `params` or a
    sum's shape, dtype or device differs from its leaf's (the pass is not used up).
    """

    def __call__(self, *, into: Any = None) -> Any: ...


class DxFn(Protocol):
    """The input-grad pass `vjp_dx(cotangent) -> (dargs, vjp_dw)` returned by `split_vjp`.

    `cotangent` has the structure of `out`; `dargs` is a tuple with one gradient pytree per positional
    arg of f after params (None for non-float leaves); `vjp_dw` is the deferred weight-grad pass. Callable
    once. A cotangent whose structure, a shape or a dtype differs from `out`'s raises ValueError naming the
    leaf, and does not use the pass up; under `torch.func.vmap` it raises RuntimeError.

    `into` (engine "autograd" with defer=False only): a pytree like `params` holding, per leaf, a
    gradient sum to add this pass's gradient into, or None. The pass then accumulates the parameter
    gradients as autograd's AccumulateGrad does, each as soon as the backward produces it (while it is in
    cache): in place into a given sum, which `vjp_dw` returns (the same tensor); for a None, the fresh
    gradient itself, which nothing else holds (AccumulateGrad keeps it only then, else a copy), so the
    caller may keep it as its sum and add into it. Raises ValueError when the structure differs from
    `params` or a sum's shape, dtype or device differs from its leaf's.
    """

    def __call__(self, cotangent: Any, /, *, into: Any = None) -> tuple[tuple[Any, ...], DwFn]: ...


ENGINES = ("func", "autograd")
PLAIN_OPS = ("dx", "defer")
PlainOps = Literal["dx", "defer"]


@overload
def split_vjp(f: Callable[..., Any], params: Any, *args: Any,
              has_aux: Literal[False] = False, engine: str = "func",
              defer: bool = True, plain_ops: PlainOps = "dx") -> tuple[Any, DxFn]: ...


@overload
def split_vjp(f: Callable[..., Any], params: Any, *args: Any,
              has_aux: Literal[True], engine: str = "func", defer: bool = True,
              plain_ops: PlainOps = "dx") -> tuple[Any, DxFn, Any]: ...


def _output_and_aux(res: Any) -> tuple[Any, Any]:
    """`res` of a has_aux function as (out, aux); TypeError naming the mistake unless it is a pair (a tensor
    of two rows used to unpack silently into out = row 0, aux = row 1)."""
    if not (isinstance(res, (tuple, list)) and len(res) == 2):
        got = type(res).__name__ + (f" of {len(res)}" if isinstance(res, (tuple, list)) else "")
        raise TypeError(f"split_vjp(has_aux=True): f must return (output, aux), got a {got}; drop has_aux "
                        "for a function without aux")
    return res[0], res[1]


def _autograd_vjp(flat_f: Callable[..., Any], xs: list[torch.Tensor], has_aux: bool, is_param: list[bool]
                  ) -> tuple[Any, Callable[..., tuple], Any, list[torch.Tensor], tuple[list, Any]]:
    """Returns (out, vjp_fn, aux, leaves, (out's leaves, out's spec)): the torch.func.vjp contract on tape
    autograd. f runs once on `leaves`, fresh leaves that alias `xs` (detached views, no copy), with grad
    enabled; vjp_fn(ct_leaves) (the cotangent flattened like out) is torch.autograd.grad to them (None for
    a leaf the output does not depend on), the graph freed as the backward passes it. `out` (and aux)
    come back detached: the graph stays inside vjp_fn."""
    leaves = [x.detach().requires_grad_() for x in xs]
    with torch.enable_grad():
        res = flat_f(*leaves)
    out_g, aux = _output_and_aux(res) if has_aux else (res, None)
    out_leaves, out_spec = flatten(out_g)
    differentiable = [k for k, o in enumerate(out_leaves) if isinstance(o, torch.Tensor) and o.requires_grad]
    graph = {"outs": [out_leaves[k] for k in differentiable], "leaves": leaves}

    def vjp_fn(ct_leaves: list[torch.Tensor], retain_graph: bool = False,
               into: list[torch.Tensor | None] | None = None, tape: WeightGradTape | None = None) -> tuple:
        outs, ins = graph.pop("outs"), graph.pop("leaves")
        if not outs:
            return tuple(into) if into is not None else tuple(None for _ in ins)
        cts = [ct_leaves[k] for k in differentiable]
        if tape is not None:  # plain_ops="defer": the weight paths of plain ops wait on the tape
            return tuple(split_backward(outs, cts, ins, is_param, tape))
        if into is None:
            return torch.autograd.grad(outs, ins, cts, retain_graph=retain_graph, allow_unused=True)
        # AccumulateGrad into the leaves: in place where a sum is given, else the fresh gradient kept
        for leaf, acc in zip(ins, into):
            leaf.grad = acc
        torch.autograd.backward(outs, cts, retain_graph=retain_graph, inputs=ins)
        grads = tuple(leaf.grad for leaf in ins)
        for leaf in ins:
            leaf.grad = None
        return grads

    detach = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
    out = unflatten(detach, out_spec)
    return out, vjp_fn, _detached(aux) if has_aux else None, leaves, (detach, out_spec)


def _requires_grad(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def _detached(tree: Any) -> Any:
    """Returns pytree `tree` with its tensors detached: rebuilt when one of them requires grad (a view taken
    under no_grad of one that does requires grad too), else `tree` itself (an aux of routing layouts and
    loads, made under grad but holding no graph: its nodes, frozen dataclasses, would be rebuilt for
    nothing)."""
    if not any_leaf(tree, _requires_grad):
        return tree
    leaves, spec = flatten(tree)
    return unflatten([a.detach() if isinstance(a, torch.Tensor) else a for a in leaves], spec)


def _warn_left_in_dx(tape: WeightGradTape, dx_param_grads: list[Any], param_pos: list[int],
                     p_spec: Any) -> None:
    """Warns (once per call site: Python's default filter) naming the weight leaves (2-D and up) whose
    gradient the dx pass computed although a tape deferred: they were read by plain torch ops
    (`F.linear`, `x @ w`), which know no tape. Norm scales and biases are cheap to leave there and are not
    named. A leaf the function never read gets zeros from torch.func.vjp (engine "func"), which cannot be
    told apart without reading them (a host sync in the dx pass): it is named too, and the message says so.
    fmoe's own blocks read every weight through fmoe.ops, so they never warn."""
    left = [i for g, i in zip(dx_param_grads, param_pos)
            if isinstance(g, torch.Tensor) and g.dim() >= 2 and not tape.is_placeholder(g)]
    if not left:
        return
    paths = _paths(p_spec)
    names = [f"params{keystr(paths[i])}" if paths is not None else f"params leaf {i}" for i in left]
    warnings.warn(f"split_vjp: the dx pass computed the weight gradients of {', '.join(names)} (plain torch "
                  "ops know no tape); pass engine='autograd', plain_ops='defer' to defer them too, or read "
                  "them through fmoe.ops (linear, grouped_linear); a leaf f never reads is named as well "
                  "(torch.func gives it zeros)", UserWarning, stacklevel=3)


def split_vjp(
    f: Callable[..., Any], params: Any, *args: Any, has_aux: bool = False, engine: str = "func",
    defer: bool = True, plain_ops: PlainOps = "dx",
) -> tuple[Any, DxFn] | tuple[Any, DxFn, Any]:
    """Run `f(params, *args)` and return `(out, vjp_dx)` (or `(out, vjp_dx, aux)` with has_aux).

    With has_aux, f returns `(out, aux)`; aux may be any pytree (ints, dataclasses) and comes back
    unwrapped; under engine "autograd" an aux with no tensor that requires grad comes back as f returned
    it (the same objects), any other rebuilt with its tensors detached. `vjp_dx: DxFn` maps a cotangent of
    `out` to `(dargs, vjp_dw)`; `vjp_dw: DwFn` returns `dparams` with the structure of `params`. Each may
    be called once; `vjp_dw` exists only after `vjp_dx`, so the order is enforced by construction. After
    `vjp_dw` returns, neither activations nor tape entries are held; the inputs are not held by `vjp_dw`
    (only what its thunks read). A tensor under several keys gets one gradient per key, as with
    `torch.func.vjp`. Raises RuntimeError under `torch.func.vmap` (see `VMAP_MESSAGE`).

    `engine`: "func" runs f under `torch.func.vjp`; "autograd" runs it once on tape autograd (fresh
    leaves, `torch.autograd.grad` for dx): the same contract and gradients, less per-op overhead, and the
    forward's activations freed as the dx pass passes them. Both need f's weight-bearing ops to be
    setup_context Functions (fmoe.ops); "autograd" does not compose with an outer torch.func transform.

    `defer` (default True): the weight-bearing primitives' weight gradients wait on a tape for `vjp_dw`.
    False computes every gradient in the `vjp_dx` pass (the primitives may take their native autograd
    paths, less per-op overhead) and `vjp_dw` only hands the parameter gradients over: for a caller that
    runs the two back to back (a pipeline's fused B), same gradients, less work.

    `plain_ops` (with defer=True): what happens to the weight gradients of ops that know no tape (plain
    torch ops: `F.linear`, `F.layer_norm`, a bias add). "dx" (default): they are made in the dx pass.
    "defer" (engine "autograd" only): the autograd graph is walked after the forward and they wait for
    `vjp_dw` too, with no recompute (the dx pass keeps the cotangents where a weight path branches off;
    see transforms/_plain_defer.py for what stays in the dx pass: weights below a Python autograd
    Function, a weight below two branch points). `deferral_report` counts what each pass computes.
    """
    if under_vmap():
        raise RuntimeError(VMAP_MESSAGE)
    if engine not in ENGINES:
        raise ValueError(f"split_vjp: engine must be one of {ENGINES}, got {engine!r}")
    if plain_ops not in PLAIN_OPS:
        raise ValueError(f"split_vjp: plain_ops must be one of {PLAIN_OPS}, got {plain_ops!r}")
    if plain_ops == "defer" and engine != "autograd":
        raise ValueError("split_vjp: plain_ops='defer' needs engine='autograd' (it walks the autograd graph; "
                         "torch.func.vjp has none to walk). fmoe.transforms.deferral_report tells what the "
                         "'func' engine's dx pass computes.")
    # params and args flattened apart: each spec is needed on its own (vjp_dw, dargs), and every flatten
    # and unflatten of torch's Python pytrees costs tens of microseconds per call
    p_leaves, p_spec = flatten(params)
    a_leaves, a_spec = flatten(args)
    leaves = p_leaves + a_leaves
    n_leaves, n_param_leaves = len(leaves), len(p_leaves)
    del p_leaves, a_leaves
    # the differentiable leaves (floating or complex tensors: `_is_diff`, spelled out in one pass that also
    # keeps each one's shape, dtype and device, for zero gradients of unused leaves and `into` checks)
    diff_pos: list[int] = []
    leaf_meta: list[tuple[torch.Size, torch.dtype, torch.device]] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            dtype = leaf.dtype
            if dtype.is_floating_point or dtype.is_complex:
                diff_pos.append(i)
                leaf_meta.append((leaf.shape, dtype, leaf.device))
    diff_leaves = _distinct([leaves[i] for i in diff_pos])
    n_param_diff = bisect.bisect_left(diff_pos, n_param_leaves)  # diff_pos is sorted: params' come first
    param_diff = list(enumerate(diff_pos[:n_param_diff]))
    arg_diff = [(k, diff_pos[k]) for k in range(n_param_diff, len(diff_pos))]
    every_leaf_diff = len(diff_pos) == n_leaves  # (params of float tensors only, acts): nothing to interleave

    def flat_f(*xs: torch.Tensor) -> Any:
        if every_leaf_diff:
            full = list(xs)
        else:
            full = list(leaves)
            for i, x in zip(diff_pos, xs):
                full[i] = x
        p, a = unflatten(full[:n_param_leaves], p_spec), unflatten(full[n_param_leaves:], a_spec)
        # recording(): the primitives in f keep their weight gradients deferrable; without it they may take
        # their native autograd paths (dw computed in the dx pass, as plain autograd does)
        with recording() if defer else contextlib.nullcontext():
            return f(p, *a)

    if engine == "autograd":
        out, vjp_fn, aux, diff_leaves, (out_leaves, out_spec) = _autograd_vjp(
            flat_f, diff_leaves, has_aux, [True] * n_param_diff + [False] * len(arg_diff))
    elif has_aux:
        # torch.func.vjp accepts only tensors as aux; route the rest (ints, dataclasses) around it.
        aux_skeleton: list[Any] = []

        def flat_f_aux(*xs: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
            out, aux = _output_and_aux(flat_f(*xs))
            tensors: list[torch.Tensor] = []
            aux_skeleton.append(_split_tensors(aux, tensors))
            return out, tensors

        out, vjp_fn, aux_tensors = torch.func.vjp(flat_f_aux, *diff_leaves, has_aux=True)
        aux = _fill_tensors(aux_skeleton[0], aux_tensors)
    else:
        out, vjp_fn = torch.func.vjp(flat_f, *diff_leaves)
    if engine != "autograd":
        out_leaves, out_spec = flatten(out)
    out_meta = [(o.shape, o.dtype) for o in out_leaves]  # shapes and dtypes only: out is not kept alive
    tape = WeightGradTape([diff_leaves[k] for k, _ in param_diff]) if defer else None
    state: dict[str, Any] = {"vjp_fn": vjp_fn, "tape": tape}
    dx_once = _Once("vjp_dx")

    def vjp_dx(cotangent: Any, *, into: Any = None) -> tuple[tuple[Any, ...], DwFn]:
        if under_vmap():
            raise RuntimeError(VMAP_MESSAGE)
        ct_leaves = _check_cotangent(cotangent, out_spec, out_meta)
        acc = None if into is None else _accumulators(into, p_spec, diff_pos, n_param_leaves, leaf_meta,
                                                      engine == "autograd" and not defer)
        dx_once.claim()
        # Weak references, for naming an input in vjp_dw's error only: holding them must not keep memory.
        arg_refs = [(i, weakref.ref(leaves[i])) for i in range(n_param_leaves, n_leaves)
                    if isinstance(leaves[i], torch.Tensor)]
        ct_refs = [weakref.ref(c) for c in ct_leaves]
        fn = state.pop("vjp_fn")
        with active_tape(state["tape"]):
            if engine != "autograd":
                grads = fn(cotangent, retain_graph=False)
            else:
                grads = fn(ct_leaves, into=acc, tape=state["tape"] if plain_ops == "defer" else None)
        del fn
        full: list[Any] = [None] * (n_leaves - n_param_leaves)  # the arguments' gradients
        for k, i in arg_diff:
            g = grads[k]
            # autograd: None for an argument the output does not depend on
            full[i - n_param_leaves] = _zeros(leaf_meta[k]) if g is None else _writable(g)
        dargs = unflatten(full, a_spec)
        # The dx pass already produced grads for parameters used outside weight-bearing primitives.
        dx_param_grads = [grads[k] for k, _ in param_diff]
        if state["tape"] is not None and plain_ops == "dx":
            _warn_left_in_dx(state["tape"], dx_param_grads, [i for _, i in param_diff], p_spec)
        del grads, full
        dw_once = _Once("vjp_dw")

        def modified_message(err: CaptureModifiedError) -> str:
            p_paths, a_paths, ct_paths = _paths(p_spec), _paths(a_spec), _paths(out_spec)
            if p_paths is not None and a_paths is not None:
                labels = ([f"params{keystr(p)}" for p in p_paths]
                          + [f"argument {p[0].idx}{keystr(p[1:])}" for p in a_paths])
            else:
                labels = [f"params leaf {i}" if i < n_param_leaves else f"argument leaf {i - n_param_leaves}"
                          for i in range(n_leaves)]
            ct_labels = ([f"the cotangent{keystr(p)}" for p in ct_paths] if ct_paths is not None else
                         [f"the cotangent (leaf {k})" for k in range(len(ct_refs))])
            candidates = ([(labels[i], r()) for i, r in arg_refs]
                          + [(lb, r()) for lb, r in zip(ct_labels, ct_refs)]
                          + [(labels[i], p) for i, p in enumerate(tree_flatten(params)[0])
                             if isinstance(p, torch.Tensor)])
            return _modified_message(err, candidates, labels[param_diff[err.weight_index][1]])

        def vjp_dw(*, into: Any = None) -> Any:
            sums = None if into is None else _accumulators(into, p_spec, diff_pos, n_param_leaves, leaf_meta,
                                                           defer, "vjp_dw")
            if not dw_once.done and state["tape"] is not None:
                try:
                    state["tape"].check()  # before claiming: the error repeats, never "already called"
                except CaptureModifiedError as err:
                    raise CaptureModifiedError(modified_message(err), tensor=err.tensor,
                                               weight_index=err.weight_index, recorded=err.recorded,
                                               current=err.current) from None
            dw_once.claim()
            tape = state.pop("tape")
            targets = None if sums is None else [sums[k] for k, _ in param_diff]
            deferred = tape.run(into=targets) if tape is not None else [None] * len(param_diff)
            flat_params: list[Any] = [None] * n_param_leaves
            for (k, i), now, later in zip(param_diff, dx_param_grads, deferred):
                if now is None or (tape is not None and tape.is_placeholder(now)):  # a zero: skip the pass
                    g = later
                elif later is not None:
                    g = later.add_(now)  # later is the sum, a tape's own tensor or a copy
                else:  # autograd's gradient may alias a cotangent: a sum for the caller is a copy
                    g = now if sums is None else now.clone()
                flat_params[i] = _writable(g) if g is not None else _zeros(leaf_meta[k])
            dx_param_grads.clear()
            if tape is not None:
                tape.clear()
            return unflatten(flat_params, p_spec)

        return tuple(dargs), vjp_dw

    if has_aux:
        return out, vjp_dx, aux
    return out, vjp_dx
