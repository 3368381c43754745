"""Pipeline schedules on 2 gloo ranks, side by side in one run: fmoe's executor, the simulator's prediction
from costs calibrated on the same run, and torch.distributed.pipelining on the same model and weights.

    .venv/bin/python benchmarks/pipeline.py              # the measurement (a few minutes on 2 cores)
    .venv/bin/python benchmarks/pipeline.py --quick      # tiny model, 2 repetitions: a smoke test

Model: one MoE GPT (fmoe.GPTConfig, every layer MoE: dropless softmax top-k router, no balancing loss,
no shared expert, no MTP), fp32, cut into equal layer chunks (2 chunks for one stage per rank, 4 for
the V and interleaved placements); 8 microbatches per step, the same microbatches every step (no
optimizer step, so every step computes the same loss and gradients).

For every 2-rank schedule of fmoe.schedule.registry.NAMES, through fmoe.pipeline.gpt_pipeline_step:
- step: wall time of one gpt_pipeline_step (max over the ranks, both started by a barrier), run as `fmoe
  train` runs it: the program built once per run, the params checked on the first step, no timeline;
- the executor's timeline (step.result.events, from --reps more steps that record it, after the timed
  rounds: recording costs host time that neither the timed steps nor torch's pay): busy = compute-lane
  events of category F/B/I/W, idle = "wait" events; makespan = the latest compute-lane event end over
  both ranks (each rank's clock starts when its executor does, right after the barrier); measured bubble
  per rank = 1 - busy / makespan.
  What is neither busy nor wait counts as bubble too: the time after a rank's last event, and the "gap"
  (printed) before its first event and between events (executor bookkeeping, receive posting);
- predicted: fmoe.schedule.simulate on Costs calibrated from each repetition's events: per stage, the
  mean over microbatches of F (sum of the F events of one (stage, microbatch)), I (the dx part: events
  of category I, or B, whose W part is the events named "W ...") and W; p2p = the one-way time of a
  [B, S, D] gloo send measured by ping-pong in the same processes. Means, because a makespan is a sum
  of op times; the same with medians is printed too (it runs low where op times are skewed right).
torch.distributed.pipelining runs the same model written as plain nn.Modules (tape autograd, same
weights copied from the fmoe params), paired like with like (same cut, same placement):
    gpipe ~ ScheduleGPipe, 1f1b ~ Schedule1F1B, interleaved ~ ScheduleInterleaved1F1B (2 stages per rank),
    zb_h1 ~ ScheduleInterleavedZeroBubble with one stage per rank (ZB-H1: F, I, W on the 1F1B cut),
    zbv ~ ScheduleZBVZeroBubble, dualpipev+dw_detach and dualpipev ~ ScheduleDualPipeV (torch's DualPipeV
    ends with split I / W backwards, as fmoe's dualpipev+dw_detach does; fmoe's dualpipev ends with B).
For the multi-stage torch schedules the script checks that the action lists torch executes equal fmoe's,
rank by rank ("order"). The first step's loss and gradients of each torch schedule are compared with
those of its fmoe pair. What separates a ratio's parts: "bound" is the replay of fmoe's measured op times
through the simulator (every compute action taking the time it took, no host time between them) over
torch's step, what any executor running fmoe's ops would reach; "torch sim" the same replay of the times
torch's runtime took for the same actions (forward_one_chunk with its loss, backward_one_chunk,
backward_weight_one_chunk, timed in --reps steps of their own), "t-eff" it over torch's step (how close
torch's runtime comes to its own ops' makespan), and "ops" fmoe's replay over torch's: the two models'
compute on this schedule, the executors apart.

Both run in the same timing processes, whose malloc keeps freed memory (fmoe.train.host_memory, as `fmoe
train` sets its CPU ranks; --default-malloc leaves glibc's defaults, under which fmoe's GPipe faults its
backward's memory back in every microbatch).
Order: one warm-up step of every variant, then --reps rounds running every variant once, each round
starting --rotate units later (medians); a unit is a torch schedule with the fmoe schedules it is compared
with, run back to back, in reverse order every other round. fmoe / torch is printed twice: the ratio of
the medians, and "paired", the median over rounds of the ratio of the two steps of one unit (seconds
apart, so a drift of the machine's speed between rounds cancels); "cpu" is the same ratio for the CPU time
of the ranks' main threads during the two steps (the host work of each, which other processes on a loaded
machine add to far less than to wall time). A control, a second instance of torch's
Schedule1F1B run in that schedule's unit, prints both ratios of two identical steps: how far apart this
machine puts the same work in the same run, the resolution of every other ratio.
Peak memory comes from a second pair of processes in the same run (glibc malloc set to mmap every block
>= 64 KiB, so freed tensors go back to the OS at once): per rank, the RSS high-water mark during one step
minus the RSS before it (/proc/self/clear_refs resets the mark), after one warm-up step: activations,
gradients, buffers and temporaries of the step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import _ranks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ranks import per_rank
from torch import nn
from torch.distributed import pipelining as tpp

from fmoe import GPTConfig, MoEConfig, init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe._compat import grouped_mm
from fmoe.calibrate.machine import ping_pong
from fmoe.parallel.shared_grads import SharedGrads
from fmoe.pipeline import ChunkSpec, gpt_pipeline_step, gpt_program, holders
from fmoe.schedule.options import ExecOptions
from fmoe.schedule.timeline import summarize
from fmoe.train.host_memory import keep_freed_memory

WORLD = 2
BUSY = ("F", "B", "I", "W")
# torch.distributed.pipelining schedule -> (the fmoe schedule it runs after, its stages per rank)
TORCH = {"ScheduleGPipe": ("gpipe", 1), "Schedule1F1B": ("1f1b", 1),
         "ScheduleInterleaved1F1B": ("interleaved", 2), "ScheduleInterleavedZeroBubble": ("zb_h1", 1),
         "ScheduleZBVZeroBubble": ("zbv", 2), "ScheduleDualPipeV": ("dualpipev+dw_detach", 2)}
# the control: a second instance of one torch schedule, run in its unit like a pair, whose ratio to the
# first says how far this machine moves two identical steps apart in the same run (the noise floor)
CONTROL_OF, CONTROL = "torch:Schedule1F1B", "torch:Schedule1F1B (control)"
# the comparison table: (fmoe schedule, torch schedule)
PAIRS = [("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B"), ("interleaved", "ScheduleInterleaved1F1B"),
         ("zb_h1", "ScheduleInterleavedZeroBubble"), ("zbv", "ScheduleZBVZeroBubble"),
         ("dualpipev", "ScheduleDualPipeV"), ("dualpipev+dw_detach", "ScheduleDualPipeV")]


# ---- the model ------------------------------------------------------------------------------------------

def model_config(args: argparse.Namespace) -> GPTConfig:
    """Returns the benchmark's GPT: every layer MoE, dropless, no balancing loss, no shared expert."""
    moe = MoEConfig(d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts, top_k=args.top_k)
    return GPTConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                     moe=moe)


