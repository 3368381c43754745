"""remat: recompute a function's activations in the backward, inside torch.func transforms.

    g = remat(f, policy=nothing_saveable)
    y = g(*args)                     # saves only args; the backward re-runs f and takes its vjp

`torch.utils.checkpoint` relies on saved-tensor hooks, which `torch.func.vjp` does not support;
this one is a setup_context autograd Function that saves only its inputs and whose backward calls
`torch.func.vjp` on the recomputed forward. It works under an outer `torch.func.vjp`, tape autograd,
and `split_vjp`: the dx pass recomputes once, and the weight-bearing primitives inside the recompute
put their dw on the active tape, so the dw pass recomputes nothing.

Between the forward and the backward a remat call holds its inputs (and the tensors f closes over), the
values its policy saves, the random state when preserved, and its outputs' structure, plain leaves and
metadata (shape, dtype, device): none of its output tensors, which live only as long as their readers
keep them (an output read by an op that saves nothing of it is freed after the forward, as without remat).

Policies, as in JAX (`jax.checkpoint_policies`), given as values or by name (`policy="dots_saveable"`):
- `nothing_saveable`: save the inputs only, recompute everything.
- `everything_saveable`: no recompute (f runs as is).
- `dots_saveable` (alias `checkpoint_dots`): keep the output of every matrix product of the forward
  (aten mm, bmm, addmm, baddbmm, _grouped_mm, ...: `DOTS`), which the recompute reuses in place of
  running the product again; the rest (norms, activations) is recomputed. A product's output that f then
  writes in place is not kept (the forward's value is gone): the recompute runs that product again.
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

What is checked, so that a recompute never silently differentiates another computation (as
`torch.utils.checkpoint` compares the metadata of what its recompute saves):
- The inputs (every tensor leaf of args, integer ones too), the tensors f closes over (closure cells,
  defaults, `functools.partial` arguments, an `nn.Module`'s parameters and buffers) and every other tensor
  an op of the forward reads that no op of the forward made (a module-level global, an attribute of an
  object f reaches: seen by a `TorchDispatchMode` during the forward, `_Reads`), by version counter: one
  modified in place between the forward and the backward raises `RecomputeError` naming it. A tensor the
  forward only writes (an `out=` buffer, a copy's destination) is not an input of it.
- The recompute's `checkpoint_name` tags (name, shape, dtype, device, in order) and its outputs
  (structure, shape, dtype, device; plain int / float / bool / str leaves by value) against the
  forward's: another branch taken raises `RecomputeError`. A branch on Python state that changes
  neither (same tags, same output shapes) is not seen: tag the values a branch decides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from fmoe._compat import (
    Function,
    keystr,
    tensor_version,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)
from fmoe.transforms.tape import unwrapped


class RecomputeError(RuntimeError):
    """remat's recompute would not reproduce its forward: its gradients would be another computation's."""


@dataclass(frozen=True)
class Policy:
    """Which `checkpoint_name`-tagged values a remat keeps from its forward."""

    name: str
    save_all: bool = False
    names: frozenset[str] = frozenset()
    dots: bool = False  # keep the outputs of the forward's matrix products (DOTS)

    def saves(self, tag: str) -> bool:
        """True when values tagged `tag` are kept from the forward."""
        return self.save_all or tag in self.names


nothing_saveable = Policy("nothing_saveable")
everything_saveable = Policy("everything_saveable", save_all=True)


dots_saveable = Policy("dots_saveable", dots=True)
checkpoint_dots = dots_saveable  # JAX's other name for it


def save_only_these_names(*names: str) -> Policy:
    """Policy that keeps the values tagged with one of `names` and recomputes the rest."""
    return Policy(f"save_only_these_names{names}", names=frozenset(names))


POLICIES: dict[str, Policy] = {"nothing_saveable": nothing_saveable,
                               "everything_saveable": everything_saveable,
                               "dots_saveable": dots_saveable, "checkpoint_dots": checkpoint_dots}


def policy_of(policy: Policy | str) -> Policy:
    """Return `policy`, or the policy of that name (`POLICIES`); raise ValueError for an unknown name."""
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"remat: policy must be a Policy or one of the names {sorted(POLICIES)}, got a "
                        f"{type(policy).__name__}")
    if policy not in POLICIES:
        takes = policy in ("save_only_these_names", "save_any_names_but_these")
        close = difflib.get_close_matches(policy, POLICIES, n=1, cutoff=0.5)
        hint = (f" (it takes names: pass {policy}('a', ...))" if takes else
                f" (did you mean {close[0]!r}?)" if close else "")
        raise ValueError(f"remat: unknown policy {policy!r}{hint}; the policies by name are "
                         f"{sorted(POLICIES)}")
    return POLICIES[policy]


@dataclass
class _Record:
    """Tagged values of one remat call: filled during forward, replayed during recompute."""

    policy: Policy
    replay: bool = False
    saved: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    cursor: dict[str, int] = field(default_factory=dict)
    seen: list[tuple[str, tuple[int, ...], bool]] = field(default_factory=list)
    tags: list[tuple[str, _Meta]] = field(default_factory=list)  # every tag of the forward, in order
    replayed: int = 0  # tags passed by the recompute so far

    def check_tag(self, name: str, x: torch.Tensor) -> None:
        """Raise RecomputeError unless the recompute's next tag is the forward's (name and metadata)."""
        i, self.replayed = self.replayed, self.replayed + 1
        got = (name, _meta(x))
        if i >= len(self.tags):
            raise RecomputeError(f"remat: the forward passed {len(self.tags)} tags, the recompute more "
                                 f"(tag {i}: {name!r} {_show(got[1])}): {_RECOMPUTE_DIFFERS}")
        if self.tags[i] != got:
            want = self.tags[i]
            raise RecomputeError(f"remat: tag {i} was {want[0]!r} {_show(want[1])} in the forward, {name!r} "
                                 f"{_show(got[1])} in the recompute: {_RECOMPUTE_DIFFERS}")

    def check_all_replayed(self) -> None:
        """Raise RecomputeError when the recompute passed fewer tags than the forward."""
        if self.replayed != len(self.tags):
            name, meta = self.tags[self.replayed]
            raise RecomputeError(f"remat: the forward passed {len(self.tags)} tags, the recompute "
                                 f"{self.replayed} (tag {self.replayed} was {name!r} {_show(meta)}): "
                                 f"{_RECOMPUTE_DIFFERS}")


_RECORDS: list[_Record] = []  # stack of remat calls in progress (forward or recompute)

_Meta = tuple[tuple[int, ...], torch.dtype, torch.device]
_RECOMPUTE_DIFFERS = ("it took another branch than the forward (state read by f changed after it?), so its "
                      "gradients would be another computation's. Keep what f branches on unchanged until "
                      "the backward, or pass it as an input")


def _meta(x: torch.Tensor) -> _Meta:
    return tuple(x.shape), x.dtype, x.device


def _show(meta: _Meta) -> str:
    shape, dtype, device = meta
    return f"{str(dtype).removeprefix('torch.')} {list(shape)} on {device}"


def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """Tag `x` with `name` for remat policies; returns x (or, in a recompute, the saved value)."""
    if not _RECORDS:
        return x
    rec = _RECORDS[-1]
    if rec.replay:
        rec.check_tag(name, x)  # before a saved value of another shape could broadcast into the recompute
    else:
        rec.tags.append((name, _meta(x)))
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


_READ = "read"  # versions key of a tensor found by _Reads (named only when the check fails)
_PLAIN = (int, float, bool, str, type(None))  # output leaves compared by value
_WALK_DEPTH = 3  # how deep into dicts / lists / dataclasses of a closure to look for tensors


def _tensors_in(obj: Any, label: str, depth: int = _WALK_DEPTH) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (label, tensor) for the tensors in `obj`: a tensor, or dicts / lists / tuples / dataclasses /
    nn.Modules of them, `depth` levels deep (a bound on the cost per call)."""
    if isinstance(obj, torch.Tensor):
        yield label, obj
    elif depth == 0 or isinstance(obj, _PLAIN):
        return
    elif isinstance(obj, torch.nn.Module):
        for name, t in [*obj.named_parameters(), *obj.named_buffers()]:
            yield f"{label}.{name}", t
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors_in(v, f"{label}[{k!r}]", depth - 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            if not isinstance(v, _PLAIN):  # host counts: long tuples of ints, skipped without a call each
                yield from _tensors_in(v, f"{label}[{i}]", depth - 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for fd in dataclasses.fields(obj):
            v = getattr(obj, fd.name)
            if not isinstance(v, _PLAIN):
                yield from _tensors_in(v, f"{label}.{fd.name}", depth - 1)


def _closed_over(f: Any, depth: int = _WALK_DEPTH) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (label, tensor) for the tensors `f` reads besides its arguments, where they can be found:
    closure cells, defaults, a partial's arguments, a module's (or a bound method's module's) state."""
    if isinstance(f, functools.partial):
        yield from _tensors_in((f.args, f.keywords), "a functools.partial argument ", depth)
        yield from _closed_over(f.func, depth)
        return
    if isinstance(f, torch.nn.Module):
        yield from _tensors_in(f, "the module", depth)
    owner = getattr(f, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        yield from _tensors_in(owner, "the method's module", depth)
    f = getattr(f, "__func__", f)
    code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None) or ()
    names = code.co_freevars if code is not None else ()
    for name, cell in zip(names, cells):
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        yield from _tensors_in(value, f"closed-over {name!r}", depth)
    yield from _tensors_in(getattr(f, "__defaults__", None) or (), "a default argument ", depth)
    yield from _tensors_in(getattr(f, "__kwdefaults__", None) or {}, "a default argument ", depth)


def _written(func: Any) -> frozenset[int]:
    """Positions of the arguments (in schema order) that `func` writes in place (`Tensor(a!)`)."""
    found = _WRITES.get(func)
    if found is None:
        args = getattr(getattr(func, "_schema", None), "arguments", ())
        found = frozenset(i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
        _WRITES[func] = found
    return found


_WRITES: dict[Any, frozenset[int]] = {}


class _Reads(TorchDispatchMode):
    """Collect the tensors the ops run under it read that none of them made or wrote first: what a function
    reads from outside (its arguments, closed-over, global and attribute tensors), whatever path it took.

    Below every torch.func transform, so it sees plain tensors (the objects a caller writes to). Only the
    forward runs under it: one Python call per op of the region.
    """

    def __init__(self) -> None:
        super().__init__()
        self.made: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors the region produced (held weakly)
        self.read: dict[int, torch.Tensor] = {}  # id -> tensor read from outside, in order of first read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = _written(func)
        names = [a.name for a in getattr(func._schema, "arguments", ())]
        wrote = [v for i, v in enumerate(args) if i in written]
        wrote += [v for k, v in kwargs.items() if k in names and names.index(k) in written]
        for t in tree_flatten((args, kwargs))[0]:
            if (isinstance(t, torch.Tensor) and t not in self.made and id(t) not in self.read
                    and not any(t is w for w in wrote)):
                self.read[id(t)] = t
        out = func(*args, **kwargs)
        for t in [*tree_flatten(out)[0], *tree_flatten(wrote)[0]]:
            if isinstance(t, torch.Tensor):
                self.made[t] = True
        return out


_aten = torch.ops.aten
# The matrix products whose outputs dots_saveable keeps (composite ones, such as linear and matmul, reach a
# dispatch mode as these).
DOTS = frozenset(getattr(_aten, name) for name in (
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "_grouped_mm", "_scaled_mm",
    "_scaled_grouped_mm") if hasattr(_aten, name))


class _Dots(TorchDispatchMode):
    """dots_saveable: keep the forward's matrix-product outputs (`replay` False), then hand them, in order,
    to the recompute in place of running the products again (`replay` True)."""

    def __init__(self) -> None:
        super().__init__()
        self.replay = False
        # ((op, its tensor arguments' metadata), the output or None, the output's version when made)
        self.saved: list[tuple[tuple[str, list[_Meta]], torch.Tensor | None, int]] = []
        self.cursor = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in DOTS:
            return func(*args, **kwargs)
        call = (str(func.overloadpacket),
                [_meta(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)])
        if not self.replay:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):  # out itself: a detach made down here counts versions apart
                self.saved.append((call, out, tensor_version(out)))
            return out
        i, self.cursor = self.cursor, self.cursor + 1
        if i >= len(self.saved):
            raise RecomputeError(f"remat: the forward ran {len(self.saved)} matrix products, the recompute "
                                 f"more ({_show_call(call)}): {_RECOMPUTE_DIFFERS}")
        was, out, _ = self.saved[i]
        if was != call:
            raise RecomputeError(f"remat: matrix product {i} was {_show_call(was)} in the forward, "
                                 f"{_show_call(call)} in the recompute: {_RECOMPUTE_DIFFERS}")
        if out is None:  # f wrote it in place after the forward made it: run it again
            return func(*args, **kwargs)
        return out.detach()  # a new tensor on the kept storage, for autograd to record this op on

    def drop_overwritten(self) -> None:
        """Forget the outputs f wrote in place after making them (their forward values are gone)."""
        self.saved = [(call, None if out is not None and tensor_version(out) != v else out, v)
                      for call, out, v in self.saved]

    def check_all_replayed(self) -> None:
        """Raise RecomputeError when the recompute ran fewer matrix products than the forward."""
        if self.cursor != len(self.saved):
            raise RecomputeError(f"remat: the forward ran {len(self.saved)} matrix products, the recompute "
                                 f"{self.cursor}: {_RECOMPUTE_DIFFERS}")


def _show_call(call: tuple[str, list[_Meta]]) -> str:
    return f"{call[0]} of {', '.join(map(_show, call[1]))}"


class _Plan:
    """What a remat call needs besides its differentiable inputs (kept off the autograd graph)."""

    def __init__(self, f: Callable[..., Any], leaves: list[Any], spec: Any, diff_pos: list[int],
                 policy: Policy, rng_devices: list[torch.device] | None):
        self.f, self.leaves, self.spec, self.diff_pos, self.policy = f, leaves, spec, diff_pos, policy
        self.rng_devices = rng_devices  # None: do not preserve the random state
        self.rng: _RngState | None = None
        self.out_spec: Any = None
        # the output leaves with None at the tensors' positions (out_tensor_pos): the region holds no
        # output of its own, which its readers alone keep alive (or not) until the backward
        self.out_static: list[Any] = []
        self.out_tensor_pos: list[int] = []
        self.record: _Record | None = None
        self.dots: _Dots | None = _Dots() if policy.dots else None
        self.out_meta: list[_Meta] | None = None  # the forward's tensor outputs; None until it ran
        # (leaf index in args or label of a closed-over tensor, the tensor, its version after the forward)
        self.versions: list[tuple[int | str, torch.Tensor, int]] = []
        self.reads: list[torch.Tensor] = []  # the tensors the forward read from outside (_Reads)

    def call(self, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        full = list(self.leaves)
        for i, x in zip(self.diff_pos, xs):
            full[i] = x
        out = self.f(*tree_unflatten(full, self.spec))
        out_leaves, out_spec = tree_flatten(out)
        tensor_pos = [i for i, o in enumerate(out_leaves) if isinstance(o, torch.Tensor)]
        if self.out_meta is None:  # the forward: keep the structure and the plain leaves, not the tensors
            self.out_spec, self.out_tensor_pos = out_spec, tensor_pos
            self.out_static = [None if isinstance(o, torch.Tensor) else o for o in out_leaves]
        else:
            self.check_outputs(out_leaves, out_spec)
        return tuple(out_leaves[i] for i in tensor_pos)

    def check_outputs(self, out_leaves: list[Any], out_spec: Any) -> None:
        """Raise RecomputeError when the recompute's outputs are not the forward's (structure, metadata)."""
        if out_spec != self.out_spec:
            raise RecomputeError(f"remat: the forward returned {self.out_spec}, the recompute {out_spec}: "
                                 f"{_RECOMPUTE_DIFFERS}")
        metas = iter(self.out_meta)
        was_tensor = set(self.out_tensor_pos)
        for i, (got, was) in enumerate(zip(out_leaves, self.out_static)):
            if (i in was_tensor) != isinstance(got, torch.Tensor):
                kind = "Tensor" if i in was_tensor else type(was).__name__
                raise RecomputeError(f"remat: output leaf {i} was a {kind} in the forward, a "
                                     f"{type(got).__name__} in the recompute: {_RECOMPUTE_DIFFERS}")
            if isinstance(got, torch.Tensor):
                want = next(metas)
                if _meta(got) != want:
                    raise RecomputeError(f"remat: output {i} was {_show(want)} in the forward, "
                                         f"{_show(_meta(got))} in the recompute: {_RECOMPUTE_DIFFERS}")
            elif isinstance(was, _PLAIN) and type(got) is type(was) and got != was:
                raise RecomputeError(f"remat: output leaf {i} was {was!r} in the forward, {got!r} in the "
                                     f"recompute: {_RECOMPUTE_DIFFERS}")

    def watch(self) -> None:
        """Keep the version counters of the inputs and closed-over tensors, as they are after the forward."""
        found: list[tuple[int | str, torch.Tensor]] = [
            (i, x) for i, x in enumerate(self.leaves) if isinstance(x, torch.Tensor)]
        found += list(_closed_over(self.f))
        seen: set[int] = set()
        for key, t in found:
            base = unwrapped(t)  # under an outer torch.func transform: the tensor a caller can write to
            seen.add(id(base))
            self.versions.append((key, base, tensor_version(base)))
        for t in self.reads:  # the rest: globals, attributes, tensors of the functions f calls
            if id(t) not in seen:
                self.versions.append((_READ, t, tensor_version(t)))
        self.reads = []

    def check_versions(self) -> None:
        """Raise RecomputeError naming an input or closed-over tensor modified in place since `watch`."""
        for key, t, was in self.versions:
            now = tensor_version(t)
            if now != was:
                name = (self.arg_label(key) if isinstance(key, int)
                        else self.read_label(t) if key == _READ else key)
                raise RecomputeError(
                    f"remat: {name} ({_show(_meta(t))}) was modified in place after the forward (version "
                    f"{was} -> {now}); the recompute would read the new values and give another "
                    "computation's gradients. Write to it only after the backward, or hand remat a copy")

    def read_label(self, t: torch.Tensor) -> str:
        """'global 'W'' when f's module holds `t` under a name f's code uses, else a description."""
        f = self.f.func if isinstance(self.f, functools.partial) else self.f
        f = getattr(f, "__func__", f)
        glob, code = getattr(f, "__globals__", {}), getattr(f, "__code__", None)
        for name in code.co_names if code is not None else ():
            for label, g in _tensors_in(glob.get(name), f"global {name!r}"):
                if unwrapped(g) is t:
                    return label
        return "a tensor f reads that is not its argument nor closed over (a global or an attribute)"

    def arg_label(self, leaf: int) -> str:
        """'argument [1]['w']': the path of leaf `leaf` of the args tuple."""
        paths = tree_flatten_with_path(tree_unflatten(self.leaves, self.spec))[0]
        return f"argument {keystr(paths[leaf][0])}"

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
        reads = _Reads()
        try:
            with reads, plan.dots or contextlib.nullcontext():
                outs = plan.call(xs)
        finally:
            _RECORDS.pop()
        plan.reads = list(reads.read.values())
        if plan.dots is not None:
            plan.dots.drop_overwritten()
        plan.out_meta = [_meta(o) for o in outs]
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
        plan.check_versions()  # first: tape autograd's own check on saved inputs names no input
        xs = ctx.saved_tensors
        record = plan.record
        record.replay, record.cursor, record.replayed = True, {}, 0
        rng, caller_rng = plan.rng, None
        if rng is not None:
            # The recompute draws what the forward drew; the caller's stream resumes where it was.
            caller_rng = _get_rng([d for d, _ in rng.devices])
            _set_rng(rng)
        _RECORDS.append(record)
        dots = plan.dots
        if dots is not None:
            dots.replay, dots.cursor = True, 0
        try:
            with torch.enable_grad():
                # vjp differentiates floating outputs only; integer ones (counts, ids) carry no gradient.
                def float_outs(*a: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[()]]:
                    with dots or contextlib.nullcontext():
                        return tuple(o for o in plan.call(a) if o.is_floating_point()), ()

                outs, vjp_fn, _ = torch.func.vjp(float_outs, *xs, has_aux=True)
            record.check_all_replayed()
            if dots is not None:
                dots.check_all_replayed()
        finally:
            _RECORDS.pop()
            if caller_rng is not None:
                _set_rng(caller_rng)
        float_grads = [g for g, o in zip(grads, ctx.output_is_float) if o]
        cts = tuple(torch.zeros_like(o) if g is None else g for o, g in zip(outs, float_grads))
        dxs = vjp_fn(cts, retain_graph=False)
        return (None, *dxs)


def remat(f: Callable[..., Any], policy: Policy | str = nothing_saveable, *,
          preserve_rng_state: bool = True) -> Callable[..., Any]:
    """Return g with g(*args) == f(*args) whose backward recomputes f's activations (see module doc).

    Differentiable inputs are the floating-point tensor leaves of args (pytrees allowed); other leaves
    are passed through. Outputs may be any pytree; its non-tensor leaves are returned as computed in
    the forward. `preserve_rng_state` (default True): the recompute replays the random state of the
    forward (CPU generator, and the generators of the devices the inputs live on), so random ops such as
    dropout give the gradients of f itself; False skips saving it (only for f that draws nothing).
    `policy`: a Policy or its name in `POLICIES` ("dots_saveable"); an unknown name raises ValueError.

    The backward raises `RecomputeError` when an input or closed-over tensor was modified in place after
    the forward, or when the recompute's tags or outputs differ from the forward's (see the module doc).
    """
    policy = policy_of(policy)
    if policy.save_all:
        return f

    def rematted(*args: Any) -> Any:
        leaves, spec = tree_flatten(args)
        diff_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.is_floating_point()]
        plan = _Plan(f, leaves, spec, diff_pos, policy, _rng_devices(leaves) if preserve_rng_state else None)
        outs = _Remat.apply(plan, *[leaves[i] for i in diff_pos])
        plan.watch()
        return plan.rebuild(outs)

    return rematted


def saved_residuals(
    f: Callable[..., Any], policy: Policy | str, *args: Any
) -> list[tuple[str, tuple[int, ...], bool]]:
    """Run f once and return [(name, shape, saved?)] for every `checkpoint_name` tag it passes, then, under
    dots_saveable, (op name such as "aten.mm", output shape, True) for every matrix product it keeps."""
    policy = policy_of(policy)
    record = _Record(policy)
    dots = _Dots() if policy.dots else None
    _RECORDS.append(record)
    try:
        with torch.no_grad(), dots or contextlib.nullcontext():
            f(*args)
    finally:
        _RECORDS.pop()
    if dots is None:
        return record.seen
    dots.drop_overwritten()
    return record.seen + [(call[0], tuple(out.shape), True) for call, out, _ in dots.saved
                          if out is not None]
