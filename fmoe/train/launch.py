"""Start `fmoe train`: under torchrun use the ranks it gives; alone, spawn the local ranks the layout
needs (or run in this process when it needs one). Then every rank runs `train_rank`.

Devices (`--device auto`, the default): on a machine with CUDA GPUs every rank is an NCCL rank on its own
GPU (local rank i on cuda:i), with Ascend NPUs (torch_npu) an HCCL rank on npu:i, else a gloo rank on the
CPU; `--device cpu` forces the CPU. A rank binds its device before joining the group and passes it as
`init_process_group(device_id=...)`, so the communicator is created on that device at once. Spawned
alone, a layout needing more ranks than the machine has devices fails before any rank starts. The
choices are pure functions (`choose_device`, `rank_device`) tested on CPU with faked device counts;
nothing here has run on a GPU or NPU.

A rank that dies (an error, SIGKILL) stops the others at once: the launcher terminates them and exits
non-zero; the last complete checkpoint stays the latest. A CheckpointError (a damaged, unsafe or
mismatched checkpoint, a --save in use) is printed as one line, `fmoe train: CheckpointError: ...`; a
RunError (fmoe/train/run_errors.py: ranks started with different inputs, an fp16 run that cannot go on) as
`fmoe train: error: ...`, exit code 1.

Before any rank builds its model, every rank's config, layout and data fingerprint are compared
(fmoe/train/rank_agreement.py). SIGINT / SIGTERM sent to the launcher alone stop every spawned rank
within seconds, the launcher exiting 128 + the signal (fmoe/train/signals.py).

The --save directory is claimed (fmoe/train/save_dir.py: locked, checked again, cleared for
--overwrite-save), and the output files locked (fmoe/train/run_outputs.py, the same lock), by the launcher
before it spawns a rank, or by global rank 0 under torchrun.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from fmoe.parallel import ParallelLayout, Topology
from fmoe.parallel.teardown import close_default_group, exit_process, thread_locks_for_bars
from fmoe.pipeline.cut import cut_costs
from fmoe.precision import float32_matmul_precision
from fmoe.schedule.imbalance import imbalance_pct
from fmoe.schedule.timeline import TraceEvent
from fmoe.train import checkpoint, preflight, run_outputs, save_dir
from fmoe.train.checkpoint import CheckpointError
from fmoe.train.config import TrainConfig
from fmoe.train.evaluate import due as eval_due
from fmoe.train.evaluate import evaluate
from fmoe.train.host_memory import keep_freed_memory
from fmoe.train.log_backends import LogBackends
from fmoe.train.loop import Trainer, World
from fmoe.train.rank_agreement import check_ranks_agree
from fmoe.train.report import Reporter, read_metrics, write_loss_curve, write_step_trace
from fmoe.train.run_errors import RunError, raised_run_error
from fmoe.train.signals import die_with_parent, forward_stop_signals, stop_ranks


def under_torchrun() -> bool:
    """Whether torchrun (or another env:// launcher) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def device_counts() -> dict[str, int]:
    """The accelerators of this machine: {"cuda": N, "npu": M} (torch_npu imported when installed)."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    npu = 0
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        npu = torch.npu.device_count() if torch.npu.is_available() else 0
    return {"cuda": cuda, "npu": npu}


def choose_device(requested: str, counts: dict[str, int]) -> str:
    """Returns the device type the ranks run on: `requested` ("cpu", "cuda", "npu"), or for "auto" CUDA
    when the machine has a GPU, else an NPU, else the CPU. ValueError for a device the machine lacks."""
    if requested == "auto":
        return next((d for d in ("cuda", "npu") if counts.get(d, 0) > 0), "cpu")
    if requested != "cpu" and counts.get(requested, 0) < 1:
        raise ValueError(f"--device {requested}: this machine has no {requested} device")
    return requested


def _device_type(tc: TrainConfig) -> str:
    """The device type --device picks on this machine (its devices are not probed for --device cpu)."""
    return choose_device(tc.device, device_counts() if tc.device != "cpu" else {})


def rank_device(device_type: str, local_rank: int) -> tuple[str, torch.device, torch.device | None]:
    """Returns (backend, device, device_id for init_process_group) of local rank `local_rank`: gloo on
    the CPU (no device_id, as before), NCCL on cuda:local_rank, HCCL on npu:local_rank."""
    if device_type == "cpu":
        return "gloo", torch.device("cpu"), None
    device = torch.device(device_type, local_rank)
    return BACKENDS[device_type], device, device


def _set_device(device: torch.device) -> None:
    # before the group exists: NCCL / HCCL create the communicator on the current device
    torch.cuda.set_device(device) if device.type == "cuda" else torch.npu.set_device(device)


def deterministic_env(device_type: str) -> dict[str, str]:
    """Returns the environment a deterministic run on `device_type` needs besides
    `torch.use_deterministic_algorithms(True)`: on CUDA a fixed cuBLAS workspace (without it cuBLAS may
    split a GEMM's reduction differently run to run, and torch raises in deterministic mode) and NCCL's
    ring algorithm (NVLS / tree reductions may sum in another order); nothing on CPU (gloo reduces in rank
    order) or NPU (torch_npu's own settings are not checked here)."""
    if device_type == "cuda":
        return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
    return {}


def _world(tc: TrainConfig, local_rank: int, init_method: str | None = None, rank: int = 0,
           size: int = 1, device_type: str | None = None) -> World:
    """Joins the process group (env:// under torchrun when `init_method` is None, else `init_method` as
    rank `rank` of `size`) on `device_type` (None: what --device picks on this machine) and builds this
    rank's layout; returns its World."""
    if device_type is None:
        device_type = _device_type(tc)
    backend, device, device_id = rank_device(device_type, local_rank)
    if tc.deterministic:
        for name, value in deterministic_env(device.type).items():
            os.environ.setdefault(name, value)  # before the first cuBLAS / NCCL call; a user's value wins
        torch.use_deterministic_algorithms(True)
    if device_id is not None:
        _set_device(device)
        precision = float32_matmul_precision(device.type, tc.tf32)
        if precision is not None:
            torch.set_float32_matmul_precision(precision)
    if device.type == "cpu" and tc.keep_host_memory:
        keep_freed_memory()  # the step's tensors live in host memory: keep it mapped between microbatches
    timeout = timedelta(seconds=tc.timeout)
    kw = {"device_id": device_id} if device_id is not None else {}
    if init_method is None:
        dist.init_process_group(backend, timeout=timeout, **kw)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout,
                                **kw)
    rank, size = dist.get_rank(), dist.get_world_size()
    rpn = tc.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", size))
    # before the layout's groups and the model: ranks started with other flags fail here, in one line
    check_ranks_agree(tc, {"world_size": size, "ranks_per_node": rpn, "device_type": device.type,
                           "backend": backend})
    layout = None
    if size > 1:
        layout = ParallelLayout(pp=tc.pp, ep=tc.ep, dp=tc.dp, tp=tc.tp, cp=tc.cp, ep_over_cp=tc.ep_over_cp,
                                topology=Topology(size, rpn), device_type=device.type, timeout=timeout)
    return World(rank, size, layout, device)


class _Claimed:
    """What one job holds while it lives: --save's lock (save_dir.claim) and its outputs' (run_outputs)."""

    def __init__(self, tc: TrainConfig):
        """Claims --save, then the output files; CheckpointError / RunError (one line) when refused."""
        self.save = (save_dir.claim(tc.save, resume=tc.resume, overwrite=tc.overwrite_save, load=tc.load)
                     if tc.save else None)
        try:
            self.outputs = run_outputs.claim(tc)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if getattr(self, "outputs", None) is not None:
            self.outputs.release()
        if self.save is not None:
            self.save.close()


def _claim_on_rank0(tc: TrainConfig, world: World) -> _Claimed | None:
    """Under torchrun (no fmoe launcher): global rank 0 claims --save and the outputs and tells every rank
    the outcome, so all of them fail together with its one line; returns the claim on rank 0 (None
    elsewhere)."""
    claimed, problem = None, None
    if world.rank == 0:
        try:
            claimed = _Claimed(tc)
        except (CheckpointError, RunError) as exc:
            problem = (type(exc).__name__, str(exc))
    if world.size > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem is not None:
        raise (CheckpointError if problem[0] == "CheckpointError" else RunError)(problem[1])
    return claimed


def train_rank(tc: TrainConfig, world: World, save_claimed: bool = False) -> str | None:
    """Trains on this rank from the start, `--load` or `--resume` to `--steps`, saving as asked; returns
    rank 0's summary (None on the other ranks). `save_claimed`: the launcher holds the locks of --save and
    the outputs (else rank 0 takes them here)."""
    lock = _claim_on_rank0(tc, world) if not save_claimed else None
    try:
        return _train(tc, world)
    finally:
        if lock is not None:
            lock.close()


def _train(tc: TrainConfig, world: World) -> str | None:
    trainer = Trainer(tc, world)
    lead = world.rank == 0
    start = None
    if tc.resume:
        start = checkpoint.latest(tc.save)
    elif tc.load:  # a checkpoint directory, or a --save directory (its latest checkpoint)
        is_one = os.path.isfile(os.path.join(tc.load, checkpoint.META))
        start = tc.load if is_one else checkpoint.latest(tc.load)
        if start is None:
            raise checkpoint.CheckpointError(f"--load {tc.load}: no complete checkpoint there")
    if start is not None:
        trainer.load(str(start))
    reporter = Reporter(tc.steps, metrics_path=tc.metrics if lead else None, progress=tc.progress and lead,
                        floor=trainer.dataset.floor, describe=_describe(tc, trainer),
                        continue_from=trainer.step_done if tc.resume else None, log_interval=tc.log_interval)
    if lead and start is not None:
        print(_started_from(tc, str(start), trainer.step_done), flush=True)
    if lead:
        reporter.start(trainer.step_done)
    backends = LogBackends.open(tc, trainer.step_done) if lead else None
    try:
        _steps(tc, trainer, reporter, backends, lead)
    finally:
        if backends is not None:
            backends.close()
    if not lead:
        return None
    summary = reporter.close()
    if tc.loss_curve and reporter.history:
        drawn = write_loss_curve(reporter.earlier + reporter.history, tc.loss_curve, trainer.dataset.floor,
                                 _describe(tc, trainer), resumed_at=reporter.earlier[-1]["step"]
                                 if reporter.earlier else None)
        if drawn is None:
            summary += "\n  (no loss-curve PNG: matplotlib is not installed; pip install 'fmoe[viz]')"
    return summary + _compiled_line(trainer) + "".join(f"\n  {line}" for line in _written(tc))


def _compiled_line(trainer: Trainer) -> str:
    """--compile: what compiling the phases took on rank 0 (traces, seconds, traces after step 2)."""
    c = trainer.compiled
    if c is None:
        return ""
    by_step = trainer.compiles_by_step
    late = by_step[-1] - by_step[min(1, len(by_step) - 1)] if by_step else 0
    return (f"\n  compiled: {len(c)} phases, {c.compiles} traces (forward, dx and dw graphs each) in "
            f"{c.seconds:.1f} s; traces after step 2: {late}")


def _started_from(tc: TrainConfig, start: str, step: int) -> str:
    """The line saying what the run starts from: a --resume continues its run at the checkpoint's step; a
    --load starts this run from a checkpoint's weights (a converted one: step 0, what it was converted
    from)."""
    if tc.resume:
        return f"fmoe train: resumed from {start} at step {step}"
    meta = checkpoint.read_meta(start)
    hf = meta.get("hf_config") or {}
    source = f", converted from Hugging Face {hf.get('model_type', 'a model')}" if hf else ""
    state = "weights (a fresh optimizer)" if hf else f"weights, optimizer state and step {step}"
    return f"fmoe train: loaded the {state} of {start}{source}; training steps {step + 1}-{tc.steps}"


def _written(tc: TrainConfig) -> list[str]:
    """Where the run's outputs are, one line each: metrics, loss curve, trace, checkpoints, TensorBoard."""
    out = [f"metrics: {tc.metrics}" if tc.metrics else None,
           f"loss curve: {tc.loss_curve}" if tc.loss_curve and os.path.isfile(tc.loss_curve)
           and os.path.getsize(tc.loss_curve) else None,
           f"trace: {tc.trace} (and {os.path.splitext(tc.trace)[0]}.png)" if tc.trace else None]
    if tc.save:
        last = checkpoint.latest(tc.save)
        out.append(f"checkpoints: {tc.save} (latest {last.name})" if last is not None else None)
    out.append(f"TensorBoard: {tc.tensorboard_dir}" if tc.tensorboard_dir else None)
    return [line for line in out if line]


def _steps(tc: TrainConfig, trainer: Trainer, reporter: Reporter, backends: LogBackends | None,
           lead: bool) -> None:
    """Steps to --steps: each step's metrics (with a held-out evaluation when one is due) to rank 0's
    reporter and log backends, the trace step's trace, the checkpoints."""
    while trainer.step_done < tc.steps:
        metrics = trainer.step()
        if lead and trainer.compiled is not None and len(trainer.compiles_by_step) == 2:
            c = trainer.compiled  # --compile: the phases were traced and compiled in the first steps
            print(f"fmoe train: compiled {len(c)} phases ({c.compiles} traces of forward, dx and dw graphs) "
                  f"in {c.seconds:.1f} s", flush=True)
        if eval_due(tc, trainer.step_done):
            metrics.update(evaluate(trainer))  # collective: every rank evaluates
        if lead:
            reporter.step(metrics)
            backends.log(metrics)
        if tc.trace and metrics["step"] == tc.trace_step and trainer.last_result is not None:
            _gather_trace(trainer, tc.trace, lead)
        if tc.save and ((tc.save_interval and trainer.step_done % tc.save_interval == 0)
                        or trainer.step_done == tc.steps):
            trainer.save(tc.save)


def _gather_trace(trainer: Trainer, path: str, lead: bool) -> None:
    events = trainer.last_result.events
    gathered: list | None = [None] * trainer.world.size if lead else None
    if trainer.world.size > 1:
        dist.gather_object(events, gathered, dst=0)
    else:
        gathered = [events]
    if lead:
        model = trainer.tc.compute_model if trainer.compute_model is not None else 0.0
        write_step_trace(gathered, path, meta={"compute_model": model or "off"})
        if len(gathered) > 1:
            print(f"fmoe train: traced step {trainer.tc.trace_step}: measured per-rank compute imbalance "
                  f"{_measured_imbalance(gathered):.1f}%", flush=True)


def _cut(tc: TrainConfig, trainer: Trainer) -> str:
    """The pipeline cut for the banner: layers per chunk, whether MTP runs alone on the last, and the
    modelled imbalance (FLOPs) per rank, and per chunk where a rank holds several."""
    if trainer.schedule is None or len(trainer.chunks) == 1:
        return ""
    ranks, chunks = cut_costs(trainer.cfg, trainer.schedule.placement, trainer.chunks, tc.seq_length)
    alone = "" if trainer.chunks[-1].head else ", MTP alone on the last chunk"
    per_chunk = f", {imbalance_pct(chunks):.1f}% per chunk" if len(chunks) > len(ranks) else ""
    return (f", cut {'+'.join(str(len(c.layers)) for c in trainer.chunks)} layers{alone} "
            f"(modelled imbalance {imbalance_pct(ranks):.1f}% per rank{per_chunk})")


def _measured_imbalance(events_by_rank: list[list[TraceEvent]]) -> float:
    """Returns the measured per-rank compute imbalance ((max/mean - 1) x 100) of one traced step."""
    busy = [sum(e.end - e.start for e in evs if e.lane == "compute") for evs in events_by_rank]
    return imbalance_pct(tuple(busy))


def _layout(tc: TrainConfig) -> str:
    """The banner's layout: pp x ep x dp always (pp 1 x ep 1 names the one-process path), tp where > 1,
    "(sp)" after it when sequence parallelism shards the sequence over the tp ranks, cp where > 1; an
    expert group carved from dp x cp is named after them ("pp 1 x dp 1 x cp 2 (p2p), ep 2 of dp x cp")."""
    tp = f" x tp {tc.tp}{' (sp)' if tc.sequence_parallel else ''}" if tc.tp > 1 else ""
    cp = f" x cp {tc.cp} ({tc.cp_comm_type})" if tc.cp > 1 else ""
    if tc.ep_over_cp:
        return f"pp {tc.pp}{tp} x dp {tc.dp}{cp}, ep {tc.ep} of dp x cp"
    return f"pp {tc.pp}{tp} x ep {tc.ep} x dp {tc.dp}{cp}"


def _describe(tc: TrainConfig, trainer: Trainer) -> str:
    seams = "".join(f", {name} {getattr(tc, name)}" for name in ("router", "experts", "attention")
                    if getattr(tc, name) is not None)  # the functions replacing fmoe's (docs/research.md)
    return (f"{tc.num_layers} layers, D {tc.hidden_size}, {tc.num_experts} experts top-{tc.moe_router_topk}"
            f"{seams}; {_layout(tc)}, {tc.schedule_name}"
            f"{' + fb overlap' if tc.overlap and trainer.schedule is not None else ''}{_cut(tc, trainer)}; "
            f"{trainer.dataset.describe()}"
            f"{f'; held out: {trainer.valid.describe()}' if trainer.valid is not None else ''}")


def _spawned(local_rank: int, tc: TrainConfig, init_method: str, size: int, out_path: str,
             device_type: str, launcher_pid: int) -> None:
    die_with_parent(launcher_pid)  # a launcher killed outright leaves no rank training
    thread_locks_for_bars()  # it ends with exit_process: no semaphore may be left to the tracker
    # As torchrun does: ranks sharing the machine split its cores, or their OpenMP regions wait on each
    # other's descheduled threads (a small grouped GEMM goes from 0.1 ms to 60 ms on 2 busy cores).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        summary = _train_and_close(tc, _world(tc, local_rank, init_method, local_rank, size, device_type),
                                   save_claimed=True)
    except Exception:  # noqa: BLE001 - every failure goes to the launcher, as torch's spawn would send it
        # written where the launcher reads it, then the same exit as a success: a rank that raised and
        # went through finalization could abort in gloo's threads ("terminate called without an active
        # exception", teardown.py) and add that to the one line the launcher prints
        with open(_error_path(out_path, local_rank), "w") as f:
            f.write(traceback.format_exc())
        exit_process(1)
    if summary is not None:
        with open(out_path, "w") as f:
            f.write(summary)
    exit_process(0)  # the group is closed; leave before gloo's threads meet finalization (teardown.py)


def _error_path(out_path: str, local_rank: int) -> str:
    """Where spawned rank `local_rank` of the run whose summary goes to `out_path` writes its traceback."""
    return f"{out_path}.rank{local_rank}.err"


def _rank_failed(index: int, msg: str) -> int:
    """Reports a spawned rank's failure from its traceback `msg`: a checkpoint or run error as its one line
    (the other ranks met the same), anything else whole; returns the exit code (1)."""
    message = _raised_checkpoint_error(msg)
    if message is not None:
        return _checkpoint_failed(message)
    message = raised_run_error(msg)
    if message is not None:
        return _run_failed(message)
    print(f"fmoe train: rank {index} failed:\n{msg}", file=sys.stderr)
    return 1


def _train_and_close(tc: TrainConfig, world: World, save_claimed: bool = False) -> str | None:
    """`train_rank`, then the default process group closed (`close_default_group`: a barrier first when
    the run succeeded)."""
    succeeded = False
    try:
        summary = train_rank(tc, world, save_claimed)
        succeeded = True
    finally:
        close_default_group(succeeded)
    return summary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tc: TrainConfig) -> int:
    """Runs the whole job; returns the exit code (0, or 1 after a rank failed, 2 for a bad config)."""
    torchrun = under_torchrun()
    problem = preflight.problem(tc, int(os.environ["WORLD_SIZE"]) if torchrun else None)
    if problem is not None:
        print(f"fmoe train: error: {problem}", file=sys.stderr)
        return 2
    lr_warning = tc.lr_warning()
    if lr_warning is not None and (not torchrun or os.environ.get("RANK", "0") == "0"):  # once per run
        print(f"fmoe train: warning: {lr_warning}", file=sys.stderr)
    if torchrun:  # this process is one rank: it ends here, without finalization (teardown.py)
        thread_locks_for_bars()
        exit_process(_torchrun_rank(tc))
    try:
        device_type = _device_type(tc)
        available = device_counts()[device_type] if device_type != "cpu" else tc.world_size
        if tc.world_size > available:
            raise ValueError(f"{tc.layout_text()} ranks, one per "
                             f"device, but this machine has {available} {device_type} devices (--device cpu "
                             "runs them on the CPU)")
    except ValueError as exc:
        print(f"fmoe train: error: {exc}", file=sys.stderr)
        return 2
    try:  # before any rank starts: a second run on this --save or these outputs fails here, at once
        lock = _Claimed(tc)
    except CheckpointError as exc:
        return _checkpoint_failed(str(exc))
    except RunError as exc:
        return _run_failed(str(exc))
    try:
        return _spawn(tc, device_type)
    finally:
        lock.close()


