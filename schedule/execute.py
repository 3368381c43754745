"""execute: run one rank's part of a verified schedule over its stage programs.

    result = execute(s, rank, programs, data, group=pp_group)
    result.loss, result.grads, result.events, result.peak_activations

Contract:
- Cooperative and single-threaded. The weight-grad tape and remat's records are process-global, so the
  executor interleaves work only at phase boundaries, on the calling thread; it never runs two phases at
  once. Gloo runs issued collectives on its own threads, so compute between issue and wait overlaps them.
- F runs every phase of the stage under `split_vjp` (compute) or issues and waits its exchange (comm), and
  keeps the dx closures. I runs them in reverse and queues the dw thunks; W runs the thunks; B is I and
  then W. A B with nothing to hide its dw behind (overlap off, or every exchange of its stage marked
  `local`) defers nothing: its forward runs with `split_vjp(defer=False)` and its dx pass computes the
  weight gradients too, as plain autograd would (the same gradients, without the tape's work). An
  Overlap pair runs its backward and its forward by turns, the backward first (docs/pipeline.md says
  what pairs with what).
  Each op is a generator that yields after issuing an exchange and before waiting for it: a driver that
  runs two of them in turn overlaps one microbatch's exchange with the other's compute without changing
  the op code.
- Activations live from F until W (or B); after that nothing of the microbatch is held.
- Pipeline P2P on `group`, in the wire order (wire.py): every rank issues its sends and receives in the
  order of one global list of messages, so NCCL and HCCL, which ignore tags and run a pair's messages in
  issue order on one stream, match them as gloo's tags do. A send goes out the moment its data exists
  (an activation when its forward ends, a gradient when its dx pass ends, mid-pair), unless an op before
  it on the wire cannot go yet, then at the latest at its Send action; receives up to `recv_ahead`
  compute actions before their consumer (a gradient's once its own forward gave the shapes, and any
  that stand before a ready send) but never past an op before them on the wire, and waited just before
  use. On gloo, which matches by tag (wire.tag_matched), a receive asked for goes out at once, past the
  wire order: a receive posted right behind a send to the same peer would wait for gloo to push that
  send (the pair's lock). A send is waited, and its buffer dropped, as soon as it completed: when its
  work says so (NCCL, HCCL), at the latest when a later message on the wire arrives from its peer
  (which posted its receive before sending that one); what is left at the end of the step is waited
  there. Adjacent stages on one rank (the turn of a V) hand over in memory. Every message has its own
  buffer, on the stage's device: nothing is reused while a deferred dw could still read it.
- Loss: the mean over microbatches of the sum of every phase's losses; gradients are those of that mean.
- A measured timeline: compute phases on the compute lane, exchanges (issue to completion) on the comm
  lane, and every wait as its own compute-lane event.

Generic: knows stage programs (fmoe.transforms.program), never the model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fmoe._work import wait_work
from fmoe.schedule.comms import forward_first_by_turns
from fmoe.schedule.deps import Dep, Kind, carried
from fmoe.schedule.fuse import fuse_adjacent_iw
from fmoe.schedule.group import check_group
from fmoe.schedule.ir import B, F, I, Op, Overlap, Recv, Schedule, ScheduleError, Send
from fmoe.schedule.options import DEFAULTS, ExecOptions
from fmoe.schedule.rank_plan import RankPlan, rank_plan
from fmoe.schedule.timeline import COMPUTE, TraceEvent
from fmoe.schedule.verify import verify
from fmoe.schedule.wire import tag_matched, wire_order
from fmoe.transforms import split_vjp
from fmoe.transforms.program import (
    Acts,
    Layer,
    Meta,
    Phase,
    StageProgram,
    issue,
    run_phases,
    side_acts,
    subtree,
    turns,
)
from fmoe.transforms.split_vjp import DxFn

_MAX_KEYS = 64  # acts per message; message tags are (what, stage, microbatch, key index)
# (kind F/B/I/W, phase, stage, layer, mb, started perf_counter) -> returns at the phase's modelled end
ComputeModel = Callable[[str, str, int, str, int, float], None]


@dataclass
class StepResult:
    """What one rank's step produced.

    loss: mean over microbatches of the losses computed on this rank (0-dim tensor; 0 when none);
    losses: the same per loss name; grads: nested dicts with the global keys of this rank's stage params,
    summed over its stages; stats: (stage, mb, layer, phase, value) for every phase that reported
    meta["stats"]; events: the measured timeline (empty when not traced: ExecOptions.trace); peak_activations:
    most (stage, microbatch) forwards alive at once; peak_deferred: most (stage, microbatch) dw passes queued
    at once; waited: seconds this rank spent waiting for exchanges and receives (the timeline's "wait"
    events' total, kept when it is not traced)."""

    loss: torch.Tensor
    losses: dict[str, torch.Tensor]
    grads: dict[str, Any]
    stats: list[tuple[int, int, str, str, Any]]
    events: list[TraceEvent]
    peak_activations: int
    peak_deferred: int
    waited: float = 0.0


class Side(NamedTuple):
    """What a side phase's forward left (`_side_forward`): its output acts, its dx closure, their specs."""

    out: Acts
    vjp_dx: Callable[..., Any]
    spec: dict[str, tuple]


@dataclass(frozen=True)
class PhaseRecord:
    """What F of one (stage, microbatch) keeps of one phase `phase` of layer `layer` for its backward: a
    compute phase its dx closure `vjp_dx` and its outputs' `spec` ((shape, dtype, device) per act); an
    exchange the `side` run alongside it (None when none ran in its forward) and the `meta` its wait
    returned (what `start_transpose` is given)."""

    phase: Phase
    layer: str
    vjp_dx: Callable[..., Any] | None = None
    spec: dict[str, tuple] | None = None
    side: Side | None = None
    meta: Meta | None = None
    delivered: dict[str, tuple] | None = None  # a deferred exchange: (shape, dtype, device) of what it gave


class DwPass(NamedTuple):
    """A weight-gradient pass left for later: phase `phase` of layer `layer`, its thunk `vjp_dw`."""

    phase: Phase
    layer: str
    vjp_dw: Callable[[], Any]


class _Posted(NamedTuple):
    """A receive issued early: its works, the buffers they fill, when it was posted (timeline seconds)."""

    works: list
    bufs: Acts
    posted_at: float


class _Sent(NamedTuple):
    """A send in flight: its work, the buffer kept alive until it is waited, what it sends (for errors),
    its message's index on the rank's wire."""

    work: Any
    buf: torch.Tensor
    what: str
    at: int


class _Held(NamedTuple):
    """An exchange of (stage, mb) whose wait is deferred (Phase.defer_wait): its phase, layer, Pending,
    issue time and the meta keys it was issued with (the forward's; the backward's record, its direction)."""

    phase: Phase
    layer: str
    stage: int
    mb: int
    pending: Any
    issued: float
    keys: set[str]


@dataclass
class _Record:
    """What F of one (stage, microbatch) keeps for its backward, phase by phase."""

    phases: list[PhaseRecord] = field(default_factory=list)
    out_spec: dict[str, tuple[torch.Size, torch.dtype]] | None = None  # set when the forward ends
    # a whole stage whose dx pass adds its weight gradients into the step's sums (split_vjp's `into`)
    sums_in_dx: bool = False
    defer: bool = False  # its weight gradients wait on split_vjp tapes for the dw passes


class _Summed:
    """A dw pass whose gradients already are the step's sums (the dx pass added into them, or the dw pass
    adds into them when called): its results are handed over, not added again. `sums`: None when the dx
    pass was given its sums (`fn()` hands them over), else a function returning (the `into` tree, whether
    it is complete), asked as the pass runs and given to `fn(into=...)`. `complete`: every leaf was given
    its sum (`_sums_of` from `sums_at`), so each gradient the pass returns is the sum already in the
    step's tree, and there is nothing to hand over."""

    __slots__ = ("fn", "sums", "complete")

    def __init__(self, fn: Callable[..., Any], sums: Callable[[], tuple[Any, bool]] | None = None,
                 complete: bool = False):
        self.fn, self.sums, self.complete = fn, sums, complete

    def __call__(self) -> Any:
        if self.sums is None:
            return self.fn()
        into, self.complete = self.sums()
        return self.fn(into=into)


class _Counter:
    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, k: int) -> None:
        self.now += k
        self.peak = max(self.peak, self.now)


