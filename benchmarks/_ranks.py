"""What the multi-rank benchmarks share: one launcher for spawned gloo ranks (so every script fails the
same bounded way), the machine-load probes, and the model shape options.

    results = spawn(fn, world, args, timeout_s, label)

`fn(rank, world, *args)` runs in each process (module-level, pickled by reference) inside the gloo group
fmoe.parallel.local_ranks set up, and returns the rank's value.
"""

from __future__ import annotations

import argparse
import os
import resource
from collections.abc import Callable
from typing import Any

import torch

from fmoe import GPTConfig, init_gpt
from fmoe._compat import tree_flatten
from fmoe.parallel.local_ranks import failures, run_ranks
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


def spawn(fn: Callable[..., Any], world: int, args: tuple, timeout_s: float, label: str,
          pg_timeout_s: float = 300.0) -> list[Any]:
    """Runs `fn(rank, world, *args)` on `world` spawned gloo ranks (fmoe.parallel.local_ranks); returns each
    rank's value in rank order. Raises RuntimeError with the tracebacks when a rank fails (stopping the
    others at once, rather than letting them wait for the gloo timeout), and kills the ranks after
    `timeout_s`."""
    results = run_ranks(fn, world, *args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s, stop_on_error=True)
    if failures(results):
        missing = [r.rank for r in results if r.error is not None]
        raise RuntimeError(f"{label} failed (ranks without a result: {missing}, limit {timeout_s:.0f} s)\n"
                           + failures(results))
    return [r.value for r in results]


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