def batches(cfg: GPTConfig, args: argparse.Namespace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.microbatches):
        seq = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _leaf(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """fmoe.ops.rms_norm's math (fp32 in, fp32 out)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x_BSHd: torch.Tensor, theta: float) -> torch.Tensor:
    """fmoe.ops.rope's math: half-split rotation, angle pos * theta^(-2i/d)."""
    S_, d = x_BSHd.shape[-3], x_BSHd.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d // 2, dtype=torch.float32) * 2 / d)
    ang = torch.arange(S_).to(torch.float32).unsqueeze(-1) * inv_freq
    cos, sin = ang.cos().unsqueeze(-2), ang.sin().unsqueeze(-2)
    x1, x2 = x_BSHd[..., : d // 2], x_BSHd[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TorchMoEBlock(nn.Module):
    """fmoe.model.block (MoE block) as an nn.Module under tape autograd: RMSNorm, causal attention with
    RoPE, residual, RMSNorm, softmax top-k router (stable sort, renormalised gates), dropless experts on
    torch._grouped_mm over expert-sorted rows, gate-weighted combine, residual. Weights [in, out]."""

    KEYS = {"attn_norm": ("attn_norm",), "w_q": ("w_q",), "w_k": ("w_k",), "w_v": ("w_v",),
            "w_o": ("w_o",), "mlp_norm": ("mlp_norm",), "w_router": ("moe", "router", "w"),
            "w_gate_up": ("moe", "experts", "w_gate_up"), "w_down": ("moe", "experts", "w_down")}

    def __init__(self, p: dict[str, Any], cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        for name, path in self.KEYS.items():
            setattr(self, name, nn.Parameter(_leaf(p, path).detach().clone()))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, S_, D = x_BSD.shape
        H, G, d, E, K = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.moe.num_experts, cfg.moe.top_k
        h = _rms_norm(x_BSD, self.attn_norm, cfg.norm_eps)
        q = _rope((h @ self.w_q).view(B, S_, H, d), cfg.rope_theta).transpose(1, 2)
        k = _rope((h @ self.w_k).view(B, S_, G, d), cfg.rope_theta).transpose(1, 2)
        v = (h @ self.w_v).view(B, S_, G, d).transpose(1, 2)
        if G != H:
            k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S_, H * d)
        r_BSD = x_BSD + o @ self.w_o
        t_TD = _rms_norm(r_BSD, self.mlp_norm, cfg.norm_eps).reshape(B * S_, D)
        scores_TE = torch.softmax(t_TD @ self.w_router, dim=-1)
        ids_TK = torch.sort(scores_TE.detach(), dim=-1, descending=True, stable=True).indices[:, :K]
        probs_TK = scores_TE.gather(1, ids_TK)
        probs_TK = probs_TK / probs_TK.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        ids_N = ids_TK.reshape(-1)
        order_N = torch.sort(ids_N, stable=True).indices  # expert-sorted (token, slot) pairs
        offs_E = torch.bincount(ids_N, minlength=E).cumsum(0).to(torch.int32)
        x_ND = t_TD.index_select(0, order_N // K)
        g_NF, u_NF = grouped_mm(x_ND, self.w_gate_up, offs=offs_E).chunk(2, dim=-1)  # gate | up
        y_ND = grouped_mm(F.silu(g_NF) * u_NF, self.w_down, offs=offs_E)
        inverse_N = torch.empty_like(order_N)
        inverse_N[order_N] = torch.arange(order_N.numel())
        y_TKD = y_ND.index_select(0, inverse_N).view(B * S_, K, D)
        y_TD = (y_TKD * probs_TK.unsqueeze(-1)).sum(1)  # fmoe's combine: multiply, sum over the K slots
        return r_BSD + y_TD.view(B, S_, D)


class TorchStage(nn.Module):
    """One model chunk as an nn.Module: embedding (first), MoE blocks, final norm + head (last, returns
    logits). `paths[name]` is the fmoe parameter path each parameter was copied from."""

    def __init__(self, cfg: GPTConfig, params: dict[str, Any], chunk: ChunkSpec):
        super().__init__()
        self.cfg, self.first, self.last = cfg, chunk.first, chunk.last
        self.paths: dict[str, tuple] = {}
        if chunk.first:
            self.embed = nn.Parameter(params["embed"]["table"].detach().clone())
            self.paths["embed"] = ("embed", "table")
        self.blocks = nn.ModuleList(TorchMoEBlock(params["layers"][i], cfg) for i in chunk.layers)
        for j, i in enumerate(chunk.layers):
            for name, path in TorchMoEBlock.KEYS.items():
                self.paths[f"blocks.{j}.{name}"] = ("layers", i, *path)
        if chunk.last:
            self.norm = nn.Parameter(params["norm"].detach().clone())
            self.head = nn.Parameter(params["head"]["w"].detach().clone())
            self.paths.update(norm=("norm",), head=("head", "w"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.embedding(x, self.embed) if self.first else x
        for blk in self.blocks:
            h = blk(h)
        if self.last:
            h = _rms_norm(h, self.norm, self.cfg.norm_eps) @ self.head
        return h


def _ce(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1))


# ---- variants -------------------------------------------------------------------------------------------

@dataclass
class Variant:
    name: str  # fmoe schedule name, or "torch:<class>"
    run: Any  # () -> PipelineStep (fmoe), or (loss or None, stage modules) (torch)
    fmoe: bool
    order: dict[int, list[str]] | None = None  # torch: its compute actions per rank
    reset: Any = None  # called before each (timed or measured) step: torch drops the last step's grads
    # () -> one step with its timeline recorded (fmoe: a PipelineStep), or its compute actions timed (torch:
    # {(kind, stage, mb): seconds}); run apart from the timed steps
    traced: Any = None


UNTRACED, TRACED = ExecOptions(trace=False), ExecOptions(trace=True)


def _fmoe_variant(cfg, name, m, rank, params, state, data) -> Variant:
    """fmoe's step as `fmoe train` runs it: the program built once per run, the params and state checked on
    the first step only, no timeline recorded (torch's runtime records none); `traced` records it."""
    s = S.build(name, WORLD, m)
    chunks = _ranks.even_chunks(cfg, len(set(s.placement.layer_chunk)))
    shared = SharedGrads(holders(cfg, s.placement, chunks), None)  # built once: it creates process groups
    program = gpt_program(cfg, s, rank, chunks=chunks)
    checked: list[bool] = []

    def step(options: ExecOptions) -> Any:
        out = gpt_pipeline_step(program, params, state, data, shared=shared, options=options,
                                check=not checked)
        checked.append(True)
        return out

    return Variant(name, lambda: step(UNTRACED), True, traced=lambda: step(TRACED))


def _torch_variant(cfg, cls_name, per_rank, m, rank, params, data) -> Variant:
    n = WORLD * per_rank
    chunks = _ranks.even_chunks(cfg, n)
    if per_rank == 1:
        mine = [rank]
    elif cls_name == "ScheduleInterleaved1F1B":
        mine = [rank, rank + WORLD]  # loop placement, like fmoe's interleaved
    else:
        mine = [rank, n - 1 - rank]  # V placement
    mods = [TorchStage(cfg, params, chunks[i]) for i in mine]
    stages = [tpp.PipelineStage(mod, i, n, torch.device("cpu")) for mod, i in zip(mods, mine)]
    cls = getattr(tpp, cls_name)
    sched = cls(stages[0] if per_rank == 1 and cls_name in ("ScheduleGPipe", "Schedule1F1B") else stages,
                n_microbatches=m, loss_fn=_ce, scale_grads=True)
    ids = torch.cat([i for i, _ in data])
    tgt = torch.cat([t for _, t in data])
    first = any(mod.first for mod in mods)
    last = any(mod.last for mod in mods)

    def reset():
        for mod in mods:
            mod.zero_grad(set_to_none=True)

    def run():
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"return_outputs": False}  # a training step needs no merged logits
        if last:
            kwargs.update(target=tgt, losses=losses)
        sched.step(*((ids,) if first else ()), **kwargs)
        loss = torch.stack(losses).detach().mean() if last else None
        return loss, mods

    ops: dict[tuple[str, int, int], float] = {}
    timed = _time_torch_ops(sched, stages, ops)

    def traced():  # one step with its compute actions timed: {(kind, stage, mb): seconds}
        ops.clear()
        with timed():
            run()
        return dict(ops)

    return Variant(f"torch:{cls_name}", run, False, torch_order(sched), reset, traced)


def _time_torch_ops(sched: Any, stages: list[Any], ops: dict[tuple[str, int, int], float]) -> Any:
    """Returns a context manager under which every compute action of torch's runtime on `stages` adds its
    duration to `ops[(kind, stage, mb)]`: F = forward_one_chunk (plus the loss, which torch computes
    after it), B / I = backward_one_chunk (a full backward or the input gradients), W =
    backward_weight_one_chunk; what the runtime does around them (P2P, its bookkeeping) is not counted."""
    def add(key: tuple[str, int, int], started: float) -> None:
        ops[key] = ops.get(key, 0.0) + time.perf_counter() - started

    def timer(kind_of: Any, stage: Any, fn: Any) -> Any:
        def timed(chunk: int, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = fn(chunk, *a, **k)
            add((kind_of(k), stage.stage_index, chunk), t)
            return out
        return timed

    def loss_timer(fn: Any) -> Any:
        def timed(stage: Any, output: Any, target_mbs: Any, mb: int, *a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = fn(stage, output, target_mbs, mb, *a, **k)
            add(("F", stage.stage_index, mb), t)
            return out
        return timed

    @contextlib.contextmanager
    def on() -> Any:
        for st in stages:  # instance attributes shadow the methods while timed
            st.forward_one_chunk = timer(lambda k: "F", st, st.forward_one_chunk)
            st.backward_one_chunk = timer(lambda k: "B" if k.get("full_backward", True) else "I", st,
                                          st.backward_one_chunk)
            st.backward_weight_one_chunk = timer(lambda k: "W", st, st.backward_weight_one_chunk)
        sched._maybe_compute_loss = loss_timer(sched._maybe_compute_loss)
        try:
            yield
        finally:
            for st in stages:
                for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                    del st.__dict__[name]
            del sched.__dict__["_maybe_compute_loss"]
    return on


def build_variants(cfg, args, rank, params, state, data) -> list[Variant]:
    """Returns every variant, each torch schedule right after its fmoe pair (noise hits both alike)."""
    out = []
    for name in args.schedules:
        out.append(_fmoe_variant(cfg, name, args.microbatches, rank, params, state, data))
        for cls_name, (after, stages_per_rank) in TORCH.items():
            if after == name and not args.no_torch:
                out.append(_torch_variant(cfg, cls_name, stages_per_rank, args.microbatches, rank, params,
                                          data))
                if f"torch:{cls_name}" == CONTROL_OF and not args.no_control:
                    twin = _torch_variant(cfg, cls_name, stages_per_rank, args.microbatches, rank, params,
                                          data)
                    out.append(dataclasses.replace(twin, name=CONTROL))
    return out


def _units(variants: list[Variant]) -> list[list[Variant]]:
    """Returns the variants grouped into the units a round runs back to back: each torch schedule with the
    fmoe schedules it is compared with (PAIRS), every other fmoe schedule alone; in build order."""
    by = {v.name: v for v in variants}
    units: list[list[Variant]] = []
    placed: set[str] = set()
    for v in variants:
        if v.name in placed or v.name == CONTROL:
            continue
        mates = [f"torch:{c}" for n, c in PAIRS if n == v.name and f"torch:{c}" in by]
        names = [n for n, c in PAIRS if f"torch:{c}" in mates and n in by] + mates or [v.name]
        unit = [by[n] for n in dict.fromkeys(names) if n not in placed]
        placed.update(u.name for u in unit)
        units.append(unit)
    if CONTROL in by:  # the control runs next to the schedule it copies
        next(u for u in units if any(x.name == CONTROL_OF for x in u)).append(by[CONTROL])
    return units


def torch_order(sched: Any) -> dict[int, list[str]] | None:
    """Returns a multi-stage torch schedule's compute actions per rank (the list its runtime executes),
    written as fmoe prints them (F3.1, F0.3&B3.1); None for a single-stage schedule."""
    def fmt(a: Any) -> str:
        if a.sub_actions:
            return "&".join(fmt(x) for x in a.sub_actions)
        return f"{a.computation_type.value}{a.stage_index}.{a.microbatch_index}"

    if isinstance(sched, tpp.schedules.PipelineScheduleSingle):
        # its loop runs the textbook order; pipeline_order is only a picture (and torch 2.13's 1F1B one is
        # off by one on the last rank: F1.1 ... F1.8 for 8 microbatches)
        return None
    return {r: [fmt(a) for a in acts if a is not None and (a.sub_actions or a.computation_type.value in BUSY)]
            for r, acts in (sched.pipeline_order or {}).items()}


# ---- measurements in a rank ----------------------------------------------------------------------------

def timeline_stats(events) -> dict[str, Any]:
    """One rank's step timeline -> busy, wait, gap (time before the first compute-lane event and between
    consecutive ones: executor bookkeeping) and end (seconds), and compute time per (kind, stage, mb)."""
    summary = summarize(events)
    phase: dict[tuple[str, int, int], float] = {}
    for (kind, st, mb), d in summary.ops.items():
        kind = {"B": "I"}.get(kind, kind)  # the dx part of a B; its W part is the "W ..." events
        phase[(kind, st, mb)] = phase.get((kind, st, mb), 0.0) + d
    return {"busy": summary.busy, "wait": summary.wait, "gap": summary.gap, "end": summary.end,
            "phase": phase}


def _p2p_one_way(args: argparse.Namespace, rank: int, n: int = 30) -> float:
    """Median one-way time of a [B, S, D] fp32 gloo send (half a ping-pong round trip)."""
    x = torch.randn(args.micro_batch, args.seq, args.d_model)
    times = []
    for it in range(n + 3):
        dist.barrier()
        t = time.perf_counter()
        ping_pong(x, 1 - rank, rank == 0)
        if it >= 3:
            times.append((time.perf_counter() - t) / 2)
    return statistics.median(times)


def _grad_diff(step, mods) -> float:
    """Max |torch grad - fmoe grad| / max |fmoe grad| over the parameters this rank holds."""
    worst = 0.0
    for mod in mods:
        for name, p in mod.named_parameters():
            want = _leaf(step.grads, mod.paths[name])
            err = (p.grad - want).abs().max() / want.abs().max().clamp(min=1e-30)
            worst = max(worst, float(err))
    return worst


def _reset(v: Variant) -> None:
    """Frees what the variant's last step left (torch: parameter grads; fmoe returns them and the caller
    has dropped them), then collects garbage: every step starts from the same state."""
    if v.reset is not None:
        v.reset()
    gc.collect()


def _timing(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    if not args.default_malloc:
        keep_freed_memory()  # as `fmoe train` sets its CPU ranks; the torch variants share these processes
    cfg = model_config(args)
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    state, data = init_gpt_state(cfg), batches(cfg, args)
    variants = build_variants(cfg, args, rank, params, state, data)
    out: dict[str, Any] = {"p2p": _p2p_one_way(args, rank), "loss": {}, "grad_diff": {}, "peak_acts": {},
                           "order": {v.name: v.order for v in variants if not v.fmoe},
                           "wall": {v.name: [] for v in variants}, "cpu": {v.name: [] for v in variants},
                           "timeline": {v.name: [] for v in variants}}
    last_fmoe = None  # the fmoe step right before (a torch variant follows its fmoe pair)
    for v in variants:  # warm-up; its losses and gradients are the first step's
        _reset(v)
        dist.barrier()
        res = v.run()
        if v.fmoe:
            last_fmoe = res
            out["loss"][v.name] = float(res.loss)
            out["peak_acts"][v.name] = res.result.peak_activations
        else:
            loss, mods = res
            out["loss"][v.name] = None if loss is None else float(loss)
            out["grad_diff"][v.name] = _grad_diff(last_fmoe, mods)
        del res
    del last_fmoe
    units = _units(variants)
    for rep in range(args.reps):
        k = (rep * args.rotate) % len(units)
        # a pair runs back to back, in the opposite order every other round: the paired ratio of one round
        # compares steps seconds apart, and neither side always follows the other
        for v in [v for u in units[k:] + units[:k] for v in (u if rep % 2 == 0 else u[::-1])]:
            _reset(v)
            dist.barrier()
            t, c = time.perf_counter(), time.thread_time()
            res = v.run()
            out["wall"][v.name].append(time.perf_counter() - t)
            out["cpu"][v.name].append(time.thread_time() - c)
            del res
    # the timelines (fmoe) and the compute actions' times (torch) from steps of their own: recording costs
    # host time that the timed steps do not pay
    out["torch_ops"] = {v.name: [] for v in variants if not v.fmoe and v.name != CONTROL}
    for _ in range(args.reps):
        for v in (v for v in variants if v.name != CONTROL):
            _reset(v)
            dist.barrier()
            res = v.traced()
            if v.fmoe:
                out["timeline"][v.name].append(timeline_stats(res.result.events))
            else:
                out["torch_ops"][v.name].append(res)
            del res
    return out


def _memory(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    _ranks.return_freed_memory()
    cfg = model_config(args)
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    state, data = init_gpt_state(cfg), batches(cfg, args)
    out = {}
    for v in build_variants(cfg, args, rank, params, state, data):
        if v.name == CONTROL:  # its memory is its twin's
            continue
        _reset(v)
        dist.barrier()
        res = v.run()  # warm-up
        del res
        _reset(v)
        dist.barrier()
        res, _, out[v.name] = _ranks.measure_rss(v.run)
        del res
    return out


def _pass(rank: int, world: int, mode: str, args: argparse.Namespace) -> Any:
    """One rank's part of the "timing" or "memory" pass."""
    return (_timing if mode == "timing" else _memory)(rank, args)


def spawn(mode: str, args: argparse.Namespace, timeout_s: float) -> list[Any]:
    """Runs `mode` on WORLD spawned gloo ranks (benchmarks/_ranks.py); returns each rank's result."""
    return _ranks.spawn(_pass, WORLD, (mode, args), timeout_s, f"{mode} pass", pg_timeout_s=args.pg_timeout)


# ---- analysis in the parent ----------------------------------------------------------------------------

def calibrated_costs(s: S.Schedule, reps: list[list[dict]], p2p: float,
                     stat: Any = statistics.median) -> S.Costs:
    """Costs with per-stage F, I, W: `stat` (default median) over microbatches and repetitions of the run's
    events."""
    samples: dict[tuple[str, int], list[float]] = {}
    for rep in reps:
        for rank_stats in rep:
            for (kind, st, _mb), t in rank_stats["phase"].items():
                samples.setdefault((kind, st), []).append(t)
    n = s.placement.num_stages

    def per_stage(kind: str) -> tuple[float, ...]:
        return tuple(stat(samples[(kind, st)]) if (kind, st) in samples else 0.0
                     for st in range(n))

    return S.Costs(f=per_stage("F"), i=per_stage("I"), w=per_stage("W"), p2p=p2p)


@dataclass(frozen=True)
class ReplayCosts(S.Costs):
    """Costs giving every op the time it took in one measured step (`table[(kind, stage, mb)]`, B = I + W):
    a replay of that step through the simulator, which tests the simulator's dependency and P2P model
    without the per-stage constant-cost assumption. A diagnostic next to the calibrated prediction."""

    table: Any = None

    def compute(self, op: S.Op) -> float:
        if op.kind == "B":
            return self.table[("I", op.stage, op.mb)] + self.table.get(("W", op.stage, op.mb), 0.0)
        return self.table.get((op.kind, op.stage, op.mb), 0.0)


def analyse(name: str, m: int, timing: list[dict], mem: list[dict] | None) -> dict[str, Any]:
    """One fmoe schedule: measured medians and the simulator's predictions. Each repetition's prediction
    uses costs calibrated on that repetition's events and is compared with that repetition's makespan
    (so load from other processes during one step moves both); ratios are medians over repetitions."""
    s = S.build(name, WORLD, m)
    n_reps = len(timing[0]["wall"][name])
    reps = [[timing[r]["timeline"][name][k] for r in range(WORLD)] for k in range(n_reps)]
    makespans = [max(x["end"] for x in rep) for rep in reps]
    med = statistics.median

    def per_rank(key: str) -> list[float]:
        return [med(rep[r][key] / ms for rep, ms in zip(reps, makespans)) for r in range(WORLD)]

    def ratio(predicted: list[float]) -> float:
        return med(p / ms for p, ms in zip(predicted, makespans))

    p2p = med(t["p2p"] for t in timing)
    # per-stage means: a makespan is a sum of op times, which means predict; medians (a diagnostic) run low
    # on this box, where op times are skewed to the right (another process takes the CPU now and then)
    sims = [S.simulate(s, calibrated_costs(s, [rep], p2p, statistics.fmean)) for rep in reps]
    medians = [S.simulate(s, calibrated_costs(s, [rep], p2p)).makespan for rep in reps]
    replays = [S.simulate(s, ReplayCosts(p2p=p2p, table={k: v for x in rep for k, v in x["phase"].items()}))
               .makespan for rep in reps]
    return {"name": name, "wall": _wall(timing, name), "spread": _spread(timing, name),
            "makespan": med(makespans), "bubble": [1 - b for b in per_rank("busy")], "gap": per_rank("gap"),
            "sim_ms": med(x.makespan for x in sims), "sim_ratio": ratio([x.makespan for x in sims]),
            "sim_bubble": [med(x.bubble_fraction[r] for x in sims) for r in range(WORLD)],
            "median_ratio": ratio(medians), "replay": ratio(replays), "replay_ms": med(replays),
            "costs": calibrated_costs(s, reps, p2p, statistics.fmean),
            "mem": None if mem is None else [mem[r][name] for r in range(WORLD)],
            "peak_acts": [timing[r]["peak_acts"][name] for r in range(WORLD)],
            "sim_acts": list(sims[0].peak_activations), "loss": timing[0]["loss"][name]}


def torch_tables(timing: list[dict], torch_name: str) -> list[dict[tuple[str, int, int], float]]:
    """Per repetition, the time torch's runtime took for each compute action, both ranks' in one table as
    ReplayCosts reads it: a full backward under ("I", stage, mb) with no W (its W part is in it)."""
    return [{({"B": "I"}.get(kind, kind), st, mb): d for t in timing
             for (kind, st, mb), d in t["torch_ops"][torch_name][k].items()}
            for k in range(len(timing[0]["torch_ops"][torch_name]))]


def _stage_mean(tables: list[dict[tuple[str, int, int], float]], kind: str, stage: int) -> float:
    """The median over repetitions of the mean time of `kind` actions of `stage` (0 where none ran)."""
    return statistics.median(statistics.fmean([d for (k, st, _), d in t.items() if k == kind and st == stage]
                                              or [0.0]) for t in tables)


def torch_replay_ms(name: str, m: int, timing: list[dict], torch_name: str) -> float:
    """The makespan fmoe's simulator gives schedule `name` (whose lists torch's runtime ran: "order") with
    every compute action taking the time torch's runtime took for it (ReplayCosts); the median over
    repetitions."""
    s = S.build(name, WORLD, m)
    p2p = statistics.median(t["p2p"] for t in timing)
    return statistics.median(S.simulate(s, ReplayCosts(p2p=p2p, table=table)).makespan
                             for table in torch_tables(timing, torch_name))


def _spread(timing: list[dict], name: str) -> float:
    """(max - min) / median of the step's wall times over repetitions (max over ranks)."""
    walls = [max(t["wall"][name][k] for t in timing) for k in range(len(timing[0]["wall"][name]))]
    return (max(walls) - min(walls)) / statistics.median(walls)


def _wall(timing: list[dict], name: str) -> float:
    """Median over repetitions of the step's wall time, max over ranks."""
    n = len(timing[0]["wall"][name])
    return statistics.median(max(t["wall"][name][k] for t in timing) for k in range(n))


def _paired(timing: list[dict], name: str, other: str) -> float:
    """Median over repetitions of `name`'s step time / `other`'s in the same repetition (max over ranks):
    the two ran back to back (_units), so a drift of this machine's speed between rounds cancels."""
    def step(who: str, k: int) -> float:
        return max(t["wall"][who][k] for t in timing)

    return statistics.median(step(name, k) / step(other, k) for k in range(len(timing[0]["wall"][name])))


def _paired_cpu(timing: list[dict], name: str, other: str) -> float:
    """Median over repetitions of `name`'s CPU time / `other`'s in the same repetition (the main threads'
    CPU seconds during the step, summed over the ranks): the host work of the two steps, which the other
    processes of a loaded machine add to far less than to wall time (a rank that waits uses none)."""
    def cpu(who: str, k: int) -> float:
        return sum(t["cpu"][who][k] for t in timing)

    return statistics.median(cpu(name, k) / cpu(other, k) for k in range(len(timing[0]["cpu"][name])))


def _ms(x: float) -> str:
    return f"{1e3 * x:.0f}"


def report(args: argparse.Namespace, timing: list[dict], mem: list[dict] | None, seconds: float) -> None:
    """Prints the configuration, the fmoe / simulator table and the fmoe / torch table."""
    cfg = model_config(args)
    total, active = _ranks.param_count(cfg)
    m = args.microbatches
    print(f"pipeline benchmark: 2 gloo ranks, 1 thread each, {os.cpu_count()} CPUs; fp32; {m} microbatches "
          f"of B={args.micro_batch} x S={args.seq} tokens; 1 warm-up + {args.reps} reps (medians), rotating "
          f"by {args.rotate}")
    print(f"model: MoE GPT, {cfg.n_layers} MoE layers, D={cfg.d_model}, heads {cfg.n_heads}, "
          f"E={cfg.moe.num_experts}, K={cfg.moe.top_k}, F={cfg.moe.d_ff}, V={cfg.vocab_size}: "
          f"{total / 1e6:.1f} M parameters "
          f"({active / 1e6:.1f} M active per token); p2p one-way {1e3 * timing[0]['p2p']:.2f} ms")
    rows = [analyse(name, m, timing, mem) for name in args.schedules]
    for r in rows:
        if r["name"] in ("1f1b", "zbv") or args.only:
            c = r["costs"]
            per = ", ".join(f"s{st} {_ms(c.f[st])}/{_ms(c.i[st])}/{_ms(c.w[st])}" for st in range(len(c.f)))
            print(f"calibrated F/I/W per stage (ms), {r['name']}: {per}")
            pair = next((c for n, c in PAIRS if n == r["name"]), None)
            if pair is not None and not args.no_torch and TORCH[pair][0] in args.schedules:
                tables = torch_tables(timing, f"torch:{pair}")
                per = ", ".join(f"s{st} " + "/".join(_ms(_stage_mean(tables, kind, st)) for kind in "FIW")
                                for st in range(len(c.f)))
                print(f"  torch's runtime on the same actions (a full backward under I): {per}")
    print()
    print("fmoe executor vs simulator (costs: per-stage means of F/I/W, per repetition). span: timeline "
          "makespan;\nbubble = 1 - busy/span (%, r0/r1); gap: its part before and between events (executor "
          "bookkeeping);\nmedian/span: simulated with per-stage medians instead of means; replay/span: "
          "simulated with every op's own measured time (median over reps);\nspread: (max - min) / median "
          "step time over reps; acts: peak live forwards, measured and simulated")
    print(f"{'schedule':<20} {'step ms':>7} {'spread':>6} {'span ms':>7} {'sim ms':>7} {'sim/span':>8} "
          f"{'median/span':>11} {'replay/span':>11}  "
          f"{'bubble meas':>11} {'bubble sim':>10} {'gap':>7}  {'peak MiB':>9} {'acts':>5} {'sim':>5}")
    for r in rows:
        print(f"{r['name']:<20} {_ms(r['wall']):>7} {100 * r['spread']:>5.0f}% {_ms(r['makespan']):>7} "
              f"{_ms(r['sim_ms']):>7} {r['sim_ratio']:>8.3f} {r['median_ratio']:>11.3f} "
              f"{r['replay']:>11.3f}  "
              f"{per_rank(r['bubble'], '{:.1f}', 100):>11} {per_rank(r['sim_bubble'], '{:.1f}', 100):>10} "
              f"{per_rank(r['gap'], '{:.1f}', 100):>7}  {'-' if r['mem'] is None else per_rank(r['mem']):>9} "
              f"{per_rank(r['peak_acts']):>5} {per_rank(r['sim_acts']):>5}")
    off = [r["name"] for r in rows if abs(r["sim_ratio"] - 1) > 0.10]
    print(f"predicted makespan within 10% of the measured one: {len(rows) - len(off)}/{len(rows)}"
          + (f" (outside: {', '.join(off)})" if off else ""))
    if not args.no_torch:
        print()
        print("fmoe vs torch.distributed.pipelining on the same model and weights (torch: nn.Modules, tape "
              "autograd);\norder: the torch schedule's compute actions equal fmoe's, rank by rank; |dloss|: "
              "first step; grad: max relative gradient difference;\nfmoe/torch: the medians' ratio; paired: "
              "the median over rounds of the ratio of the two steps run back to back; cpu: the same for "
              "the ranks' CPU time (host work);\nbound: the replay of fmoe's measured op times through the "
              "simulator (no host time between ops) / torch's step, what an executor with no cost of its "
              "own reaches;\ntorch sim: the same replay of the times torch's runtime took for the same "
              "actions; t-eff: torch sim / torch's step; ops: fmoe's replay / torch sim (the models' "
              "compute)")
        print(f"{'fmoe':<20} {'torch':<30} {'order':>5} {'fmoe ms':>7} {'torch ms':>8} {'spread':>6} "
              f"{'fmoe/torch':>10} {'paired':>6} {'cpu':>6} {'bound':>6} {'torch sim':>9} {'t-eff':>5} "
              f"{'ops':>5}  "
              f"{'|dloss|':>7} {'grad':>7}  {'fmoe MiB':>9} {'torch MiB':>9}")
        by = {r["name"]: r for r in rows}
        ran = [(n, c) for n, c in PAIRS if n in args.schedules and TORCH[c][0] in args.schedules]
        for name, cls_name in ran:  # pairs whose torch schedule ran (--only may leave it out)
            tn = f"torch:{cls_name}"
            tloss = next(t["loss"][tn] for t in timing if t["loss"][tn] is not None)
            ours = S.without_comms(S.build(name, WORLD, m)).ranks
            order = timing[0]["order"][tn]
            same = all([str(a) for a in ours[rk]] == order.get(rk) for rk in range(WORLD)) if order else None
            tw = _wall(timing, tn)
            tsim = torch_replay_ms(name, m, timing, tn)
            print(f"{name:<20} {cls_name:<30} {'-' if same is None else 'same' if same else 'diff':>5} "
                  f"{_ms(by[name]['wall']):>7} {_ms(tw):>8} {100 * _spread(timing, tn):>5.0f}% "
                  f"{by[name]['wall'] / tw:>10.3f} {_paired(timing, name, tn):>6.3f} "
                  f"{_paired_cpu(timing, name, tn):>6.3f} {by[name]['replay_ms'] / tw:>6.3f} "
                  f"{_ms(tsim):>9} {tsim / tw:>5.3f} {by[name]['replay_ms'] / tsim:>5.3f}  "
                  f"{abs(by[name]['loss'] - tloss):>7.1e} {max(t['grad_diff'][tn] for t in timing):>7.1e}  "
                  f"{'-' if mem is None else per_rank([x[name] for x in mem]):>9} "
                  f"{'-' if mem is None else per_rank([x[tn] for x in mem]):>9}")
        if CONTROL in timing[0]["wall"]:
            print(f"control: {CONTROL_OF[6:]} against a second instance of itself (same weights, run next to "
                  f"it): medians' ratio {_wall(timing, CONTROL) / _wall(timing, CONTROL_OF):.3f}, paired "
                  f"{_paired(timing, CONTROL, CONTROL_OF):.3f}, cpu "
                  f"{_paired_cpu(timing, CONTROL, CONTROL_OF):.3f} (the resolution of this run's ratios)")
        first = args.schedules[0]
        print(f"first-step loss {by[first]['loss']:.6f} (fmoe {first})")
    print(f"total {seconds:.0f} s (both passes)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model and 2 repetitions (smoke test)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rotate", type=int, default=3, help="each round starts this many units later")
    _ranks.add_model_arguments(p)
    p.add_argument("--no-torch", action="store_true", help="fmoe and the simulator only")
    p.add_argument("--no-control", action="store_true",
                   help="leave out the control (a second instance of torch's Schedule1F1B)")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc malloc's defaults in the timing ranks (default: keep_freed_memory, as "
                        "`fmoe train` sets its CPU ranks)")
    p.add_argument("--only", nargs="+", choices=S.registry.NAMES, metavar="SCHEDULE",
                   help="these fmoe schedules (and their torch pairs) only; default: all")
    args = p.parse_args(argv)
    args.schedules = tuple(args.only or S.registry.NAMES)
    if args.quick:
        _ranks.quick_shapes(args)
    if args.d_model % 4 or args.d_ff % 4:
        p.error("--d-model and --d-ff must be multiples of 4 (torch._grouped_mm needs 16-byte row strides)")
    if args.layers % 4:
        p.error("--layers must be a multiple of 4 (4 equal chunks for the V and interleaved placements)")
    t0, busy0 = time.perf_counter(), _ranks.machine_busy_s()
    timing = spawn("timing", args, args.timeout)
    mem = None if args.no_memory else spawn("memory", args, args.timeout)
    seconds = time.perf_counter() - t0
    report(args, timing, mem, seconds)
    others = max(0.0, _ranks.machine_busy_s() - busy0 - _ranks.own_cpu_s())
    print(f"CPU time of other processes on this machine during the run: {others:.0f} s "
          f"({100 * others / (seconds * (os.cpu_count() or 1)):.0f}% of its {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