def check_programs(s: Schedule, rank: int, programs: Mapping[int, StageProgram]) -> None:
    """Raises ScheduleError unless `programs` holds exactly the stages `s` places on `rank`, each naming
    its own stage, with stages of one model chunk structured alike; returns None."""
    want = set(s.placement.stages_of(rank))
    if set(programs) != want:
        raise ScheduleError(f"rank {rank}: stage programs for stages {sorted(programs)}, but schedule "
                            f"{s.name} places stages {sorted(want)} on this rank")
    for st, prog in programs.items():
        if prog.stage != st:
            raise ScheduleError(f"rank {rank}: the program under stage {st} says it is stage {prog.stage}")
        if not prog.layers:
            raise ScheduleError(f"rank {rank}: stage {st} has no layers")


def execute(s: Schedule, rank: int, programs: Mapping[int, StageProgram], data: Callable[[int], Meta], *,
            group: dist.ProcessGroup | None = None, options: ExecOptions = DEFAULTS,
            on_stage_done: Callable[[int, dict[str, Any]], None] | None = None,
            stage_turns: Mapping[int, int] | None = None,
            around_op: Callable[[Op], contextlib.AbstractContextManager] | None = None) -> StepResult:
    """Runs rank `rank`'s actions of `s` over `programs` (stage -> StageProgram) for one step; returns its
    StepResult. `data(mb)` gives the microbatch's meta (token ids, targets; every rank that runs a stage of
    the microbatch calls it). `group` is the pipeline process group (None: the default group; unused when
    pp = 1). `options` (fmoe.schedule.options.ExecOptions, built once per run), field by field:
    `timeout` bounds every P2P wait, so a dead peer fails the step naming the rank. `recv_ahead`:
    how many compute actions before its consumer a receive is posted (each one posted early holds its
    buffer that much longer). 4, because on gloo a receive posted while the peer is already sending that
    message waits for the peer's transport thread, which on a machine with no spare core is a scheduler
    quantum: with 2, posting took 7-52 ms of rank 1's 2-rank interleaved step on 2 cores (single calls up
    to 7.6 ms), with 4 it takes 2.5-4.9 ms (0.1 ms a call), as on rank 0. `overlap`
    (default on): an Overlap pair interleaves its two ops phase by phase, and a lone B runs the dw of the
    phases it has differentiated while its exchanges travel; off: pairs run one op after the other.
    `engine`: how compute phases are differentiated (`split_vjp`'s engine; "autograd", the default, has
    less per-op overhead and frees a phase's activations as its dx pass runs; "func": torch.func.vjp).
    `grad_dtype`: the dtype the
    weight gradients are summed in over microbatches (None: as each dw pass produces them); a mixed-
    precision step passes fp32 so that bf16 dw results are added in fp32. `loss_scale`: the backward starts
    from loss_scale / m instead of 1 / m (fp16 loss scaling): the gradients come back multiplied by it,
    the reported losses do not. `fuse_iw` (default on): a lone I whose W is the rank's next compute action,
    with no send between them, runs as one B (`fmoe.schedule.fuse_adjacent_iw`: same results at the same
    points of the list, less work); off runs every I and W as listed. `device`: where receive buffers and
    loss sums live (None: the device of the stages' parameters). `compute_model(kind, phase, stage, layer,
    mb, started)`: called as each compute phase ends (kind F/B/I/W, `started` a time.perf_counter()
    value), it returns no earlier than the phase's modelled end, so that ranks sharing a few cores run as
    devices that compute while their exchanges travel (as a LinkModel does for the exchanges); the
    computation itself runs as always. The executor starts its device clock (`new_step`) and tells it
    when each exchange or receive it waited for completed (`waited`). `stage_turns`: for every stage of
    the schedule (all ranks', the same on every rank), the exchanges in flight at which its ops hand
    over (`stage_turns_of` of its program): with them an overlapped pair's two messages go on the wire
    in the order they exist (comms.forward_first_by_turns), so an activation never waits behind its
    pair's gradient; None: the backward's first (right when both stages hold as many exchanges).
    `on_stage_done(stage, grads)`: called once per stage of this rank, right after the last weight
    gradient of its last microbatch was added into `grads` (the step's gradient dict, as returned):
    from then on the gradients of the params only that stage reads on this rank no longer change, so a
    caller may start reducing them while the rest of the schedule runs. `around_op(op)`: a context
    manager entered around each op that runs alone (not an Overlap pair's), e.g. to count what that op
    does (fmoe.sync_count.phased_block_syncs). `trace` (default on): record the measured timeline
    (`StepResult.events`); off, the step makes no event (and no name for one): what it saves is
    benchmarks/host_overhead.py's "trace records" row.
    Everything that depends on the schedule alone (which Dep each op takes and gives, where each receive
    is asked for, each message's place on the wire: schedule/rank_plan.py) is decided on the first step
    of a (schedule, rank, options) and kept with its verification; each step walks that plan."""
    check_programs(s, rank, programs)
    check_group(s, rank, group)
    if stage_turns is not None:
        _check_turns(s, rank, programs, stage_turns)
    turns_key = None if stage_turns is None else tuple(sorted(stage_turns.items()))
    plan = _plan(s, rank, options, turns_key)
    return _Executor(s, rank, programs, data, group, options, on_stage_done,
                     options.device or _device_of(programs), around_op).run(plan)


def _device_of(programs: Mapping[int, StageProgram]) -> torch.device:
    """Returns the device of the first parameter of `programs` (CPU when they hold none)."""
    stack: list[Any] = [prog.params for prog in programs.values()]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            return node.device
        stack.extend(node.values() if isinstance(node, Mapping) else node if isinstance(node, (list, tuple))
                     else ())
    return torch.device("cpu")


def stage_turns_of(program: StageProgram) -> int:
    """Returns the exchanges in flight at which an op of `program`'s stage hands over to its pair: its
    comm phases that may leave the process and switch (`Phase.switch`), the same for its forward and its
    backward's dx pass; 0 when none may leave the process (the executor runs the stage whole)."""
    return sum(turns(ly.phases) for ly in program.layers)


def _check_turns(s: Schedule, rank: int, programs: Mapping[int, StageProgram],
                 stage_turns: Mapping[int, int]) -> None:
    # every rank derives the wire order from stage_turns: a wrong value for a stage would order a pair's
    # messages differently on the two ends of a link (a mismatch under NCCL), so this rank checks its own
    if set(stage_turns) != set(range(s.placement.num_stages)):
        raise ScheduleError(f"rank {rank}: stage_turns covers stages {sorted(stage_turns)}, schedule "
                            f"{s.name} has stages 0..{s.placement.num_stages - 1}")
    for st, prog in programs.items():
        if stage_turns[st] != stage_turns_of(prog):
            raise ScheduleError(f"rank {rank}: stage_turns says stage {st} hands over at {stage_turns[st]} "
                                f"exchanges, its program at {stage_turns_of(prog)}")


# (schedule, fuse_iw, overlap, turns) -> the lists the executor runs and their wire order, by identity: a
# training loop runs one Schedule value every step, and verifying it (a dependency replay of every rank's
# list) costs as much as the executor's own bookkeeping of a step on small shapes. Schedules are frozen, so
# a verification stays valid; the entry holds its schedule, so the id cannot be reused while it is cached.
# The rank's plan (rank_plan.py) is kept with them: every decision that depends on the schedule alone.
_VERIFIED: dict[tuple, tuple[Schedule, Schedule, tuple, dict[tuple[int, int], RankPlan]]] = {}
_VERIFIED_MAX = 16