def _torchrun_rank(tc: TrainConfig) -> int:
    """This process's rank of a torchrun job, trained and its group closed; returns the exit code."""
    try:
        summary = _train_and_close(tc, _world(tc, int(os.environ.get("LOCAL_RANK", 0))))
    except CheckpointError as exc:
        return _checkpoint_failed(str(exc))
    except RunError as exc:
        return _run_failed(str(exc))
    if summary:
        print(summary)
    return 0


def _checkpoint_failed(message: str) -> int:
    print(f"fmoe train: CheckpointError: {message}", file=sys.stderr)
    return 1


def _run_failed(message: str) -> int:
    print(f"fmoe train: error: {message}", file=sys.stderr)
    return 1


def _raised_checkpoint_error(msg: str) -> str | None:
    """The message of a CheckpointError that ended a spawned rank (the last line of its traceback; the
    message is one line by construction), else None."""
    lines = msg.rstrip().splitlines()
    prefix = f"{CheckpointError.__module__}.{CheckpointError.__name__}: "
    return lines[-1][len(prefix):] if lines and lines[-1].startswith(prefix) else None


def _run_ranks(args: tuple, nprocs: int) -> int | None:
    """Starts the ranks and waits for them: None when all finished; 128 + the signal after SIGINT /
    SIGTERM ended them; raises as `mp.start_processes(join=True)` when a rank fails on its own."""
    with forward_stop_signals() as received:
        ranks = mp.start_processes(_spawned, args=args, nprocs=nprocs, join=False, start_method="spawn")
        try:
            while not ranks.join(timeout=0.2) and received() is None:
                pass
        except ProcessException:
            if received() is None:
                raise
            # Ctrl-C in a terminal signals the ranks too: one that died of it is the stop, not a failure
        signum = received()
        if signum is None:
            return None
        stop_ranks(ranks.processes)
    return 128 + signum


