"""Stage programs: what an executor runs for one pipeline stage, with no knowledge of the model.

A stage program is a sequence of layers; a layer is a sequence of phases with one signature:

    compute:  fn(params: the user's tree, acts: dict[str, Tensor], meta: dict) -> (acts, meta)
    comm:     start(acts, meta) -> Pending;  Pending.wait() -> (acts, meta)
              start_transpose(ct_acts, meta) -> Pending;  Pending.wait() -> ct_acts

`acts` holds the differentiable activations only (floating tensors), keyed by name; it is the whole live
state after the phase, so a phase's cotangent is a dict keyed like its output and the next backward phase
needs no key-by-key assembly. `meta` holds everything else (token ids, routing layouts, split sizes) and is
never differentiated. A compute phase runs under `split_vjp`: its dx closure runs at I, its dw thunk at W.
A comm phase is linear, so it runs outside any vjp: its backward is `start_transpose` (the same exchange
with the splits swapped), issued and waited by the executor like the forward. `local=True` marks an
exchange that never leaves the process (a single-process dispatcher): with nothing travelling there is
nothing to hide behind compute, so a B of a stage whose exchanges are all local computes its weight
gradients in its dx pass instead of deferring them.

A comm phase may carry a `side`: a compute phase that reads only acts passing through the exchange
(never what it delivers), so the executor runs it while the exchange travels (the shared expert beside
the dispatch). It is handed the acts named in `side_reads` (all of them when none are named), its outputs
(new keys) join the acts after the wait, and the keys in `side_consumes` leave them. In the backward
the side runs at the first exchange whose cotangents include all of its outputs (the combine's, for the
shared expert), and its input cotangents are added where the exchange it rides on is transposed.

A compute phase may name some of its outputs `losses`: scalars that end there (the cross-entropy, a
balancing loss). The executor takes them out of `acts`, adds them to the step's loss and gives them the
cotangent 1 / microbatches in the backward. `meta["stats"]` after a phase, when present, is collected into
the step result (per-microbatch expert loads and the like), so the model can update its state once per
step.

`params` of a phase are the subtrees at `param_paths` of the stage's parameter pytree (nested dicts whose
keys are the model's global names), handed to `fn` as the tree the user wrote below `param_root` holding
just those subtrees (`Phase.run`, `nested`): the attention phase of the block at ("layers", "3") gets
{"attn_norm": ..., "w_q": ..., "moe": {"router": ...}}, the head {"norm": ..., "head": {"w": ...}}; a
phase with no weights has `param_paths = ()` and gets {}. The same path on two
stages (a shared weight) is allowed: the executor returns per-stage gradients and `shared_keys` says which
must be summed across ranks.

The first stage's forward starts from `acts = {}` (its first phase reads token ids from `meta`); the last
stage's final phase returns only losses. Between stages `acts` travels as it is: `in_spec` gives the
shapes and dtypes of a stage's input acts, which receive buffers are allocated from.

`run_phases` runs layers in order in one process, differentiable by autograd (and torch.func): the one
sequential runner, which the model's own functions (fmoe.model), an executor's stage with nothing to
overlap and the forward-only evaluation all use. An exchange that leaves the process runs through
`exchanged`, an autograd Function whose backward issues the transpose; a local one runs inline, so
autograd differentiates what its `start` computed. Generic: knows phases, never a model or a schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from fmoe._compat import Function

Acts = dict[str, torch.Tensor]
Meta = dict[str, Any]
Path = tuple[str, ...]
TensorSpec = tuple[tuple[int, ...], torch.dtype]


class Pending(Protocol):
    """An issued exchange. `wait()` returns its result; `completed_at` (perf_counter seconds or None) is
    when the exchange completed, when the handle knows it (a link model's completion time); `in_flight`
    (optional, default True) False when nothing travels, so the executor need not switch ops for it."""

    def wait(self) -> Any: ...


@dataclass(frozen=True)
class Phase:
    """One phase of a layer. `kind` "compute": `fn` and `param_paths`, `losses` names scalar outputs that
    end here. `kind` "comm": `start` and `start_transpose` (see the module docstring)."""

    name: str
    kind: Literal["compute", "comm"]
    fn: Callable[[Any, Acts, Meta], tuple[Acts, Meta]] | None = None
    param_paths: tuple[Path, ...] = ()
    # compute: `fn` receives the subtrees at `param_paths` as the user's tree below this path (`run`)
    param_root: Path = ()
    losses: tuple[str, ...] = ()
    start: Callable[[Acts, Meta], Pending] | None = None
    start_transpose: Callable[[Acts, Meta], Pending] | None = None
    side: Phase | None = None
    side_consumes: tuple[str, ...] = ()
    # comm with a side: the acts the side is given (all of them when empty). A side that names what it
    # reads is handed nothing else: under remat it then keeps only that, not acts that later phases may
    # take over and write (the rows the experts donate)
    side_reads: tuple[str, ...] = ()
    local: bool = False  # comm: the exchange never leaves this process (nothing travels, nothing to hide)
    # comm: an fb-overlap pair hands over to its other op while this exchange travels. False for an
    # exchange whose result the op's very next step needs (a count exchange that sizes the dispatch):
    # handing over there would shift every later pairing of the pair by one phase
    switch: bool = True
    # comm: the op goes on with its next compute phases while this exchange travels and waits for it just
    # before its next exchange (a count exchange, which permute-1 then hides; a token chunk's dispatch, which
    # the previous chunk's experts hide). It is given only the acts named in `reads` (they leave the op's
    # acts); its result acts join them at the wait, with the meta keys it adds; the phases run meanwhile
    # must not read what it delivers. In the backward its transpose is issued at the same place (given the
    # cotangents of what it delivered) and waited before the next exchange, mirroring the forward
    defer_wait: bool = False
    reads: tuple[str, ...] = ()  # defer_wait: the acts the exchange takes

    def __post_init__(self) -> None:
        if self.side is not None and (self.kind != "comm" or self.side.kind != "compute" or self.side.losses):
            raise ValueError(f"phase {self.name!r}: a side phase is a compute phase without losses, "
                             "carried by a comm phase")
        if self.kind == "compute" and (self.fn is None or self.start is not None):
            raise ValueError(f"compute phase {self.name!r} needs fn and no start")
        if self.kind == "comm" and (self.start is None or self.start_transpose is None or self.fn is not None
                                    or self.param_paths or self.losses):
            raise ValueError(f"comm phase {self.name!r} needs start and start_transpose, and no fn, params "
                             "or losses")
        if self.defer_wait and (self.kind != "comm" or self.side is not None):
            raise ValueError(f"phase {self.name!r}: only a comm phase without a side may defer its wait")
        if self.side_reads and self.side is None:
            raise ValueError(f"phase {self.name!r}: `side_reads` names the acts of its side phase, and it "
                             "has none")
        if self.reads and not self.defer_wait:
            raise ValueError(f"phase {self.name!r}: `reads` names the acts of a deferred exchange "
                             "(defer_wait)")
        outside = [p for p in self.param_paths if tuple(p[:len(self.param_root)]) != tuple(self.param_root)]
        if outside:
            raise ValueError(f"phase {self.name!r}: param_paths {outside} are not below param_root "
                             f"{self.param_root}")
        if self.kind not in ("compute", "comm"):
            raise ValueError(f"phase {self.name!r}: kind must be 'compute' or 'comm', got {self.kind!r}")


    def run(self, params: tuple[Any, ...], acts: Acts, meta: Meta) -> tuple[Acts, Meta]:
        """Runs compute phase `fn` on `params` (the subtrees at `param_paths`, in order) given as the
        user's tree below `param_root` (`nested`); returns fn's (acts, meta)."""
        return self.fn(nested(self.param_root, self.param_paths, params), acts, meta)


def nested(root: Path, paths: tuple[Path, ...], values: tuple[Any, ...]) -> Any:
    """Returns `values` (one subtree per path) as nested dicts keyed by each path below `root`: the tree the
    user wrote, holding just these subtrees. A single path equal to `root` gives its subtree itself; no
    path gives {}. Raises ValueError for a path given twice or inside another."""
    if len(paths) == 1 and tuple(paths[0]) == tuple(root):
        return values[0]
    out: dict[str, Any] = {}
    for path, value in zip(paths, values):
        rel = tuple(path[len(root):])
        node = out
        for k in rel[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"param path {'.'.join(path)} lies inside another path of the phase")
        if not rel or rel[-1] in node:
            raise ValueError(f"param path {'.'.join(path)} given twice, or beside a path that holds it")
        node[rel[-1]] = value
    return out


@dataclass(frozen=True)
class Layer:
    """A named sequence of phases (name used in timelines, for example "L5"). `lone_phases`: another
    sequence of the same computation for a forward that runs alone (warmup, cooldown, overlap off), where
    no paired op hides its exchanges and the layer may hide them behind its own work (an all-to-all in
    chunks); None: `phases`. Its backward follows whichever the forward ran. Both hand over to a pair at
    the same number of exchanges."""

    name: str
    phases: tuple[Phase, ...]
    lone_phases: tuple[Phase, ...] | None = None

    def __post_init__(self) -> None:
        if self.lone_phases is not None and turns(self.lone_phases) != turns(self.phases):
            raise ValueError(f"layer {self.name!r}: lone_phases hand over at {turns(self.lone_phases)} "
                             f"exchanges, phases at {turns(self.phases)}")

    def forward_phases(self, paired: bool) -> tuple[Phase, ...]:
        """The phases a forward runs: `phases` in an F&B pair, else `lone_phases` when given."""
        return self.phases if paired or self.lone_phases is None else self.lone_phases


def turns(phases: tuple[Phase, ...]) -> int:
    """Returns the exchanges of `phases` at which an op hands over to its fb-overlap pair: comm phases that
    may leave the process and switch (`Phase.switch`)."""
    return sum(ph.kind == "comm" and ph.switch and not ph.local for ph in phases)


@dataclass(frozen=True)
class StageProgram:
    """What stage `stage` runs: `layers` in order over `params` (nested dicts, global keys).
    `in_spec`: name -> (shape, dtype) of the input acts (empty for a stage that starts a path)."""

    stage: int
    layers: tuple[Layer, ...]
    params: Any
    in_spec: Mapping[str, TensorSpec] = field(default_factory=dict)


def subtree(tree: Any, path: Path) -> Any:
    """Returns the node of nested dicts `tree` at `path` (raises KeyError naming the path); a list or tuple
    on the way is indexed by a key of digits ("layers", "3")."""
    node = tree
    for i, k in enumerate(path):
        if isinstance(node, (list, tuple)) and k.isdigit() and int(k) < len(node):
            node = node[int(k)]
        elif isinstance(node, Mapping) and k in node:
            node = node[k]
        else:
            raise KeyError(f"no parameter subtree at {'.'.join(path[:i + 1])!r}")
    return node


def issue(ph: Phase, acts: Acts, meta: Meta) -> tuple[Pending, Acts]:
    """Issues comm phase `ph` on `acts`; returns (its Pending, the acts that go on beside it). A deferred
    exchange (Phase.defer_wait) takes only `ph.reads` and the rest go on; any other takes all acts and
    its result replaces them. After the wait the op's acts are {**rest, **result acts}."""
    if not ph.defer_wait:
        return ph.start(acts, meta), {}
    missing = [k for k in ph.reads if k not in acts]
    if missing:
        raise KeyError(f"deferred exchange {ph.name!r} reads acts {missing} that the op does not hold")
    return (ph.start({k: acts[k] for k in ph.reads}, meta),
            {k: v for k, v in acts.items() if k not in ph.reads})


class Ready:
    """A Pending that is already complete (a local exchange, or a comm phase with nothing to send)."""

    in_flight = False  # the executor does not yield to another op for it

    def __init__(self, value: Any):
        self.value = value
        self.completed_at: float | None = None

    def wait(self) -> Any:
        """Returns the value it was made with."""
        return self.value


class _Exchanged(Function):
    @staticmethod
    def forward(issue, transpose, keys, out_keys, *tensors):
        out = issue(dict(zip(keys, tensors))).wait()
        out_keys.names = tuple(out)  # known once the exchange delivered (a phase's outputs are its own)
        return tuple(out.values())

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.transpose, ctx.keys, ctx.out_keys = inputs[1:4]

    @staticmethod
    def backward(ctx, *cts):
        back = ctx.transpose(dict(zip(ctx.out_keys.names, cts))).wait()
        return (None,) * 4 + tuple(back[k] for k in ctx.keys)


def exchanged(issue: Callable[[Acts], Pending], transpose: Callable[[Acts], Pending], acts: Acts) -> Acts:
    """Returns `issue(acts)` (a Pending of a linear exchange, waiting gives a dict of tensors) waited,
    differentiable: its backward waits `transpose(cotangents keyed like the result)`, which returns the
    cotangents keyed like `acts`."""
    out_keys = _Names()
    out = _Exchanged.apply(issue, transpose, tuple(acts), out_keys, *acts.values())
    return dict(zip(out_keys.names, out))


class _Names:
    """The result keys of one exchange, filled by its forward (an object, not a list: torch.func rebuilds
    the containers among a Function's arguments)."""

    names: tuple[str, ...] = ()


class PhaseHooks(Protocol):
    """What `run_phases` tells its caller (an executor's timeline, checks): each compute phase once it
    ran (its output acts, the time it began) and each exchange once it was waited."""

    def computed(self, ph: Phase, layer: str, out: Acts, start: float) -> None: ...

    def waited(self, pending: Any, ph: Phase, layer: str, start: float, wait_start: float) -> None: ...


@dataclass
class Ran:
    """What `run_phases` returns: the acts left after the last phase, its meta, the losses the phases
    ended ({name: scalar}) and each phase's meta["stats"] as (layer name, phase name, stats)."""

    acts: Acts
    meta: Meta
    losses: dict[str, torch.Tensor]
    stats: list[tuple[str, str, Any]]


def run_phases(layers: tuple[Layer, ...] | list[Layer], params_of: Callable[[Phase], tuple[Any, ...]],
               acts: Acts, meta: Meta, hooks: PhaseHooks | None = None) -> Ran:
    """Runs every phase of `layers` (each layer's `phases`) in order on `acts` / `meta`; returns a `Ran`.

    `params_of(phase)`: the subtrees at the phase's `param_paths`, in order (`tree_params` for a tree).
    Differentiable: compute phases and local exchanges by autograd through what they compute, other
    exchanges through `exchanged` (their transposes). A side phase runs before its exchange when
    gradients are recorded (the exchange's issue and wait are one autograd node) and while the exchange
    travels otherwise; a deferred exchange (Phase.defer_wait) is waited at once, nothing being left to
    hide it behind. Losses leave the acts where they end; meta["stats"] leaves the meta after each phase."""
    losses: dict[str, torch.Tensor] = {}
    stats: list[tuple[str, str, Any]] = []
    clock = _clock(hooks)
    for layer in layers:
        for ph in layer.phases:
            start = clock()
            if ph.kind == "compute":
                acts, meta = ph.run(params_of(ph), acts, meta)
                acts = dict(acts)
                if hooks is not None:
                    hooks.computed(ph, layer.name, acts, start)
                losses.update((k, acts.pop(k)) for k in ph.losses)
            else:
                acts, meta = _exchange(ph, layer.name, params_of, acts, meta, hooks, start)
            if isinstance(meta, dict) and "stats" in meta:
                meta = dict(meta)
                stats.append((layer.name, ph.name, meta.pop("stats")))
    return Ran(acts, meta, losses, stats)


def _no_clock() -> float:
    return 0.0


def _clock(hooks: PhaseHooks | None) -> Callable[[], float]:
    """The clock phases are timed with: perf_counter for hooks that record times, else none (nothing
    reads the times then, and torch.compile cannot trace a clock read)."""
    return time.perf_counter if hooks is not None else _no_clock


def tree_params(tree: Any) -> Callable[[Phase], tuple[Any, ...]]:
    """Returns `params_of` for `run_phases` over the nested dicts `tree` (global keys)."""
    return lambda ph: tuple(subtree(tree, q) for q in ph.param_paths)


def _exchange(ph: Phase, layer: str, params_of: Callable[[Phase], tuple[Any, ...]], acts: Acts, meta: Meta,
              hooks: PhaseHooks | None, start: float) -> tuple[Acts, Meta]:
    """Runs comm phase `ph` (and its side) in `run_phases`; returns (acts, meta) after it."""
    sent, rest = ({k: acts[k] for k in ph.reads}, {k: v for k, v in acts.items() if k not in ph.reads}) \
        if ph.defer_wait else (acts, {})
    def run_side() -> Acts | None:
        if ph.side is None:
            return None
        side_start = _clock(hooks)()
        out, _ = ph.side.run(params_of(ph.side), side_acts(ph, acts), meta)
        if hooks is not None:
            hooks.computed(ph.side, layer, out, side_start)
        return out

    if ph.local or not torch.is_grad_enabled():  # inline: the side runs while the exchange travels
        pending = ph.start(sent, meta)
        side = run_side()
        wait_start = _clock(hooks)()
        got, meta = pending.wait()
    else:  # one autograd node issues and waits: the side runs first
        side = run_side()
        wait_start = _clock(hooks)()
        got, meta, pending = _differentiable(ph, sent, meta)
    if hooks is not None:
        hooks.waited(pending, ph, layer, start, wait_start)
    acts = {**rest, **got}
    if side is not None:
        acts = {**{k: v for k, v in acts.items() if k not in ph.side_consumes}, **side}
    return acts, meta


def side_acts(ph: Phase, acts: Acts) -> Acts:
    """The acts comm phase `ph`'s side is given: those it names (`side_reads`), else all of them."""
    return {k: acts[k] for k in ph.side_reads} if ph.side_reads else acts


def _differentiable(ph: Phase, acts: Acts, meta: Meta) -> tuple[Acts, Meta, Any]:
    """Runs exchange `ph` through `exchanged`; returns (its acts, its meta, its Pending)."""
    box: dict[str, Any] = {}

    def issue(a: Acts) -> Any:
        box["pending"] = ph.start(a, meta)
        return _Waited(box)

    def transpose(ct: Acts) -> Any:
        return ph.start_transpose(ct, box["meta"])

    got = exchanged(issue, transpose, acts)
    return got, box["meta"], box["pending"]


class _Waited:
    """A Pending of a phase's exchange that keeps the meta its wait returns (for the transpose)."""

    def __init__(self, box: dict[str, Any]):
        self.box = box

    def wait(self) -> Acts:
        acts, self.box["meta"] = self.box["pending"].wait()
        return acts