def _verified(s: Schedule, fuse_iw: bool, overlap: bool, turns: tuple[tuple[int, int], ...] | None
              ) -> tuple[Schedule, tuple[tuple[Send | Recv, ...], ...], dict[tuple[int, int], RankPlan]]:
    key = (id(s), fuse_iw, overlap, turns)
    hit = _VERIFIED.get(key)
    if hit is not None and hit[0] is s:
        return hit[1], hit[2], hit[3]
    full = verify(s, forward_first_by_turns(None if turns is None else dict(turns), overlap))
    if fuse_iw:
        full = fuse_adjacent_iw(full)
    wire = wire_order(full)  # of the lists as they run: fusing moves no Send, but the replay says so
    if len(_VERIFIED) >= _VERIFIED_MAX:
        _VERIFIED.pop(next(iter(_VERIFIED)))
    _VERIFIED[key] = (s, full, wire, {})
    return full, wire, _VERIFIED[key][3]


def _plan(s: Schedule, rank: int, options: ExecOptions, turns: tuple[tuple[int, int], ...] | None
          ) -> RankPlan:
    """Returns rank `rank`'s RankPlan of `s` under `options`, made on the first step that asks for it."""
    full, wire, plans = _verified(s, options.fuse_iw, options.overlap, turns)
    got = plans.get((rank, options.recv_ahead))
    if got is None:
        got = plans[(rank, options.recv_ahead)] = rank_plan(full, wire[rank], rank, options.recv_ahead)
    return got


