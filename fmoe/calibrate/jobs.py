"""Several `fmoe train` jobs kept alive on spawned CPU ranks and stepped in turn, one step at a time.

    with LiveJobs({"a": tc_a, "b": tc_b}, events={"a"}) as jobs:
        runs = jobs.step_in_turn(steps=20, warm=2)      # {"a": JobRun, "b": JobRun}

Why: this machine's speed moves by up to 2x within seconds (other tenants of the host), and a job that
runs all its steps in one stretch is timed in whatever phase it met. Jobs stepped alternately, a step of
each in turn with the order shuffled every round, meet the same phases, so their medians compare (one
job's step is a few hundred milliseconds; the phases last seconds). The cost is a cold cache at the start
of every step, the same for every job. Each rank runs with one thread, as `fmoe train` splits the cores.
Between its steps a job's ranks are stopped (SIGSTOP): an idle rank's gloo threads still wake (about 1%
of a core each), and forty of them would take a fifth of this machine from the job that steps.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fmoe.calibrate.samples import median_sample, sample_of
from fmoe.outline import outline
from fmoe.train.config import TrainConfig

_READY, _STEP, _STOP, _ERROR = "ready", "step", "stop", "error"


def _job_rank(tc: TrainConfig, rank: int, store: str, events: bool, commands: Any, results: Any) -> None:
    """One rank of a live job: builds its Trainer, then runs a step per "step" command until "stop"."""
    torch.set_num_threads(1)
    try:
        from fmoe.train.launch import _world
        from fmoe.train.loop import Trainer

        trainer = Trainer(tc, _world(tc, 0, f"file://{store}", rank, tc.world_size), timeline=events)
        results.put((rank, _READY, None))
        while commands.get() == _STEP:
            step_s = trainer.step()["step_s"]
            sample = None
            if events:  # this step's HostSample (peak memory comes at the end)
                sample = sample_of([step_s], [trainer.last_result.events], outline(trainer.cfg),
                                   tc.microbatches, 0.0)
            results.put((rank, step_s, sample))
        with open("/proc/self/status") as f:
            hwm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        results.put((rank, _STOP, hwm_kib / 2**20))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops every job
        results.put((rank, _ERROR, traceback.format_exc()))
    # leave without the interpreter's finalization (see fmoe.train.launch._spawned): gloo's threads may
    # still drop tensors then, and a GIL taken at teardown aborts the process
    results.close()
    results.join_thread()
    sys.stdout.flush()
    os._exit(0)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (or gone), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return True
    return text[text.rindex(")") + 2] in "TtZX"


@dataclass
class JobRun:
    """What one live job measured: `step_s` per measured step (the slowest rank's), `samples` per rank the
    HostSample of each measured step (jobs asked for events; else empty), `peak_gib` the largest peak
    resident memory of its ranks over their whole life."""

    step_s: list[float] = field(default_factory=list)
    samples: list[list[Any]] = field(default_factory=list)
    peak_gib: float = 0.0

    def host_sample(self) -> Any:
        """The job's HostSample: per rank the field-by-field median over its steps, then over the ranks;
        `peak_gib` the job's."""
        per_rank = [median_sample(steps) for steps in self.samples]
        return replace(median_sample(per_rank), peak_gib=self.peak_gib)


class LiveJobs:
    """Live `fmoe train` jobs (name -> TrainConfig, each on `tc.world_size` spawned gloo ranks); those named
    in `events` also return each step's executor events as a HostSample. A context manager: leaving it
    kills whatever ranks are still alive. `timeout_s` bounds every wait on a rank."""

    def __init__(self, configs: dict[str, TrainConfig], events: set[str] | frozenset[str] = frozenset(),
                 timeout_s: float = 600.0) -> None:
        unknown = set(events) - set(configs)
        if unknown:
            raise ValueError(f"LiveJobs: events asked of jobs not given: {sorted(unknown)}")
        ctx = torch.multiprocessing.get_context("spawn")
        self.timeout_s = timeout_s
        self.configs = dict(configs)
        self.events = set(events)
        self._commands: dict[str, list[Any]] = {}
        self._results: dict[str, Any] = {}
        self._procs: dict[str, list[Any]] = {}
        for name, tc in self.configs.items():
            store = tempfile.mktemp(prefix="fmoe_live_")
            self._results[name] = ctx.Queue()
            self._commands[name] = [ctx.Queue() for _ in range(tc.world_size)]
            self._procs[name] = [
                ctx.Process(target=_job_rank, daemon=True,
                            args=(tc, rank, store, name in self.events, self._commands[name][rank],
                                  self._results[name]))
                for rank in range(tc.world_size)]
            for p in self._procs[name]:
                p.start()
        try:
            for name in self.configs:
                self._gather(name, _READY)
                self._signal(name, signal.SIGSTOP)
        except BaseException:  # a job that cannot start: leave no rank of any job behind
            self.__exit__()
            raise

    def __enter__(self) -> LiveJobs:
        return self

    def __exit__(self, *exc: Any) -> None:
        procs = [p for ps in self._procs.values() for p in ps]
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)

    def _signal(self, name: str, sig: int) -> None:
        """Sends `sig` to every live rank of job `name` (SIGSTOP between its steps, SIGCONT before one); after
        SIGSTOP, waits (up to a second) until they are stopped: a signal takes effect when the process is
        next scheduled, and the next job's step should not share the cores with it."""
        live = [p for p in self._procs[name] if p.is_alive()]
        for p in live:
            os.kill(p.pid, sig)
        deadline = time.monotonic() + 1.0
        while sig == signal.SIGSTOP and time.monotonic() < deadline:
            if all(_stopped(p.pid) for p in live):
                return
            time.sleep(1e-4)

    def _gather(self, name: str, expect: str | None = None) -> list[Any]:
        """Every rank's answer of job `name`, by rank; raises on a rank's error or a silent rank."""
        got: dict[int, Any] = {}
        for _ in self._commands[name]:
            try:
                rank, head, body = self._results[name].get(timeout=self.timeout_s)
            except Exception as exc:  # queue.Empty: a rank hung or died without a word
                raise RuntimeError(f"LiveJobs: job {name!r} silent for {self.timeout_s:.0f} s") from exc
            if head == _ERROR:
                raise RuntimeError(f"LiveJobs: job {name!r}, rank {rank} failed:\n{body}")
            if expect is not None and head != expect:
                raise RuntimeError(f"LiveJobs: job {name!r}, rank {rank} answered {head!r}, not {expect!r}")
            got[rank] = (head, body)
        return [got[r] for r in sorted(got)]

    def step(self, name: str) -> list[tuple[float, Any]]:
        """Runs one step of job `name` on all its ranks; returns per rank (step seconds, its HostSample or
        None)."""
        self._signal(name, signal.SIGCONT)
        for q in self._commands[name]:
            q.put(_STEP)
        answers = self._gather(name)
        self._signal(name, signal.SIGSTOP)
        return answers

    def close(self) -> dict[str, float]:
        """Stops every job; returns each one's peak resident memory in GiB (max over its ranks)."""
        for name, qs in self._commands.items():
            self._signal(name, signal.SIGCONT)
            for q in qs:
                q.put(_STOP)
        peaks = {name: max(body for _, body in self._gather(name, _STOP)) for name in self.configs}
        for ps in self._procs.values():
            for p in ps:
                p.join(timeout=60)
        return peaks

    def step_in_turn(self, steps: int, warm: int = 2, each_round: Callable[[], None] | None = None,
                     seed: int = 0) -> dict[str, JobRun]:
        """Runs `warm` untimed then `steps` timed rounds, each a step of every job, in an order shuffled every
        round (by `seed`: a rotation would keep each job behind the same one, whatever that one leaves in
        the caches), and `each_round()` at the start of every timed round (while every
        job is stopped: a measurement of the caller's that should meet the same phases of the machine);
        stops the jobs; returns each one's JobRun."""
        if steps < 1 or warm < 0:
            raise ValueError(f"step_in_turn: steps={steps} must be >= 1 and warm={warm} >= 0")
        names = list(self.configs)
        runs = {name: JobRun(samples=[[] for _ in self._commands[name]]) for name in names}
        order = random.Random(seed)
        for r in range(warm + steps):
            if each_round is not None and r >= warm:
                each_round()
            order.shuffle(names)
            for name in names:
                answers = self.step(name)
                if r < warm:
                    continue
                runs[name].step_s.append(max(step_s for step_s, _ in answers))
                if name in self.events:
                    for rank, (_, sample) in enumerate(answers):
                        runs[name].samples[rank].append(sample)
        for name, peak in self.close().items():
            runs[name].peak_gib = peak
        return runs


