"""The `local` cluster: this machine, calibrated from fmoe's own measured costs and gloo collective times,
and written as a cluster spec file the planner reads (`fmoe plan --cluster local`: `cluster_file`).

A device is a CPU process with one thread (as `fmoe train` splits the cores between its ranks); a node
is the machine (its cores). Measured, in this order, and written to `$FMOE_LOCAL_CLUSTER` (default
~/.cache/fmoe/local-cluster.toml, a TOML cluster spec (fmoe.plan.specs.to_toml) whose first line names the
torch version and core count it was measured with; delete it to measure again):
- GEMM FLOP/s of a 512^3 fp32 matmul (the peak; gemm_eff 1) and of a 32 x 64 x 64 one (gemm_half_dim);
  the causal attention kernel's FLOP/s at a small shape (attn_eff); AdamW's bytes per second over 2M
  fp32 parameters (hbm_bytes_per_s, 28 bytes per parameter): `measure_rates`, once in every round of
  the calibration runs below, medians over the rounds;
- the latency and bandwidth of a gloo send between two processes (ping-pong at 4 B and 4 MiB; one
  machine: intra = inter) and a tiny all-to-all's cost beyond that latency (comm_overhead_s); medians
  after a warm-up;
- the host overheads (`fit_host`): `fmoe train`'s `tiny` preset through the executor, data parallel over
  every core (one thread per rank, 8 microbatches each; `calibration_config`; seven runs and a
  pipelined eighth, live side by side and stepped in turn, see `calibration_configs` and
  `measure_runs`): per layer kind, its forward events beyond the FLOP model's compute (a fixed part and
  a part per token, steeper below the preset's microbatch, from three microbatch sizes; for an
  expert-parallel MoE layer both parts from two expert-parallel runs); the backward's as multiples
  of that plus a part per stage; the wall time outside the executor per layer held; the
  memory beyond what the planner counts (base_mem_gib); and, from the same preset pipelined over two
  ranks in a V (dualpipev, 16 microbatches), what one pipeline message costs each rank it leaves or
  reaches (p2p_overhead_s).
Exchanges do not progress while the ranks compute here (gloo's threads need the same cores): the spec
says so (comm_hides=False), and fb overlap hides nothing in its predictions.
On this CPU the tiny model's step is almost all host time (Python, dispatch, small kernels), so these
overheads decide the predictions; benchmarks/plan_local.py steps the calibration runs in turn with the
layouts it predicts, since this machine's speed drifts by up to 2x within seconds.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fmoe.calibrate.jobs import step_live
from fmoe.calibrate.models import load_model
from fmoe.calibrate.samples import HostSample
from fmoe.parallel.local_ranks import failures, run_ranks
from fmoe.plan.estimate import Context, _layer_phases, evaluate
from fmoe.plan.layer_costs import block_cost, embed_cost, head_cost
from fmoe.plan.layout import Layout
from fmoe.plan.specs import ClusterSpec, load_cluster, to_toml
from fmoe.train.config import TrainConfig


def _cache_path() -> Path:
    return Path(os.environ.get("FMOE_LOCAL_CLUSTER", Path.home() / ".cache" / "fmoe" / "local-cluster.toml"))


CALIBRATION_VERSION = 11  # bump when what is measured changes: older caches are measured again


def _key() -> str:
    return f"torch {torch.__version__}, {os.cpu_count()} cores, calibration {CALIBRATION_VERSION}"


Progress = Callable[[int, int, Path], None]  # (rounds done, rounds in all, the file written at the end)


def cluster_file(recalibrate: bool = False, progress: Progress | None = None) -> Path:
    """Returns the path of this machine's cluster spec file, measured now (a few minutes) and written
    there on first use, when it was measured with another torch or core count, or with `recalibrate`.
    `progress(done, total, path)` is called as the measurement starts (done 0) and after each round."""
    path = _cache_path()
    if not recalibrate and path.is_file():
        with path.open() as f:
            if f.readline().rstrip("\n") == f"# {_key()}":
                return path
    spec = calibrate(None if progress is None else lambda done, total: progress(done, total, path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(spec, _key()))
    return path


def local_cluster(recalibrate: bool = False) -> ClusterSpec:
    """Returns this machine's ClusterSpec, as the planner reads it from `cluster_file`."""
    return load_cluster(str(cluster_file(recalibrate)))