def _stopped(tc: TrainConfig, signum: int) -> int:
    """After a stop signal ended the run: its loss curve drawn from the metrics file (the ranks could not
    draw it) and one line saying how to continue; returns 128 + the signal."""
    drawn = ""
    if tc.loss_curve and tc.metrics and os.path.isfile(tc.metrics):
        history = read_metrics(tc.metrics)
        if history and write_loss_curve(history, tc.loss_curve, None,
                                        f"stopped after step {history[-1]['step']}") is not None:
            drawn = f"; loss curve of its {len(history)} steps: {tc.loss_curve}"
    last = checkpoint.latest(tc.save) if tc.save else None
    if last is not None:
        step = checkpoint.read_meta(last).get("step", "?")
        how = (f"continue from {last} (step {step}): the same command with --resume"
               + (" in place of --overwrite-save" if tc.overwrite_save else ""))
    elif tc.save:
        how = f"no checkpoint was saved yet in {tc.save} (--save-interval N saves every N steps)"
    else:
        how = "nothing was saved: give --save DIR (and --save-interval N) to make a run resumable"
    print(f"fmoe train: stopped by {signal.Signals(signum).name}; every rank was ended{drawn}; {how}",
          file=sys.stderr)
    return 128 + signum


def _spawn(tc: TrainConfig, device_type: str) -> int:
    """Runs the ranks (in this process when there is one) with --save claimed; returns the exit code."""
    fd, out_path = tempfile.mkstemp(prefix="fmoe_train_summary_")
    os.close(fd)
    try:
        if tc.world_size == 1:
            store = tempfile.mktemp(prefix="fmoe_train_store_")
            world = _world(tc, 0, f"file://{store}", 0, 1, device_type)
            try:
                print(_train_and_close(tc, world, save_claimed=True))
            except KeyboardInterrupt:  # Ctrl-C: the one rank is this process
                return _stopped(tc, signal.SIGINT)
            return 0
        init = f"tcp://127.0.0.1:{_free_port()}"
        try:
            stopped = _run_ranks((tc, init, tc.world_size, out_path, device_type, os.getpid()), tc.world_size)
            if stopped is not None:
                return _stopped(tc, stopped - 128)
        except mp.ProcessExitedException as exc:
            path = _error_path(out_path, exc.error_index)
            if exc.exit_code == 1 and os.path.isfile(path):  # it raised: its traceback (`_spawned`)
                with open(path) as f:
                    return _rank_failed(exc.error_index, f.read())
            print(f"fmoe train: rank {exc.error_index} exited with code {exc.exit_code}; the other ranks "
                  "were stopped", file=sys.stderr)
            return 1
        except mp.ProcessRaisedException as exc:
            return _rank_failed(exc.error_index, exc.msg)
        with open(out_path) as f:
            print(f.read())
        return 0
    except CheckpointError as exc:
        return _checkpoint_failed(str(exc))
    except RunError as exc:
        return _run_failed(str(exc))
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        os.unlink(out_path)
        for k in range(tc.world_size):
            if os.path.isfile(_error_path(out_path, k)):
                os.unlink(_error_path(out_path, k))
