"""Predict one layout: per-stage F / I / W times, communication, memory per device; the step composed by
`fmoe.schedule.simulate` so bubbles and overlap come from the schedule itself.

Legend: T tokens of one microbatch on one rank (micro_batch x seq / cp), m microbatches per rank and step,
S stages, P ranks of a group, N = cp context-parallel ranks. Times in seconds, memory in bytes (GiB in the
Prediction).

Time of one layer and phase (one rank, one microbatch): GEMM FLOPs / (peak x gemm efficiency), the
efficiency falling for small GEMMs (ClusterSpec.gemm_half_dim); attention core / (peak x attn_eff); the
routed experts scaled by the load factor (the capacity factor, or the expected max/mean load when
dropless); the TP collectives the runtime issues under sequence parallelism (layer_costs.tp_collectives:
the forward's in F, the backward's in I, weight-gradient sums included); a fixed host overhead. The MoE
all-to-all (dispatch + combine, bytes per link class from fmoe.parallel.traffic, the dispatchers' own
formulas) goes to the simulator as `a2a`, so fb overlap hides it where the schedule pairs F and B. P2P
between stages, the data-parallel gradient reduce (issued when a rank's last backward ends) and the
optimizer step (memory bound) complete the step.

Context parallelism (fmoe.parallel.context_parallel, the ring form `fmoe train` runs): every per-rank
figure above takes a rank's T = micro_batch x seq / N tokens (the causal load balancing gives each rank
1 / N of the attention core too), gradients are summed over the data x cp ranks, and each attention layer
adds its ring (`ring_s`): N - 1 steps in the forward, each moving this rank's key / value block (its
seq / N positions, `ring_step_bytes`) one rank on while one step's blocks of the core run (1 / N of it:
every step computes two of the four chunk pairs, the first two half-masked and one whole), so a step
waits max(0, transfer - core / N); the backward passes the blocks' gradients round the same N - 1 steps,
each behind one step's backward of the core (twice the forward's). Each rank keeps the N - 1 received
blocks for the backward (memory), not the blocks' scores (the runtime recomputes them).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from fmoe import schedule as S
from fmoe.overlap import LONE, PAIRED
from fmoe.parallel import traffic
from fmoe.plan import layout as L
from fmoe.plan.layer_costs import (
    PART_GEMM_GROUP,
    LayerCost,
    block_cost,
    embed_cost,
    fp8_flops,
    fp8_saved_bytes,
    head_cost,
    loss_cost,
    mtp_cost,
    part_attn_flops,
    part_costs,
    totals,
    tp_collectives,
)
from fmoe.plan.memory import peak_bytes
from fmoe.plan.specs import DTYPE_BYTES, ClusterSpec, ModelSpec, PlanError
from fmoe.schedule.ir import B, F, Op, W

GIB = 2**30
SIM_CAP = 4  # simulate at most SIM_CAP x pp microbatches exactly; extrapolate linearly beyond
PAIRED_SCHEDULES = ("interleaved+extra", "dualpipev", "dualpipe", "combined_1f1b")  # with F&B pairs
DEFAULT_MODES = ("pair", "none")  # fmoe.overlap.LayerOverlap()'s: the runtime's default
# fmoe's hierarchical dispatch runs its two levels one after the other (the tokens gathered across nodes,
# then the all-to-all within the node); DeepSeek's kernels forward IB traffic over NVLink as it arrives.
# benchmarks/plan_published.py sets this True to price the levels overlapped (the slower one's time)
HIER_LEVELS_OVERLAP = False


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step: `step_s`, tokens/s, MFU, `mem_gib` (max over ranks) with `memory`
    (GiB per part on the fullest rank), `bubble` (idle share of the step, mean over ranks), `exposed_comm`
    (share of the step spent waiting on communication), `times` (seconds per part), `fits` and `reason`
    when it does not, `simulated` (False: closed-form estimate only)."""

    layout: L.Layout
    microbatches: int
    step_s: float
    tokens_per_s: float
    mfu: float
    mem_gib: float
    bubble: float
    exposed_comm: float
    fits: bool
    reason: str | None
    simulated: bool
    times: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    a2a_bytes: dict[str, float] = field(default_factory=dict)
    costs: S.Costs | None = None  # what the simulator was given (per stage, seconds)
    cut_imbalance_pct: float = 0.0  # the layer cut's modelled per-rank compute imbalance, (max/mean-1) x 100
    overlap_modes: tuple[str, str] = DEFAULT_MODES  # how MoE layers hide their all-to-all: (in a pair, alone)
    cut_stage_imbalance_pct: float = 0.0  # the same per chunk (what a rank holding several waits on too)

    def as_dict(self) -> dict[str, object]:
        """Plain summary (for --json): the layout's fields, schedule, overlap and the predicted figures."""
        lay = self.layout
        return {
            "tp": lay.tp,
            "pp": lay.pp,
            "ep": lay.ep,
            "vpp": lay.vpp,
            "dp": lay.dp,
            "cp": lay.cp,
            "data_parallel": lay.data_ranks,
            "schedule": lay.schedule,
            "overlap": lay.overlap,
            "micro_batch": lay.micro_batch,
            "microbatches": self.microbatches,
            "recompute": lay.recompute,
            "tp_extends_ep": lay.tp_extends_ep,
            "hierarchical": lay.hierarchical,
            "capacity_factor": lay.capacity_factor,
            "zero1": lay.zero1,
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "mem_gib": self.mem_gib,
            "bubble": self.bubble,
            "exposed_comm": self.exposed_comm,
            "fits": self.fits,
            "reason": self.reason,
            "simulated": self.simulated,
            "times": self.times,
            "memory": self.memory,
            "cut_imbalance_pct": self.cut_imbalance_pct,
            "cut_stage_imbalance_pct": self.cut_stage_imbalance_pct,
            "pair_overlap": self.overlap_modes[0],
            "lone_overlap": self.overlap_modes[1],
        }


