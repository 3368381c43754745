"""What the multi-rank benchmarks share: one launcher for spawned gloo ranks (so every script fails the
same bounded way), the machine-load probes, and the model shape options.

    results = spawn(worker, world, worker_args, timeout_s, label)

`worker(rank, *worker_args, store, q)` runs in each process (module-level, pickled by reference): it
rendezvouses through the file store `store` and puts `(rank, value, error_or_None)` on `q`.
"""

from __future__ import annotations

import argparse
import os
import queue
import resource
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from fmoe import GPTConfig, init_gpt
from fmoe._compat import tree_flatten
from fmoe.pipeline import ChunkSpec
from fmoe.train.host_memory import set_malloc_thresholds


def rss_kib(field: str) -> int:
    """Returns `field` ("VmRSS", "VmHWM") of /proc/self/status in KiB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def return_freed_memory() -> None:
    """Sets glibc malloc to mmap every block of 64 KiB or more (and trim at 64 KiB), so a freed tensor goes
    back to the OS at once and an RSS rise counts what a step holds, not what earlier steps left in the
    heap. Returns None; call it before the steps being measured."""
    set_malloc_thresholds(trim_bytes=64 * 1024, mmap_bytes=64 * 1024)


def measure_rss(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """Runs fn() with the RSS high-water mark first reset to the current RSS (/proc/self/clear_refs);
    returns (fn's result, the peak RSS during it, its rise over the RSS before it), both in MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = rss_kib("VmRSS")
    out = fn()
    peak = rss_kib("VmHWM")
    return out, peak / 1024, (peak - before) / 1024


def spawn(worker: Callable[..., None], world: int, worker_args: tuple, timeout_s: float,
          label: str) -> list[Any]:
    """Runs `worker` on `world` spawned ranks; returns each rank's value in rank order. Raises
    RuntimeError with the tracebacks when a rank fails (stopping the others at once, rather than letting
    them wait for the gloo timeout), and kills the ranks after `timeout_s`."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="fmoe_bench_")
    os.close(fd)
    os.unlink(store)
    procs = [ctx.Process(target=worker, args=(r, *worker_args, store, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout_s
    while len(got) + len(errors) < world and time.monotonic() < deadline:
        try:
            rank, value, err = q.get(timeout=0.5)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and q.empty():
                break
            continue
        if err is None:
            got[rank] = value
        else:
            errors.append(f"--- rank {rank} ---\n{err}")
            break
    for p in procs:
        p.join(timeout=0 if errors else 10)
        if p.is_alive():
            p.kill()
            p.join(5)
    if os.path.exists(store):
        os.unlink(store)
    if errors or len(got) < world:
        missing = sorted(set(range(world)) - set(got))
        raise RuntimeError(f"{label} failed (ranks without a result: {missing}, limit {timeout_s:.0f} s)\n"
                           + "\n".join(errors))
    return [got[r] for r in range(world)]


def machine_busy_s() -> float:
    """Returns the CPU seconds the whole machine has spent busy (all processes; /proc/stat, not idle or
    iowait): with `own_cpu_s`, how much other processes loaded the machine during a run."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """Returns the CPU seconds of this process and its finished children (the ranks)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the options the pipeline benchmarks share: MoE GPT and batch shapes, --no-memory, and the
    launcher's --timeout / --pg-timeout."""
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds per pass before the ranks are killed")
    p.add_argument("--pg-timeout", type=float, default=300.0, help="gloo timeout (seconds)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--no-memory", action="store_true", help="skip the memory pass")


def per_rank(xs: list[float], fmt: str = "{:.0f}", scale: float = 1.0) -> str:
    """Returns the values of `xs` (one per rank) formatted and joined by "/" (e.g. "12/13")."""
    return "/".join(fmt.format(scale * x) for x in xs)


def param_count(cfg: GPTConfig) -> tuple[int, int]:
    """Returns (total parameters, parameters active per token) of the GPT `cfg`."""
    p = init_gpt(cfg, torch.Generator().manual_seed(0))
    total = sum(t.numel() for t in tree_flatten(p)[0])
    experts = sum(t.numel() for layer in p["layers"] for t in layer["moe"]["experts"].values())
    return total, total - experts + experts * cfg.moe.top_k // cfg.moe.num_experts


def even_chunks(cfg: GPTConfig, n: int) -> tuple[ChunkSpec, ...]:
    """Returns n chunks of n_layers / n consecutive layers (embedding on the first, head on the last)."""
    k = cfg.n_layers // n
    return tuple(ChunkSpec(c, tuple(range(c * k, (c + 1) * k)), first=c == 0, last=c == n - 1)
                 for c in range(n))


def quick_shapes(args: argparse.Namespace) -> None:
    """Sets the tiny model of a --quick smoke run on `args` (in place): D 64, 2 heads, 4 layers of 4
    experts, F 64, V 128, S 32, 2 repetitions."""
    args.d_model, args.heads, args.layers, args.experts, args.d_ff = 64, 2, 4, 4, 64
    args.vocab, args.seq, args.reps = 128, 32, 2