def ping_pong(x: torch.Tensor, peer: int, first: bool) -> None:
    """One round trip of `x` with global rank `peer` over the default group: send then receive when
    `first`, else receive then send (the peer calls it with the other `first`); x is overwritten."""
    if first:
        dist.send(x, peer)
        dist.recv(x, peer)
    else:
        dist.recv(x, peer)
        dist.send(x, peer)


def _median_s(fn: Callable[[], Any], reps: int = 15, warm: int = 3) -> float:
    """The median seconds of `fn()` over `reps` timed calls after `warm` untimed ones."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_rates() -> tuple[float, int]:
    big = [torch.randn(512, 512) for _ in range(2)]
    rate = 2 * 512**3 / _median_s(lambda: big[0] @ big[1])
    small = [torch.randn(32, 64), torch.randn(64, 64)]
    small_rate = 2 * 32 * 64 * 64 / _median_s(lambda: small[0] @ small[1], reps=200)
    eff = min(small_rate / rate, 0.999)
    return rate, max(1, int(64 * (1 / eff - 1)))  # eff(64) = 64 / (64 + half)


def _attention_rate(peak: float) -> float:
    q, k, v = (torch.randn(4, 4, 128, 32) for _ in range(3))
    t = _median_s(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    flops = 4 * 4 * 2 * 2 * 128 * 32 * 128 / 2  # B H (QK + PV), causal half
    return min(1.0, flops / t / peak)


def _adamw_bytes_per_s() -> float:
    p = [torch.nn.Parameter(torch.randn(2**21))]
    p[0].grad = torch.randn(2**21)
    opt = torch.optim.AdamW(p, foreach=True)
    return 28 * 2**21 / _median_s(opt.step, reps=10)


def _link_rank(rank: int, world: int) -> dict[Any, float]:
    """One of the two ranks of `_links`: {1: a 4 B send's one-way s, 2**20: a 4 MiB one's, "a2a": s}."""
    import fmoe.train.loop  # noqa: F401  (a rank's resident set includes the training code)

    # medians after a warm-up (_median_s): this machine's outliers (a rank time-sliced out) would move a
    # mean by several times, and the first calls set up gloo's pairs
    out = {}
    for n in (1, 2**20):  # fp32 elements: 4 B and 4 MiB
        x = torch.zeros(n)

        dist.barrier()
        out[n] = _median_s(lambda x=x: ping_pong(x, 1 - rank, rank == 0), 50 if n == 1 else 15, warm=5) / 2
    x = torch.zeros(2)
    dist.barrier()
    out["a2a"] = _median_s(lambda: dist.all_to_all_single(x, x.clone()), 50, warm=5)
    dist.barrier()
    return out


def _links() -> tuple[float, float, float]:
    """(latency s, bytes/s, extra seconds per collective call) between two spawned gloo processes: the
    one-way time of a 4-byte send, the bandwidth of a 4 MiB one, and what a tiny all-to-all costs beyond
    that latency (its host-side overhead)."""
    results = run_ranks(_link_rank, 2, timeout_s=300, pg_timeout_s=300, stop_on_error=True)
    if failures(results):
        raise RuntimeError(f"calibration: the link measurement failed:\n{failures(results)}")
    out = results[0].value
    latency = out[1]
    bandwidth = 4 * 2**20 / max(out[2**20] - latency, 1e-9)
    return latency, bandwidth, max(0.0, out["a2a"] - latency)


# The tiny preset data-parallel over every core, 8 microbatches per rank through the executor: ranks of one
# job, as the layouts the planner predicts run (measured here: two ranks of one job ran their ops up to 30%
# slower than two independent processes did; their gloo work shares the same cores).
CALIBRATION_RUN = {"pp": 1, "ep": 1, "schedule": "1f1b", "micro_batch_size": 4, "progress": False}
CALIBRATION_MICROBATCHES = 8
# Run twice: with the preset's layers and with SHORT_LAYERS (one dense, one MoE): the difference splits
# the backward's host time into a part per layer and a part per stage and microbatch.
SHORT_LAYERS = 2
# And once with microbatches of LARGE_MICRO_BATCH sequences: the forward's growth beyond its FLOPs splits
# each layer kind's host time into a fixed part and a part per token.
LARGE_MICRO_BATCH = 16
# And once with microbatches of SMALL_MICRO_BATCH sequences: below the preset's size the host time falls
# faster per token than above it (a dense layer's forward, per sequence: 0.25 ms from 1 to 2 sequences,
# 0.17 from 8 to 16), so the line through 4 and 16 priced 2 sequences 4-6% high; this run gives the slope
# below (ClusterSpec.small_token_overhead_s, with the knee at the preset's size).
SMALL_MICRO_BATCH = 1
# And once pipelined over PIPELINE_STAGES ranks under PIPELINE_SCHEDULE with PIPELINE_MICROBATCHES
# microbatches: what its span takes beyond the planner's pipeline time without messages prices one
# pipeline message (p2p_overhead_s). A V, because its ranks hold two stages each, with twice the messages
# of 1F1B's (a 1F1B run, whose stages each hold half the layers, came out no slower than the planner's
# time without messages, while interleaved ran 12% over it). Timing messages alone, two ranks alternating
# compute with sends, gave 0.07 to 0.45 ms a message from run to run here.
PIPELINE_STAGES = 2
PIPELINE_SCHEDULE = "dualpipev"
PIPELINE_MICROBATCHES = 16


def calibration_config(layers: int | None = None, schedule: str = "1f1b", ep: bool = False,
                       micro_batch: int | None = None, pp: int = 1,
                       microbatches: int = CALIBRATION_MICROBATCHES) -> Any:
    """Returns the TrainConfig of a calibration run on this machine: data parallel over its cores (with
    `ep`: expert parallel over them instead, fb overlap off; with `pp` > 1: that many pipeline ranks,
    data parallel over the rest), `layers` blocks (by default the preset's), `schedule` ("1f1b": each
    backward one B; "zb_h1": I then W; or a pipeline schedule), `micro_batch` sequences per microbatch
    (by default CALIBRATION_RUN's), `microbatches` per data rank."""
    n = os.cpu_count() or 1
    if pp < 1 or n % pp:
        raise ValueError(f"calibration_config: pp={pp} does not divide this machine's {n} cores")
    mbs = micro_batch or CALIBRATION_RUN["micro_batch_size"]
    data = n // pp
    # fuse_iw off: the zb_h1 run is there to time I and W apart (pp 1 lists each W right after its I)
    over = {**CALIBRATION_RUN, "pp": pp, "dp": 1 if ep else data, "ep": data if ep else 1, "overlap": not ep,
            "micro_batch_size": mbs, "global_batch_size": mbs * microbatches * data,
            "schedule": schedule, "fuse_iw": False}
    if layers is not None:
        over["num_layers"] = layers
    return TrainConfig.from_sources("tiny", None, over)


def measure_rates() -> dict[str, float]:
    """One measurement of this machine's single-thread rates: "peak" (GEMM FLOP/s), "half"
    (gemm_half_dim), "attn_eff" and "hbm" (AdamW bytes/s). A fraction of a second: calibrations take the
    median over many, spread over their run (this machine's speed moves within seconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak, half = _gemm_rates()
        return {"peak": peak, "half": float(half), "attn_eff": _attention_rate(peak),
                "hbm": _adamw_bytes_per_s()}
    finally:
        torch.set_num_threads(threads)


def measure_machine(rates: list[dict[str, float]] | None = None) -> ClusterSpec:
    """This machine's rates and links (GEMM, attention, optimizer bytes, gloo latency and bandwidth), with
    no host overhead yet (see fit_host); the rates the field-by-field median of `rates` (measure_rates
    results), or measured once now."""
    rates = rates or [measure_rates()]
    peak, half, attn_eff, hbm = (statistics.median(r[k] for r in rates) for k in ("peak", "half", "attn_eff",
                                                                                   "hbm"))
    half = int(round(half))
    latency, bandwidth, per_call = _links()
    cores = os.cpu_count() or 1
    with open("/proc/meminfo") as f:
        total_gib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal")) / 2**20
    return ClusterSpec(
        name="local",
        devices_per_node=cores,
        peak_flops={"fp32": peak},
        mem_gib=total_gib / cores,
        intra_bytes_per_s=bandwidth,
        inter_bytes_per_s=bandwidth,
        intra_latency_s=latency,
        inter_latency_s=latency,
        gemm_eff=1.0,
        attn_eff=attn_eff,
        gemm_half_dim=half,
        hbm_bytes_per_s=hbm,
        op_overhead_s=0.0,
        comm_overhead_s=per_call,
        base_mem_gib=0.0,
        # gloo's transport threads need the cores both ranks compute on: fb overlap hides nothing here
        # (expert-parallel tiny preset, 2 ranks: 160.0 against 162.5 ms and 108.1 against 107.8 ms)
        comm_hides=False,
    )


def calibrate(progress: Callable[[int, int], None] | None = None) -> ClusterSpec:
    """Measures this machine (see the module docstring) and returns its ClusterSpec; `progress(done,
    total)` at the start and after each measured round."""
    samples, rates = measure_runs(progress=progress)
    return fit_host(measure_machine(rates), **samples)


def calibration_configs() -> dict[str, Any]:
    """The calibration runs fit_host takes, by its argument names: "full" (1f1b with the preset's layers),
    "short" (1f1b with SHORT_LAYERS), "split" (zb_h1), "expert" and "expert_large" (1f1b expert parallel,
    the second with LARGE_MICRO_BATCH sequences), "large" and "small" (1f1b with LARGE_MICRO_BATCH and
    SMALL_MICRO_BATCH sequences) and "pipeline" (PIPELINE_SCHEDULE over
    PIPELINE_STAGES ranks; left out on a machine whose cores they do not divide); each a TrainConfig
    (calibration_config)."""
    runs = {"full": calibration_config(), "short": calibration_config(SHORT_LAYERS),
            "split": calibration_config(None, "zb_h1"), "expert": calibration_config(None, "1f1b", ep=True),
            "large": calibration_config(micro_batch=LARGE_MICRO_BATCH),
            "small": calibration_config(micro_batch=SMALL_MICRO_BATCH),
            "expert_large": calibration_config(None, "1f1b", ep=True, micro_batch=LARGE_MICRO_BATCH)}
    if (os.cpu_count() or 1) % PIPELINE_STAGES == 0:
        runs["pipeline"] = calibration_config(None, PIPELINE_SCHEDULE, pp=PIPELINE_STAGES,
                                              microbatches=PIPELINE_MICROBATCHES)
    return runs


CALIBRATION_STEPS = 16  # measured steps of each calibration run, after 2 warm-up steps a session


def measure_runs(steps: int = CALIBRATION_STEPS, progress: Callable[[int, int], None] | None = None,
                 ) -> tuple[dict[str, HostSample], list[dict[str, float]]]:
    """The HostSample of every calibration run (calibration_configs), measured live side by side: a step of
    each in turn, `steps` rounds over two sets of fresh processes (fmoe.calibrate.jobs.step_live; this
    machine's speed drifts within seconds, and two copies of one job came out up to 1.066x apart);
    and the machine's rates (measure_rates) measured once in every round, with the jobs stopped.
    `progress(done, steps)`: at the start (0) and after each round."""
    configs = calibration_configs()
    rates: list[dict[str, float]] = []

    def each_round() -> None:
        rates.append(measure_rates())
        if progress is not None:
            progress(len(rates), steps)

    if progress is not None:
        progress(0, steps)
    runs = step_live(configs, steps, events=set(configs), each_round=each_round)
    return {name: run.host_sample() for name, run in runs.items()}, rates


def fit_host(spec: ClusterSpec, full: HostSample, short: HostSample, split: HostSample,
             expert: HostSample | None = None, large: HostSample | None = None,
             pipeline: HostSample | None = None, small: HostSample | None = None,
             expert_large: HostSample | None = None) -> ClusterSpec:
    """Returns `spec` with the host overheads the calibration runs measured (`full`: 1f1b with the preset's
    layers, `short`: 1f1b with SHORT_LAYERS of them, `split`: zb_h1, whose backwards run as I then W,
    `expert`: 1f1b expert parallel over the cores, `large`: 1f1b with LARGE_MICRO_BATCH):
    - per layer kind, the forward's time beyond the FLOP model's compute (from `full`); with `large`,
      split into a fixed part (`layer_overhead_s`) and a part per token (`token_overhead_s`: its growth
      to the larger microbatch beyond the FLOP model's, per token), else all fixed; with `small` (1f1b
      with SMALL_MICRO_BATCH) too, the growth per token below the preset's microbatch
      (`small_token_overhead_s`, `token_knee` the preset microbatch's tokens);
    - the backward: B's host time (beyond its compute) = b_overhead_ratio x the stage's forward host time
      + a part per stage and microbatch; the two 1f1b runs give both. The time between the executor's
      events goes to the per-stage part too (`stage_overhead_s`). The I and W of `split`, beyond their
      compute, give i_overhead_ratio (after the same per-stage part) and w_overhead_ratio (in the 1f1b
      runs, W only hands the gradients over and counts as part of B);
    - all of them scaled together so that the planner's pipeline time of the `full` run equals its
      measured executor span;
    - `step_overhead_s`: the wall time outside the executor beyond the optimizer's memory traffic and the
      gradient reduce, per layer held; `base_mem_gib`: the process memory beyond what the planner counts;
    - with `expert`: the "moe_ep" forward host time of an expert-parallel MoE layer, such that the
      planner's pipeline time of that run equals its span (the all-to-alls' host work and waits, and the
      runtime's phase-by-phase execution, all go into it); with `expert_large` (the same at
      LARGE_MICRO_BATCH) too, split into a fixed part and a part per token that predict both spans;
    - with `pipeline` (the pipelined run, measure_runs): `p2p_overhead_s`, the host
      cost of one pipeline message on each rank it leaves or reaches, such that the planner's pipeline
      time of that run equals its span (posting sends and receives, the gloo threads' share of the busy
      cores)."""
    tc = calibration_config()
    model = load_model("tiny")
    lay = Layout(tp=1, pp=1, ep=1, dp=tc.dp, vpp=1, schedule="1f1b", overlap=False,
                 micro_batch=tc.micro_batch_size)
    bare = spec.replace(op_overhead_s=0.0, layer_overhead_s={}, token_overhead_s={}, i_overhead_ratio=0.0,
                        w_overhead_ratio=0.0, b_overhead_ratio=None, step_overhead_s=0.0,
                        stage_overhead_s=0.0, small_token_overhead_s={}, token_knee=0.0)
    ctx = Context(model, bare, tc.world_size, tc.global_batch_size)
    costs = {"embed": embed_cost(model), "dense": block_cost(model, False), "moe": block_cost(model, True),
             "head": head_cost(model)}
    compute = {k: _phases(ctx, lay, c) for k, c in costs.items()}  # (F, I, W) per layer, no overhead
    host_f = {k: max(0.0, full.f_s.get(k, compute[k][0]) - compute[k][0]) for k in costs}
    per_token = {k: 0.0 for k in costs}
    t0 = lay.micro_batch * model.seq  # tokens of one microbatch
    if large is not None:
        big = replace(lay, micro_batch=LARGE_MICRO_BATCH)
        for k, c in costs.items():
            f1 = _phases(ctx, big, c)[0]
            grown = large.f_s.get(k, f1) - f1 - host_f[k]
            per_token[k] = max(0.0, grown) / (big.micro_batch * model.seq - t0)
    fixed = {k: max(0.0, h - per_token[k] * t0) for k, h in host_f.items()}
    below: dict[str, float] = {}
    if small is not None:
        little = replace(lay, micro_batch=SMALL_MICRO_BATCH)
        t1 = little.micro_batch * model.seq
        for k, c in costs.items():
            f1 = _phases(ctx, little, c)[0]
            below[k] = max(0.0, host_f[k] - max(0.0, small.f_s.get(k, f1) - f1)) / (t0 - t1)
    m = CALIBRATION_MICROBATCHES

    def counts(layers: int) -> dict[str, int]:
        """Layers of each kind in a run with `layers` blocks."""
        return {"embed": 1, "dense": model.dense_layers, "moe": layers - model.dense_layers, "head": 1}

    def per_microbatch(sample: HostSample, layers: int) -> tuple[float, float, float]:
        """(forward host, backward host, time between events) of one microbatch of the run."""
        n = counts(layers)
        f_host = sum(host_f[k] * c for k, c in n.items())
        # B and the W event after it (which hands the gradients over) make one backward here
        b_host = sample.b_s + sample.w_s - sum((compute[k][1] + compute[k][2]) * c for k, c in n.items())
        events = sum(sample.f_s.get(k, 0.0) * c for k, c in n.items()) + sample.b_s + sample.w_s
        return f_host, b_host, sample.span_s / m - events

    f4, b4, gap4 = per_microbatch(full, model.layers)
    f2, b2, gap2 = per_microbatch(short, SHORT_LAYERS)
    b_ratio = max(0.0, (b4 - b2) / (f4 - f2)) if f4 > f2 else max(0.0, b4) / f4 if f4 else 1.0
    b_stage = max(0.0, b4 - b_ratio * f4)
    stage = b_stage + max(0.0, statistics.median((gap4, gap2)))
    n = counts(model.layers)
    i_host = split.i_s - sum(compute[k][1] * c for k, c in n.items())
    w_host = split.w_s - sum(compute[k][2] * c for k, c in n.items())
    i_ratio = max(0.0, i_host - b_stage) / f4 if f4 else 1.0
    w_ratio = max(0.0, w_host) / f4 if f4 else 1.0
    hosted = bare.replace(layer_overhead_s=fixed, token_overhead_s=per_token, i_overhead_ratio=i_ratio,
                          w_overhead_ratio=w_ratio, b_overhead_ratio=b_ratio, stage_overhead_s=stage)
    p0 = evaluate(ctx, lay)
    p1 = evaluate(Context(model, hosted, tc.world_size, tc.global_batch_size), lay)
    grow = p1.times["pipeline"] - p0.times["pipeline"]
    scale = max(0.0, full.span_s - p0.times["pipeline"]) / grow if grow > 0 else 1.0
    outside = full.wall_s - full.span_s - (p0.step_s - p0.times["pipeline"])  # beyond the modelled
    held = model.layers + 2  # the blocks, the embedding and the head
    fitted = hosted.replace(
        layer_overhead_s={k: v * scale for k, v in fixed.items()},
        token_overhead_s={k: v * scale for k, v in per_token.items()},
        small_token_overhead_s={k: v * scale for k, v in below.items()},
        token_knee=float(t0) if below else 0.0,
        op_overhead_s=statistics.median(fixed.values()) * scale,
        stage_overhead_s=stage * scale,
        step_overhead_s=max(0.0, outside) / held,
        base_mem_gib=max(0.0, full.peak_gib - p1.mem_gib),
    )
    if expert is not None:
        fitted = _fit_expert(fitted, model, expert, expert_large)
    return fitted if pipeline is None else _fit_messages(fitted, model, pipeline)


def _fit_linear(model: Any, tc: Any, lay: Any, with_value: Callable[[float], ClusterSpec], span_s: float,
                fallback: float) -> float:
    """The value x >= 0 at which the planner's pipeline time of calibration run `tc` (layout `lay`) under
    `with_value(x)` equals its measured `span_s` (that time is linear in x); `fallback` where x moves it
    not at all."""
    def pipeline(x: float) -> float:
        ctx = Context(model, with_value(x), tc.world_size, tc.global_batch_size)
        return evaluate(ctx, lay).times["pipeline"]

    t0, t1 = pipeline(0.0), pipeline(1e-3)
    return max(0.0, (span_s - t0) / (t1 - t0) * 1e-3) if t1 > t0 else fallback


def _fit_expert(spec: ClusterSpec, model: Any, expert: HostSample,
                large: HostSample | None = None) -> ClusterSpec:
    """`spec` with layer_overhead_s["moe_ep"] fitted to the expert-parallel calibration run's span; with
    `large` (the same run at LARGE_MICRO_BATCH) also token_overhead_s["moe_ep"], so that the planner
    predicts both spans (where that needs a negative part, that part is 0 and the other fits `expert`)."""
    def with_moe_ep(x: float, y: float | None = None) -> ClusterSpec:
        tokens = spec.token_overhead_s if y is None else {**spec.token_overhead_s, "moe_ep": y}
        return spec.replace(layer_overhead_s={**spec.layer_overhead_s, "moe_ep": x}, token_overhead_s=tokens)

    def run(micro_batch: int | None) -> tuple[Any, Any]:
        tc = calibration_config(ep=True, micro_batch=micro_batch)
        return tc, Layout(tp=1, pp=1, ep=tc.ep, dp=1, vpp=1, schedule="1f1b", overlap=False,
                          micro_batch=tc.micro_batch_size)

    tc, lay = run(None)
    x = _fit_linear(model, tc, lay, with_moe_ep, expert.span_s, spec.overhead_s("moe"))
    if large is None:
        return with_moe_ep(x)
    per_token = spec.token_overhead_s.get("moe", 0.0)

    def pipeline(case: tuple[Any, Any], x: float, y: float) -> float:
        tc, lay = case
        return evaluate(Context(model, with_moe_ep(x, y), tc.world_size, tc.global_batch_size), lay).times[
            "pipeline"]

    # both spans are linear in (x, y): solve the 2 x 2 system from three evaluations of each run
    cases = (run(None), run(LARGE_MICRO_BATCH))
    rows = []
    for case, span in zip(cases, (expert.span_s, large.span_s)):
        t0 = pipeline(case, 0.0, 0.0)
        rows.append(((pipeline(case, 1e-3, 0.0) - t0) / 1e-3, (pipeline(case, 0.0, 1e-6) - t0) / 1e-6,
                     span - t0))
    (a, b, e), (c, d, f) = rows
    det = a * d - b * c
    x2, y2 = ((e * d - b * f) / det, (a * f - e * c) / det) if det else (x, per_token)
    if x2 >= 0.0 and y2 >= 0.0:
        return with_moe_ep(x2, y2)
    if y2 < 0.0:  # the spans call for less than no growth per token: none, and the fixed part fits `expert`
        return with_moe_ep(max(0.0, e / a) if a else x, 0.0)
    return with_moe_ep(0.0, max(0.0, e / b) if b else per_token)  # all of it grows with the tokens


def _fit_messages(spec: ClusterSpec, model: Any, pipeline: HostSample) -> ClusterSpec:
    """`spec` with p2p_overhead_s fitted to the pipelined calibration run's span (0 where the run is no
    slower than the planner predicts without it)."""
    tc = calibration_config(None, PIPELINE_SCHEDULE, pp=PIPELINE_STAGES, microbatches=PIPELINE_MICROBATCHES)
    lay = Layout(tp=1, pp=tc.pp, ep=1, dp=tc.dp, vpp=2, schedule=PIPELINE_SCHEDULE, overlap=tc.overlap,
                 micro_batch=tc.micro_batch_size)

    def with_cost(x: float) -> ClusterSpec:
        return spec.replace(p2p_overhead_s=x)

    return with_cost(_fit_linear(model, tc, lay, with_cost, pipeline.span_s, 0.0))


def _phases(ctx: Any, lay: Any, cost: Any) -> tuple[float, float, float]:
    ph = _layer_phases(ctx, lay, cost)
    return ph.f, ph.i, ph.w