def step_live(configs: dict[str, TrainConfig], steps: int, sessions: int = 2, warm: int = 2,
              events: set[str] | frozenset[str] = frozenset(),
              each_round: Callable[[], None] | None = None, timeout_s: float = 600.0) -> dict[str, JobRun]:
    """Every job of `configs` stepped in turn (LiveJobs.step_in_turn) for `steps` timed rounds in all,
    split over `sessions` sets of fresh processes, one after the other; returns each job's JobRun with the
    sessions' steps and samples joined and its largest peak. Why sessions: two copies of one layout, side
    by side in one set of processes, measured 1.004-1.066x apart over 20 rounds; if a process keeps a
    speed of its own, a calibration fitted on one slow copy moves every prediction with it, and fresh
    copies average that out."""
    if sessions < 1 or steps < sessions:
        raise ValueError(f"step_live: sessions={sessions} must be >= 1 and at most steps={steps}")
    runs: dict[str, JobRun] = {}
    for k in range(sessions):
        share = steps // sessions + (k < steps % sessions)
        with LiveJobs(configs, events=events, timeout_s=timeout_s) as jobs:
            got = jobs.step_in_turn(share, warm=warm, each_round=each_round, seed=k)
        for name, run in got.items():
            if name not in runs:
                runs[name] = run
                continue
            joined = runs[name]
            joined.step_s += run.step_s
            joined.samples = [a + b for a, b in zip(joined.samples, run.samples)]
            joined.peak_gib = max(joined.peak_gib, run.peak_gib)
    return runs