class _Executor:
    def __init__(self, s: Schedule, rank: int, programs: Mapping[int, StageProgram],
                 data: Callable[[int], Meta], group: dist.ProcessGroup | None, options: ExecOptions,
                 on_stage_done: Callable[[int, dict[str, Any]], None] | None, device: torch.device,
                 around_op: Callable[[Op], contextlib.AbstractContextManager] | None = None):
        self.s, self.rank, self.programs, self.data = s, rank, programs, data
        self.around_op = around_op or (lambda op: contextlib.nullcontext())
        self.group, self.recv_ahead, self.timeout = group, options.recv_ahead, options.timeout
        self.overlap, self.engine, self.device = options.overlap, options.engine, device
        self.compiled = options.compiled
        self.compute_model = compute_model = options.compute_model
        self.on_stage_done = on_stage_done
        self.grad_dtype = options.grad_dtype
        loss_scale = options.loss_scale
        self.weights_done: dict[int, int] = {}  # stage -> microbatches whose dw all ran
        self.scale = 1.0 / s.m  # the losses are averaged over the microbatches
        self.seed = loss_scale / s.m  # the cotangent every loss's backward starts from
        self.t0 = time.perf_counter()
        if compute_model is not None:  # the device is idle when the step begins
            compute_model.new_step(self.t0)
        self.events: list[tuple] = []  # what `_event` recorded; TraceEvents made once the step ends
        self.waited = 0.0  # seconds waited for exchanges and receives, traced or not
        self.records: dict[tuple[int, int], _Record] = {}
        self.deferred: dict[tuple[int, int], list[DwPass]] = {}
        self.local: dict[Dep, Acts] = {}
        self.posted: dict[Dep, _Posted] = {}
        self.wire: list[Send | Recv] = []  # this rank's P2P ops not issued yet, in wire order
        self.wanted: set[Dep] = set()  # receives asked for early (posted once the wire order allows)
        self.issued: set[Dep] = set()  # receives gone out (a receive leaves the wire only by `_irecv`)
        self.sent: set[Dep] = set()  # messages sent before their Send action (the moment they existed)
        # sends in flight per peer, in wire order: each is released (waited, its buffer dropped) once it
        # completed, at the latest when a later message from its peer arrived (`_release_sends`)
        self.sends: dict[int, list[_Sent]] = {}
        self.trace = options.trace
        matched = tag_matched(group)
        if options.early_recv and dist.is_initialized() and not matched:
            raise ValueError(f"execute: early_recv=True on {dist.get_backend(group)}, which matches messages "
                             "by issue order: receives out of the wire order would hang or swap messages "
                             "(leave early_recv None: gloo's receives go early by themselves)")
        self.early_recv = matched if options.early_recv is None else options.early_recv
        self.losses: dict[str, torch.Tensor] = {}
        self.grads: dict[str, Any] = {}
        self.owned: set[tuple[str, ...]] = set()  # paths in grads whose tensor the executor allocated
        self.params_at: dict[tuple, tuple[Any, ...]] = {}  # (stage, param paths) -> their params subtrees
        self.sums_at: dict[tuple, tuple[Any, ...]] = {}  # (stage, param paths) -> complete `into` trees
        self.stats: list[tuple[int, int, str, str, Any]] = []
        self.live, self.queued = _Counter(), _Counter()
        self.step = ""  # "pair" / "lone" while an Overlap / a single op runs: tags the trace events
        self.backward_is_b: set[tuple[int, int]] = set()  # (stage, mb) whose backward is a B
        # stages with an exchange that may leave the process (a comm phase not marked local)
        self.remote = {st for st, prog in programs.items()
                       if any(ph.kind == "comm" and not ph.local for ly in prog.layers for ph in ly.phases)}
        # an overlapped pair starts with its backward where that hands over (seed 000's pairing); one whose
        # backward stage hands over nowhere (its exchanges local, or no layer pairs) runs as listed, the
        # forward first: what comms.forward_first_by_turns lists its messages by
        self.backward_starts = {st for st in self.remote if stage_turns_of(programs[st]) > 0}

    # ---- driver ---------------------------------------------------------------------------------------

    def run(self, plan: RankPlan) -> StepResult:
        self.plan = plan
        self.wire = list(reversed(plan.wire))  # popped from the end
        self.backward_is_b = plan.backward_is_b
        recv_before = plan.recv_before
        for k, a in enumerate(plan.actions):
            for r in recv_before.get(k, ()):
                self._post_recv(r)
            if isinstance(a, Send):
                self._send(a)
            elif isinstance(a, Op):
                self.step = "lone"
                with self.around_op(a):
                    _drain(self.op(a))
            elif isinstance(a, Overlap) and self.overlap:
                self.step = "pair"
                if a.b.stage in self.backward_starts:
                    # the backward first: its combine goes out, the forward's attention hides it, and so on
                    # by turns: seed 000's pairing (docs/pipeline.md, "fb overlap: what pairs with what")
                    _interleave(self.op(a.b, paired=True), self.op(a.f, paired=True))
                else:  # the backward hands over nowhere, nothing to pair it with: as listed
                    _interleave(self.op(a.f, paired=True), self.op(a.b, paired=True))
            elif isinstance(a, Overlap):
                self.step = "pair"
                _drain(self.op(a.f))
                _drain(self.op(a.b, paired=True))
            self.step = ""
            if self.sends and self.device.type != "cpu":  # a gloo send says it completed only once waited
                self._reap_sends()
        for peer in list(self.sends):
            self._release_sends(peer, len(self.plan.wire))
        if self.wire:
            left = [str(a) for a in reversed(self.wire)]
            raise ScheduleError(f"rank {self.rank}: P2P ops {left} never ran")
        if self.records or self.deferred:
            left = sorted(set(self.records) | set(self.deferred))
            raise ScheduleError(f"rank {self.rank}: (stage, mb) {left} still held at the end of the step")
        loss = sum(self.losses.values(), torch.zeros((), device=self.device))
        events = [_trace_event(self.rank, *raw) for raw in self.events]
        return StepResult(loss, dict(self.losses), self.grads, self.stats, events, self.live.peak,
                          self.queued.peak, self.waited)

    def op(self, op: Op, paired: bool = False) -> Iterator[None]:
        """Returns the generator that runs compute op `op`, yielding after each issued exchange that is
        still in flight. `paired`: the op is one half of an Overlap (the other op hides its exchanges)."""
        if op.kind == F:
            return self._forward(op.stage, op.mb, paired=paired)
        if op.kind == I:
            return self._backward(op.stage, op.mb, weights=False, paired=paired)
        if op.kind == B:
            return self._backward(op.stage, op.mb, weights=True, paired=paired)
        return self._weights(op.stage, op.mb)

    # ---- compute ops ----------------------------------------------------------------------------------

    def _defers(self, stage: int, mb: int) -> bool:
        """Whether (stage, mb)'s forward keeps its weight gradients deferrable. Not when its backward is a
        B that has no exchange to hide them behind (overlap off, or every exchange of the stage local):
        the B then computes them in its dx pass, as plain autograd does, with less work."""
        if (stage, mb) not in self.backward_is_b:
            return True
        return self.overlap and stage in self.remote

    def _forward(self, stage: int, mb: int, paired: bool = False) -> Iterator[None]:
        prog = self.programs[stage]
        acts = self._take_boundary((F, stage, mb))
        meta = dict(self.data(mb))
        defer = self._defers(stage, mb)
        rec = _Record(defer=defer)
        self.records[(stage, mb)] = rec
        self.live.add(1)
        phased = stage in self.remote
        if not phased:  # nothing travels: no phase boundary to switch ops at
            acts = self._whole_stage_forward(prog, acts, meta, stage, mb, rec, defer)
        held = None  # an exchange whose wait is deferred (Phase.defer_wait), with what its wait needs
        for layer in prog.layers if phased else ():
            for ph in layer.forward_phases(paired):
                side = None
                if ph.kind == "comm" and held is not None:
                    if paired and ph.side is not None:
                        # the paired op's compute hides this exchange; the side (it reads acts only, the
                        # same before and after the held wait) hides the held one, whose EP peer may be late
                        side = self._timed_side(prog, ph, layer.name, acts, meta, defer, stage, mb)
                    acts, meta = self._wait_held(held, acts, meta, rec)
                    held = None
                if ph.kind == "compute":
                    t = self._now()
                    acts, meta = self._compute_forward(prog, ph, layer.name, acts, meta, stage, mb, rec,
                                                       defer)
                    self._computed("F", ph.name, stage, layer.name, mb, t)
                else:
                    t = self._now()
                    pending, rest = issue(ph, acts, meta)
                    if ph.defer_wait:  # the next compute phases hide it; waited before the next exchange
                        held, acts = _Held(ph, layer.name, stage, mb, pending, t, set(meta)), rest
                        continue
                    if ph.side is not None and side is None:  # runs while the exchange travels
                        side = self._timed_side(prog, ph, layer.name, acts, meta, defer, stage, mb)
                    if _in_flight(pending) and ph.switch:
                        yield
                    tw = self._now()
                    acts, meta = pending.wait()
                    self._comm_events(pending, ph.name, "F", stage, layer.name, mb, t, tw)
                    if side is not None:
                        acts = _with_side(acts, ph, side.out)
                    rec.phases.append(PhaseRecord(ph, layer.name, side=side, meta=meta))
        if held is not None:
            acts, meta = self._wait_held(held, acts, meta, rec)
        if not self._give_boundary((F, stage, mb), acts) and acts:
            raise ScheduleError(f"stage {stage} ends microbatch {mb}'s path but leaves acts "
                                f"{sorted(acts)} that no loss consumes")
        rec.out_spec = {k: (v.shape, v.dtype) for k, v in acts.items()}
        self._pump()  # a gradient receive may have waited for these shapes

    def _wait_held(self, held: _Held, acts: Acts, meta: Meta, rec: _Record) -> tuple[Acts, Meta]:
        """Waits a forward exchange whose wait was deferred (`held`); returns (`acts` with what it
        delivered, `meta` with the keys it added). Its record goes where it is waited: the backward meets
        it after the compute that hid it and issues its transpose there."""
        tw = self._now()
        got_acts, got = held.pending.wait()
        self._comm_events(held.pending, held.phase.name, "F", held.stage, held.layer, held.mb, held.issued,
                          tw)
        delivered = {k: (v.shape, v.dtype, v.device) for k, v in got_acts.items()}
        rec.phases.append(PhaseRecord(held.phase, held.layer, meta=got, delivered=delivered))
        return {**acts, **got_acts}, {**meta, **{k: v for k, v in got.items() if k not in held.keys}}

    def _wait_held_transpose(self, held: _Held, ct: Acts) -> Acts:
        """Waits a deferred exchange's transpose (`held`); returns `ct` with the cotangents it delivered."""
        tw = self._now()
        got = held.pending.wait()
        self._comm_events(held.pending, held.phase.name, "B", held.stage, held.layer, held.mb, held.issued,
                          tw)
        return {**ct, **got}

    def _whole_stage_forward(self, prog: StageProgram, acts: Acts, meta: Meta, stage: int, mb: int,
                             rec: _Record, defer: bool) -> Acts:
        """Runs every phase of the stage, its local exchanges inline, under one split_vjp: for a stage with
        nothing to overlap, so its dx pass is one autograd pass instead of one per phase (and, `defer`
        False, computes the weight gradients too, as plain autograd does). The forward's timeline keeps
        its phases; the backward is one event. Returns the acts the stage passes on (losses taken out)."""
        whole = _whole_stage(prog.layers)
        # a compiled stage has no phases to record
        hooks = None if self.compiled is not None else _ForwardHooks(self, stage, mb)

        def fn(p: tuple, a: Acts, m: Meta) -> tuple[Acts, list]:
            # aux: the stats only (the executor passes no meta on from a whole stage: nothing to detach)
            ran = run_phases(prog.layers, _params_in_order(p), a, m, hooks)
            return {**ran.acts, **ran.losses}, ran.stats

        out, vjp_dx, stats = self._split(("stage", stage), fn, self._params_at(prog, whole.phase.param_paths),
                                         acts, meta, defer)
        # its B adds each weight gradient into the step's sum as the backward makes it (in cache), as
        # AccumulateGrad does, instead of a pass over every gradient afterwards
        rec.sums_in_dx = not defer and (self.engine == "autograd" or self.compiled is not None)
        rec.phases.append(PhaseRecord(whole.phase, whole.names, vjp_dx=vjp_dx,
                                      spec={k: (v.shape, v.dtype, v.device) for k, v in out.items()}))
        self.stats.extend((stage, mb, layer, ph_name, st) for layer, ph_name, st in stats)
        for k in whole.phase.losses:
            self._add_loss(k, out.pop(k))
        return out

    def _timed_side(self, prog: StageProgram, ph: Phase, layer: str, acts: Acts, meta: Meta, defer: bool,
                    stage: int, mb: int) -> Side:
        """Runs comm phase `ph`'s side forward (`_side_forward`) on the acts it is given (`side_acts`) and
        records it on the timeline."""
        ts = self._now()
        side = self._side_forward(prog, ph.side, layer, side_acts(ph, acts), meta, defer, stage)
        self._computed("F", ph.side.name, stage, layer, mb, ts)
        return side

    def _side_forward(self, prog: StageProgram, ph: Phase, layer: str, acts: Acts, meta: Meta,
                      defer: bool, stage: int) -> Side:
        """Runs side phase `ph` on the pre-exchange `acts` under split_vjp; returns its Side."""
        params = self._params_at(prog, ph.param_paths)
        out, vjp_dx, _ = self._split(("side", stage, layer, ph.name), ph.run, params, acts, meta, defer)
        return Side(out, vjp_dx, {k: (v.shape, v.dtype, v.device) for k, v in out.items()})

    def _compute_forward(self, prog: StageProgram, ph: Phase, layer: str, acts: Acts, meta: Meta,
                         stage: int, mb: int, rec: _Record, defer: bool) -> tuple[Acts, Meta]:
        params = self._params_at(prog, ph.param_paths)

        def fn(p: tuple, a: Acts, m: Meta) -> tuple[Acts, Meta]:
            out, meta_out = ph.run(p, a, m)
            _check_floating(out, stage, layer, ph.name)
            return out, meta_out

        out, vjp_dx, meta_out = self._split(("phase", stage, layer, ph.name), fn, params, acts, meta, defer)
        spec = {k: (v.shape, v.dtype, v.device) for k, v in out.items()}
        rec.phases.append(PhaseRecord(ph, layer, vjp_dx=vjp_dx, spec=spec))
        if isinstance(meta_out, dict) and "stats" in meta_out:
            # a copy: split_vjp hands a graph-free aux back as the phase made it, which stays as it was
            meta_out = dict(meta_out)
            stats = meta_out.pop("stats")
            if stats is not None:
                self.stats.append((stage, mb, layer, ph.name, stats))
        passed = {}
        for k, v in out.items():
            if k in ph.losses:
                self._add_loss(k, v)
            else:
                passed[k] = v
        return passed, meta_out

    def _split(self, key: tuple[Any, ...], fn: Callable[[Any, Acts, Meta], tuple[Acts, Any]], params: Any,
               acts: Acts, meta: Meta, defer: bool) -> tuple[Acts, DxFn, Any]:
        """`fn(params, acts, meta)` with its backward split (out, vjp_dx, aux): under split_vjp, or as the
        three compiled graphs of phase `key` (options.compiled, traced once per run)."""
        if self.compiled is None:
            return split_vjp(lambda p, a: fn(p, a, meta), params, acts, has_aux=True, engine=self.engine,
                             defer=defer)
        return self.compiled.split(key, fn)(params, acts, consts=(meta,), defer=defer)

    def _add_loss(self, name: str, v: torch.Tensor) -> None:
        """Adds microbatch loss `v` (scalar) into the step's mean loss `name`."""
        mine = v.detach() * self.scale
        self.losses[name] = mine if name not in self.losses else self.losses[name] + mine

    def _backward(self, stage: int, mb: int, weights: bool, paired: bool = False) -> Iterator[None]:
        rec = self.records.pop((stage, mb), None)
        if rec is None:
            raise ScheduleError(f"rank {self.rank}: backward of stage {stage} mb {mb} before its forward")
        ct = self._take_boundary((I, stage, mb), rec.out_spec)
        queue: list[DwPass] = []
        kind = "B" if weights else "I"
        # side phases whose backward has not run yet (index in rec.phases -> record), and the input
        # cotangents of those that ran, to add where their exchange is transposed; a side runs early only
        # at an exchange of its own layer (another layer's acts may have the same names)
        sides = {k: r for k, r in enumerate(rec.phases) if r.phase.kind == "comm" and r.side is not None}
        side_ct: dict[int, Acts] = {}
        held = None  # a deferred exchange's transpose (Phase.defer_wait), waited before the next exchange
        while rec.phases:
            at = len(rec.phases) - 1
            r = rec.phases.pop()
            ph, layer = r.phase, r.layer
            if ph.kind == "comm" and held is not None:
                ct, held = self._wait_held_transpose(held, ct), None
            if ph.kind == "comm" and ph.defer_wait:  # mirrors its forward: the compute before it hides it
                t = self._now()
                given = {k: ct.pop(k) if k in ct else torch.zeros(sh, dtype=dt, device=dev)
                         for k, (sh, dt, dev) in (r.delivered or {}).items()}
                held = _Held(ph, layer, stage, mb, ph.start_transpose(given, r.meta), t, set())
                if not _in_flight(held.pending):  # nothing travels (a count exchange's transpose)
                    ct, held = self._wait_held_transpose(held, ct), None
            elif ph.kind == "compute":
                t = self._now()
                full = {}
                for k, (shape, dtype, device) in r.spec.items():
                    if k in ph.losses:
                        full[k] = torch.full(shape, self.seed, dtype=dtype, device=device)
                    else:
                        g = ct.get(k)
                        full[k] = torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                if rec.sums_in_dx:
                    into, complete = self._sums_of(stage, ph), self._sums_complete(stage, ph)
                    (ct,), vjp_dw = r.vjp_dx(full, into=into)
                    vjp_dw = _Summed(vjp_dw, complete=complete)
                    del into
                else:
                    (ct,), vjp_dw = r.vjp_dx(full)
                    if rec.defer:
                        vjp_dw = self._dw_into_sums(stage, ph, vjp_dw)
                ct = {k: v for k, v in ct.items() if v is not None}
                del full, r  # the record held the last reference to the dx closure
                queue.append(DwPass(ph, layer, vjp_dw))
                self._computed(kind, ph.name, stage, layer, mb, t)
            else:
                t = self._now()
                # sides whose output cotangents are all here (or that ride on this exchange) run now
                ready = [k for k, sr in sides.items()
                         if k == at or (sr.layer == layer and set(sr.side.spec) <= set(ct))]
                side_in = {k: {name: ct.pop(name) if name in ct else torch.zeros(sh, dtype=dt, device=dev)
                               for name, (sh, dt, dev) in sides[k].side.spec.items()} for k in ready}
                pending = ph.start_transpose(ct, r.meta)
                for k in ready:  # the side's backward hides this exchange
                    sr = sides.pop(k)
                    side_ph, side_layer, side_dx = sr.phase.side, sr.layer, sr.side.vjp_dx
                    ts = self._now()
                    (side_ct[k],), vjp_dw = side_dx(side_in[k])
                    if rec.defer:
                        vjp_dw = self._dw_into_sums(stage, side_ph, vjp_dw)
                    queue.append(DwPass(side_ph, side_layer, vjp_dw))
                    self._computed(kind, side_ph.name, stage, side_layer, mb, ts)
                if _in_flight(pending):
                    if weights and self.overlap and not paired:
                        # a lone B: the dw of the phases already differentiated (the routed experts')
                        # hides the exchange, whether or not its layer hands over in a pair
                        self._run_dw(stage, mb, queue)
                    if ph.switch:
                        yield
                tw = self._now()
                ct = pending.wait()
                self._comm_events(pending, ph.name, "B", stage, layer, mb, t, tw)
                if at in side_ct:  # this exchange carried a side: add the side's input cotangents
                    for name, g in side_ct.pop(at).items():
                        if g is not None:
                            ct[name] = g if name not in ct else ct[name] + g
        if held is not None:
            ct = self._wait_held_transpose(held, ct)
        if self._give_boundary((I, stage, mb), ct):
            self._pump()  # the gradient goes out now, before any dw and before the paired op's rest
        self.deferred[(stage, mb)] = queue
        self.queued.add(1)
        if weights:
            yield from self._weights(stage, mb, interleaved=paired and self.overlap)

    def _weights(self, stage: int, mb: int, interleaved: bool = False) -> Iterator[None]:
        """Runs the dw thunks of (stage, mb). `interleaved` (the B of an overlapped pair): one thunk per
        turn, so the pair's forward, which the backward would otherwise leave alone with its last
        exchanges, runs while they travel and the dw fills the waits."""
        queue = self.deferred.pop((stage, mb), None)
        if queue is None:
            raise ScheduleError(f"rank {self.rank}: W of stage {stage} mb {mb} before its I")
        while queue:
            work = bool(queue[0].phase.param_paths)  # a phase without weights has no dw: no turn for it
            self._run_dw(stage, mb, [queue.pop(0)])
            if interleaved and queue and work:
                yield
        self.queued.add(-1)
        self.live.add(-1)
        self.weights_done[stage] = self.weights_done.get(stage, 0) + 1
        if self.weights_done[stage] == self.s.m and self.on_stage_done is not None:
            self.on_stage_done(stage, self.grads)

    def _run_dw(self, stage: int, mb: int, queue: list[DwPass]) -> None:
        """Runs (and empties) `queue`'s dw thunks in order, adding their gradients into the step's."""
        while queue:
            ph, layer, vjp_dw = queue.pop(0)
            t = self._now()
            summed = isinstance(vjp_dw, _Summed)
            grads = vjp_dw()
            if not (summed and vjp_dw.complete):  # complete: every gradient is its sum, in the tree already
                for path, g in zip(ph.param_paths, grads):
                    _add_at(self.grads, path, g, self.grad_dtype, self.owned, summed)
            del vjp_dw, grads
            if ph.param_paths:
                self._computed("W", ph.name, stage, layer, mb, t)

    def _dw_into_sums(self, stage: int, ph: Phase, vjp_dw: Callable[..., Any]) -> Callable[..., Any]:
        """Returns the deferred dw pass `vjp_dw` of phase `ph` (stage `stage`) as one that adds into the
        step's sums when it runs (split_vjp's `vjp_dw(into=...)`): the deferred products accumulate
        straight into them (a GEMM with beta = 1) instead of making a gradient and adding it. Not when the
        sums are kept in another dtype (`grad_dtype`, mixed precision): no sum would fit a gradient, and
        each would be made, copied, then cast; `vjp_dw` is returned as it is."""
        if self.grad_dtype is not None:
            return vjp_dw
        # the sums as the pass runs (a closure over the executor, never over the pass: no reference cycle,
        # which would hold the thunk's activations past its run until the cycle collector came by)
        return _Summed(vjp_dw, lambda: (self._sums_of(stage, ph), self._sums_complete(stage, ph)))

    def _params_at(self, prog: StageProgram, paths: tuple[tuple[str, ...], ...]) -> tuple[Any, ...]:
        """Returns the params subtrees of `prog` at `paths`, looked up once per step (every microbatch's
        forward of a phase reads the same ones)."""
        key = (prog.stage, paths)
        got = self.params_at.get(key)
        if got is None:
            got = self.params_at[key] = tuple(subtree(prog.params, q) for q in paths)
        return got

    def _sums_of(self, stage: int, ph: Phase) -> tuple[Any, ...]:
        """Returns split_vjp's `into` for phase `ph` of `stage`: per param path, its params subtree with the
        step's gradient sums in place of the leaves (None where there is none yet). Kept once every leaf
        has its sum: an owned sum is only ever added into in place, so later microbatches reuse it."""
        key = (stage, ph.param_paths)
        got = self.sums_at.get(key)
        if got is None:
            params = self._params_at(self.programs[stage], ph.param_paths)
            got = tuple(self._sums_like(q, p) for q, p in zip(ph.param_paths, params))
            if _complete(got):
                self.sums_at[key] = got
        return got

    def _sums_complete(self, stage: int, ph: Phase) -> bool:
        """Whether `_sums_of(stage, ph)` gives every leaf its sum (it keeps only such trees)."""
        return (stage, ph.param_paths) in self.sums_at

    def _sums_like(self, path: tuple[str, ...], params: Any) -> Any:
        """Returns `params` (the subtree at `path`) with each leaf replaced by the step's gradient sum for
        it when the executor owns one of the leaf's shape and dtype, else None: split_vjp's `into`."""
        if isinstance(params, Mapping):
            return {k: self._sums_like((*path, k), v) for k, v in params.items()}
        node: Any = self.grads
        for k in path:
            node = node.get(k) if isinstance(node, dict) else None
        ok = (isinstance(node, torch.Tensor) and path in self.owned and isinstance(params, torch.Tensor)
              and (node.shape, node.dtype, node.device) == (params.shape, params.dtype, params.device))
        return node if ok else None

    # ---- P2P -------------------------------------------------------------------------------------------

    def _global(self, pp_rank: int) -> int:
        return pp_rank if self.group is None else dist.get_global_rank(self.group, pp_rank)

    def _tag(self, dep: Dep, k: int) -> int:
        w = 0 if dep.kind is Kind.ACT else 1
        return ((w * self.s.placement.num_stages + dep.stage) * self.s.m + dep.mb) * _MAX_KEYS + k

    def _take_boundary(self, key: tuple[str, int, int], spec: Mapping[str, tuple] | None = None) -> Acts:
        """Returns what op `key` ((F, stage, mb), or (I, stage, mb) for a backward) needs from another
        stage (an ACT for F, a GRAD for a backward), or {} when it needs none (the start of a path for F,
        the loss stage for I)."""
        dep = self.plan.takes[key]
        if dep is None:
            return {}
        if dep in self.local:  # the producer ran on this rank (the turn of a V)
            return self.local.pop(dep)
        peer = self.s.placement.stage_rank[dep.stage]
        if dep not in self.posted:
            self._issue_through(Recv(dep.kind.value, dep.stage, dep.mb, peer), spec)
        works, bufs, t_post = self.posted.pop(dep)
        t = self._now()
        what = f"receive of {dep.kind.value} s{dep.stage} mb{dep.mb} from pipeline rank {peer}"
        for w in works:
            self._wait_work(w, what)
        if self.compute_model is not None:  # gloo tells no completion time: the wait's end bounds it
            self.compute_model.waited(time.perf_counter())
        self._release_sends(peer, self.plan.wire_at[dep])
        now = self._now()
        self.waited += now - t
        if self.trace:
            what = dep.kind.value
            self._event("compute", "wait", t, now, "wait p2p", dep.stage, dep.mb, what=what)
            self._event("comm", "p2p", t_post, now, "p2p recv", dep.stage, dep.mb, what=what, peer=peer)
        return bufs

    def _give_boundary(self, key: tuple[str, int, int], acts: Acts) -> bool:
        """Keeps `acts`, what op `key` ((F | I, stage, mb)) produced for another stage, until its consumer on
        this rank takes it or the schedule's Send issues it; returns False when the op produces no such Dep
        (the path ends)."""
        dep = self.plan.gives[key]
        if dep is None:
            return False
        self.local[dep] = acts
        return True

    def _send(self, a: Send) -> None:
        """The schedule's Send: issues it unless it went out already, the moment its data existed."""
        dep = carried(a)
        if dep in self.sent:
            return
        if dep not in self.local:
            raise ScheduleError(f"rank {self.rank}: {a} before the data exists")
        self._issue_through(a)
        self._pump()  # receives asked for early that waited behind this send

    def _isend(self, a: Send) -> None:
        dep = carried(a)
        acts = self.local.pop(dep)
        self.sent.add(dep)
        if len(acts) > _MAX_KEYS:
            raise ScheduleError(f"stage {a.stage}: {len(acts)} acts in one message (at most {_MAX_KEYS})")
        t = self._now()
        for k, name in enumerate(sorted(acts)):
            buf = acts[name].detach().contiguous()
            what = f"send of {a.what} s{a.stage} mb{a.mb} to pipeline rank {a.peer}"
            with self._peer_failure(what):
                work = dist.isend(buf, self._global(a.peer), group=self.group, tag=self._tag(dep, k))
            self.sends.setdefault(a.peer, []).append(_Sent(work, buf, what, self.plan.wire_at[dep]))
        if self.trace:
            self._event("comm", "p2p", t, self._now(), "p2p send", a.stage, a.mb, what=a.what, peer=a.peer)

    def _release_sends(self, peer: int, before: int) -> None:
        """Waits the sends to pipeline rank `peer` that come before wire index `before` and drops their
        buffers. Called when the message at `before` from `peer` arrived: the peer issued its receives in
        wire order, so it posted theirs before it sent that one, and they completed or are completing
        (with gloo's transport thread); on NCCL / HCCL one stream runs a pair's messages in issue order,
        so they have completed. A send's buffer is held no longer than that (not to the end of the step:
        up to 2 m [B, S, D] per rank)."""
        mine = self.sends.get(peer)
        while mine and mine[0].at < before:
            work, _, what, _ = mine.pop(0)
            self._wait_work(work, what)
        if not mine:
            self.sends.pop(peer, None)

    def _reap_sends(self) -> None:
        """Releases every send whose work reports it completed (NCCL / HCCL do, from an event; a gloo
        send reports it only once waited, and waits for `_release_sends`)."""
        for peer, mine in list(self.sends.items()):
            while mine and mine[0].work.is_completed():
                work, _, what, _ = mine.pop(0)
                self._wait_work(work, what)
            if not mine:
                del self.sends[peer]

    def _post_recv(self, a: Recv) -> None:
        """Asks for the receive of `a` early: it goes out as soon as the wire order lets it (every P2P op
        before it issued) and its buffers' shapes are known."""
        self.wanted.add(carried(a))
        self._pump()

    def _pump(self) -> None:
        """Issues what can go out at the head of the wire: a send whose data exists (the moment its op made
        it, not at its Send action), a receive asked for early whose shapes are known; stops at the first
        op that cannot."""
        if self.early_recv:
            self._post_early()
        while self.wire:
            op, dep = self.wire[-1], carried(self.wire[-1])
            if isinstance(op, Send) and dep in self.local:
                self._isend(self.wire.pop())
            elif isinstance(op, Recv) and self._recv_spec(dep) is not None and (
                    dep in self.wanted or self._send_ready_behind()):
                self._irecv(carried(self.wire.pop()), self._recv_spec(dep))
            else:
                return

    def _post_early(self) -> None:
        """Posts every receive asked for early whose shapes are known, wherever it stands on the wire (a
        transport that matches messages by tag: `early_recv`), in wire order among themselves."""
        ready = [dep for dep in self.wanted if self._recv_spec(dep) is not None]
        for dep in sorted(ready, key=self.plan.wire_at.__getitem__):
            if dep in self.issued:  # a receive may be asked for after it went out
                self.wanted.discard(dep)
                continue
            self.wire.remove(Recv(dep.kind.value, dep.stage, dep.mb, self.s.placement.stage_rank[dep.stage]))
            self._irecv(dep, self._recv_spec(dep))  # drops it from `wanted`

    def _send_ready_behind(self) -> bool:
        """True when, past receives that could be posted now, the wire holds a send whose data exists: the
        receives go out early so that the send need not wait for their consumers."""
        for op in reversed(self.wire):
            if isinstance(op, Send):
                return carried(op) in self.local
            if self._recv_spec(carried(op)) is None:
                return False
        return False

    def _issue_through(self, target: Send | Recv, spec: Mapping[str, tuple] | None = None) -> None:
        """Issues the wire's ops up to and including `target` (a Recv is given `spec` when its forward's
        record is gone, at its consumer). What comes before it must be able to go out now: by the wire
        order's construction a send before it has its data, and a gradient receive its shapes."""
        while self.wire:
            op = self.wire.pop()
            if op == target:
                if isinstance(op, Send):
                    self._isend(op)
                else:
                    self._irecv(carried(op), spec if spec is not None else self._recv_spec(carried(op)))
                return
            if isinstance(op, Send) and carried(op) in self.local:
                self._isend(op)
                continue
            got = self._recv_spec(carried(op)) if isinstance(op, Recv) else None
            if got is None:
                raise ScheduleError(f"rank {self.rank}: {target} is due but {op} comes before it in the wire "
                                    "order and cannot be issued yet (a schedule whose lists do not match "
                                    "the order its replay sends in)")
            self._irecv(carried(op), got)
        raise ScheduleError(f"rank {self.rank}: {target} is not in this rank's wire order (or ran twice)")

    def _recv_spec(self, dep: Dep) -> Mapping[str, tuple] | None:
        """Returns the shapes and dtypes of the message `dep` this rank receives: a stage's input spec for
        an ACT, for a GRAD the output spec of our own forward (None until that forward has run)."""
        if dep.kind is Kind.ACT:
            return self.programs[self.s.next_stage(dep.stage, dep.mb)].in_spec
        rec = self.records.get((self.s.prev_stage(dep.stage, dep.mb), dep.mb))
        return None if rec is None else rec.out_spec

    def _irecv(self, dep: Dep, spec: Mapping[str, tuple] | None) -> None:
        if spec is None:
            raise ScheduleError(f"rank {self.rank}: the receive of {dep.kind.value} s{dep.stage} mb{dep.mb} "
                                "has no shapes to allocate (its forward has not run on this rank)")
        self.wanted.discard(dep)
        self.issued.add(dep)
        pp_peer = self.s.placement.stage_rank[dep.stage]
        peer = self._global(pp_peer)
        bufs: Acts = {}
        works = []
        for k, name in enumerate(sorted(spec)):
            bufs[name] = torch.empty(spec[name][0], dtype=spec[name][1], device=self.device)
            with self._peer_failure(f"receive of {dep.kind.value} s{dep.stage} mb{dep.mb} from pipeline rank "
                                    f"{pp_peer}"):
                works.append(dist.irecv(bufs[name], peer, group=self.group, tag=self._tag(dep, k)))
        self.posted[dep] = _Posted(works, bufs, self._now())

    @contextlib.contextmanager
    def _peer_failure(self, what: str) -> Iterator[None]:
        """Turns a failed P2P call into an error that names this rank, the message and the peer."""
        try:
            yield
        except RuntimeError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RuntimeError(f"pipeline rank {self.rank}: {what} failed or did not complete within "
                               f"{self.timeout} (the peer died, raised, or runs a different schedule): "
                               f"{first}") from exc

    def _wait_work(self, work: Any, what: str) -> None:
        with self._peer_failure(what):  # a CPU wait that times out raises RuntimeError, named here
            wait_work(work, self.device, self.timeout)

    # ---- timeline --------------------------------------------------------------------------------------

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _computed(self, kind: str, phase: str, stage: int, layer: str, mb: int, start: float) -> None:
        """Records compute phase `phase` of (stage, mb) that started at `start` (F, B, I or W), after the
        compute model (if any) has held it to its modelled duration."""
        if self.compute_model is not None:
            self.compute_model(kind, phase, stage, layer, mb, self.t0 + start)
        if self.trace:
            self._event("compute", kind, start, self._now(), kind, stage, mb, layer, phase)

    def _event(self, lane: str, cat: str, start: float, end: float, kind: str, stage: int, mb: int,
               layer: str | None = None, phase: str | None = None, direction: str | None = None,
               what: str | None = None, peer: int | None = None) -> None:
        """Records an event of `kind` from `start` to `end` on `lane` (its TraceEvent fields: timeline.py's
        table) as a tuple: the TraceEvent, and the name the pictures show, are made once the step ended
        (`_trace_event`), not between its phases."""
        self.events.append((lane, cat, start, end, self.step, kind, stage, mb, layer, phase, direction, what,
                            peer))

    def _comm_events(self, pending: Any, phase: str, direction: str, stage: int, layer: str, mb: int,
                     issued: float, wait_start: float) -> None:
        """Records exchange `phase` of (stage, layer, mb) ("F": a forward's, "B": a backward's transpose),
        issued at `issued`, from issue to completion on the comm lane and its wait from `wait_start` to
        now on the compute lane."""
        wait_end = self._now()
        done = getattr(pending, "completed_at", None)
        end = wait_end if done is None else min(wait_end, max(issued, done - self.t0))
        if self.compute_model is not None:  # what the next phase needs arrived then, not before
            self.compute_model.waited(self.t0 + end)
        self.waited += wait_end - wait_start
        if not self.trace:
            return
        self._event("comm", "a2a", issued, end, "a2a", stage, mb, layer, phase, direction)
        self._event("compute", "wait", wait_start, wait_end, "wait a2a", stage, mb, layer, phase, direction)


