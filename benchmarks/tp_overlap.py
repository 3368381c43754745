"""Sequence-parallel TP collectives overlapped with their GEMMs by chunking, against the runtime's plain
order, side by side on 2 gloo ranks (not wired into the runtime: this measures whether it should be).

    .venv/bin/python benchmarks/tp_overlap.py                  # the measurement (about a minute, 2 cores)
    .venv/bin/python benchmarks/tp_overlap.py --ffn 8192       # a wider GEMM: less comm per FLOP
    .venv/bin/python benchmarks/tp_overlap.py --quick          # small shapes, 3 rounds: a smoke test

Legend: P = 2 ranks of a TP group, T the group's tokens, D model width, F the column-parallel GEMM's full
width (each rank holds F/P columns), n chunks.

Two patterns, forward only (a backward is the same two patterns transposed), fp32, one thread per rank:
- ag_gemm, SP entering a column-parallel GEMM: plain = all-gather x [T/P, D] -> [T, D], wait, then
  y = x @ w [D, F/P]; chunked = x cut into n row chunks, the all-gather of chunk i+1 in flight (async
  handle, fmoe.parallel.collectives.all_gather_async) while chunk i's rows of every rank multiply, the
  n outputs put back in the plain row order at the end (a copy, counted).
- gemm_rs, a row-parallel GEMM leaving to SP: plain = part = h [T, F/P] @ w [F/P, D], then reduce-scatter
  -> [T/P, D]; chunked = the rows cut so that chunk i holds rows i of every rank's destination block,
  the reduce-scatter of chunk i in flight while chunk i+1 multiplies, then the n outputs joined.
Both give the plain result exactly (checked once per rank before timing).

Link variants, in one run:
- gloo: the collectives as gloo moves them on this machine (loopback; its transport thread takes the cores
  the GEMMs compute on, 2 cores for 2 ranks);
- device (--cluster, default h800): a `fmoe.parallel.link_model.LinkModel` on the group, so that a handle
  completes no earlier than latency + bytes / bandwidth after the link is free (`SerialLink`: one
  collective at a time on the link, so chunks share its bandwidth). Its figures are scaled to this CPU:
  the whole all-gather takes the device's collective / GEMM time ratio for --device-shape (a real
  model's GEMM: the benchmark's own CPU-sized shape would be all latency on a device; its intra-node
  bandwidth and latency, bf16 bytes, its bf16 peak x gemm_eff, as the planner prices them) times the
  GEMM time measured here (median, max over ranks, before the rounds), split into latency and transfer
  as the device's is. --ratio sets the ratio instead. So the comparison reads the code's overlap, not
  gloo's use of 2 cores.

Timing: one warm-up round, then --reps rounds; each round runs every (variant, pattern, mode) once, in
an order rotated by one each round; a run = barrier, then the pattern's wall time; the round's time =
max over ranks. Printed: medians in ms, chunked / plain as the median of per-round ratios (with its
range), and the peak RSS rise of one run of each (MiB, max over ranks; glibc malloc set to return blocks
of 64 KiB or more at once, so the rise counts what the run holds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import _ranks
import torch
import torch.distributed as dist

from fmoe.parallel.collectives import CommGroup, all_gather_async, reduce_scatter_async
from fmoe.parallel.counters import all_gather_sent
from fmoe.parallel.link_model import LinkModel
from fmoe.plan.specs import load_cluster

PATTERNS = ("ag_gemm", "gemm_rs")
MODES = ("plain", "chunked")


# ---- the two patterns, plain and chunked ---------------------------------------------------------------

def ag_gemm_plain(x_XD: torch.Tensor, w_DF: torch.Tensor, comm: CommGroup, n: int) -> torch.Tensor:
    """Returns y [T, F/P] = all_gather(x) @ w: the gather waited, then one GEMM."""
    x_TD, h = all_gather_async(x_XD, comm, op="tp.sp_gather")
    h.wait()
    return x_TD @ w_DF


def ag_gemm_chunked(x_XD: torch.Tensor, w_DF: torch.Tensor, comm: CommGroup, n: int) -> torch.Tensor:
    """Returns the same y as `ag_gemm_plain`: chunk i+1's all-gather in flight while chunk i multiplies."""
    chunks = x_XD.chunk(n)
    pending = [all_gather_async(chunks[0], comm, op="tp.sp_gather")]
    outs = []
    for i in range(n):
        if i + 1 < n:  # issued before this chunk's GEMM, so it travels while the GEMM runs
            pending.append(all_gather_async(chunks[i + 1], comm, op="tp.sp_gather"))
        x_i, h = pending[i]
        h.wait()
        outs.append((x_i @ w_DF).unflatten(0, (comm.size, -1)))  # [P, X/n, F/P]: rank-major rows
    return torch.cat(outs, dim=1).flatten(0, 1)  # the plain order: rank p's X rows, then p + 1's


