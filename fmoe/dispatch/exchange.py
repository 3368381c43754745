"""Exchanges as issue / wait pairs: the one form every dispatcher writes its route in.

Legend (the package's, docs/moe.md): E global experts, L local experts, R rows of this rank's
expert-sorted layout, M rows this rank's experts receive, D width.

A dispatcher that is an Exchange has `start_plan(route)` (the count exchange, host syncs that size every
split) and four linear exchanges, each issued by a `start_*` call returning a Pending (`wait()` gives
the moved tensors; compute may run in between):
    start_dispatch(plan, acts)            -> rows at the experts         (forward)
    start_combine(plan, acts)             -> rows back                   (forward)
    start_dispatch_transpose(plan, ct)    -> cotangents of the inputs    (backward: the same exchange
    start_combine_transpose(plan, ct)     -> cotangents of the outputs    with the splits swapped)
Row level: dispatch moves acts["rows_RD"] (and acts["probs_R"]) to "rows_MD" ("probs_M"), combine moves
"rows_MD" back to "rows_RD"; other keys pass through. Permute-2 is compute: `plan.to_experts` /
`plan.from_experts`. The pipeline runs these directly (fmoe/phases.py); the layer's
synchronous dispatch / combine is one adapter over them (fmoe/dispatch/sync.py).

What the MoE phases may do with an exchange depends on what it can do, not on its class: each one
declares its capabilities (`Exchange`: `local`, `splits_rows`, `token_level(cfg)`), and the model asks
those. A dispatcher with only the synchronous Dispatcher protocol gets them from one adapter
(`fmoe.dispatch.sync.as_exchange`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fmoe.transforms.pytree import pytree_dataclass

if TYPE_CHECKING:
    from fmoe.config import MoEConfig


class Exchange(Protocol):
    """A dispatcher's issue / wait form (module docstring) and the capabilities the MoE phases ask of it,
    each declared by the class (never inferred from the class or from which methods it has)."""

    num_local_experts: int
    local: bool  # nothing leaves this process: every exchange completes at issue (nothing to hide)
    splits_rows: bool  # its row plans split into row chunks (fmoe.parallel.alltoall.row_chunks): self-overlap

    def token_level(self, cfg: MoEConfig) -> bool:
        """True when a layer under `cfg` hands it whole tokens: the phases then drive `token_exchange()`
        (it permutes, and sums a token's top-k rows, itself) instead of this row-level Exchange."""
        ...

    def token_exchange(self) -> Exchange:
        """The token-level Exchange (acts "normed_TD" / "probs_TK" in, "y_TD" back); only asked for when
        `token_level` is True."""
        ...

    def start_plan(self, route: Any) -> Any:
        """Issues the count exchange of a routed layer; its wait gives the plan (a RowPlan)."""
        ...

    def start_dispatch(self, plan: Any, acts: dict) -> Any: ...

    def start_combine(self, plan: Any, acts: dict) -> Any: ...

    def start_dispatch_transpose(self, plan: Any, ct: dict) -> Any: ...

    def start_combine_transpose(self, plan: Any, ct: dict) -> Any: ...


def takes_tokens(cfg: MoEConfig) -> bool:
    """True when a layer under `cfg` can hand a token-level exchange whole tokens: dropless routing (no
    capacity, no dynamic window) with the gate weights applied at combine. Other modes need the row
    layout (capacity drops rows; gate weights in the expert travel per row)."""
    return cfg.capacity_factor is None and not cfg.dynamic_capacity_window and not cfg.probs_in_expert


@pytree_dataclass
@dataclass(frozen=True)
class RowPlan:
    """Split sizes and indices of one layer's exchange. counts_L: rows per local expert after permute-2
    (host ints where known); idx_M / inverse_M: permute-2 and its inverse (None: rows already grouped);
    the rest is the dispatcher's own (None on one process)."""

    counts_L: Any
    idx_M: torch.Tensor | None = None
    inverse_M: torch.Tensor | None = None
    send_P: list[int] | None = None  # all-to-all: rows to each rank
    recv_P: list[int] | None = None  # all-to-all: rows from each rank
    recv_PL: tuple[tuple[int, ...], ...] | None = None  # all-to-all: rows from each rank per local expert
    route: Any = None  # a two-stage exchange's route (all-gather, hierarchical)

    def traced_view(self) -> RowPlan:
        """This plan as a compiled phase sees it (transforms/compiled.py): what only exchanges read dropped
        (the host split sizes, which vary from microbatch to microbatch, and a two-stage exchange's route);
        the counts' device form."""
        counts = self.counts_L.traced_view() if hasattr(self.counts_L, "traced_view") else self.counts_L
        return RowPlan(counts, self.idx_M, self.inverse_M)

    def to_experts(self, x_MD: torch.Tensor) -> torch.Tensor:
        """Returns received rows [M, ...] regrouped by local expert (permute-2; differentiable)."""
        return x_MD if self.idx_M is None else x_MD.index_select(0, self.idx_M)

    def from_experts(self, y_MD: torch.Tensor) -> torch.Tensor:
        """Returns expert-grouped rows [M, ...] back in the received order (inverse permute-2)."""
        return y_MD if self.inverse_M is None else y_MD.index_select(0, self.inverse_M)


class Chain:
    """A Pending of exchanges in sequence. `first` = (result, handles) of the exchange issued at
    construction (no handles: the result is already there); each later step is a function of the previous
    result that issues the next exchange and returns (result, handles). `wait()` waits each step's
    handles, then runs the next; it returns the last result. `completed_at` (a time.perf_counter() value,
    set by wait()): when the last exchange that sent something completed, the later of its link-model
    completion and the moment its works finished (a late EP peer included); a trailing step that issues
    nothing (a rename, a slice) does not move it, nor does the wait itself when the exchange finished
    while compute hid it. None before wait(), and when no step sent anything."""

    def __init__(self, first: tuple[Any, list], *later: Any):
        self.result, self.handles = first
        self.later = list(later)
        self.completed_at: float | None = None
        self._finished = _finish_stamps(self.handles)

    @property
    def in_flight(self) -> bool:
        """True when the exchange issued first is travelling (False: nothing was sent, e.g. locally)."""
        return bool(self.handles)

    def wait(self) -> Any:
        """Runs the chain to the end; returns its result."""
        while True:
            for h in self.handles:
                h.wait()
            if self.handles:
                stamps, n = self._finished
                # a work without a finish stamp (a device's, a fake's): its wait's return stands for it
                done = max(stamps) if n and len(stamps) == n else time.perf_counter()
                self.completed_at = max([done] + [getattr(h, "not_before", 0.0) for h in self.handles])
            if not self.later:
                return self.result
            self.result, self.handles = self.later.pop(0)(self.result)
            self._finished = _finish_stamps(self.handles)


def _finish_stamps(handles: list) -> tuple[list[float], int]:
    """Returns (stamps, n): `stamps` gets time.perf_counter() appended as each of the n works of `handles`
    finishes, from its future's callback on the thread that completes it (gloo's), so an exchange that
    finished while compute hid it is not dated at its wait. n = 0 when any handle has no CPU works with
    futures: a device's future completes at launch, so its time says nothing (fake handles have none)."""
    stamps: list[float] = []
    works = []
    for h in handles:
        ws = getattr(h, "_works", None)  # CommHandle's c10d works (fmoe/parallel/async_comm.py)
        if not ws or getattr(h, "on_device", True):
            return stamps, 0
        works += ws
    try:
        for w in works:
            w.get_future().add_done_callback(lambda _f: stamps.append(time.perf_counter()))
    except (AttributeError, RuntimeError):  # a backend whose works have no future
        return stamps, 0
    return stamps, len(works)


def lift(f: Any) -> Any:
    """A Chain step that runs `f` on the result and issues nothing."""
    return lambda result: (f(result), [])


def unchanged(x: Any) -> Any:
    """The finish of a move whose received tensors are already the result."""
    return x


def chained(acts: dict, *moves: Any, then: Any = unchanged) -> Chain:
    """The Chain of `moves` in sequence: each `move(acts) -> (raw, handles, finish)` issues an exchange,
    `finish(raw)` after its wait gives the next move's acts; `then` maps the last one's."""
    raw, handles, finish = moves[0](acts)
    box = [finish]

    def step(move: Any) -> Any:
        def issue(got: Any) -> tuple[Any, list]:
            raw, handles, box[0] = move(box[0](got))
            return raw, handles
        return issue

    return Chain((raw, handles), *map(step, moves[1:]), lift(lambda got: then(box[0](got))))


class RowExchange:
    """The four row-level exchanges over the dispatcher's `move(plan, rows, reverse, name) -> (raw,
    handles, finish)`: issue, then `finish(raw)` after the wait gives the moved rows. `name` ("dispatch",
    "combine", with ".bwd" for a transpose) names the traffic; `reverse`: experts -> layout."""

    local = False  # Exchange capabilities: a subclass that differs declares its own
    splits_rows = False

    def token_level(self, cfg: MoEConfig) -> bool:
        """False: a row-level exchange takes layout rows whatever the config."""
        return False

    def token_exchange(self) -> Exchange:
        raise TypeError(f"{type(self).__name__} moves layout rows only (token_level is always False)")

    def start_plan(self, route: Any) -> Any:
        """Issues the count exchange of a routed layer (route.layout: its expert-sorted rows)."""
        return self.start_plan_rows(route.layout.counts_E, route.layout.num_rows)

    def _start(self, plan: RowPlan, acts: dict, src: str, dst: str, name: str) -> Chain:
        rows, rest = rows_apart(acts, src)
        move = partial(self.move, plan, reverse=src == "M", name=name)
        return chained(rows, move, then=lambda got: renamed(rest, got, src, dst))

    def start_dispatch(self, plan: RowPlan, acts: dict) -> Any:
        """Issues rows_RD (+ probs_R) -> rows_MD (+ probs_M); other acts pass through."""
        return self._start(plan, acts, "R", "M", "dispatch")

    def start_dispatch_transpose(self, plan: RowPlan, ct: dict) -> Any:
        """Issues the cotangents of rows_MD (+ probs_M) back to those of rows_RD (+ probs_R)."""
        return self._start(plan, ct, "M", "R", "dispatch.bwd")

    def start_combine(self, plan: RowPlan, acts: dict) -> Any:
        """Issues rows_MD -> rows_RD; other acts pass through."""
        return self._start(plan, acts, "M", "R", "combine")

    def start_combine_transpose(self, plan: RowPlan, ct: dict) -> Any:
        """Issues the cotangent of rows_RD back to that of rows_MD."""
        return self._start(plan, ct, "R", "M", "combine.bwd")


def rows_apart(acts: dict, src: str) -> tuple[dict, dict]:
    """Returns (rows, rest): the rows an exchange moves from side `src` ("R" layout, "M" experts: rows_<src>D
    and probs_<src> where present) and the other acts, which pass through."""
    keys = [k for k in (f"rows_{src}D", f"probs_{src}") if k in acts]
    return {k: acts[k] for k in keys}, {k: v for k, v in acts.items() if k not in keys}


def renamed(rest: dict, got: dict, src: str, dst: str) -> dict:
    """The acts after an exchange: `rest` and the moved rows `got` under side `dst`'s names."""
    return {**rest, **{k.replace(f"_{src}", f"_{dst}"): v for k, v in got.items()}}


def traffic_op(prefix: str, name: str, key: str) -> str:
    """The counter name of moving `key` in exchange `name`: gate weights count apart ("<prefix>.probs")."""
    return f"{prefix}.{name.replace('dispatch', 'probs') if key.startswith('probs') else name}"