class _ForwardHooks:
    """`run_phases`'s hooks for a whole-stage forward (`_Executor._whole_stage_forward`): every output act
    checked floating, each phase and exchange on the timeline."""

    def __init__(self, ex: _Executor, stage: int, mb: int):
        self.ex, self.stage, self.mb = ex, stage, mb

    def computed(self, ph: Phase, layer: str, out: Acts, start: float) -> None:
        """Checks a compute phase's outputs and records it."""
        _check_floating(out, self.stage, layer, ph.name)
        self.ex._computed("F", ph.name, self.stage, layer, self.mb, start - self.ex.t0)

    def waited(self, pending: Any, ph: Phase, layer: str, start: float, wait_start: float) -> None:
        """Records an exchange."""
        t0 = self.ex.t0
        self.ex._comm_events(pending, ph.name, "F", self.stage, layer, self.mb, start - t0, wait_start - t0)


class _WholeStage(NamedTuple):
    """What a whole-stage forward (`_Executor._whole_stage_forward`) knows from the stage's layers alone:
    `phase`, the stage as one compute phase (its param paths in the order its phases consume them, a comm
    phase's being its side's; the losses its phases end; `fn` runs the layers with no hooks), and `names`,
    the layers it spans for the timeline ("L0-L3")."""

    phase: Phase
    names: str


