"""The schedule IR: immutable per-rank lists of actions on (stage, microbatch).

Legend: pp ranks (devices), S stages (model chunks), m microbatches; `stage` is a global stage id, `mb`
a global microbatch id, `rank` a device. Printing: `F3.1` = forward of stage 3 on microbatch 1; `B`, `I`
(input grad only), `W` (weight grad only); `F3.1&B4.0` = an overlapped pair run as one step;
`sa3.1>r2` / `ra3.1<r1` = send / receive of stage 3's output activation for microbatch 1 to / from a
rank; `sg`/`rg` the same for the input gradient produced by stage 3's backward.

Executor-facing API (all an executor needs): `Schedule.ranks[r]` is the ordered tuple of actions of rank
r, each one of `Op`, `Overlap`, `Send`, `Recv`; `Schedule.placement.stage_rank[s]` and
`.layer_chunk[s]` say where a stage lives and which model chunk it runs; `comms.with_comms(s)` (also
returned by `verify`) inserts the sends and receives; `deps.needs/produces(s, action)` say what an action
needs on its rank and leaves there. Nothing here is mutable.
"""

from __future__ import annotations

from dataclasses import dataclass

F, B, I, W = "F", "B", "I", "W"  # noqa: E741 - the names of the papers
COMPUTE_KINDS = (F, B, I, W)
ACT, GRAD = "act", "grad"


class ScheduleError(ValueError):
    """A schedule or generator argument violates a stated constraint; the message says which."""


@dataclass(frozen=True, order=True)
class Op:
    """One compute action: `kind` in F/B/I/W on (stage, mb)."""

    kind: str
    stage: int
    mb: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; expected one of {COMPUTE_KINDS}")

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


@dataclass(frozen=True)
class Overlap:
    """The forward `f` of one microbatch overlapped with the backward `b` (kind B or I) of another."""

    f: Op
    b: Op

    def __post_init__(self) -> None:
        if self.f.kind != F or self.b.kind not in (B, I):
            raise ScheduleError(f"an overlapped pair is F&B or F&I, got {self.f}&{self.b}")

    @property
    def ops(self) -> tuple[Op, Op]:
        """Returns (forward op, backward op)."""
        return (self.f, self.b)

    def __str__(self) -> str:
        return f"{self.f}&{self.b}"


@dataclass(frozen=True)
class Send:
    """Send `what` (ACT: output of stage's F; GRAD: input grad from stage's B/I) of `mb` to rank `peer`."""

    what: str
    stage: int
    mb: int
    peer: int

    def __str__(self) -> str:
        return f"s{self.what[0]}{self.stage}.{self.mb}>r{self.peer}"


@dataclass(frozen=True)
class Recv:
    """Receive `what` produced by `stage` for `mb` from rank `peer` (same key as the matching Send)."""

    what: str
    stage: int
    mb: int
    peer: int

    def __str__(self) -> str:
        return f"r{self.what[0]}{self.stage}.{self.mb}<r{self.peer}"


Action = Op | Overlap | Send | Recv


def ops_of(action: Action) -> tuple[Op, ...]:
    """Returns the compute ops inside an action: 1 for Op, 2 for Overlap, 0 for Send/Recv."""
    if isinstance(action, Op):
        return (action,)
    if isinstance(action, Overlap):
        return action.ops
    return ()


@dataclass(frozen=True)
class Placement:
    """Where stages live. `stage_rank[s]` = rank of stage s; `paths` = the stage sequences a microbatch
    may traverse (one for loop/interleaved/V, two for bidirectional DualPipe); `layer_chunk[s]` = the
    model chunk stage s runs (differs from s only when the model is duplicated)."""

    kind: str
    pp: int
    stage_rank: tuple[int, ...]
    paths: tuple[tuple[int, ...], ...]
    layer_chunk: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        """Returns the number of stages S."""
        return len(self.stage_rank)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Returns the stages held by `rank`, in increasing id."""
        return tuple(s for s, r in enumerate(self.stage_rank) if r == rank)


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: `ranks[r]` is rank r's ordered actions; microbatch `mb` follows
    `placement.paths[mb_path[mb]]`. Equality compares everything; `str` prints one line per rank."""

    name: str
    placement: Placement
    m: int
    mb_path: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]

    @property
    def pp(self) -> int:
        """Returns the number of ranks."""
        return self.placement.pp

    def path(self, mb: int) -> tuple[int, ...]:
        """Returns the stage sequence of microbatch `mb`."""
        return self.placement.paths[self.mb_path[mb]]

    def next_stage(self, stage: int, mb: int) -> int | None:
        """Returns the stage after `stage` on `mb`'s path, or None at its end (where the loss is)."""
        p = self.path(mb)
        k = p.index(stage)
        return p[k + 1] if k + 1 < len(p) else None

    def prev_stage(self, stage: int, mb: int) -> int | None:
        """Returns the stage before `stage` on `mb`'s path, or None at its start."""
        p = self.path(mb)
        k = p.index(stage)
        return p[k - 1] if k > 0 else None

    def __str__(self) -> str:
        return "\n".join(f"r{r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.ranks))


def diff(a: Schedule, b: Schedule) -> list[str]:
    """Returns human-readable differences (first differing position per rank); empty when a == b."""
    out = []
    if (a.placement, a.m, a.mb_path) != (b.placement, b.m, b.mb_path):
        out.append("placement, microbatches or paths differ")
    for r in range(max(len(a.ranks), len(b.ranks))):
        xa = a.ranks[r] if r < len(a.ranks) else ()
        xb = b.ranks[r] if r < len(b.ranks) else ()
        for k in range(max(len(xa), len(xb))):
            sa = str(xa[k]) if k < len(xa) else "<end>"
            sb = str(xb[k]) if k < len(xb) else "<end>"
            if sa != sb:
                out.append(f"r{r} position {k}: {sa} != {sb}")
                break
    return out
