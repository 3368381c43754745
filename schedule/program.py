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
the dispatch). Its outputs (new keys) join the acts after the wait, and the keys in `side_consumes` leave
them. In the backward the side runs at the first exchange whose cotangents include all of its outputs
(the combine's, for the shared expert), and its input cotangents are added where the exchange it rides
on is transposed.

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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

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
    """Returns the node of nested dicts `tree` at `path` (raises KeyError naming the path)."""
    node = tree
    for i, k in enumerate(path):
        if not isinstance(node, Mapping) or k not in node:
            raise KeyError(f"no parameter subtree at {'.'.join(path[:i + 1])!r}")
        node = node[k]
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
