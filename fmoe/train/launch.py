"""Start `fmoe train`: under torchrun use the ranks it gives; alone, spawn the local gloo ranks the layout
needs (or run in this process when it needs one). Then every rank runs `train_rank`.

Backends: gloo on CPU, NCCL with CUDA devices, HCCL with Ascend NPUs (torch_npu), one device per local
rank. A rank that dies (an error, SIGKILL) stops the others at once: the launcher terminates them and
exits non-zero; the last complete checkpoint stays the latest.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fmoe.parallel import ParallelLayout, Topology
from fmoe.train import checkpoint
from fmoe.train.config import TrainConfig
from fmoe.train.host_memory import keep_freed_memory
from fmoe.train.loop import Trainer, World
from fmoe.train.report import Reporter, write_loss_curve, write_step_trace


def under_torchrun() -> bool:
    """Whether torchrun (or another env:// launcher) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _backend_and_device(local_rank: int) -> tuple[str, torch.device]:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return "nccl", torch.device("cuda", local_rank)
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        npu.set_device(local_rank)
        return "hccl", torch.device("npu", local_rank)
    return "gloo", torch.device("cpu")


def _world(tc: TrainConfig, local_rank: int, init_method: str | None = None, rank: int = 0,
           size: int = 1) -> World:
    """Joins the process group (env:// under torchrun when `init_method` is None, else `init_method` as
    rank `rank` of `size`, CPU gloo) and builds this rank's layout; returns its World."""
    spawned = init_method is not None  # spawned local ranks are CPU gloo ranks
    backend, device = ("gloo", torch.device("cpu")) if spawned else _backend_and_device(local_rank)
    if device.type == "cpu" and tc.keep_host_memory:
        keep_freed_memory()  # the step's tensors live in host memory: keep it mapped between microbatches
    timeout = timedelta(seconds=tc.timeout)
    if init_method is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    rank, size = dist.get_rank(), dist.get_world_size()
    rpn = tc.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", size))
    layout = None
    if size > 1:
        layout = ParallelLayout(pp=tc.pp, ep=tc.ep, dp=tc.dp, topology=Topology(size, rpn),
                                device_type=device.type)
    return World(rank, size, layout, device)


def train_rank(tc: TrainConfig, world: World) -> str | None:
    """Trains on this rank from the start, `--load` or `--resume` to `--steps`, saving as asked; returns
    rank 0's summary (None on the other ranks)."""
    trainer = Trainer(tc, world)
    lead = world.rank == 0
    if lead:
        for out in (tc.metrics, tc.loss_curve, tc.trace):
            if out:
                os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
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
                        floor=trainer.dataset.floor, describe=_describe(tc, trainer))
    if lead and start is not None:
        print(f"fmoe train: resumed from {start} at step {trainer.step_done}", flush=True)
    reporter.start(trainer.step_done)
    while trainer.step_done < tc.steps:
        metrics = trainer.step()
        if lead:
            reporter.step(metrics)
        if tc.trace and metrics["step"] == tc.trace_step and trainer.last_result is not None:
            _gather_trace(trainer, tc.trace, lead)
        if tc.save and ((tc.save_interval and trainer.step_done % tc.save_interval == 0)
                        or trainer.step_done == tc.steps):
            trainer.save(tc.save)
    summary = reporter.close() if lead else None
    if lead and tc.loss_curve and reporter.history:
        drawn = write_loss_curve(reporter.history, tc.loss_curve, trainer.dataset.floor,
                                 _describe(tc, trainer))
        if drawn is None:
            summary += "\n  (no loss-curve PNG: matplotlib is not installed; pip install 'fmoe[viz]')"
        else:
            summary += f"\n  loss curve: {tc.loss_curve}"
    return summary


def _gather_trace(trainer: Trainer, path: str, lead: bool) -> None:
    events = trainer.last_result.events
    gathered: list | None = [None] * trainer.world.size if lead else None
    if trainer.world.size > 1:
        dist.gather_object(events, gathered, dst=0)
    else:
        gathered = [events]
    if lead:
        write_step_trace(gathered, path)


def _describe(tc: TrainConfig, trainer: Trainer) -> str:
    return (f"{tc.num_layers} layers, D {tc.hidden_size}, {tc.num_experts} experts top-{tc.moe_router_topk}; "
            f"pp {tc.pp} x ep {tc.ep} x dp {tc.dp}, {tc.schedule_name}"
            f"{' + fb overlap' if tc.overlap and trainer.schedule is not None else ''}; "
            f"{trainer.dataset.describe()}")


def _spawned(local_rank: int, tc: TrainConfig, init_method: str, size: int, out_path: str) -> None:
    # As torchrun does: ranks sharing the machine split its cores, or their OpenMP regions wait on each
    # other's descheduled threads (a small grouped GEMM goes from 0.1 ms to 60 ms on 2 busy cores).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    summary = _train_and_close(tc, _world(tc, local_rank, init_method, local_rank, size))
    if summary is not None:
        with open(out_path, "w") as f:
            f.write(summary)
    # The work is done and the group closed: leave without the interpreter's finalization, during which
    # gloo's threads may still drop tensors (a GIL taken at teardown aborts the process: "terminate called
    # without an active exception", twice in today's test runs, after every step had been written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train_and_close(tc: TrainConfig, world: World) -> str | None:
    """`train_rank`, then the process group closed: after a barrier when the run succeeded, so no rank
    tears its connections down while a peer still talks to it (gloo aborts the process then)."""
    try:
        summary = train_rank(tc, world)
        if world.size > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return summary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tc: TrainConfig) -> int:
    """Runs the whole job; returns the exit code (0, or 1 after a rank failed, 2 for a bad config)."""
    torchrun = under_torchrun()
    problem = tc.problem(int(os.environ["WORLD_SIZE"]) if torchrun else None)
    if problem is not None:
        print(f"fmoe train: error: {problem}", file=sys.stderr)
        return 2
    if torchrun:
        summary = _train_and_close(tc, _world(tc, int(os.environ.get("LOCAL_RANK", 0))))
        if summary:
            print(summary)
        return 0
    fd, out_path = tempfile.mkstemp(prefix="fmoe_train_summary_")
    os.close(fd)
    try:
        if tc.world_size == 1:
            store = tempfile.mktemp(prefix="fmoe_train_store_")
            print(_train_and_close(tc, _world(tc, 0, f"file://{store}", 0, 1)))
            return 0
        init = f"tcp://127.0.0.1:{_free_port()}"
        try:
            mp.start_processes(_spawned, args=(tc, init, tc.world_size, out_path), nprocs=tc.world_size,
                               join=True, start_method="spawn")
        except mp.ProcessExitedException as exc:
            print(f"fmoe train: rank {exc.error_index} exited with code {exc.exit_code}; the other ranks "
                  "were stopped", file=sys.stderr)
            return 1
        except mp.ProcessRaisedException as exc:
            print(f"fmoe train: rank {exc.error_index} failed:\n{exc.msg}", file=sys.stderr)
            return 1
        with open(out_path) as f:
            print(f.read())
        return 0
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        os.unlink(out_path)