@dataclass(frozen=True)
class Context:
    """What every evaluation of one request shares: model, cluster, devices, global batch, the load
    factor of dropless routing (`imbalance`, expected max / mean expert load), the recompute choices the
    search may pick (`recompute`, lightest first; None: layout.recompute_ladder's)."""

    model: ModelSpec
    cluster: ClusterSpec
    devices: int
    global_batch: int
    imbalance: float = 1.2
    recompute: tuple[str, ...] | None = None  # the recompute choices to try, lightest first (None: all)

    @property
    def rpn(self) -> int:
        """Devices per node (a request smaller than a node uses that many)."""
        return min(self.cluster.devices_per_node, self.devices)


def _eff(c: ClusterSpec, dim: float) -> float:
    return c.gemm_eff * dim / (dim + c.gemm_half_dim) if c.gemm_half_dim else c.gemm_eff


def _link(c: ClusterSpec, intra: bool) -> tuple[float, float]:
    return (c.intra_bytes_per_s, c.intra_latency_s) if intra else (c.inter_bytes_per_s, c.inter_latency_s)


def _remote_neighbours(s: S.Schedule, stage: int) -> int:
    """How many of `stage`'s neighbours in the stage chain (the one before and the one after) run on
    another rank: the pipeline messages it sends and receives per microbatch, each way."""
    rank = s.placement.stage_rank
    return sum(1 for nb in (stage - 1, stage + 1) if 0 <= nb < len(rank) and rank[nb] != rank[stage])


def _collective_s(c: ClusterSpec, nbytes: float, intra: bool, steps: int = 1) -> float:
    bw, lat = _link(c, intra)
    return nbytes / bw + steps * lat + c.comm_overhead_s


@dataclass(frozen=True)
class _Phases:
    f: float
    i: float
    w: float
    recompute: float  # extra I time recompute costs
    tp_comm: float  # TP collectives of F and I together
    b: float  # I and W run as one B (its host cost may differ from a split I + W)
    ring: float = 0.0  # the context-parallel ring's exposed waits of F and I together (in tp_comm too)


def _layer_phases(ctx: Context, lay: L.Layout, cost: LayerCost) -> _Phases:
    """Seconds of F, I, W of one layer for one microbatch on one rank (all-to-all excluded). GEMMs of the
    model's FP8 groups run at the cluster's FP8 peak (the compute dtype's where it has none); recompute
    adds the forward of what it recomputes (all of F under full, else its parts') to the backward."""
    m, c, tp = ctx.model, ctx.cluster, lay.tp
    T = rank_tokens(m, lay)
    peak = c.flops(m.dtype)
    peak8 = c.gemm_flops(m.dtype, True)
    fp8_dense, _ = fp8_flops(m, cost.kind)
    dense_eff = _eff(c, min(T, m.hidden))
    dense = T * ((cost.dense_flops - fp8_dense) / peak + fp8_dense / peak8) / tp / dense_eff
    attn = T * cost.attn_flops / tp / (peak * c.attn_eff)
    expert = _expert_s(ctx, lay, cost)
    tp_f, tp_b = _tp_comm_s(ctx, lay, cost.kind)
    oh = c.host_s(cost.kind, T / tp, lay.expert_group > 1)  # sequence parallel: T / tp tokens per rank
    ring_f, ring_b = ring_s(ctx, lay, attn) if cost.kind in ("dense", "moe") else (0.0, 0.0)
    tp_f, tp_b = tp_f + ring_f, tp_b + ring_b  # the ring's waits are communication, as the TP collectives
    f = dense + attn + expert + tp_f + oh
    i_compute, w_compute = dense + 2 * attn + expert + tp_b, dense + expert
    i = i_compute + c.i_overhead_ratio * oh
    w = w_compute + c.w_overhead_ratio * oh
    if lay.recompute == "full":
        extra = f
    else:  # each part's forward again: the attention core at its kernel's rate, the GEMMs at theirs
        extra = 0.0
        parts = L.recompute_parts(lay.recompute) or ()
        for part, (flops, _) in part_costs(m, cost.kind).items():
            if part not in parts:
                continue
            if part == "moe":
                extra += expert
                continue
            if part == "core_attn" and "mla_up_proj" in parts:
                continue  # mla_up_proj's region holds the core: recomputed once
            core = part_attn_flops(m, cost.kind, part)
            gemm_peak = c.gemm_flops(m.dtype, m.fp8(PART_GEMM_GROUP[part]))
            extra += T * (flops - core) / tp / (gemm_peak * dense_eff)
            extra += attn * core / cost.attn_flops if cost.attn_flops else 0.0
    b_ratio = c.i_overhead_ratio + c.w_overhead_ratio if c.b_overhead_ratio is None else c.b_overhead_ratio
    b = i_compute + w_compute + b_ratio * oh
    return _Phases(f, i + extra, w, extra, tp_f + tp_b, b + extra, ring_f + ring_b)


def rank_tokens(m: ModelSpec, lay: L.Layout) -> float:
    """Tokens of one microbatch on one rank before tensor parallelism: micro_batch x seq / cp."""
    return lay.micro_batch * m.seq / lay.cp