def gemm_rs_plain(h_TF: torch.Tensor, w_FD: torch.Tensor, comm: CommGroup, n: int) -> torch.Tensor:
    """Returns y [T/P, D] = reduce_scatter(h @ w): one GEMM, then the reduce-scatter waited."""
    y, hd = reduce_scatter_async(h_TF @ w_FD, comm, op="tp.sp_scatter")
    hd.wait()
    return y


def gemm_rs_chunked(h_TF: torch.Tensor, w_FD: torch.Tensor, comm: CommGroup, n: int) -> torch.Tensor:
    """Returns the same y as `gemm_rs_plain`: chunk i's reduce-scatter in flight while chunk i+1 multiplies
    (chunk i = rows i of every rank's destination block, so each is a reduce-scatter of its own)."""
    h_PnXF = h_TF.unflatten(0, (comm.size, n, -1))
    pending = []
    for i in range(n):
        part = (h_PnXF[:, i].flatten(0, 1) @ w_FD)
        pending.append(reduce_scatter_async(part, comm, op="tp.sp_scatter"))
    outs = []
    for y_i, hd in pending:
        hd.wait()
        outs.append(y_i)
    return torch.cat(outs)


RUN: dict[tuple[str, str], Callable[..., torch.Tensor]] = {
    ("ag_gemm", "plain"): ag_gemm_plain, ("ag_gemm", "chunked"): ag_gemm_chunked,
    ("gemm_rs", "plain"): gemm_rs_plain, ("gemm_rs", "chunked"): gemm_rs_chunked,
}


# ---- the device-like link ------------------------------------------------------------------------------

@dataclass(frozen=True)
class SerialLink(LinkModel):
    """A LinkModel whose transfers queue on one link: a collective issued while another is in flight starts
    when that one ends. (LinkModel alone times each collective from its own issue, so n chunks issued at
    once would share no bandwidth and chunking would look n times faster on the wire.)"""

    busy_until: list = field(default_factory=lambda: [0.0], compare=False, repr=False)

    def duration(self, sent_by_link):
        now = time.perf_counter()
        end = max(now, self.busy_until[0]) + super().duration(sent_by_link)
        self.busy_until[0] = end
        return end - now


