"""split_vjp: a vjp whose backward runs in two calls, dx now and dw later, with no recompute.

    out, vjp_dx = split_vjp(f, params, *args)
    dargs, vjp_dw = vjp_dx(cotangent)      # input grads; weight grads of primitives are deferred
    dparams = vjp_dw()                     # weight grads, with the pytree structure of params

Built on `torch.func.vjp`. During `vjp_dx` a `WeightGradTape` over the parameter leaves is active:
weight-bearing primitives (`fmoe.ops.linear`, `grouped_linear`, ...) return dx only and record their
weight-grad thunks there. Parameters that no such primitive consumes (norm scales, biases) get their
gradients in the dx pass; `vjp_dw` returns them together with the deferred ones. Unused leaves get
zeros; a weight used twice accumulates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, Protocol, overload

import torch
from fmoe.transforms.tape import WeightGradTape, active_tape

from fmoe._compat import tree_flatten, tree_unflatten


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
    None for non-float leaves). Callable once; afterwards neither activations nor tape entries are held.
    """

    def __call__(self) -> Any: ...


class DxFn(Protocol):
    """The input-grad pass `vjp_dx(cotangent) -> (dargs, vjp_dw)` returned by `split_vjp`.

    `cotangent` has the structure of `out`; `dargs` is a tuple with one gradient pytree per positional
    arg of f after params (None for non-float leaves); `vjp_dw` is the deferred weight-grad pass. Callable
    once.
    """

    def __call__(self, cotangent: Any, /) -> tuple[tuple[Any, ...], DwFn]: ...


@overload
def split_vjp(f: Callable[..., Any], params: Any, *args: Any,
              has_aux: Literal[False] = False) -> tuple[Any, DxFn]: ...


@overload
def split_vjp(f: Callable[..., Any], params: Any, *args: Any,
              has_aux: Literal[True]) -> tuple[Any, DxFn, Any]: ...


def split_vjp(
    f: Callable[..., Any], params: Any, *args: Any, has_aux: bool = False
) -> tuple[Any, DxFn] | tuple[Any, DxFn, Any]:
    """Run `f(params, *args)` and return `(out, vjp_dx)` (or `(out, vjp_dx, aux)` with has_aux).

    With has_aux, f returns `(out, aux)`; aux may be any pytree (ints, dataclasses) and comes back
    unwrapped. `vjp_dx: DxFn` maps a cotangent of `out` to `(dargs, vjp_dw)`; `vjp_dw: DwFn` returns
    `dparams` with the structure of `params`. Each may be called once; `vjp_dw` exists only after
    `vjp_dx`, so the order is enforced by construction. After `vjp_dw` returns, neither activations nor
    tape entries are held.
    """
    leaves, spec = tree_flatten((params, args))
    n_param_leaves = len(tree_flatten(params)[0])
    diff_pos = [i for i, leaf in enumerate(leaves) if _is_diff(leaf)]
    diff_leaves = [leaves[i] for i in diff_pos]
    param_diff = [(k, i) for k, i in enumerate(diff_pos) if i < n_param_leaves]

    def flat_f(*xs: torch.Tensor) -> Any:
        full = list(leaves)
        for i, x in zip(diff_pos, xs):
            full[i] = x
        p, a = tree_unflatten(full, spec)
        return f(p, *a)

    if has_aux:
        # torch.func.vjp accepts only tensors as aux; route the rest (ints, dataclasses) around it.
        aux_skeleton: list[Any] = []

        def flat_f_aux(*xs: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
            out, aux = flat_f(*xs)
            tensors: list[torch.Tensor] = []
            aux_skeleton.append(_split_tensors(aux, tensors))
            return out, tensors

        out, vjp_fn, aux_tensors = torch.func.vjp(flat_f_aux, *diff_leaves, has_aux=True)
        aux = _fill_tensors(aux_skeleton[0], aux_tensors)
    else:
        out, vjp_fn = torch.func.vjp(flat_f, *diff_leaves)
    tape = WeightGradTape([diff_leaves[k] for k, _ in param_diff])
    state: dict[str, Any] = {"vjp_fn": vjp_fn, "tape": tape}
    dx_once = _Once("vjp_dx")

    def vjp_dx(cotangent: Any) -> tuple[tuple[Any, ...], DwFn]:
        dx_once.claim()
        fn = state.pop("vjp_fn")
        with active_tape(state["tape"]):
            grads = fn(cotangent, retain_graph=False)
        del fn
        full: list[Any] = [None] * len(leaves)
        for i, g in zip(diff_pos, grads):
            full[i] = g
        _, dargs = tree_unflatten(full, spec)
        # The dx pass already produced grads for parameters used outside weight-bearing primitives.
        dx_param_grads = [grads[k] for k, _ in param_diff]
        del grads, full
        dw_once = _Once("vjp_dw")

        def vjp_dw() -> Any:
            dw_once.claim()
            tape = state.pop("tape")
            deferred = tape.run()
            tape.clear()
            flat_params: list[Any] = [None] * n_param_leaves
            for (_, i), now, later in zip(param_diff, dx_param_grads, deferred):
                flat_params[i] = now if later is None else (later if now is None else later.add_(now))
            dx_param_grads.clear()
            return tree_unflatten(flat_params, tree_flatten(params)[1])

        return tuple(dargs), vjp_dw

    if has_aux:
        return out, vjp_dx, aux
    return out, vjp_dx
