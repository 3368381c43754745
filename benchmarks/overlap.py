"""fb overlap on and off, side by side in one run: DualPipeV on pp 2 x ep 2 and combined 1F1B on pp 1 x ep 2,
the all-to-all slowed by a LinkModel calibrated so that one dispatch takes as long as one expert phase.

    .venv/bin/python benchmarks/overlap.py                       # the measurement (a few minutes on 2 cores)
    .venv/bin/python benchmarks/overlap.py --quick               # tiny model, 2 repetitions: a smoke test
    .venv/bin/python benchmarks/overlap.py --reps 9 --png docs/overlap-timeline.png \
        --trace docs/overlap-trace.json                          # BENCHMARKS.md "fb overlap"
    .venv/bin/python benchmarks/overlap.py --compute-model both  # real compute, then the compute model

Model: one MoE GPT (every layer MoE: dropless softmax top-k router, one shared expert, no balancing loss,
no MTP), fp32, 8 microbatches per step, the same microbatches every step (no optimizer step). Each EP
rank has its own microbatches and holds E / ep experts of every layer. Layouts (gloo ranks this script
spawns, file-store rendezvous, 1 thread each):
- dualpipev: pp 2 x ep 2 = 4 ranks, the GPT cut into 4 equal chunks (a V over the 2 pipeline ranks);
- combined_1f1b: pp 1 x ep 2 = 2 ranks, the whole GPT on one stage.
Exchanges: fmoe.parallel.AllToAllDispatcher over the "expert" group; its CommGroup has a LinkModel.

Per configuration, one set of processes:
1. calibration (link model with no delay, overlap off, 1 warm-up + --calib steps): the median time of the
   forward `mlp` phase (permute-2 + routed experts) and the median bytes one row all-to-all sends to
   the other rank (rows x D x 4); then one LinkModel for intra- and inter-node links alike (the layout is
   one simulated node, so every transfer is intra): latency --latency-us, bandwidth = bytes / (--ratio x
   mlp time - latency), i.e. one dispatch takes --ratio (default 1, DeepSeek-V3's 1:1) compute phases;
   then --refine rounds (one step per mode) re-measure the mlp phase with that link model in place and
   reset the bandwidth (on 2 cores a rank computes faster while the others sleep in modelled waits);
2. timing: one warm-up step per mode, then --reps rounds running overlap on and off, each round starting
   with the other one (rotation); step = wall time of gpt_pipeline_step (max over ranks, barrier before).
   From the executor's timeline (step.result.events): hidden share of the all-to-all = 1 - (sum of the
   "wait a2a ..." compute-lane events) / (sum of the "a2a ..." comm-lane events), per step kind ("pair":
   inside an F&B pair, "lone": a single op, warmup / cooldown) (fmoe.schedule.timeline.hidden_of; the
   written trace gives the same figure back with hidden_shares). Column "exec": the executor's spans,
   issue to completion (Chain.completed_at: the later of the link-model completion and the moment gloo
   finished the works, so a late EP peer counts; the wait does not); column "model": issue to the link
   model's completion only (issue + latency + bytes / bandwidth, from a LinkModel subclass that logs every
   duration it computes), so a late peer or a host round trip shows as a wait longer than the span (the
   count exchange's waits make "model" negative); targets use "exec". Waits are split into EP peer late,
   transfer not done and the rest (gloo, Python: host);
3. the simulator: fmoe.schedule.simulate on Costs calibrated on the same run's overlap-on steps: f, i, w
   per stage (means over microbatches of the summed F / I (+ B's dx) / W compute events of one
   (stage, microbatch), stretched by the rank's compute-lane gaps: the executor's work between events
   is time the rank spends on each op too), a2a = the median modelled dispatch / combine time,
   moe_layers = MoE layers per stage, attn_frac = the measured non-expert share of compute,
   lone_hide = the measured lone hidden share of dispatch + combine ("model" spans), pair_overlap=True,
   p2p = a measured gloo one-way send;
   predicted makespan next to the measured step time (median over rounds of per-round ratios).
--compute-model on (or both: the run above, then this one): each compute phase is held to a modelled
time (fmoe.schedule.compute_model.ComputeModel, passed as gpt_pipeline_step(compute_model=)): step 1
instead runs 1 warm-up + --calib steps with overlap on and no delay, the table is --compute-scale x the
median of each (kind, phase) over all ranks, and the link model makes one dispatch take --ratio modelled
mlp phases; step 2 runs both modes under the model (overlap off: a B's modelled time includes its dw),
printing what the model did (modelled vs real seconds, phases that overran); step 3 adds the simulator
given the model's own costs (modelled_costs: f, i, w per stage, attn_frac, the seed's lone pairings under
the modelled durations, the modelled a2a, the measured p2p; no measured time), the "sim" column of the
+cm rows. No memory pass with the model (it changes no allocation). The trace (--trace) is the compute
model's run when there is one, with the model's state in its metadata.
A second set of processes (same link model) measures memory: glibc malloc set to mmap every block >=
64 KiB (freed tensors go back to the OS at once); per rank and mode, after one warm-up step in that mode,
the RSS high-water mark during one step minus the RSS right before it (/proc/self/clear_refs resets the
mark): activations, gradients, buffers and temporaries of the step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import _ranks
import torch
import torch.distributed as dist
from _ranks import per_rank

from fmoe import GPTConfig, MoEConfig, init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.calibrate.machine import ping_pong
from fmoe.overlap import LayerOverlap
from fmoe.parallel import AllToAllDispatcher, CommGroup, ParallelLayout, Topology
from fmoe.parallel.context import ParallelContext
from fmoe.parallel.link_model import LinkModel
from fmoe.parallel.shared_grads import SharedGrads
from fmoe.pipeline import gpt_pipeline_step, gpt_program, holders
from fmoe.schedule.compute_model import ComputeModel, ModelStats, table_from_events
from fmoe.schedule.options import ExecOptions
from fmoe.schedule.timeline import TraceEvent, hidden_of, hidden_shares, summarize

EP = 2
CONFIGS = {"dualpipev": 2, "combined_1f1b": 1}  # schedule -> pp
BUSY = ("F", "B", "I", "W")
MODES = ("on", "off")
# the exchanges the simulator's a2a models (with --a2a-chunks 2, both chunks of each)
DC = ("dispatch-F", "combine-F", "dispatch-B", "combine-B", "dispatch.1-F", "combine.0-F", "dispatch.1-B",
      "combine.0-B")


def modes(args: argparse.Namespace) -> tuple[str, ...]:
    """The step modes timed side by side: fb overlap on and off at --a2a-chunks; with 2 chunks also "on1",
    overlap on with the all-to-all whole, so that chunking is measured against no chunking in one run,
    and "self", where no MoE layer pairs and each hides its exchanges in its own row chunks in a pair too
    (fmoe.overlap: paired "self"), against pairing ("on")."""
    return MODES + (("on1", "self") if args.a2a_chunks == 2 else ())


def mode_setting(args: argparse.Namespace, mode: str) -> tuple[bool, int, str]:
    """(overlap, a2a_chunks, how a pair hides each MoE layer's all-to-all) of a mode."""
    return mode != "off", 1 if mode == "on1" else args.a2a_chunks, "self" if mode == "self" else "pair"
# executor exchange label -> how many link-model calls it makes (counts-B is Ready: nothing travels)
_CALLS = {"counts-B": 0}


# ---- the model ------------------------------------------------------------------------------------------

def model_config(args: argparse.Namespace) -> GPTConfig:
    """Returns the benchmark's GPT: every layer MoE, dropless, one shared expert, no balancing loss."""
    moe = MoEConfig(d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts, top_k=args.top_k,
                    num_shared_experts=1)
    return GPTConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                     moe=moe)