# layers tuple id -> (the layers, their _WholeStage): a run's stage programs hold the same layers every step
# (GPTProgram builds them once), so each step reuses what the first one derived; the entry holds its
# layers, so the id cannot be reused while it is cached
_WHOLE: dict[int, tuple[tuple[Layer, ...], _WholeStage]] = {}
_WHOLE_MAX = 16  # a rank runs a few stages; a caller that builds programs per step cycles through


def _whole_stage(layers: tuple[Layer, ...]) -> _WholeStage:
    """Returns the _WholeStage of a stage with `layers`, made on the first step that asks for it."""
    hit = _WHOLE.get(id(layers))
    if hit is not None and hit[0] is layers:
        return hit[1]
    steps = [(layer.name, ph) for layer in layers for ph in layer.phases]
    paths = tuple(q for _, ph in steps  # in the order fn consumes them: a comm phase's are its side's
                  for q in (ph.side.param_paths if ph.side is not None else ph.param_paths))
    loss_names = tuple(k for _, ph in steps if ph.kind == "compute" for k in ph.losses)

    def fn(p: tuple, a: Acts, m: Meta) -> tuple[Acts, list]:
        ran = run_phases(layers, _params_in_order(p), a, m)
        return {**ran.acts, **ran.losses}, ran.stats

    names = f"{steps[0][0]}-{steps[-1][0]}" if steps[0][0] != steps[-1][0] else steps[0][0]
    got = _WholeStage(Phase("stage", "compute", fn=fn, param_paths=paths, losses=loss_names), names)
    if len(_WHOLE) >= _WHOLE_MAX:
        _WHOLE.pop(next(iter(_WHOLE)))
    _WHOLE[id(layers)] = (layers, got)
    return got


