"""A compute model: every compute phase the executor runs takes a modelled time, as on a device.

Legend: kind F / B / I / W (ir.py); phase = a Phase name ("attention", "mlp", "shared", ...; "stage" is a
whole stage run as one phase, its layer "L0-L3"); a table maps (kind, phase) -> seconds, kinds F, I, W.

    cm = ComputeModel(table_from_events(calibration_step.events, scale=2.0))
    execute(s, rank, programs, data, compute_model=cm)     # or gpt_pipeline_step(..., compute_model=cm)
    cm.summary()                                           # modelled against real time, overruns

Why: on a shared CPU, ranks compute in turns (4 ranks on 2 cores), so how much compute hides an exchange
depends on the scheduler, not on the executor. The executor calls the model as each compute phase ends;
the model sleeps until the phase's device start + its modelled duration (the real computation already
ran, and should take less: a phase that took longer returns at once and counts as an overrun). Asleep, a
rank leaves the core to the others, so ranks behave like devices computing while their exchanges travel,
as `fmoe.parallel.LinkModel` makes an exchange take its modelled time without a core.

The device start: a device runs the phases its host queued back to back, the host running ahead (the
executor has no host sync on a device path but the count exchange, issue 29), so the host's time between
two phases (Python, split_vjp's bookkeeping) costs the device nothing while the host is ahead. The model
keeps a device clock per step (`new_step`) and the host's lead: the time it slept since it last had to
wait for an exchange (the host of a device would not have slept: it queues and goes on). A phase starts
on the device at the latest of: the previous phase's end there, the completion of the exchanges the host
waited for (`waited`), and the moment the host would have queued it (its start less the lead). A host
slower than the modelled device still shows; so does every wait for a late peer.

Durations (`ComputeModel.duration`):
- F, I, W of a phase: the table's entry.
- B of a phase: I, plus W unless `deferred_dw` (the executor defers a phased B's dw to W calls under fb
  overlap; overlap off, the B's dx pass computes the dw too: set `deferred_dw = overlap` per step).
- phase "stage" (a stage with no exchange that leaves the process, run as one phase; the executor still
  reports its forward phase by phase): the sum over the (layer, phase)s that stage's forwards reported
  of the kind's duration; its B always includes W (such a stage never defers a B's dw). A table entry
  (kind, "stage") is used as it is, when given.
- anything else: `default` seconds when given, else KeyError. Raising is the default because a guessed
  duration would make every figure measured under the model quietly wrong.
Generic: knows phase names as strings, never the model.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from fmoe.schedule.ir import COMPUTE_KINDS, B, F, I, W
from fmoe.schedule.timeline import TraceEvent, summarize

STAGE = "stage"  # the phase name of a whole stage run as one phase
Table = Mapping[tuple[str, str], float]


@dataclass
class ModelStats:
    """What the model did, per kind: calls, modelled and real seconds (real = end of the real computation
    - start), overruns (phases whose real time exceeded the modelled one) and their excess seconds; and
    the modelled seconds per (kind, stage, mb) and per (kind, phase), for a simulator given the same
    costs."""

    calls: dict[str, int] = field(default_factory=dict)
    modelled: dict[str, float] = field(default_factory=dict)
    real: dict[str, float] = field(default_factory=dict)
    overruns: dict[str, int] = field(default_factory=dict)
    excess: dict[str, float] = field(default_factory=dict)
    per_op: dict[tuple[str, int, int], float] = field(default_factory=dict)
    per_phase: dict[tuple[str, str], float] = field(default_factory=dict)

    def add(self, kind: str, phase: str, stage: int, mb: int, modelled: float, real: float) -> None:
        # spelled out, not looped over the five dicts: called once per phase, on the host's budget
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.modelled[kind] = self.modelled.get(kind, 0) + modelled
        self.real[kind] = self.real.get(kind, 0) + real
        self.overruns[kind] = self.overruns.get(kind, 0) + (real > modelled)
        self.excess[kind] = self.excess.get(kind, 0) + (real - modelled if real > modelled else 0.0)
        self.per_op[(kind, stage, mb)] = self.per_op.get((kind, stage, mb), 0.0) + modelled
        self.per_phase[(kind, phase)] = self.per_phase.get((kind, phase), 0.0) + modelled

    def line(self) -> str:
        """Returns one printable line: modelled / real seconds in all, overruns and their excess."""
        n = sum(self.calls.values())
        over = sum(self.overruns.values())
        return (f"compute model: {n} phases, modelled {sum(self.modelled.values()):.3f} s, real "
                f"{sum(self.real.values()):.3f} s; {over} overran ({100 * over / max(n, 1):.1f}%) by "
                f"{sum(self.excess.values()):.3f} s in all")


class ComputeModel:
    """Holds each compute phase to its modelled duration (module docstring); a callable matching the
    executor's `compute_model` hook. `clock` / `sleep` default to time.perf_counter / time.sleep (tests
    pass a fake clock). `stats` accumulates until `reset()`."""

    def __init__(self, table: Table, *, default: float | None = None, deferred_dw: bool = True,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        for (kind, phase), t in table.items():
            if kind not in (F, I, W):
                raise ValueError(f"compute model: table kinds are F, I, W (B is I + W), got {(kind, phase)}")
            if not t >= 0 or t == float("inf"):
                raise ValueError(f"compute model: {(kind, phase)} must take finite seconds >= 0, got {t}")
        if default is not None and not 0 <= default < float("inf"):
            raise ValueError(f"compute model: default must be finite seconds >= 0, got {default}")
        self.table = dict(table)
        self.default = default
        self.deferred_dw = deferred_dw
        self.clock, self.sleep = clock, sleep
        self.stats = ModelStats()
        self._stage_phases: dict[int, dict[tuple[str, str], None]] = {}  # stage -> its forwards' phases
        self._device_free: float | None = None  # when the device ends its last phase (None: step not begun)
        self._inputs_ready = float("-inf")  # when the exchanges waited for since then completed
        self._lead = 0.0  # how far a device's host would be ahead of this one (module docstring)

    def new_step(self, t0: float) -> None:
        """Starts the device clock of a step that begins at clock time `t0` (the device is idle)."""
        self._device_free, self._inputs_ready, self._lead = t0, float("-inf"), 0.0

    def waited(self, completed: float) -> None:
        """Tells the model, as a wait ends, that the host waited for an exchange that completed at clock
        time `completed`: the next phase cannot start on the device before it, and the host's lead is
        what is left of it after blocking until then."""
        self._inputs_ready = max(self._inputs_ready, completed)
        self._lead = max(0.0, min(self._lead, self.clock() - completed))

    def reset(self) -> ModelStats:
        """Returns the stats so far and starts new ones."""
        out, self.stats = self.stats, ModelStats()
        return out

    def duration(self, kind: str, phase: str, stage: int | None = None) -> float:
        """Returns the modelled seconds of `kind` of `phase` (of `stage`, for phase "stage"). Raises
        KeyError for a phase the table does not know when there is no default, ValueError for a kind
        that is not F, B, I or W."""
        if kind not in COMPUTE_KINDS:
            raise ValueError(f"compute model: kind {kind!r} is not one of {COMPUTE_KINDS}")
        if (kind, phase) in self.table:
            return self.table[(kind, phase)]
        if phase == STAGE and stage is not None and stage in self._stage_phases:
            each = I if kind == B else kind
            t = sum(self._lookup(each, ph) for _, ph in self._stage_phases[stage])
            return t + (sum(self._lookup(W, ph) for _, ph in self._stage_phases[stage]) if kind == B else 0.0)
        if kind == B:
            with_w = phase == STAGE or not self.deferred_dw
            return self._lookup(I, phase) + (self._lookup(W, phase) if with_w else 0.0)
        return self._lookup(kind, phase)

    def _lookup(self, kind: str, phase: str) -> float:
        t = self.table.get((kind, phase), self.default)
        if t is None:
            known = ", ".join(f"{k} {p}" for k, p in sorted(self.table))
            raise KeyError(f"compute model: no duration for {kind} {phase!r} and no default (known: {known})")
        return t

    def __call__(self, kind: str, phase: str, stage: int, layer: str, mb: int, started: float) -> None:
        """The executor's hook, for a phase the host started at `started`: returns no earlier than its
        device start (module docstring; `started` when no step was begun) + its modelled duration, and
        no earlier than now."""
        if kind == F and phase != STAGE:
            self._stage_phases.setdefault(stage, {})[(layer, phase)] = None
        modelled = self.duration(kind, phase, stage)
        now = self.clock()
        self.stats.add(kind, phase, stage, mb, modelled, now - started)
        device_start = started
        if self._device_free is not None:
            device_start = max(self._device_free, self._inputs_ready, started - self._lead)
        end = max(device_start + modelled, now)
        if self._device_free is not None:
            self._device_free = end
        if end > now:
            self.sleep(end - now)
            self._lead += end - now


def table_from_events(events: Iterable[TraceEvent], scale: float = 1.0, b_is_dx: bool = True) -> dict:
    """Returns a table: `scale` x the median measured seconds of each (kind, phase) over the compute
    events of executor timelines (`StepResult.events`). `b_is_dx`: the B events are dx passes only (a
    step run with fb overlap on a phased stage, whose dw show as W events), counted as I; False: a B
    event holds dx and dw and cannot be split, so it raises ValueError. Whole-stage events (phase
    "stage") are left out (their forwards show per phase); a phase seen with dx events but no W gets W 0
    (it has no parameters, the executor runs no dw for it); a phase seen only in forwards (a whole
    stage's) gets I = W = its F, the Zero Bubble FLOP model. Pick `scale` so that the real phases run
    well within their modelled time under load (stats().overruns says when they did not)."""
    if not scale > 0:
        raise ValueError(f"table_from_events: scale must be > 0, got {scale}")
    times: dict[tuple[str, str], list[float]] = {}
    for (kind, phase), durations in summarize(events).compute.items():
        if phase == STAGE:
            continue
        if kind == B:
            if not b_is_dx:
                raise ValueError(f"table_from_events: the B {phase} events hold dx and dw together; "
                                 "calibrate on a step whose dw is deferred (fb overlap on)")
            kind = I
        times.setdefault((kind, phase), []).extend(durations)
    table = {k: scale * statistics.median(v) for k, v in times.items()}
    for kind, phase in list(table):
        if kind != F:
            continue
        dx = (I, phase) in table
        table.setdefault((I, phase), table[(F, phase)])
        table.setdefault((W, phase), 0.0 if dx else table[(F, phase)])
    return table


def table_from_flops(flops: Table, flops_per_s: float) -> dict:
    """Returns a table of `flops` ((kind, phase) -> FLOPs of one call) over a modelled rate."""
    if not flops_per_s > 0:
        raise ValueError(f"table_from_flops: flops_per_s must be > 0, got {flops_per_s}")
    return {k: v / flops_per_s for k, v in flops.items()}