def batches(cfg: GPTConfig, args: argparse.Namespace,
            ep_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1 + ep_rank)
    out = []
    for _ in range(args.microbatches):
        seq = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def local_params(cfg: GPTConfig, ep_rank: int) -> dict[str, Any]:
    """The full GPT params with every expert tensor sliced to this EP rank's E / ep experts."""
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    L = cfg.moe.num_experts // EP
    for b in params["layers"]:
        b["moe"]["experts"] = {k: v[ep_rank * L:(ep_rank + 1) * L].clone()
                               for k, v in b["moe"]["experts"].items()}
    return params


def schedule_of(name: str, m: int) -> S.Schedule:
    return S.dualpipev(CONFIGS[name], m) if name == "dualpipev" else S.combined_1f1b(m)


@dataclass(frozen=True)
class LoggedLinkModel(LinkModel):
    """A LinkModel that logs (perf_counter at issue, bytes sent, modelled seconds) for every collective."""

    log: list = field(default_factory=list, compare=False, repr=False)

    def duration(self, sent_by_link):
        d = super().duration(sent_by_link)
        self.log.append((time.perf_counter(), sum(sent_by_link.values()), d))
        return d


# ---- one rank ------------------------------------------------------------------------------------------

class Rank:
    """One rank's layout, model, data and schedule; `step(overlap)` runs one timed pipeline step."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name, self.args = name, args
        self.pp = CONFIGS[name]
        world = dist.get_world_size()
        self.layout = ParallelLayout(pp=self.pp, ep=EP, topology=Topology(world, world))  # one node
        self.pp_group, self.ep_group = self.layout.group("pp"), self.layout.group("expert")
        self.ep_rank, self.stage_rank = dist.get_rank(self.ep_group), dist.get_rank(self.pp_group)
        self.cfg = model_config(args)
        self.s = schedule_of(name, args.microbatches)
        self.chunks = _ranks.even_chunks(self.cfg, self.s.placement.num_stages)
        self.params = local_params(self.cfg, self.ep_rank)
        self.state = init_gpt_state(self.cfg)
        self.data = batches(self.cfg, args, self.ep_rank)
        self.shared = SharedGrads(holders(self.cfg, self.s.placement, self.chunks), self.pp_group)
        self.checked = False
        self.cm: ComputeModel | None = None  # --compute-model: set by the calibration
        self.cm_stats: ModelStats | None = None  # what it did in the last step
        self.set_link(LoggedLinkModel(0.0, 1e30, 0.0, 1e30))  # logs bytes, delays nothing

    def set_link(self, link: LoggedLinkModel) -> None:
        self.link = link
        comm = CommGroup(self.ep_group, topology=self.layout.topology, link_model=link)
        self.dispatcher = AllToAllDispatcher(comm, self.cfg.moe.num_experts)

    def step(self, overlap: bool, a2a_chunks: int | None = None,
             paired: str = "pair") -> tuple[Any, float, list]:
        """Runs one step (`a2a_chunks` None: --a2a-chunks; `paired`: how a pair hides each MoE layer's
        all-to-all, fmoe.overlap); returns (PipelineStep, wall seconds, the link model's log of this
        step)."""
        chunks = self.args.a2a_chunks if a2a_chunks is None else a2a_chunks
        self.link.log.clear()
        if self.cm is not None:
            self.cm.deferred_dw = overlap  # overlap off: a B's dx pass computes its dw (every stage phased)
            self.cm.reset()
        dist.barrier()
        t = time.perf_counter()
        out = gpt_pipeline_step(gpt_program(self.cfg, self.s, self.stage_rank, chunks=self.chunks,
                                            parallel=ParallelContext(dispatcher=self.dispatcher),
                                            overlap=LayerOverlap(paired, "self" if chunks == 2 else "none")),
                                self.params, self.state, self.data, group=self.pp_group, shared=self.shared,
                                check=not self.checked,
                                options=ExecOptions(overlap=overlap, compute_model=self.cm))
        wall = time.perf_counter() - t
        self.cm_stats = None if self.cm is None else self.cm.reset()
        self.checked = True
        return out, wall, list(self.link.log)


def step_stats(events: list[TraceEvent], log: list, width_bytes: int) -> dict[str, Any]:
    """One rank's step: compute-lane busy / wait / gap / end, compute per (kind, stage, mb), expert and total
    compute, and per (step kind, exchange kind) the sums of the executor's a2a spans ("exec"), of the
    link model's durations ("model") and of the waits; plus the events with modelled a2a ends."""
    summary = summarize(events)
    phase: dict[tuple[str, int, int], float] = {}
    for (kind, st, mb), d in summary.ops.items():
        kind = {"B": "I"}.get(kind, kind)  # the dx part of a B; its W part is the "W ..." events
        phase[(kind, st, mb)] = phase.get((kind, st, mb), 0.0) + d
    # a layer's forward mlp (with row chunks: mlp.0 + mlp.1 of each layer, in order)
    mlp_f = list(summary.compute.get(("F", "mlp"), [])) or [
        a + b for a, b in zip(summary.compute.get(("F", "mlp.0"), []),
                              summary.compute.get(("F", "mlp.1"), []))]
    mlp_all = sum(sum(ds) for (_kind, ph), ds in summary.compute.items() if ph.split(".")[0] == "mlp")
    exchanges = summary.exchanges  # in start order
    labels = [x.label for x in exchanges]
    need = [_CALLS.get(lb, 1) for lb in labels]
    # the link model's log in issue order against the a2a events in start order (one call per exchange,
    # none for counts-B); a count exchange sends less than one row, a row exchange whole rows
    model: list[float | None] = [None] * len(exchanges)
    issued: list[float | None] = [None] * len(exchanges)  # perf_counter at issue (one clock for all ranks)
    matched = sum(need) == len(log)
    k = 0
    for j, (lb, n) in enumerate(zip(labels, need)):
        if not matched:
            break
        if n == 0:
            model[j] = 0.0
            continue
        issued[j], nbytes, d = log[k]
        k += 1
        counts = lb.startswith("counts")
        matched = nbytes < width_bytes if counts else nbytes % width_bytes == 0
        model[j] = d
    sums: dict[tuple[str, str], list[float]] = {}  # (step, exchange kind) -> [exec, model, wait, n]
    model_d = []
    offset = (statistics.median(t - x.span.start for t, x in zip(issued, exchanges) if t is not None)
              if matched else 0.0)
    # the exchange's key (stage, layer, mb, phase, direction: the same on its EP peer) -> (step, kind, issue,
    # wait start, wait, modelled duration), perf_counter seconds
    xfer = {}
    for x, kind, d, t in zip(exchanges, labels, model, issued):
        e, w = x.span, x.wait
        span = e.duration
        d = min(d, span) if matched else span  # unmatched: fall back to the executor's span
        if matched and not kind.startswith("counts"):
            model_d.append(d)
        acc = sums.setdefault((e.step, kind), [0.0, 0.0, 0.0, 0])
        acc[0] += span
        acc[1] += d
        acc[2] += x.waited
        acc[3] += 1
        if matched and t is not None and w is not None:
            xfer[x.key] = (e.step, kind, t, w.start + offset, w.duration, d)
    w_counts = sum(a[2] for (_s, kind), a in sums.items() if kind.startswith("counts"))
    w_dc = sum(a[2] for (_s, kind), a in sums.items() if kind in DC)
    busy, wait = summary.busy, summary.wait
    return {"busy": busy, "w_counts": w_counts, "w_dc": w_dc, "w_p2p": wait - w_counts - w_dc,
            "wait": wait, "gap": summary.gap, "end": summary.end, "phase": phase, "mlp_f": mlp_f,
            "mlp_all": mlp_all, "a2a": sums, "matched": matched, "model_d": model_d, "xfer": xfer,
            "events": list(events), "hidden": hidden_of(events)}