def ring_step_bytes(m: ModelSpec, lay: L.Layout) -> float:
    """Bytes one ring step moves from each rank, of one attention layer and microbatch: its keys and values
    (GQA: 2 x kv_heads x head_dim per position; MLA: the H heads' keys, head_dim + qk_rope_dim wide, and
    values, v_head_dim) of its seq / cp positions, its heads' 1 / tp, in the core's compute dtype (fp32
    for bf16 runs, fmoe.ops._dtypes.compute_dtype: the runtime rotates and sends them in it)."""
    width = m.heads * (m.head_dim + m.qk_rope_dim + m.v_head_dim) if m.mla else 2 * m.kv_heads * m.head_dim
    return rank_tokens(m, lay) * width / lay.tp * 4


def ring_s(ctx: Context, lay: L.Layout, attn_f: float) -> tuple[float, float]:
    """Seconds one attention layer's ring leaves exposed (forward, backward dx pass) for one microbatch,
    given its core's forward `attn_f` seconds on this rank (module docstring): N - 1 transfers of
    `ring_step_bytes` each way, each behind one step's 1 / N of the core (forward) or of its backward. The
    runtime lays the cp ranks outside dp, ep and tp (fmoe.parallel.mesh): on one node while
    tp x ep x dp x cp fits it."""
    N = lay.cp
    if N == 1:
        return 0.0, 0.0
    xfer = _collective_s(ctx.cluster, ring_step_bytes(ctx.model, lay), lay.world // lay.pp <= ctx.rpn)
    fwd = (N - 1) * max(0.0, xfer - attn_f / N)
    bwd = (N - 1) * max(0.0, xfer - 2 * attn_f / N)
    return fwd, bwd


def _expert_s(ctx: Context, lay: L.Layout, cost: LayerCost, chunks: int = 1) -> float:
    """Seconds of one layer's routed experts' forward GEMMs for one microbatch on one rank, their rows
    moved in `chunks` (each chunk's GEMMs are 1/chunks the rows, at that size's efficiency)."""
    if not cost.expert_flops:
        return 0.0
    m, c = ctx.model, ctx.cluster
    T = rank_tokens(m, lay)
    _, fp8_expert = fp8_flops(m, cost.kind)
    load = lay.capacity_factor if lay.capacity_factor is not None else ctx.imbalance
    # TP extends EP: each rank dispatches its own T / tp tokens to whole experts
    rows = T / lay.tp * m.top_k * lay.expert_group / m.routed_experts / chunks
    expert_peak = c.gemm_flops(m.dtype, True) if fp8_expert else c.flops(m.dtype)
    expert_eff = _eff(c, max(min(rows, m.expert_ffn), 1.0))
    return load * T * cost.expert_flops / lay.tp / (expert_peak * expert_eff)


def _self_overlap_s(ctx: Context, lay: L.Layout, cost: LayerCost) -> tuple[float, float]:
    """What hiding its own exchanges costs one MoE layer (self-overlap, fmoe.overlap: its rows in two
    chunks), (forward, backward) seconds: two more all-to-all calls each way (a latency per peer on each
    link class, and the call's host cost), and the experts' GEMMs at half the rows (the backward's dx
    and dw both)."""
    c = ctx.cluster
    P = lay.expert_group
    per_node = min(P, ctx.rpn)
    latency = max(c.intra_latency_s * (per_node - 1), c.inter_latency_s * (P - per_node))
    calls = 2 * (latency + c.comm_overhead_s)
    gemm = _expert_s(ctx, lay, cost, chunks=2) - _expert_s(ctx, lay, cost)
    return calls + gemm, calls + 2 * gemm


def _tp_comm_s(ctx: Context, lay: L.Layout, kind: str) -> tuple[float, float]:
    """Seconds of one layer's TP collectives for one microbatch: (forward, backward dx pass). They are the
    runtime's with sequence parallelism (`layer_costs.tp_collectives`, bytes from the counters' formulas),
    each a ring on the node's links: (tp - 1) steps, twice that for an all-reduce."""
    tp, c = lay.tp, ctx.cluster
    if tp == 1:
        return 0.0, 0.0
    out = {"F": 0.0, "B": 0.0, "S": 0.0}
    for coll in tp_collectives(ctx.model, kind, rank_tokens(ctx.model, lay)):
        steps = 2 * (tp - 1) if coll.kind == "all_reduce" else tp - 1
        out[coll.phase] += _collective_s(c, coll.sent(tp), True, steps)
    return out["F"], out["B"]


def _tp_sums_s(ctx: Context, lay: L.Layout, kind: str) -> float:
    """Seconds of one layer's replicated-weight gradient sums over tp, once per step at the step's end
    (phase "S" of `layer_costs.tp_collectives`; fmoe.parallel.tensor.sum_tp_partials)."""
    tp = lay.tp
    if tp == 1:
        return 0.0
    colls = tp_collectives(ctx.model, kind, lay.micro_batch * ctx.model.seq)
    return sum(_collective_s(ctx.cluster, coll.sent(tp), True, 2 * (tp - 1)) for coll in colls
               if coll.phase == "S")


def _a2a_s(ctx: Context, lay: L.Layout) -> tuple[float, dict[str, float]]:
    """Seconds of one dispatch (or one combine) of one MoE layer, and its bytes per link class.

    Bytes: the dispatchers' formulas (fmoe.parallel.traffic); under node-limited routing
    (ModelSpec.max_nodes_per_token) the hierarchical dispatch's inter-node rows, one per node a token
    touches, are capped (`_nodes_touched`). A dispatch of FP8 experts sends FP8 rows (1 byte per element)
    and its combine the compute dtype's: each direction is priced at their mean. Latency: a pairwise
    all-to-all posts one send and one receive per peer, so each link class costs its latency once per peer
    on it (the count exchange reaches every peer, whatever the rows)."""
    m, c = ctx.model, ctx.cluster
    P = lay.expert_group
    if P == 1:
        return 0.0, {"intra": 0.0, "inter": 0.0}
    T = rank_tokens(m, lay)
    group_per_node = min(P, ctx.rpn)
    nodes = P // group_per_node
    tokens = T // lay.tp  # sequence parallel: each tp rank dispatches its own share
    b = DTYPE_BYTES[m.dtype]
    row = m.hidden * ((1 + b) / 2 if m.fp8("experts") else b)
    if lay.hierarchical:  # across nodes each token also carries its K ids (int64) and probs (fp32)
        hier = traffic.expected_hierarchical_bytes(
            tokens, m.top_k, m.routed_experts, P, group_per_node, row + 12 * m.top_k
        )
        remote = _nodes_touched(m, nodes) * (nodes - 1) / nodes  # the token's own node is one of those
        inter = tokens * remote * (row + 12 * m.top_k) if m.max_nodes_per_token else hier["inter"]
        intra = traffic.expected_hierarchical_bytes(
            tokens, m.top_k, m.routed_experts, P, group_per_node, row
        )["intra"]
        nbytes = {"intra": intra, "inter": inter}
        peers = {"intra": group_per_node - 1, "inter": nodes - 1}  # node level: the same slot on each node
    else:
        nbytes = traffic.expected_alltoall_bytes(tokens, m.top_k, m.routed_experts, P, group_per_node, row)
        peers = {"intra": group_per_node - 1, "inter": P - group_per_node}
    load = lay.capacity_factor if lay.capacity_factor is not None else ctx.imbalance
    # the busiest rank sends `load` x the mean; one all-to-all's link classes run at once, the two levels
    # of the hierarchical dispatch one after the other
    times = [_exchange_s(c, link == "intra", peers[link], n, load) for link, n in nbytes.items() if n > 0]
    t = sum(times) if lay.hierarchical and not HIER_LEVELS_OVERLAP else max(times, default=0.0)
    calls = 4 if lay.hierarchical else 2  # each level: its count exchange, then the rows
    return t + calls * c.comm_overhead_s, nbytes


def _exchange_s(c: ClusterSpec, intra: bool, peers: int, nbytes: float, load: float) -> float:
    """Seconds of one all-to-all's traffic on one link class: a latency per peer on it, and the busiest
    rank's bytes (`load` x the mean `nbytes`) at the link's bandwidth."""
    bw, lat = _link(c, intra)
    return peers * lat + load * nbytes / bw


def _nodes_touched(m: ModelSpec, nodes: int) -> float:
    """Expected nodes of an expert group spread over `nodes` nodes that one token's top-k experts touch:
    uniform routing misses a node with probability C(E - E/nodes, K) / C(E, K); node-limited routing
    (max_nodes_per_token) caps it (min of the cap and the mean: Jensen's bound on E[min], never low)."""
    E, K = m.routed_experts, m.top_k
    touched = nodes * (1 - math.comb(E - E // nodes, K) / math.comb(E, K))
    return min(touched, m.max_nodes_per_token) if m.max_nodes_per_token else touched


def _chunks(ctx: Context, lay: L.Layout, s: S.Schedule) -> tuple[S.Placement, tuple[int, ...], bool]:
    """The model-chunk placement, the layers per chunk (the balanced cut, as the runtime's) and whether
    the MTP modules run alone on the last chunk (the loss on the one before)."""
    cut = _cut(ctx, lay, S.stages.cost_placement(s.placement))
    return S.stages.chunk_placement(s.placement), cut.layers, cut.split_last > 0


CUT_ROUND = 20  # the cut's costs in 1/20 of a MoE layer: finer moves no layer, and misses the cache


def _cut(ctx: Context, lay: L.Layout, chunks: S.Placement) -> S.LayerPlacement:
    """The cut that evens per-rank compute (`S.balance_layers_or_empty`, the runtime's rule), priced by
    the modelled F + B of a microbatch: dense and MoE layers apart, the embedding on the first chunk, the
    head + loss + MTP on the last (or the MTP alone on the last, the loss on the one before); costs in
    MoE layers, rounded to 1/CUT_ROUND so that alike layouts share one search."""
    m = ctx.model

    def busy(cost: LayerCost | None) -> float:
        if cost is None:
            return 0.0
        ph = _layer_phases(ctx, lay, cost)
        return ph.f + ph.b

    moe = busy(block_cost(m, True)) if m.moe_layers else busy(block_cost(m, False))
    dense, first, last, mtp = (busy(c) / moe for c in (block_cost(m, False), embed_cost(m), head_cost(m),
                                                         mtp_cost(m)))
    dense, first, last, mtp = (round(x * CUT_ROUND) / CUT_ROUND for x in (dense, first, last, mtp))
    return _place(chunks, m.dense_layers, m.moe_layers, dense, first, last, min(mtp, last))


@functools.lru_cache(maxsize=65536)
def _place(chunks: S.Placement, n_dense: int, n_moe: int, dense: float, first: float,
           last: float, mtp: float) -> S.LayerPlacement:
    """The balanced cut of n_dense layers costing `dense` then n_moe costing 1 (cached: layouts share it);
    `mtp` the part of `last` that may run alone on the last chunk."""
    return S.balance_layers_or_empty(chunks, (dense,) * n_dense + (1.0,) * n_moe, first, last, split_last=mtp)


def _sim_schedule(lay: L.Layout, m: int) -> tuple[S.Schedule, S.Schedule | None, int]:
    """The schedule to simulate: all m microbatches, or (m1, m2) for a linear extrapolation to m."""
    v = max(lay.vpp, 1)
    cap = SIM_CAP * lay.pp
    if m <= cap + lay.pp or lay.pp == 1 and m <= 16:
        return L.executed_schedule(lay.schedule, lay.pp, m, v), None, m
    m1 = cap if lay.pp > 1 else 8
    step = lay.pp if lay.pp > 1 else 4
    return (
        L.executed_schedule(lay.schedule, lay.pp, m1, v),
        L.executed_schedule(lay.schedule, lay.pp, m1 + step, v),
        m1,
    )


def overlap_choices(lay: L.Layout, hides: bool) -> list[tuple[str, str]]:
    """The overlap modes (fmoe.overlap: in an F&B pair, alone) the runtime can run `lay` with, where they
    differ: with nothing to hide (`hides` False: fb overlap off, no exchange leaves a rank, or a cluster
    whose links wait for the compute) only the default; alone, whole rows or chunks (self-overlap, not
    through the hierarchical dispatcher, whose rows take another route); in a schedule with F&B pairs
    also no pairing, whole or in chunks in both contexts (chunks paid in a pair are paid alone too, so
    the mixed choices are no better than these)."""
    if not hides:
        return [DEFAULT_MODES]
    chunks = not lay.hierarchical
    out = [DEFAULT_MODES] + ([("pair", "self")] if chunks else [])
    if lay.schedule in PAIRED_SCHEDULES:
        out += [("none", "none")] + ([("self", "self")] if chunks else [])
    return out


def evaluate(ctx: Context, lay: L.Layout, simulate: bool = True, memory_first: bool = False,
             overlap: tuple[str, str] | None = None) -> Prediction:
    """Returns the Prediction of `lay` (which must pass `layout.problem`): simulated, or with
    `simulate=False` a closed-form estimate of the same parts (the search's first pass). `memory_first`:
    a layout that does not fit returns before its time is computed (step_s = inf). `overlap`: how the
    MoE layers hide their all-to-all, (in a pair, alone) as fmoe.overlap names the modes; None: the
    fastest of `overlap_choices` (adaptive pipe overlap), in `Prediction.overlap_modes`."""
    if overlap is not None and (overlap[0] not in PAIRED or overlap[1] not in LONE):
        raise PlanError(f"overlap modes must be (one of {', '.join(PAIRED)}, one of {', '.join(LONE)}), "
                        f"got {overlap!r}")
    model, c = ctx.model, ctx.cluster
    m = lay.microbatches(ctx.global_batch)
    s_full = L.executed_schedule(
        lay.schedule, lay.pp, min(m, SIM_CAP * lay.pp + lay.pp) if lay.pp > 1 else min(m, 16), max(lay.vpp, 1)
    )
    _, layers_C, mtp_alone = _chunks(ctx, lay, s_full)
    dense_blk, moe_blk = block_cost(model, False), block_cost(model, True)
    emb, head, loss, mtp = embed_cost(model), head_cost(model), loss_cost(model), mtp_cost(model)
    ph_dense, ph_moe = _layer_phases(ctx, lay, dense_blk), _layer_phases(ctx, lay, moe_blk)
    ph_emb = _layer_phases(ctx, lay, emb)
    # the end of the model: on the last chunk, or the loss on the one before and the MTP alone on it
    ends = {"head": (_layer_phases(ctx, lay, head), head)}
    if mtp_alone:
        ends = {"loss": (_layer_phases(ctx, lay, loss), loss), "mtp": (_layer_phases(ctx, lay, mtp), mtp)}
    n_C = len(layers_C)
    end_of = {n_C - 2: "loss", n_C - 1: "mtp"} if mtp_alone else {n_C - 1: "head"}

    # per chunk: phases, MoE layers, parameters, activations
    chunk_f, chunk_i, chunk_w, chunk_moe, chunk_dense_p, chunk_exp_p, chunk_act, chunk_wb, chunk_b = (
        [] for _ in range(9)
    )
    T = rank_tokens(model, lay)
    b = DTYPE_BYTES[model.dtype]
    load = lay.capacity_factor if lay.capacity_factor is not None else ctx.imbalance
    memo: dict[
        tuple[int, int, bool, str | None], tuple[float, ...]
    ] = {}  # most chunks are alike: price each kind once
    start = 0
    chunk_tp_sums: list[float] = []
    sums_memo: dict[tuple[int, int, bool, str | None], float] = {}
    for k, n in enumerate(layers_C):
        n_dense = max(0, min(n, model.dense_layers - start))
        start += n
        key = (n_dense, n - n_dense, k == 0, end_of.get(k))
        if key not in memo:
            memo[key] = _chunk(
                model,
                lay,
                key,
                T,
                load,
                (ph_dense, dense_blk),
                (ph_moe, moe_blk),
                (ph_emb, emb),
                ends.get(key[3]),
            )
        if key not in sums_memo:  # the chunk's replicated-weight gradient sums over tp, once per step
            kinds = [(dense_blk.kind, key[0]), (moe_blk.kind, key[1]), (emb.kind, int(key[2]))]
            kinds += [(ends[key[3]][1].kind, 1)] if key[3] else []
            sums_memo[key] = sum(q * _tp_sums_s(ctx, lay, kind) for kind, q in kinds if q)
        chunk_tp_sums.append(sums_memo[key])
        f, i, w, n_moe, dp_, ep_, act, wb, b_ = memo[key]
        # the executor's own work per stage and microbatch, whatever its layers, in the backward
        i, b_ = i + c.stage_overhead_s, b_ + c.stage_overhead_s
        for lst, x in zip(
            (chunk_f, chunk_i, chunk_w, chunk_moe, chunk_dense_p, chunk_exp_p, chunk_act, chunk_wb, chunk_b),
            (f, i, w, n_moe, dp_, ep_, act, wb, b_),
        ):
            lst.append(x)

    a2a, a2a_bytes = _a2a_s(ctx, lay)
    n_moe_total = sum(chunk_moe)
    n_chunks = len(layers_C)
    moe_per_chunk = max(1, round(n_moe_total / n_chunks)) if n_moe_total else 1
    a2a_unit = a2a * n_moe_total / (n_chunks * moe_per_chunk) if n_moe_total else 0.0
    p2p_bytes = T * model.hidden * b / lay.tp
    p2p = _collective_s(c, p2p_bytes, lay.world <= ctx.rpn) if lay.pp > 1 else 0.0

    stage_chunk = s_full.placement.layer_chunk
    # parameters and their gradient / optimizer bytes per rank (a rank holds the chunks of its stages)
    pp = lay.pp
    rank_dense = [0.0] * pp
    rank_exp = [0.0] * pp
    rank_layers = [0] * pp  # blocks, embedding and head held: what step_overhead_s is counted per
    rank_tp_sums = [0.0] * pp
    for stage, k in enumerate(stage_chunk):
        r = s_full.placement.stage_rank[stage]
        rank_tp_sums[r] += chunk_tp_sums[k]
        rank_dense[r] += chunk_dense_p[k] / lay.tp
        rank_exp[r] += chunk_exp_p[k] / (lay.ep * lay.tp)
        rank_layers[r] += layers_C[k] + (k == 0) + (k in end_of)
    mixed = model.dtype != "fp32"
    w_bytes = (b + 4) if mixed else 4
    dense_shard = lay.data_ranks if lay.zero1 else 1
    exp_shard = lay.dp if lay.zero1 else 1
    act_S = tuple(chunk_act[k] for k in stage_chunk)
    wb_S = tuple(chunk_wb[k] for k in stage_chunk)
    act_peak = peak_bytes(s_full, act_S, wb_S)
    temp = 2 * T / lay.tp * model.top_k * model.hidden * b * load  # all-to-all send + receive buffers
    if lay.recompute == "full":
        temp += max(moe_blk.act_bytes, dense_blk.act_bytes) * T / lay.tp
    mem_rank = []
    for r in range(pp):
        p = rank_dense[r] + rank_exp[r]
        parts = {
            "weights": p * w_bytes,
            "grads": p * 4,
            "optimizer": 8 * (rank_dense[r] / dense_shard + rank_exp[r] / exp_shard),
            "activations": act_peak[r],
            "buffers": temp,
            "base": c.base_mem_gib * GIB,
        }
        mem_rank.append(parts)
    worst = max(range(pp), key=lambda r: sum(mem_rank[r].values()))
    mem = {k: v / GIB for k, v in mem_rank[worst].items()}
    mem_gib = sum(mem.values())
    fits = mem_gib <= c.mem_gib
    reason = None if fits else f"needs {mem_gib:.1f} GiB per device, the device has {c.mem_gib:g}"
    if memory_first and not fits:
        inf = float("inf")
        return Prediction(lay, m, inf, 0.0, 0.0, mem_gib, 0.0, 0.0, False, reason, False, {}, mem)

    # each stage's messages to and from stages on other ranks: their host cost, in F (activations) and in
    # I or B (gradients)
    msg = [c.p2p_overhead_s * _remote_neighbours(s_full, st) for st in range(len(stage_chunk))]

    # data-parallel gradient reduce and the optimizer step, per rank
    def reduce_s(params: float, group: int) -> float:
        if group == 1 or params == 0:
            return 0.0
        intra = lay.tp * group <= ctx.rpn
        nbytes = 2 * (group - 1) / group * params * 4
        return _collective_s(c, nbytes, intra, 2 * (group - 1))

    # summed over the cp ranks too (each holds its positions' part of every gradient), with the
    # tensor-parallel sums of the replicated weights' partial gradients, also once per step
    dp_s = [reduce_s(rank_dense[r], lay.data_ranks * lay.cp) + reduce_s(rank_exp[r], lay.dp * lay.cp)
            + rank_tp_sums[r]
            for r in range(pp)]
    opt_bytes = 28 + (6 if mixed else 0)
    opt_s = [
        opt_bytes * (rank_dense[r] / dense_shard + rank_exp[r] / exp_shard) / c.hbm_bytes_per_s
        + c.step_overhead_s * rank_layers[r]
        for r in range(pp)
    ]

    # how each MoE layer hides its all-to-all (fmoe.overlap: in a pair, alone): every choice the runtime
    # allows this layout is priced and the fastest step kept (adaptive pipe overlap)
    hides = lay.overlap and c.comm_hides and a2a_unit > 0
    self_f, self_b = _self_overlap_s(ctx, lay, moe_blk)
    attn_frac = _attn_share(ph_moe, ctx, lay, moe_blk)

    def costs_of(modes: tuple[str, str]) -> S.Costs:
        # a pair hides all of an exchange it can in the simulator (each part costs max(compute, exchange)),
        # so the unhidden (1 - pair_hide) of every exchange is charged to the phase as time it waits:
        # max(compute + (1 - h) x, x) = max(compute, h x) + (1 - h) x. A lone phase then hides its share
        # of the whole when the simulator's lone share is that + 1 - h (exact for shares <= pair_hide)
        paired, lone = modes
        pairs = hides and paired == "pair"
        pair_hide = c.pair_hide if pairs else 1.0
        share = c.lone_hide if lone == "self" else c.lone_hide_whole
        chunked = hides and lone == "self"
        wait = 2 * (1 - pair_hide) * a2a_unit * moe_per_chunk
        return S.Costs(
            f=tuple(chunk_f[k] + msg[st] + wait for st, k in enumerate(stage_chunk)),
            i=tuple(chunk_i[k] + msg[st] + wait for st, k in enumerate(stage_chunk)),
            w=tuple(chunk_w[k] for k in stage_chunk),
            b=tuple(chunk_b[k] + msg[st] + wait for st, k in enumerate(stage_chunk)),
            p2p=p2p,
            a2a=a2a_unit,
            moe_layers=moe_per_chunk,
            attn_frac=attn_frac,
            lone_hide=min(1.0, share + 1.0 - pair_hide) if hides else 0.0,
            # a pair whose layers chunk instead of pairing hides what chunks hide in a pair (measured)
            unpaired_hide=c.pair_self_hide if hides and paired == "self" else None,
            self_f=self_f if chunked else 0.0,
            self_b=self_b if chunked else 0.0,
            pair_overlap=pairs,
        )

    best, tried = None, {}
    for modes in [overlap] if overlap is not None else overlap_choices(lay, hides):
        costs = costs_of(modes)
        if simulate:
            pipe, busy, exposed, last_end = _simulated(lay, m, costs)
        else:
            pipe, busy, exposed, last_end = _closed_form(lay, m, costs, s_full)
        step = max(max(last_end[r] + dp_s[r] for r in range(pp)), pipe) + max(opt_s)
        tried[f"step overlap {'/'.join(modes)}"] = step
        if best is None or step < best[0]:
            best = (step, modes, costs, pipe, busy, exposed)
    step, modes, costs, pipe, busy, exposed = best
    mean_busy = sum(busy) / pp
    tokens = ctx.global_batch * model.seq
    tps = tokens / step
    mfu = totals(model).train_flops_per_token * tps / (ctx.devices * c.flops(model.dtype))
    dp_exposed = step - max(opt_s) - pipe
    comm_exposed = (sum(exposed) / pp + max(0.0, dp_exposed)) / step
    times = {
        "pipeline": pipe,
        "busy_mean": mean_busy,
        "bubble": pipe - mean_busy,
        "a2a_per_layer": a2a,
        "p2p": p2p,
        "dp_reduce": max(dp_s),
        "dp_exposed": max(0.0, dp_exposed),
        "optimizer": max(opt_s),
        "f_chunk_max": max(chunk_f),
        "i_chunk_max": max(chunk_i),
        "w_chunk_max": max(chunk_w),
        "recompute_per_layer": ph_moe.recompute,
        "tp_comm_per_layer": ph_moe.tp_comm,
        "cp_ring_per_layer": ph_moe.ring,
        **tried,  # the step under each overlap choice priced
    }
    cut = _cut(ctx, lay, S.stages.cost_placement(s_full.placement))
    return Prediction(
        lay,
        m,
        step,
        tps,
        mfu,
        mem_gib,
        (pipe - mean_busy) / step,
        comm_exposed,
        fits,
        reason,
        simulate,
        times,
        mem,
        a2a_bytes,
        costs,
        cut.imbalance_pct,
        modes,
        cut.stage_imbalance_pct,
    )


def _chunk(
    model: ModelSpec,
    lay: L.Layout,
    key: tuple[int, int, bool, str | None],
    T: int,
    load: float,
    *priced: tuple[_Phases, LayerCost] | None,
) -> tuple[float, ...]:
    """(F, I, W, MoE layers, dense params, expert params, activation bytes, W bytes, B) of one chunk with
    n_dense dense and n_moe MoE layers, the embedding when first, and its end of the model: "head" (the
    loss and the MTP modules), "loss" or "mtp" (the MTP modules alone), None."""
    n_dense, n_moe, first, end = key
    (dense, moe, emb, tail), b = priced, DTYPE_BYTES[model.dtype]
    parts = (
        [(*dense, n_dense), (*moe, n_moe)] + ([(*emb, 1)] if first else []) + ([(*tail, 1)] if end else [])
    )
    act = wb = 0.0
    recomputed = L.recompute_parts(lay.recompute) or ()
    for _, lc, q in parts:
        keep = lc.act_bytes + (load - 1) * lc.expert_act_bytes  # headroom for the busiest expert rank
        fp8_dense, fp8_expert = fp8_saved_bytes(model, lc.kind)
        keep -= fp8_dense + (0.0 if "moe" in recomputed else load * fp8_expert)
        if lay.recompute == "full" and lc.kind in ("dense", "moe"):
            keep = b * model.hidden  # only the layer input
        else:  # each recomputed part keeps only its inputs (kept anyway): what it saved is freed
            for part, (_, freed) in part_costs(model, lc.kind).items():
                if part in recomputed:
                    keep -= (load if part == "moe" else 1.0) * freed
            keep = max(keep, b * model.hidden if lc.kind in ("dense", "moe") else 0.0)
        act += q * keep * T / lay.tp
        if lc.kind in ("dense", "moe"):  # the ring's received key / value blocks, kept for the backward
            act += q * (lay.cp - 1) * ring_step_bytes(model, lay)
        wb += q * min(lc.w_bytes, keep) * T / lay.tp
    return (
        sum(p.f * q for p, _, q in parts),
        sum(p.i * q for p, _, q in parts),
        sum(p.w * q for p, _, q in parts),
        n_moe + (model.mtp if end in ("head", "mtp") else 0),
        sum(lc.dense_params * q for _, lc, q in parts),
        sum(lc.expert_params * q for _, lc, q in parts),
        act,
        wb,
        sum(p.b * q for p, _, q in parts),
    )


def _attn_share(ph: _Phases, ctx: Context, lay: L.Layout, moe_blk: LayerCost) -> float:
    """Share of a MoE layer's F that is attention (what fb overlap hides the combine behind)."""
    m, c = ctx.model, ctx.cluster
    T = rank_tokens(m, lay)
    peak = c.flops(m.dtype)
    attn_proj = T * (
        moe_blk.dense_flops - 2 * m.routed_experts * m.hidden - m.shared_experts * 6 * m.hidden * m.expert_ffn
    )
    attn = attn_proj / lay.tp / (peak * _eff(c, min(T, m.hidden))) + T * moe_blk.attn_flops / lay.tp / (
        peak * c.attn_eff
    )
    return min(1.0, max(0.0, attn / ph.f)) if ph.f else 0.5


def _simulated(lay: L.Layout, m: int, costs: S.Costs) -> tuple[float, list[float], list[float], list[float]]:
    """(makespan, busy per rank, exposed comm per rank, end of each rank's last action), extrapolated
    linearly in m beyond SIM_CAP x pp microbatches (the steady state repeats)."""
    s1, s2, m1 = _sim_schedule(lay, m)
    r1 = S.simulate(s1, costs)
    ends1 = _last_ends(r1)
    if s2 is None:
        return r1.makespan, list(r1.busy), list(r1.exposed_comm), ends1
    r2 = S.simulate(s2, costs)
    k = (m - m1) / (s2.m - m1)

    def ext(a: float, b: float) -> float:
        return a + k * (b - a)

    return (
        ext(r1.makespan, r2.makespan),
        [ext(a, b) for a, b in zip(r1.busy, r2.busy)],
        [ext(a, b) for a, b in zip(r1.exposed_comm, r2.exposed_comm)],
        [ext(a, b) for a, b in zip(ends1, _last_ends(r2))],
    )


def _last_ends(rep: S.Report) -> list[float]:
    t0 = min(e.start for e in rep.events)
    ends = [0.0] * len(rep.busy)
    for e in rep.events:
        ends[e.rank] = max(ends[e.rank], e.end - t0)
    return ends


def _closed_form(
    lay: L.Layout,
    m: int,
    costs: S.Costs,
    s: S.Schedule,
) -> tuple[float, list[float], list[float], list[float]]:
    """A quick estimate of the simulated figures for screening: per rank the work of the microbatches
    through its stages (m each, m / 2 for each direction of DualPipe), plus the schedule's textbook
    bubble ((pp-1) x a stage's F + B, divided by the chunks per rank; zero-bubble schedules keep W out of
    it)."""
    pp, pl = lay.pp, s.placement
    work = [0.0] * pp
    exposed = [0.0] * pp
    stage_fb = []
    paired = lay.overlap and lay.schedule in PAIRED_SCHEDULES
    for st in range(pl.num_stages):
        r = pl.stage_rank[st]
        fop, bop = Op(F, st, 0), Op(B, st, 0)
        lone = costs.lone(fop) + costs.lone(bop)
        t = costs.pair(fop, bop) if paired else lone
        comp = costs.compute(fop) + costs.compute(bop)
        # the microbatches through this stage: DualPipe's two directions carry half of them each
        through = m * sum(st in path for path in pl.paths) / len(pl.paths)
        work[r] += through * t
        exposed[r] += through * (t - comp)
        stage_fb.append((comp, costs.compute(Op(W, st, 0))))
    per_rank_stages = pl.num_stages / pp
    fb = max(x for x, _ in stage_fb) * per_rank_stages
    w = max(y for _, y in stage_fb) * per_rank_stages
    chunks = max(lay.vpp, 1) if lay.schedule.startswith("interleaved") else 1
    if lay.schedule in ("zb_h1",):
        bubble = (pp - 1) * (fb - w)
    elif lay.schedule in ("zbv", "dualpipev"):
        bubble = (pp - 1) * (fb - 2 * w) / 2
    elif lay.schedule == "dualpipe":
        bubble = (pp / 2 - 1) * (fb - 2 * w)
    else:
        bubble = (pp - 1) * fb / chunks
    bubble = max(bubble, 0.0) + 2 * (pp - 1) * costs.p2p
    pipe = max(work) + bubble
    return pipe, work, exposed, [pipe] * pp


def timeline_microbatches(pred: Prediction) -> int:
    """The microbatches `timeline` draws: all of `pred`'s, at most SIM_CAP x pp + pp (16 at pp 1): the
    steady state repeats beyond."""
    lay = pred.layout
    return min(pred.microbatches, SIM_CAP * lay.pp + lay.pp) if lay.pp > 1 else min(pred.microbatches, 16)


def timeline(pred: Prediction) -> S.Report:
    """Returns the simulator's Report of `pred`'s schedule over `timeline_microbatches(pred)`, for a
    timeline picture."""
    lay = pred.layout
    return S.simulate(L.build_schedule(lay.schedule, lay.pp, timeline_microbatches(pred), max(lay.vpp, 1)),
                      pred.costs)


def fastest_fitting(ctx: Context, lay: L.Layout, simulate: bool = True) -> Prediction:
    """Returns the Prediction of `lay` with the lightest recompute that fits (`ctx.recompute`, or none,
    adaptive, the other parts the runtime recomputes selectively, full: `layout.recompute_ladder`; under
    context parallelism without the parts it refuses there), or the heaviest one (not fitting, with its
    reason) when none does."""
    ladder = ctx.recompute or L.recompute_ladder(ctx.model)
    if lay.cp > 1:  # the parts the runtime does not recompute under context parallelism
        ladder = tuple(rc for rc in ladder if not set(L.recompute_parts(rc) or ()) & set(L.CP_REFUSED_PARTS))
    for rc in ladder[:-1]:
        pred = evaluate(ctx, replace(lay, recompute=rc), simulate, memory_first=True)
        if pred.fits:
            return pred
    return evaluate(ctx, replace(lay, recompute=ladder[-1]), simulate)
