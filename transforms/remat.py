"""remat: recompute a function's activations in the backward, inside torch.func transforms.

    g = remat(f, policy=nothing_saveable)
    y = g(*args)                     # saves only args; the backward re-runs f and takes its vjp

`torch.utils.checkpoint` relies on saved-tensor hooks, which `torch.func.vjp` does not support;
this one is a setup_context autograd Function that saves only its inputs and whose backward calls
`torch.func.vjp` on the recomputed forward. It works under an outer `torch.func.vjp`, tape autograd,
and `split_vjp`: the dx pass recomputes once, and the weight-bearing primitives inside the recompute
put their dw on the active tape, so the dw pass recomputes nothing.

Policies, as in JAX (`jax.checkpoint_policies`):
- `nothing_saveable`: save the inputs only, recompute everything.
- `everything_saveable`: no recompute (f runs as is).
- `save_only_these_names(*names)`: values tagged with `checkpoint_name(x, name)` for those names are
  kept from the forward and reused verbatim by the recompute (so data-dependent decisions such as
  routing see bit-identical inputs). Eager PyTorch has no graph to prune, so the ops producing a
  saved value still run in the recompute when their own backward needs them; what the policy
  guarantees is value identity, and that only the tagged values are held between forward and
  backward. `saved_residuals` lists what a policy keeps.

Random state: as `torch.utils.checkpoint` does (preserve_rng_state=True), the forward saves the CPU
generator's state and that of each device generator the inputs live on, and the recompute runs from
those states, so dropout draws the same mask twice. The caller's generators are put back after the
recompute: the random stream seen outside is the one without remat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fmoe._compat import Function, tree_flatten, tree_unflatten


@dataclass(frozen=True)
class Policy:
    """Which `checkpoint_name`-tagged values a remat keeps from its forward."""

    name: str
    save_all: bool = False
    names: frozenset[str] = frozenset()

    def saves(self, tag: str) -> bool:
        """True when values tagged `tag` are kept from the forward."""
        return self.save_all or tag in self.names


nothing_saveable = Policy("nothing_saveable")
everything_saveable = Policy("everything_saveable", save_all=True)


def save_only_these_names(*names: str) -> Policy:
    """Policy that keeps the values tagged with one of `names` and recomputes the rest."""
    return Policy(f"save_only_these_names{names}", names=frozenset(names))


@dataclass
class _Record:
    """Tagged values of one remat call: filled during forward, replayed during recompute."""

    policy: Policy
    replay: bool = False
    saved: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    cursor: dict[str, int] = field(default_factory=dict)
    seen: list[tuple[str, tuple[int, ...], bool]] = field(default_factory=list)


_RECORDS: list[_Record] = []  # stack of remat calls in progress (forward or recompute)


def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """Tag `x` with `name` for remat policies; returns x (or, in a recompute, the saved value)."""
    if not _RECORDS:
        return x
    rec = _RECORDS[-1]
    if not rec.policy.saves(name):
        if not rec.replay:
            rec.seen.append((name, tuple(x.shape), False))
        return x
    if not rec.replay:
        rec.seen.append((name, tuple(x.shape), True))
        rec.saved.setdefault(name, []).append(x.detach())
        return x
    i = rec.cursor.get(name, 0)
    rec.cursor[name] = i + 1
    saved = rec.saved[name][i]
    if not (x.is_floating_point() and x.requires_grad):
        return saved
    return x + (saved - x).detach()  # the saved value, with the gradient still flowing into x


@dataclass
class _RngState:
    """The CPU generator's state and, per device, that device's default generator state."""

    cpu: torch.Tensor
    devices: list[tuple[torch.device, torch.Tensor]]


def _rng_devices(leaves: list[Any]) -> list[torch.device]:
    """Return the distinct non-CPU devices of the tensor leaves whose generators can be saved, in order."""
    found: list[torch.device] = []
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta") and t.device not in found:
            if hasattr(torch.get_device_module(t.device), "get_rng_state"):
                found.append(t.device)
    return found


def _get_rng(devices: list[torch.device]) -> _RngState:
    """Return the current state of the CPU generator and of the default generator of each of `devices`."""
    return _RngState(torch.get_rng_state(),
                     [(d, torch.get_device_module(d).get_rng_state(d)) for d in devices])


def _set_rng(state: _RngState) -> None:
    """Make `state` the current state of the generators it holds; returns None."""
    torch.set_rng_state(state.cpu)
    for d, s in state.devices:
        torch.get_device_module(d).set_rng_state(s, d)


class _Plan:
    """What a remat call needs besides its differentiable inputs (kept off the autograd graph)."""

    def __init__(self, f: Callable[..., Any], leaves: list[Any], spec: Any, diff_pos: list[int],
                 policy: Policy, rng_devices: list[torch.device] | None):
        self.f, self.leaves, self.spec, self.diff_pos, self.policy = f, leaves, spec, diff_pos, policy
        self.rng_devices = rng_devices  # None: do not preserve the random state
        self.rng: _RngState | None = None
        self.out_spec: Any = None
        self.out_static: list[Any] = []
        self.out_tensor_pos: list[int] = []
        self.record: _Record | None = None

    def call(self, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        full = list(self.leaves)
        for i, x in zip(self.diff_pos, xs):
            full[i] = x
        out = self.f(*tree_unflatten(full, self.spec))
        out_leaves, self.out_spec = tree_flatten(out)
        self.out_static = out_leaves
        self.out_tensor_pos = [i for i, o in enumerate(out_leaves) if isinstance(o, torch.Tensor)]
        return tuple(out_leaves[i] for i in self.out_tensor_pos)

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        full = list(self.out_static)
        for i, t in zip(self.out_tensor_pos, tensors):
            full[i] = t
        return tree_unflatten(full, self.out_spec)


class _Remat(Function):
    @staticmethod
    def forward(plan: _Plan, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        plan.record = _Record(plan.policy)
        if plan.rng_devices is not None:
            plan.rng = _get_rng(plan.rng_devices)
        _RECORDS.append(plan.record)
        try:
            outs = plan.call(xs)
        finally:
            _RECORDS.pop()
        return tuple(o.detach() for o in outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.plan = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.output_is_float = [o.is_floating_point() for o in output]
        ctx.mark_non_differentiable(*[o for o in output if not o.is_floating_point()])

    @staticmethod
    def backward(ctx, *grads):
        plan: _Plan = ctx.plan
        xs = ctx.saved_tensors
        record = plan.record
        record.replay, record.cursor = True, {}
        rng, caller_rng = plan.rng, None
        if rng is not None:
            # The recompute draws what the forward drew; the caller's stream resumes where it was.
            caller_rng = _get_rng([d for d, _ in rng.devices])
            _set_rng(rng)
        _RECORDS.append(record)
        try:
            with torch.enable_grad():
                # vjp differentiates floating outputs only; integer ones (counts, ids) carry no gradient.
                def float_outs(*a: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[()]]:
                    return tuple(o for o in plan.call(a) if o.is_floating_point()), ()

                outs, vjp_fn, _ = torch.func.vjp(float_outs, *xs, has_aux=True)
        finally:
            _RECORDS.pop()
            if caller_rng is not None:
                _set_rng(caller_rng)
        float_grads = [g for g, o in zip(grads, ctx.output_is_float) if o]
        cts = tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outs, float_grads))
        dxs = vjp_fn(cts, retain_graph=False)
        return (None, *dxs)


def remat(f: Callable[..., Any], policy: Policy = nothing_saveable, *,
          preserve_rng_state: bool = True) -> Callable[..., Any]:
    """Return g with g(*args) == f(*args) whose backward recomputes f's activations (see module doc).

    Differentiable inputs are the floating-point tensor leaves of args (pytrees allowed); other leaves
    are passed through. Outputs may be any pytree; its non-tensor leaves are returned as computed in
    the forward. `preserve_rng_state` (default True): the recompute replays the random state of the
    forward (CPU generator, and the generators of the devices the inputs live on), so random ops such as
    dropout give the gradients of f itself; False skips saving it (only for f that draws nothing).
    """
    if policy.save_all:
        return f

    def rematted(*args: Any) -> Any:
        leaves, spec = tree_flatten(args)
        diff_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        plan = _Plan(f, leaves, spec, diff_pos, policy, _rng_devices(leaves) if preserve_rng_state else None)
        outs = _Remat.apply(plan, *[leaves[i] for i in diff_pos])
        return plan.rebuild(outs)

    return rematted


def saved_residuals(
    f: Callable[..., Any], policy: Policy, *args: Any
) -> list[tuple[str, tuple[int, ...], bool]]:
    """Run f once and return [(name, shape, saved?)] for every `checkpoint_name` tag it passes."""
    record = _Record(policy)
    _RECORDS.append(record)
    try:
        with torch.no_grad():
            f(*args)
    finally:
        _RECORDS.pop()
    return record.seen