def _p2p_one_way(r: Rank, n: int = 30) -> float:
    """Median one-way time of a [B, S, D] fp32 gloo send between the two pipeline ranks (ping-pong / 2)."""
    if r.pp == 1:
        return 0.0
    x = torch.randn(r.args.micro_batch, r.args.seq, r.args.d_model)
    peer = dist.get_global_rank(r.pp_group, 1 - r.stage_rank)
    times = []
    for it in range(n + 3):
        dist.barrier()
        t = time.perf_counter()
        ping_pong(x, peer, r.stage_rank == 0)
        if it >= 3:
            times.append((time.perf_counter() - t) / 2)
    return statistics.median(times)


def _calibrate(r: Rank) -> dict[str, float]:
    """Median forward mlp phase time and median bytes of one row all-to-all, over all ranks; returns them
    with the LinkModel bandwidth that makes one such all-to-all take --ratio mlp phases. First with no
    delay (overlap off, 1 warm-up + --calib steps), then --refine times with that link model in place
    (one step per mode each): on 2 cores a rank computes faster while others sleep in modelled waits."""
    args = r.args
    width = r.cfg.d_model * 4
    lat = args.latency_us * 1e-6
    cal: dict[str, float] = {}
    plan = [[False] * (1 + args.calib)] + [[True, False]] * args.refine
    for k, modes in enumerate(plan):
        mlp, nbytes = [], []
        for j, overlap in enumerate(modes):
            out, _, log = r.step(overlap=overlap, a2a_chunks=1)  # the mlp phase and the bytes of a whole a2a
            if k or j:  # the very first step is a warm-up
                st = step_stats(out.result.events, log, width)
                mlp += st["mlp_f"]
                nbytes += [b for _t, b, _d in log if b >= width]  # row exchanges (counts send < one row)
            del out
        got: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(got, (mlp, nbytes))
        t_mlp = statistics.median(x for m, _ in got for x in m)
        b = statistics.median(x for _, bs in got for x in bs)
        bw = b / max(args.ratio * t_mlp - lat, 1e-6)
        cal = {"mlp_s": t_mlp, "bytes": b, "latency_s": lat, "bytes_per_s": bw,
               "mlp0_s": cal.get("mlp0_s", t_mlp)}
        r.set_link(LoggedLinkModel(lat, cal["bytes_per_s"], lat, cal["bytes_per_s"]))
    return cal


def _calibrate_model(r: Rank) -> dict[str, Any]:
    """With --compute-model: 1 warm-up + --calib steps with overlap on (so a B's dw shows apart, as W),
    no link delay; the ComputeModel's table = --compute-scale x the median of each (kind, phase) over all
    ranks' steps (fmoe.schedule.compute_model.table_from_events); the LinkModel bandwidth makes one
    median row all-to-all take --ratio modelled mlp phases (no refinement: a modelled phase does not
    speed up while other ranks sleep)."""
    args = r.args
    width = r.cfg.d_model * 4
    lat = args.latency_us * 1e-6
    events, nbytes = [], []
    for k in range(1 + args.calib):
        for chunks in sorted({1, args.a2a_chunks}):  # the table gets mlp (whole) and mlp.0 / mlp.1 (chunks)
            out, _, log = r.step(overlap=True, a2a_chunks=chunks)
            if k:
                events += [e for e in out.result.events if e.lane == "compute"]
                nbytes += [b for _t, b, _d in log if b >= width] if chunks == 1 else []
            del out
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, (events, nbytes))
    table = table_from_events([e for ev, _ in got for e in ev], scale=args.compute_scale)
    r.cm = ComputeModel(table)
    t_mlp = table[("F", "mlp")]
    b = statistics.median(x for _, bs in got for x in bs)
    bw = b / max(args.ratio * t_mlp - lat, 1e-6)
    cal = {"mlp_s": t_mlp, "bytes": b, "latency_s": lat, "bytes_per_s": bw,
           "mlp0_s": t_mlp / args.compute_scale, "table": table}
    r.set_link(LoggedLinkModel(lat, cal["bytes_per_s"], lat, cal["bytes_per_s"]))
    return cal


def _timing(name: str, args: argparse.Namespace) -> dict[str, Any]:
    r = Rank(name, args)
    cal = _calibrate_model(r) if args.cm else _calibrate(r)  # leaves the calibrated models in place
    p2p = _p2p_one_way(r)
    width = r.cfg.d_model * 4
    ms = modes(args)
    out: dict[str, Any] = {"cal": cal, "p2p": p2p, "wall": {m: [] for m in ms},
                           "stats": {m: [] for m in ms}, "peak_acts": {}, "peak_deferred": {}, "loss": {}}
    for mode in ms:  # warm-up
        res, _, _ = r.step(*mode_setting(args, mode))
        out["loss"][mode] = float(res.loss)
        out["peak_acts"][mode] = res.result.peak_activations
        out["peak_deferred"][mode] = res.result.peak_deferred
        del res
    for rep in range(args.reps):
        order = ms[rep % len(ms):] + ms[:rep % len(ms)]
        for mode in order:
            gc.collect()
            res, wall, log = r.step(*mode_setting(args, mode))
            st = step_stats(res.result.events, log, width)
            st["cm"] = r.cm_stats
            if not (mode == "on" and rep == args.reps - 1):
                del st["events"]  # keep the events of the last overlapped step only (the trace)
            out["wall"][mode].append(wall)
            out["stats"][mode].append(st)
            del res
    return out


