"""The weight-grad tape: where deferred weight gradients wait for the dw pass.

A weight-bearing primitive (a matmul, a grouped GEMM) computes its weight gradient in its
backward. While a tape is *active* (during the dx pass of `split_vjp`), the primitive asks the
tape whether it defers that weight; if so its backward returns only dx and records a thunk that
computes dw later from plain tensors. `WeightGradTape.run()` evaluates the thunks and sums them per
parameter (a weight used twice accumulates).

Identity matters: a tape defers exactly the tensors it was built with (the parameter leaves handed
to `split_vjp`). A primitive sees the very same tensor objects in its `forward`, also under nested
`torch.func` transforms, so deferral is decided by object identity. A weight that is an
intermediate (a cast or a slice of a parameter) is not deferred: its gradient flows in the dx pass.

The tape knows nothing of MoE or schedules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fmoe._compat import get_unwrapped, is_functorch_wrapped

# The active tape is process-wide, not a contextvar: the autograd engine may run a backward on its own
# device threads (CUDA), where a contextvar set by the caller would be invisible. One dx pass runs at a
# time per process; `active_tape` nests like a stack.
_ACTIVE: list[WeightGradTape | None] = [None]


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """Return the tensor object under every functorch wrapper of `t` (identity kept, no detach)."""
    while is_functorch_wrapped(t):
        t = get_unwrapped(t)
    return t


def plain(t: torch.Tensor) -> torch.Tensor:
    """Return `t` with every functorch wrapper removed and detached from autograd.

    Tensors seen inside a backward under `torch.func.vjp` are wrappers whose transform level dies when
    the vjp returns; a deferred thunk must hold plain tensors (../shared/notes/torch-func.md).
    """
    return unwrapped(t).detach()


class WeightGradTape:
    """Deferred weight-gradient thunks for a fixed list of parameter tensors.

    `defers(w)` is True when `w` is one of the tensors the tape was built with. `record(w, thunk)`
    stores `thunk() -> dw` (same shape as `w`). `run()` returns one gradient (or None) per parameter,
    in construction order, and empties the tape.
    """

    def __init__(self, weights: Sequence[torch.Tensor]):
        self._weights = list(weights)
        self._index = {id(w): i for i, w in enumerate(self._weights)}
        self._entries: list[tuple[int, Callable[[], torch.Tensor]]] = []

    def defers(self, w: torch.Tensor) -> bool:
        """True when the weight gradient of `w` goes on this tape instead of the dx pass."""
        return id(w) in self._index

    def record(self, w: torch.Tensor, thunk: Callable[[], torch.Tensor]) -> None:
        """Queue `thunk() -> dw` for weight `w` (which this tape must defer)."""
        if id(w) not in self._index:
            raise ValueError("record(): this tape does not defer that tensor; ask defers(w) first")
        self._entries.append((self._index[id(w)], thunk))

    def __len__(self) -> int:
        return len(self._entries)

    def run(self) -> list[torch.Tensor | None]:
        """Evaluate all thunks, summing per weight; returns [dw or None] per weight. Empties the tape."""
        grads: list[torch.Tensor | None] = [None] * len(self._weights)
        entries, self._entries = self._entries, []
        with torch.no_grad():
            while entries:
                i, thunk = entries.pop(0)
                g = thunk()
                if g.shape != self._weights[i].shape:
                    raise RuntimeError(
                        f"deferred weight grad has shape {tuple(g.shape)}, "
                        f"weight has {tuple(self._weights[i].shape)}"
                    )
                grads[i] = g if grads[i] is None else grads[i].add_(g)
        return grads

    def clear(self) -> None:
        """Drop every recorded thunk and the weight references."""
        self._entries = []
        self._weights = []
        self._index = {}


@contextlib.contextmanager
def active_tape(tape: WeightGradTape | None) -> Iterator[WeightGradTape | None]:
    """Make `tape` the tape that primitives consult while the block runs (None disables deferral)."""
    _ACTIVE.append(tape)
    try:
        yield tape
    finally:
        _ACTIVE.pop()


def current_tape() -> WeightGradTape | None:
    """The active weight-grad tape, or None when weight grads are computed immediately."""
    return _ACTIVE[-1]


def defer_weight_grad(w: torch.Tensor, thunk: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """Record `thunk` on the active tape if it defers `w`; returns the placeholder gradient, else None.

    The low-level step (a primitive's backward calls `weight_grad_or_defer`, which wraps it):

        dw = defer_weight_grad(w, lambda: x_keep.t() @ g_keep)
        if dw is None:
            dw = x.t() @ g          # no tape, or not one of its weights: compute now

    The placeholder is a stride-0 zero of w's shape (no memory, no memset), so the dx pass does not
    materialise a zero gradient for every deferred weight as `torch.func.vjp` would for a None.
    """
    tape = _ACTIVE[-1]
    w = unwrapped(w)
    if tape is None or not tape.defers(w):
        return None
    tape.record(w, thunk)
    return w.new_zeros(()).expand(w.shape)


def weight_grad_or_defer(w: torch.Tensor, compute: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """Return the gradient of weight `w` for a primitive's backward: `compute(*args)` now, or, when the
    active tape defers `w`, the stride-0 zero placeholder of w's shape, with `compute` queued on the tape.

    The whole deferred-dw recipe in one call (`w` is the caller's tensor, kept in setup_context):

        dw = weight_grad_or_defer(ctx.w_plain, _weight_grad, x_ND, g_NF)

    The queued thunk holds `plain` copies of the tensor args (they must outlive the vjp); other args pass
    as they are. `compute` must return a tensor of w's shape.
    """
    keep = [plain(a) if isinstance(a, torch.Tensor) else a for a in args]
    dw = defer_weight_grad(w, lambda: compute(*keep))
    return compute(*args) if dw is None else dw