def _params_in_order(p: tuple[Any, ...]) -> Callable[[Phase], tuple[Any, ...]]:
    """`run_phases`'s params_of for a whole stage: `p` holds every phase's param subtrees in the order the
    phases run, so each phase takes the next ones."""
    it = iter(p)
    return lambda ph: tuple(next(it) for _ in ph.param_paths)


def _trace_event(rank: int, lane: str, cat: str, start: float, end: float, step: str, kind: str, stage: int,
                 mb: int, layer: str | None, phase: str | None, direction: str | None, what: str | None,
                 peer: int | None) -> TraceEvent:
    """Returns the TraceEvent of one `_Executor._event` record, named as timeline.py's table shows it."""
    if kind in COMPUTE:
        name = f"{kind} {phase} s{stage} {layer} mb{mb}"
    elif kind == "a2a" or kind == "wait a2a":
        name = f"{kind} {phase}-{direction} s{stage} {layer} mb{mb}"
    else:  # "p2p send", "p2p recv", "wait p2p"
        name = f"{kind} {what} s{stage} mb{mb}" + (f" r{peer}" if kind == "p2p send" else "")
    return TraceEvent(rank, lane, name, cat, start, end, step, kind, stage, mb, layer, phase, direction, what,
                      peer)


def _drain(gen: Iterator[None]) -> None:
    for _ in gen:
        pass