def _memory(name: str, args: argparse.Namespace, cal: dict[str, float]) -> dict[str, float]:
    _ranks.return_freed_memory()
    r = Rank(name, args)
    r.set_link(LoggedLinkModel(cal["latency_s"], cal["bytes_per_s"], cal["latency_s"], cal["bytes_per_s"]))
    out = {}
    for mode in modes(args):
        res, _, _ = r.step(*mode_setting(args, mode))  # warm-up in this mode
        del res
        gc.collect()
        dist.barrier()
        (res, _, _), _, out[mode] = _ranks.measure_rss(lambda m=mode: r.step(*mode_setting(args, m)))
        del res
    out["rss_mib"] = _ranks.rss_kib("VmRSS") / 1024
    return out


def _job(rank: int, world: int, job: tuple) -> Any:
    """One rank's part of `job` ("timing" or "memory", its args, the engine's name, ...)."""
    kind, args, name, *rest = job
    return _timing(name, args) if kind == "timing" else _memory(name, args, *rest)


def spawn(world: int, job: tuple, timeout_s: float) -> list[Any]:
    """Runs `job` on `world` spawned gloo ranks (benchmarks/_ranks.py); returns each rank's result."""
    return _ranks.spawn(_job, world, (job,), timeout_s, f"{job[0]} {job[2]}", pg_timeout_s=job[1].pg_timeout)


# ---- analysis in the parent ----------------------------------------------------------------------------

def hidden(stats: list[dict], step: str | None, col: int,
           kinds: tuple[str, ...] | None = None) -> float | None:
    """1 - waits / spans over every rank and round, for exchanges in `step` ("pair" / "lone"; None: both)
    of `kinds` (None: all); span column `col`: 0 the executor's a2a events, 1 the link model's durations."""
    span = wait = 0.0
    for st in stats:
        for (stp, kind), acc in st["a2a"].items():
            if step in (None, stp) and (kinds is None or kind in kinds):
                span += acc[col]
                wait += acc[2]
    return None if span == 0 else 1.0 - wait / span


def kind_table(stats: list[dict], step: str) -> dict[str, list[float]]:
    """Per exchange kind in `step`: [exec span, model span, wait] in ms and the count, summed over `stats`."""
    out: dict[str, list[float]] = {}
    for st in stats:
        for (stp, kind), acc in st["a2a"].items():
            if stp == step:
                o = out.setdefault(kind, [0.0, 0.0, 0.0, 0])
                for i in range(4):
                    o[i] += acc[i] * (1e3 if i < 3 else 1)
    return out


def wait_parts(reps: list[list[dict]], step: str) -> dict[str, list[float]]:
    """Per exchange kind in `step`, summed over ranks and rounds (ms): [wait, peer late, transfer left,
    count]. peer late: the part of a wait before the EP peer issued the same exchange (skew between the
    two EP ranks); transfer left: the part after that and before the link model's completion; the rest of
    the wait is gloo and Python overhead. EP peers: global ranks g and g ^ 1 (ep 2, ep innermost)."""
    out: dict[str, list[float]] = {}
    for rep in reps:
        for g, st in enumerate(rep):
            peer = rep[g ^ 1]["xfer"]
            for lb, (stp, kind, t, w0, w, d) in st["xfer"].items():
                if stp != step or lb not in peer:
                    continue
                late = min(w, max(0.0, peer[lb][2] - w0))
                left = min(w - late, max(0.0, t + d - (w0 + late)))
                o = out.setdefault(kind, [0.0, 0.0, 0.0, 0])
                o[0] += 1e3 * w
                o[1] += 1e3 * late
                o[2] += 1e3 * left
                o[3] += 1
    return out


def waits_by_position(reps: list[list[dict]], step: str, layers: dict[int, tuple[int, ...]]) -> dict:
    """Per (exchange kind, the layer's place in its stage: first / mid / last), summed over ranks and rounds
    of the `step` exchanges: [wait ms, modelled ms, count]. `layers`: stage -> its layer indices."""
    out: dict[tuple[str, str], list[float]] = {}
    for rep in reps:
        for st in rep:
            for (stage, layer, *_), (stp, kind, _t, _w0, w, d) in st["xfer"].items():
                if stp != step or not (layer.startswith("L") and layer[1:].isdigit()):
                    continue
                ls = layers[stage]
                i = int(layer[1:])
                pos = "first" if i == ls[0] else "last" if i == ls[-1] else "mid"
                o = out.setdefault((kind, pos), [0.0, 0.0, 0])
                o[0] += 1e3 * w
                o[1] += 1e3 * d
                o[2] += 1
    return out