def _device_s(args: argparse.Namespace) -> tuple[float, float, float]:
    """(latency, whole all-gather, column GEMM) seconds of --device-shape on the device (--cluster), bf16."""
    c = load_cluster(args.cluster)
    P, (T, D, F) = 2, args.device_shape
    comm = c.intra_latency_s + all_gather_sent(T * D * 2, P) / c.intra_bytes_per_s
    return c.intra_latency_s, comm, 2 * T * D * (F // P) / (c.flops("bf16") * c.gemm_eff)


def device_ratio(args: argparse.Namespace) -> float:
    """Returns the collective / column-GEMM time ratio the link model reproduces: the device's for
    --device-shape, or --ratio."""
    _, comm, gemm = _device_s(args)
    return comm / gemm if args.ratio is None else args.ratio


def device_link(args: argparse.Namespace, cpu_gemm_s: float) -> SerialLink:
    """Returns the link that makes this shape's whole all-gather (fp32 bytes here) take device_ratio x
    `cpu_gemm_s`, split into latency and transfer as the device's is."""
    lat, comm, _ = _device_s(args)
    whole = device_ratio(args) * cpu_gemm_s
    latency = whole * lat / comm
    bw = all_gather_sent(args.tokens * args.d_model * 4, 2) / (whole - latency)
    return SerialLink(intra_latency_s=latency, intra_bytes_per_s=bw, inter_latency_s=latency,
                      inter_bytes_per_s=bw)


# ---- one rank --------------------------------------------------------------------------------------------

def _inputs(pattern: str, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1 + rank)
    T, D, Fp = args.tokens, args.d_model, args.ffn // 2
    if pattern == "ag_gemm":
        return torch.randn(T // 2, D, generator=g), torch.randn(D, Fp, generator=g) / D**0.5
    return torch.randn(T, Fp, generator=g), torch.randn(Fp, D, generator=g) / Fp**0.5


def _timed(fn: Callable[[], torch.Tensor]) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    _ranks.return_freed_memory()
    group = dist.group.WORLD
    inputs = {p: _inputs(p, rank, args) for p in PATTERNS}
    n = args.chunks
    with torch.no_grad():
        plain = CommGroup(group)
        for p in PATTERNS:  # the chunked order gives the plain result exactly
            a, b = inputs[p]
            want, got = RUN[(p, "plain")](a, b, plain, n), RUN[(p, "chunked")](a, b, plain, n)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # this CPU's column GEMM, the time the device-like link is scaled to (the slower rank's)
        a, b = inputs["ag_gemm"]
        full = torch.randn(args.tokens, args.d_model)
        gemm_s = torch.tensor(statistics.median(_timed(lambda: full @ b) for _ in range(11)))
        dist.all_reduce(gemm_s, op=dist.ReduceOp.MAX)
        link = device_link(args, gemm_s.item())
        comms = {"gloo": plain, "device": CommGroup(group, link_model=link)}
        runs = [(v, p, m) for v in comms for p in PATTERNS for m in MODES]
        times: dict[tuple, list[float]] = {r: [] for r in runs}
        for rnd in range(args.reps + 1):
            k = rnd % len(runs)
            for v, p, m in runs[k:] + runs[:k]:
                a, b = inputs[p]
                t = _timed(partial(RUN[(p, m)], a, b, comms[v], n))
                if rnd:  # round 0 warms up
                    times[(v, p, m)].append(t)
        peak = {}
        for r in runs:
            v, p, m = r
            a, b = inputs[p]
            dist.barrier()
            peak[r] = _ranks.measure_rss(partial(RUN[(p, m)], a, b, comms[v], n))[2]
    return {"times": times, "peak": peak, "gemm_s": gemm_s.item(), "link": link}


# ---- report ----------------------------------------------------------------------------------------------

def report(out: list[dict], args: argparse.Namespace) -> None:
    link = out[0]["link"]
    print(f"2 gloo ranks, 1 thread each, fp32; T {args.tokens}, D {args.d_model}, F {args.ffn} (F/P "
          f"{args.ffn // 2} a rank), {args.chunks} chunks, {args.reps} rounds")
    print(f"this CPU's column GEMM [T, D] x [D, F/P]: {1e3 * out[0]['gemm_s']:.2f} ms (max over ranks); "
          f"device link ({args.cluster}, T,D,F {args.device_shape}): collective / GEMM ratio "
          f"{device_ratio(args):.3g}, modelled as "
          f"latency {1e6 * link.intra_latency_s:.0f} us, {link.intra_bytes_per_s / 1e9:.3g} GB/s")
    print("| link | pattern | plain ms | chunked ms | chunked / plain (range) | peak MiB plain / chunked |")
    print("|---|---|---|---|---|---|")
    for v in ("gloo", "device"):
        for p in PATTERNS:
            rounds = {m: [max(r["times"][(v, p, m)][i] for r in out) for i in range(args.reps)]
                      for m in MODES}
            ratios = [c / a for a, c in zip(rounds["plain"], rounds["chunked"])]
            med = {m: 1e3 * statistics.median(rounds[m]) for m in MODES}
            peak = {m: max(r["peak"][(v, p, m)] for r in out) for m in MODES}
            print(f"| {v} | {p} | {med['plain']:.2f} | {med['chunked']:.2f} | "
                  f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
                  f"{peak['plain']:.1f} / {peak['chunked']:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="T, the group's tokens")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048, help="F, the column-parallel GEMM's full width")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--cluster", default="h800", help="the device whose link / GEMM ratio is modelled")
    p.add_argument("--device-shape", default="4096,7168,36864",
                   help="T,D,F of the device GEMM whose ratio is modelled (default DeepSeek-V3's dense MLP "
                        "gate + up, one 4096-token sequence)")
    p.add_argument("--ratio", type=float, default=None,
                   help="collective / GEMM time ratio (instead of the cluster's)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--quick", action="store_true", help="small shapes, 3 rounds")
    args = p.parse_args()
    args.device_shape = tuple(int(v) for v in args.device_shape.split(","))
    if args.quick:
        args.tokens, args.d_model, args.ffn, args.reps = 256, 64, 256, 3
    if args.tokens % (2 * args.chunks):
        p.error(f"--tokens {args.tokens} must split over 2 ranks x {args.chunks} chunks")
    report(_ranks.spawn(_rank, 2, (args,), args.timeout, "tp_overlap"), args)


if __name__ == "__main__":
    main()