def _interleave(*gens: Iterator[None]) -> None:
    """Runs generators in turn, switching at each yield (an exchange in flight) until all are done: one
    microbatch's compute runs while the other's exchange travels, and each one's own phases stay in order."""
    live = list(gens)
    k = 0
    while live:
        g = live[k % len(live)]
        try:
            next(g)
            k += 1
        except StopIteration:
            live.remove(g)


def _complete(tree: Any) -> bool:
    """True when nested dicts / tuples / lists `tree` hold no None leaf."""
    if isinstance(tree, Mapping):
        return all(_complete(v) for v in tree.values())
    if isinstance(tree, (tuple, list)):
        return all(_complete(v) for v in tree)
    return tree is not None


def _check_floating(out: Acts, stage: int, layer: str, phase: str) -> None:
    """Raises ScheduleError naming the phase if one of its output acts is not a floating tensor."""
    for k, v in out.items():
        if not (isinstance(v, torch.Tensor) and v.is_floating_point()):
            raise ScheduleError(f"stage {stage} {layer} {phase}: acts[{k!r}] is not a floating "
                                "tensor; put non-differentiable values in meta")


def _with_side(acts: Acts, ph: Phase, side_out: Acts) -> Acts:
    """Returns the acts after exchange `ph`: what it delivered less its side's consumed keys, plus the side's
    outputs."""
    return {**{k: v for k, v in acts.items() if k not in ph.side_consumes}, **side_out}


def _in_flight(pending: Any) -> bool:
    """True when waiting on `pending` could block (a Pending without `in_flight` is assumed to)."""
    return bool(getattr(pending, "in_flight", True))


def _add_at(tree: dict[str, Any], path: tuple[str, ...], grads: Any, dtype: torch.dtype | None = None,
            owned: set[tuple[str, ...]] | None = None, summed: bool = False) -> None:
    """Adds gradient subtree `grads` into nested dict `tree` at `path` (creating the path), summing in
    `dtype` (None: the gradients' own). `owned` holds the full paths whose tensor was allocated here: those
    are summed into in place (as AccumulateGrad does), the others (a thunk's output, which may alias
    something the caller still holds) are replaced by a new sum once, which is owned from then on.
    `summed`: `grads` came from a dx pass that added into the sums it was given (split_vjp's `into`):
    a leaf that is the tree's sum already is left as it is, any other is a fresh gradient nothing else
    holds, kept (owned) as the sum or added into it."""
    node = tree
    for k in path[:-1]:
        node = node.setdefault(k, {})
    _add_tree(node, path, grads, dtype, set() if owned is None else owned, summed)


def _add_tree(node: dict[str, Any], path: tuple[str, ...], g: Any, dtype: torch.dtype | None,
              owned: set[tuple[str, ...]], summed: bool = False) -> None:
    key = path[-1]
    if isinstance(g, Mapping):
        child = node.setdefault(key, {})
        for k, v in g.items():
            _add_tree(child, (*path, k), v, dtype, owned, summed)
        return
    if g is None or (summed and node.get(key) is g):
        return
    fresh = summed  # g is a tensor nothing else holds: it may become the sum, or be added into
    if dtype is not None and g.dtype != dtype:
        g = g.to(dtype)
        fresh = True  # the cast made a new tensor
    if key not in node:
        node[key] = g
        if fresh:
            owned.add(path)
    elif path in owned:
        node[key].add_(g)  # a fresh sum per microbatch costs more than the add (page faults)
    elif fresh:
        node[key] = g.add_(node[key])
        owned.add(path)
    else:
        node[key] = node[key] + g
        owned.add(path)