def pair_tails(s: S.Schedule, step_events: list[list[TraceEvent]]) -> dict[str, float]:
    """In one overlapped step (events per global rank), every F&B pair: whether its B ended before its F,
    the F compute after the B's last event and the a2a waits of the F in that tail (seconds, all ranks)."""
    acts = S.without_comms(s).ranks
    out = {"pairs": 0, "b_first": 0, "f": 0.0, "f_tail": 0.0, "wait": 0.0, "wait_tail": 0.0}
    for g, events in enumerate(step_events):
        pairs = [a for a in acts[g // EP] if isinstance(a, S.Overlap)]
        groups: list[list[tuple[str, TraceEvent]]] = [[] for _ in pairs]
        k = 0
        for e in sorted((e for e in events if e.lane == "compute" and e.step == "pair"),
                        key=lambda e: e.start):
            if e.kind not in ("F", "B", "I", "W", "wait a2a"):
                continue
            who = e.direction if e.kind == "wait a2a" else ("F" if e.kind == "F" else "B")
            key = (e.stage, e.microbatch)
            while k < len(pairs) and key != ((pairs[k].f.stage, pairs[k].f.mb) if who == "F" else
                                             (pairs[k].b.stage, pairs[k].b.mb)):
                k += 1
            if k == len(pairs):
                break
            groups[k].append((who, e))
        for grp in groups:
            b_end = max((e.end for who, e in grp if who == "B"), default=0.0)
            f_end = max((e.end for who, e in grp if who == "F"), default=0.0)
            out["pairs"] += 1
            out["b_first"] += b_end < f_end
            for who, e in grp:
                if who != "F":
                    continue
                d = e.end - e.start
                key = "wait" if e.cat == "wait" else "f"
                out[key] += d
                if e.start >= b_end:
                    out[key + "_tail"] += d
    return out


def calibrated_costs(s: S.Schedule, rep: list[dict], p2p: float, moe_layers: int, a2a: float,
                     lone_hide: float, attn_frac: float) -> S.Costs:
    """Costs with per-stage F, I, W: means over microbatches of one round's events (a makespan is a sum
    of op times, which means predict), each stretched by its rank's compute-lane gaps (the executor's own
    work between events: receive posting, bookkeeping) in proportion to its time; and the overlap
    fields."""
    samples: dict[tuple[str, int], list[float]] = {}
    stretch: dict[int, float] = {}
    for rank, rank_stats in enumerate(rep):
        stretch[rank] = 1.0 + rank_stats["gap"] / rank_stats["busy"] if rank_stats["busy"] else 1.0
        for (kind, st, _mb), t in rank_stats["phase"].items():
            samples.setdefault((kind, st), []).append(t)

    def per_stage(kind: str) -> tuple[float, ...]:
        return tuple(statistics.fmean(samples[(kind, st)]) * stretch.get(s.placement.stage_rank[st], 1.0)
                     if (kind, st) in samples else 0.0 for st in range(s.placement.num_stages))

    return S.Costs(f=per_stage("F"), i=per_stage("I"), w=per_stage("W"), p2p=p2p, a2a=a2a,
                   moe_layers=moe_layers, attn_frac=attn_frac, lone_hide=lone_hide, pair_overlap=True)


def modelled_costs(s: S.Schedule, rep: list[dict], p2p: float, moe_layers: int, a2a: float,
                   table: dict, overlap: bool, chunks: int = 1) -> S.Costs:
    """Costs given the compute model's own durations (no measurement): f, i, w per stage = means over
    microbatches of the modelled seconds of each (kind, stage, mb) (a deferred B's dx counts as I);
    attn_frac = the modelled non-mlp share; lone_hide = the seed's lone pairings under the modelled
    durations, the mean of a lone F's (dispatch-F behind the shared expert, combine-F behind nothing) and
    a lone B's (combine-B behind the shared expert's backward, dispatch-B behind the routed experts' dw;
    overlap off: no dw moves, the shared expert's sides still run); a2a = a layer's modelled exchange. With
    `chunks` 2 each exchange is two of half the time, and a lone F also hides chunk 1's dispatch behind
    mlp.0 and chunk 0's combine behind mlp.1, a lone B chunk 0's combine-B behind mlp.1's dx and chunk 1's
    dispatch-B behind mlp.0's."""
    per: dict[tuple[str, int], dict[tuple[int, int], float]] = {}  # (kind, stage) -> (rank, mb) -> s
    phase: dict[tuple[str, str], float] = {}
    for rank, st in enumerate(rep):  # EP peers run the same stages: a mean over (rank, mb)
        for (kind, stage, mb), t in st["cm"].per_op.items():
            d = per.setdefault(({"B": "I"}.get(kind, kind) if overlap else kind, stage), {})
            d[(rank, mb)] = d.get((rank, mb), 0.0) + t
        for k, t in st["cm"].per_phase.items():
            phase[k] = phase.get(k, 0.0) + t

    def per_stage(kind: str) -> tuple[float, ...]:
        return tuple(statistics.fmean(per[(kind, st)].values()) if (kind, st) in per else 0.0
                     for st in range(s.placement.num_stages))

    total = sum(phase.values())
    attn_frac = 1.0 - sum(t for (_k, ph), t in phase.items() if ph.split(".")[0] == "mlp") / total
    if chunks == 2:  # four exchanges of half a layer's each
        h = max(a2a / 2, 1e-12)
        dw = sum(min(table[("W", ph)], h) for ph in ("mlp.0", "mlp.1")) / 2 if overlap else 0.0
        lone_f = (min(table.get(("F", "shared"), 0.0), h) + min(table[("F", "mlp.0")], h)
                  + min(table[("F", "mlp.1")], h)) / (4 * h)
        lone_b = (min(table.get(("I", "shared"), 0.0), h) + min(table[("I", "mlp.1")], h)
                  + min(table[("I", "mlp.0")], h) + dw) / (4 * h)
    else:
        x = max(a2a, 1e-12)
        lone_f = min(table.get(("F", "shared"), 0.0), x) / (2 * x)
        dw = min(table[("W", "mlp")], x) if overlap else 0.0
        lone_b = (min(table.get(("I", "shared"), 0.0), x) + dw) / (2 * x)
    f, i, w, b = per_stage("F"), per_stage("I"), per_stage("W"), per_stage("B")
    # overlap on: every B's dx is counted as I and its dw as W (b None: B = I + W); off: a B's dx pass
    # computes its dw (b as modelled), an I still defers to a W; a value a stage lacks is never used
    i = tuple(x if x > 0 else y for x, y in zip(i, b))
    b = None if overlap else tuple(y if y > 0 else x + z for x, y, z in zip(i, b, w))
    return S.Costs(f=f, i=i, w=w, b=b, p2p=p2p, a2a=a2a, moe_layers=moe_layers, attn_frac=attn_frac,
                   lone_hide=(lone_f + lone_b) / 2, pair_overlap=overlap)


def analyse(name: str, args: argparse.Namespace, timing: list[dict],
            mem: list[dict] | None) -> dict[str, Any]:
    world = len(timing)
    s = schedule_of(name, args.microbatches)
    n_stage_layers = args.layers // s.placement.num_stages
    chunks = _ranks.even_chunks(model_config(args), s.placement.num_stages)
    stage_layers = {st: chunks[s.placement.layer_chunk[st]].layers for st in range(s.placement.num_stages)}
    med = statistics.median
    label = name + (" +cm" if args.cm else "") + (" a2a/2" if args.a2a_chunks == 2 else "")
    row: dict[str, Any] = {"name": name, "label": label, "cm": args.cm,
                           "world": world, "cal": timing[0]["cal"], "p2p": med(t["p2p"] for t in timing)}
    for mode in modes(args):
        walls = [max(t["wall"][mode][k] for t in timing) for k in range(args.reps)]
        reps = [[t["stats"][mode][k] for t in timing] for k in range(args.reps)]
        flat = [st for rep in reps for st in rep]

        def share(key: str, reps: list = reps) -> list[float]:  # per rank: median over rounds of key / span
            return [med(rep[r][key] / max(x["end"] for x in rep) for rep in reps) for r in range(world)]
        row[mode] = {
            "walls": walls, "step": med(walls), "span": med(max(st["end"] for st in rep) for rep in reps),
            "spread": (max(walls) - min(walls)) / med(walls),
            "pair_exec": hidden(flat, "pair", 0), "pair_model": hidden(flat, "pair", 1),
            "lone_exec": hidden(flat, "lone", 0), "lone_model": hidden(flat, "lone", 1),
            "cm": _cm_totals(flat),
            "lone_dc": hidden(flat, "lone", 1, DC),
            "pair_dc_exec": hidden(flat, "pair", 0, DC), "lone_dc_exec": hidden(flat, "lone", 0, DC),
            "all_dc": hidden(flat, None, 1, DC),
            "wait_ms": [med(rep[r]["wait"] for rep in reps) * 1e3 for r in range(world)],
            "gap": share("gap"), "w_counts": share("w_counts"), "w_dc": share("w_dc"),
            "w_p2p": share("w_p2p"),
            "mlp_ms": 1e3 * med(x for st in flat for x in st["mlp_f"]),
            "busy": share("busy"),
            "kinds": {stp: kind_table(flat, stp) for stp in ("pair", "lone")},
            "parts": {stp: wait_parts(reps, stp) for stp in ("pair", "lone")},
            "position": waits_by_position(reps, "pair", stage_layers),
            "matched": all(st["matched"] for st in flat),
            "mem": None if mem is None else [m[mode] for m in mem],
            "peak_acts": [t["peak_acts"][mode] for t in timing],
            "loss": timing[0]["loss"][mode],
            "reps": reps,
        }
    on = row["on"]
    row["tails"] = pair_tails(s, [st["events"] for st in on["reps"][-1]])
    # the simulator's a2a is a layer's whole exchange: with --a2a-chunks 2 the "on" steps' lone forwards move
    # half-size chunks, so take it from the steps that move every exchange whole
    whole = row["on1"] if "on1" in row else on
    a2a = med(d for rep in whole["reps"] for st in rep for d in st["model_d"])
    lone_hide = min(1.0, max(0.0, on["lone_dc"] if on["lone_dc"] is not None else 0.0))
    sims, sims_half, costs = [], [], None
    for rep, wall in zip(on["reps"], on["walls"]):
        total = sum(sum(st["phase"].values()) for st in rep)
        attn_frac = 1.0 - sum(st["mlp_all"] for st in rep) / total
        costs = calibrated_costs(s, rep, row["p2p"], n_stage_layers, a2a, lone_hide, attn_frac)
        sims.append((S.simulate(s, costs).makespan, wall))
        sims_half.append(S.simulate(s, replace(costs, attn_frac=0.5)).makespan)
    row["sim_ms"] = med(p for p, _ in sims) * 1e3
    row["sim_ratio"] = med(p / w for p, w in sims)
    row["sim_span_ratio"] = med(p / max(st["end"] for st in rep) for (p, _), rep in zip(sims, on["reps"]))
    row["sim_half_ratio"] = med(p / w for p, (_, w) in zip(sims_half, sims))
    off_hide = min(1.0, max(0.0, row["off"]["all_dc"] or 0.0))
    row["sim_off_ratio"] = med(
        S.simulate(s, replace(calibrated_costs(s, rep, row["p2p"], n_stage_layers, a2a, off_hide, 0.5),
                              pair_overlap=False)).makespan / w
        for rep, w in zip(row["off"]["reps"], row["off"]["walls"]))
    row["costs"], row["a2a"], row["lone_hide"] = costs, a2a, lone_hide
    if args.cm:
        table = row["cal"]["table"]
        for mode, key in (("on", "sim_model"), ("off", "sim_model_off")):
            pairs = [(S.simulate(s, modelled_costs(s, rep, row["p2p"], n_stage_layers, a2a, table,
                                                   mode == "on", args.a2a_chunks)).makespan, w)
                     for rep, w in zip(row[mode]["reps"], row[mode]["walls"])]
            row[key] = med(p / w for p, w in pairs)
            row[key + "_ms"] = med(p for p, _ in pairs) * 1e3
        row["costs_model"] = modelled_costs(s, row["on"]["reps"][-1], row["p2p"], n_stage_layers, a2a, table,
                                            True, args.a2a_chunks)
    return row


def _cm_totals(stats: list[dict]) -> dict[str, float] | None:
    """The compute model's stats summed over ranks and rounds: phases, modelled / real s, overruns and their
    excess s (None without the model)."""
    if not stats or stats[0].get("cm") is None:
        return None
    out = {"calls": 0.0, "modelled": 0.0, "real": 0.0, "overruns": 0.0, "excess": 0.0}
    for st in stats:
        for k in out:
            out[k] += sum(getattr(st["cm"], k).values())
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def report(args: argparse.Namespace, rows: list[dict], seconds: float) -> None:
    med = statistics.median
    cfg = model_config(args)
    total, active = _ranks.param_count(cfg)
    print(f"fb overlap benchmark: gloo ranks, 1 thread each, {os.cpu_count()} CPUs; fp32; "
          f"{args.microbatches} microbatches of B={args.micro_batch} x S={args.seq} tokens per EP rank; "
          f"1 warm-up per mode + "
          f"{args.reps} rounds (medians), the order rotating")
    print(f"model: MoE GPT, {cfg.n_layers} MoE layers, D={cfg.d_model}, heads {cfg.n_heads}, "
          f"E={cfg.moe.num_experts} (+1 shared), K={cfg.moe.top_k}, F={cfg.moe.d_ff}, V={cfg.vocab_size}: "
          f"{total / 1e6:.2f} M parameters ({active / 1e6:.2f} M active per token); "
          f"ep {EP} -> {cfg.moe.num_experts // EP} experts per rank")
    for r in rows:
        c = r["cal"]
        how = (f"real (median) x {args.compute_scale:g} = {1e3 * c['mlp_s']:.2f} ms modelled" if r["cm"] else
               f"{1e3 * c['mlp_s']:.2f} ms with the link model (last refinement)")
        print(f"{r['label']} ({r['world']} ranks): mlp phase {1e3 * c['mlp0_s']:.2f} ms with no delay, "
              f"{how}; one row all-to-all "
              f"{c['bytes'] / 1024:.0f} KiB -> LinkModel latency {1e6 * c['latency_s']:.0f} us, "
              f"{c['bytes_per_s'] / 1e6:.1f} MB/s (intra = inter); modelled dispatch/combine median "
              f"{1e3 * r['a2a']:.2f} ms (ratio to mlp {r['a2a'] / c['mlp_s']:.2f}); "
              f"p2p {1e3 * r['p2p']:.2f} ms")
        print(f"  mlp phase during the timed steps: on {r['on']['mlp_ms']:.2f} ms, "
              f"off {r['off']['mlp_ms']:.2f} ms "
              f"(median forward mlp event)")
        k = r["costs"]
        per = ", ".join(f"s{st} {1e3 * k.f[st]:.0f}/{1e3 * k.i[st]:.0f}/{1e3 * k.w[st]:.0f}"
                        for st in range(len(k.f)))
        print(f"  sim costs (last round, ms F/I/W per stage): {per}; moe_layers {k.moe_layers}, attn_frac "
              f"{k.attn_frac:.2f}, lone_hide {k.lone_hide:.2f}, a2a {1e3 * k.a2a:.2f} ms")
        if r["cm"]:
            k = r["costs_model"]
            per = ", ".join(f"s{st} {1e3 * k.f[st]:.1f}/{1e3 * k.i[st]:.1f}/{1e3 * k.w[st]:.1f}"
                            for st in range(len(k.f)))
            print(f"  modelled sim costs (ms F/I/W per stage): {per}; attn_frac {k.attn_frac:.2f}, lone_hide "
                  f"{k.lone_hide:.2f} (the seed's lone pairings under the modelled durations)")
            for mode in modes(args):
                t = r[mode]["cm"]
                print(f"  compute model, overlap {mode}: {int(t['calls'])} phases, modelled "
                      f"{t['modelled']:.2f} s, real {t['real']:.2f} s "
                      f"({100 * t['real'] / t['modelled']:.0f}%); "
                      f"{int(t['overruns'])} overran ({100 * t['overruns'] / t['calls']:.1f}%) by "
                      f"{1e3 * t['excess']:.0f} ms in all")
    print()
    print("step: median wall time of one gpt_pipeline_step (max over ranks); span: timeline makespan; hidden "
          "= 1 - wait / a2a\n(exec: the executor's a2a spans, issue to completion, a late EP peer included; "
          "model: issue to the link-model completion); wait: a2a + p2p wait per rank (ms);\nmem: RSS "
          "high-water mark of one step minus the RSS before it (MiB per rank); acts: peak live forwards per "
          "rank")
    print(f"{'config':<18} {'mode':<4} {'step ms':>7} {'spread':>6} {'span ms':>7} {'on/off':>7} "
          f"{'pair exec':>9} {'pair model':>10} {'lone exec':>9} {'lone model':>10} {'sim ms':>7} "
          f"{'sim/step':>8}  {'wait ms':>15} {'mem MiB':>15} {'acts':>7}")
    for r in rows:
        for mode in modes(args):
            x = r[mode]
            ratio = (f"{r['on']['step'] / r['off']['step']:.3f}" if mode == "on"
                     else f"({med(a / b for a, b in zip(r['on']['walls'], r[mode]['walls'])):.3f})")
            sim = (f"{r['sim_ms']:7.0f} {r['sim_ratio']:8.3f}" if mode == "on"
                   else f"{'':7} {r['sim_off_ratio']:8.3f}" if mode == "off" else f"{'':7} {'-':>8}")
            if r["cm"] and mode in ("on", "off"):  # the simulator given the compute model's own costs
                sim = (f"{r['sim_model_ms']:7.0f} {r['sim_model']:8.3f}" if mode == "on"
                       else f"{r['sim_model_off_ms']:7.0f} {r['sim_model_off']:8.3f}")
            print(f"{r['label']:<18} {mode:<4} {1e3 * x['step']:7.0f} {100 * x['spread']:5.0f}% "
                  f"{1e3 * x['span']:7.0f} {ratio:>7} {_pct(x['pair_exec']):>9} {_pct(x['pair_model']):>10} "
                  f"{_pct(x['lone_exec']):>9} {_pct(x['lone_model']):>10} {sim}  "
                  f"{per_rank(x['wait_ms']):>15} {'-' if x['mem'] is None else per_rank(x['mem']):>15} "
                  f"{per_rank(x['peak_acts']):>7}")
    print("(on/off: ratio of the median steps; on the off row in brackets: median of the per-round ratios"
          + (f"; modes on and off with the all-to-all in {args.a2a_chunks} row chunks, on1 overlap on with "
             "it whole, its bracket the per-round on / on1" if args.a2a_chunks == 2 else "") + ")")
    print("(sim/step on the off rows: the simulator with pair_overlap=False, lone_hide = the off steps' "
          "hidden share of dispatch + combine, on the off steps' costs)")
    print("(+cm rows: each compute phase held to its modelled time; sim = the simulator given the modelled "
          "costs, off rows with pair_overlap=False; the measured-cost sim/step: "
          + ", ".join(f"{r['label']} {r['sim_ratio']:.3f}" for r in rows if r["cm"]) + ")")
    print()
    print("where the a2a waits are (overlap on; ms per round summed over ranks: exec span / model span / "
          "wait, count per round)")
    for r in rows:
        n = args.reps
        for stp in ("pair", "lone"):
            kinds = r["on"]["kinds"][stp]
            parts = [f"{k} {v[0] / n:.0f}/{v[1] / n:.0f}/{v[2] / n:.0f} x{v[3] // n}"
                     for k, v in sorted(kinds.items())]
            print(f"  {r['label']:<18} {stp}: " + ", ".join(parts))
        for stp in ("pair", "lone"):
            parts = r["on"]["parts"][stp]
            w = [sum(v[i] for v in parts.values()) for i in range(3)]
            print(f"  {r['label']:<18} {stp} waits {w[0] / n:.0f} ms per round: EP peer not there yet "
                  f"{w[1] / n:.0f}, transfer not done {w[2] / n:.0f}, rest (gloo, Python) "
                  f"{(w[0] - w[1] - w[2]) / n:.0f}; by kind (wait/peer/transfer): " + ", ".join(
                      f"{k} {v[0] / n:.0f}/{v[1] / n:.0f}/{v[2] / n:.0f}" for k, v in sorted(parts.items())))
        pos = r["on"]["position"]
        print(f"  {r['label']:<18} pair waits by the layer's place in its stage (wait / modelled ms per "
              "round): " + ", ".join(f"{k} {p} {v[0] / n:.0f}/{v[1] / n:.0f}"
                                     for (k, p), v in sorted(pos.items()) if not k.startswith("counts-B")))
        t = r["tails"]
        print(f"  {r['label']:<18} F&B pairs of the last overlapped step: the B ends first in {t['b_first']} "
              f"of "
              f"{t['pairs']}; after it the F runs alone: {100 * t['f_tail'] / max(t['f'], 1e-9):.0f}% of the "
              f"pairs' F compute, {100 * t['wait_tail'] / max(t['wait'], 1e-9):.0f}% of their F a2a waits")
        on = r["on"]
        for mode in modes(args):
            x = r[mode]
            print(f"  {r['label']:<18} {mode:<3} per rank, % of the span: "
                  f"busy {per_rank(x['busy'], '{:.0f}', 100)}, "
                  f"wait counts {per_rank(x['w_counts'], '{:.1f}', 100)}, wait dispatch+combine "
                  f"{per_rank(x['w_dc'], '{:.1f}', 100)}, "
                  f"wait p2p {per_rank(x['w_p2p'], '{:.1f}', 100)}, gap "
                  f"{per_rank(x['gap'], '{:.1f}', 100)}")
        print(f"  {r['label']:<18} hidden (exec), dispatch+combine only, without the count exchange: pair "
              f"{_pct(on['pair_dc_exec'])}, lone {_pct(on['lone_dc_exec'])} (overlap off: pair "
              f"{_pct(r['off']['pair_dc_exec'])}, lone {_pct(r['off']['lone_dc_exec'])})")
        print(f"  {r['label']:<18} lone hidden (model), dispatch+combine only: {_pct(on['lone_dc'])}; "
              f"sim/step with "
              f"attn_frac 0.5: {r['sim_half_ratio']:.3f}; sim/span: {r['sim_span_ratio']:.3f}; "
              f"link-model log matched: {on['matched'] and r['off']['matched']}; loss on {on['loss']:.6f} "
              f"off {r['off']['loss']:.6f}")
    print()
    for r in rows:
        on = r["on"]
        sim = r["sim_model"] if r["cm"] else r["sim_ratio"]
        checks = [("pair hidden (exec) >= 95%", on["pair_exec"] is not None and on["pair_exec"] >= 0.95),
                  ("lone hidden (exec) >= 50%", on["lone_exec"] is not None and on["lone_exec"] >= 0.50),
                  ("sim within 5% of step", abs(sim - 1) <= 0.05)]
        print(f"targets {r['label']}: " + "; ".join(f"{t}: {'met' if ok else 'MISSED'}" for t, ok in checks))
    print(f"total {seconds:.0f} s")


def write_pictures(args: argparse.Namespace, row: dict) -> None:
    """The last overlapped step's timeline (rank = global rank; a2a spans end at the link-model completion)
    as a PNG and a compact Chrome trace; a trace over 300 KiB keeps only EP rank 0's pipeline."""
    pp = CONFIGS[row["name"]]
    events = [replace(e, rank=g) for g, st in enumerate(row["on"]["reps"][-1]) for e in st["events"]]
    cm = (f"on (each phase = {args.compute_scale:g} x its calibrated median)" if row["cm"] else
          "off (real compute on this machine)")
    title = (f"{row['label']} pp {pp} x ep {EP} (global ranks; pipeline rank = rank // {EP}), fb overlap on, "
             f"one step; compute model {cm.split(' (')[0]}")
    meta = {"compute_model": cm, "link_model": f"{row['cal']['bytes_per_s'] / 1e6:.1f} MB/s, "
            f"{1e6 * row['cal']['latency_s']:.0f} us"}
    if args.png:
        S.write_png(events, args.png, title=title)
        print(f"wrote {args.png}")
    if args.trace:
        _compact_trace(events, args.trace, title, meta)
        if os.path.getsize(args.trace) > 300 * 1024:
            events = [e for e in events if e.rank % EP == 0]
            _compact_trace(events, args.trace, title + " (EP rank 0 only)", meta)
        own, back = hidden_of(events), hidden_shares(args.trace)
        print(f"wrote {args.trace} ({os.path.getsize(args.trace) / 1024:.0f} KiB); hidden share of its step "
              "from the events / from the trace alone: " + ", ".join(
                  f"{k} {_pct(own.get(k))} / {_pct(back.get(k))}" for k in ("pair", "lone", "all")))


def _compact_trace(events: list[TraceEvent], path: str, title: str, meta: dict) -> None:
    S.write_trace(events, path, us_per_unit=1e6, name=title, meta=meta)
    with open(path) as f:  # compact: 0.1 us precision, no spaces
        doc = json.load(f)
    for e in doc["traceEvents"]:
        for key in ("ts", "dur"):
            if key in e:
                e[key] = round(e[key], 1)
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model and 2 repetitions (smoke test)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: dualpipev, combined_1f1b")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--calib", type=int, default=2, help="calibration steps after one warm-up")
    p.add_argument("--refine", type=int, default=2,
                   help="calibration rounds with the link model in place (one step per mode each)")
    p.add_argument("--ratio", type=float, default=1.0, help="one dispatch = this many mlp phases")
    p.add_argument("--latency-us", type=float, default=20.0)
    p.add_argument("--compute-model", choices=("off", "on", "both"), default="off",
                   help="hold each compute phase to a modelled time (fmoe.schedule.compute_model): on, or "
                        "both (a run without it, then one with it)")
    p.add_argument("--compute-scale", type=float, default=3.0,
                   help="modelled phase = this x its median measured in the calibration steps")
    _ranks.add_model_arguments(p)
    p.add_argument("--a2a-chunks", type=int, choices=(1, 2), default=1,
                   help="each MoE layer's all-to-all in this many row chunks (gpt_pipeline_step's "
                        "a2a_chunks); "
                        "2 also times overlap on with the all-to-all whole (mode on1), side by side")
    p.add_argument("--png", help="write the timeline of one overlapped dualpipev step here")
    p.add_argument("--trace", help="write its Chrome trace JSON here")
    p.add_argument("--dump", help="pickle each configuration's raw per-rank results to DUMP.<config>.pkl")
    args = p.parse_args(argv)
    if args.quick:
        _ranks.quick_shapes(args)
        args.calib, args.refine = 1, 1
    names = [n for n in args.configs.split(",") if n]
    if any(n not in CONFIGS for n in names) or args.layers % 4:
        p.error("--configs names dualpipev / combined_1f1b; --layers must be a multiple of 4")
    others = _other_benchmarks()
    if others:
        print(f"note: other benchmark processes running: {others}")
    t0, busy0 = time.perf_counter(), _ranks.machine_busy_s()
    rows = []
    for cm in {"off": (False,), "on": (True,), "both": (False, True)}[args.compute_model]:
        run = argparse.Namespace(**vars(args), cm=cm)
        for name in names:
            world = CONFIGS[name] * EP
            timing = spawn(world, ("timing", run, name), args.timeout)
            mem = None if args.no_memory or cm else spawn(world, ("memory", run, name, timing[0]["cal"]),
                                                          args.timeout)
            rows.append(analyse(name, run, timing, mem))
            if args.dump:
                with open(f"{args.dump}.{name}{'.cm' if cm else ''}.pkl", "wb") as f:
                    pickle.dump({"timing": timing, "mem": mem}, f)
    seconds = time.perf_counter() - t0
    report(args, rows, seconds)
    others_s = _ranks.machine_busy_s() - busy0 - _ranks.own_cpu_s()
    print(f"CPU time of other processes on this machine during the run: {others_s:.0f} s "
          f"({100 * others_s / (seconds * (os.cpu_count() or 1)):.0f}% of its {os.cpu_count()} CPUs)")
    if args.png or args.trace:  # the compute model's run when there is one, dualpipev when there is one
        best = max(rows, key=lambda r: (r["cm"], r["name"] == "dualpipev"))
        write_pictures(args, best)
    return 0


def _other_benchmarks() -> list[str]:
    """Command lines of other running benchmarks/*.py processes (they share the 2 CPUs)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if "benchmarks/" in cmd and "benchmarks/overlap.py" not in cmd and "multiprocessing" not in cmd:
            out.append(f"{pid}: {cmd}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
