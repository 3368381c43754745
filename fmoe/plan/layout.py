"""A candidate layout (`Layout`), the rules it must satisfy, and the enumeration of every candidate.

Legend: tp tensor parallel, pp pipeline ranks, ep expert parallel, dp data-parallel replicas beyond ep
(world = tp x ep x pp x dp x cp, the runtime's convention: expert parallelism is carved out of data
parallelism, so dp x ep ranks read different data), cp context parallel (the ranks that split each
sequence: they read the same data), vpp model chunks per pipeline rank, m microbatches per rank and step.

The rules are the runtime's own: `fmoe.parallel.topology.check_layout` (sizes, expert group against nodes),
`fmoe.parallel.tp_extends_ep.experts_per_rank` (experts divisible by the expert group), the schedule
generators (`fmoe.schedule.registry.build`: microbatch counts each schedule needs, and the chunks per rank
it runs: only the interleaved schedules take a vpp) and
`fmoe.schedule.place_layers` (every chunk gets a layer). Nothing here needs a process group.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from fmoe import schedule as S
from fmoe.parallel.topology import check_layout
from fmoe.parallel.tp_extends_ep import experts_per_rank
from fmoe.plan.layer_costs import block_cost, part_costs
from fmoe.plan.specs import ClusterSpec, ModelSpec, PlanError
from fmoe.recompute import MODULES
from fmoe.schedule.registry import CHUNKS, check_layers

# the schedules searched for pp > 1; the chunks per rank each runs (and whether it takes a vpp) are the
# registry's rule (fmoe.schedule.registry.CHUNKS), which `build` enforces for the planner and the runtime
SCHEDULES = ("1f1b", "interleaved", "interleaved+extra", "zb_h1", "zbv", "dualpipev", "dualpipe")
SINGLE = ("1f1b", "combined_1f1b")  # pp = 1: microbatches in turn, or paired for fb overlap
RECOMPUTE = ("none", "adaptive", "full")
# beside those, a recompute choice may name the parts the runtime recomputes selectively (fmoe.recompute's
# MODULES, Megatron's --recompute-modules), joined by "+": "moe+shared_experts". "adaptive" is the routed
# experts ("moe"), priced as recomputed in every layer (the load-aware choice recomputes the overloaded
# ones). The runtime has no RMSNorm or MLA up-projection part (what DeepSeek-V3 recomputes): not offered.
PART_SEP = "+"
# context parallelism is offered where the sequence is long (Megatron's long-context runs: 16k and more),
# at sizes that leave each rank at least CP_MIN_POSITIONS positions: below that a ring step's attention
# block is too small to hide its key / value transfer
LONG_SEQ = 16384
CP_MIN_POSITIONS = 4096
# recompute parts the runtime refuses under context parallelism (their recompute would replay the ring)
CP_REFUSED_PARTS = ("core_attn", "mla_up_proj")


def recompute_parts(choice: str) -> tuple[str, ...] | None:
    """Returns the parts a recompute choice recomputes selectively (() for "none" and "full", ("moe",) for
    "adaptive"), or None when `choice` is neither one of RECOMPUTE nor "+"-joined parts of MODULES."""
    if choice in ("none", "full"):
        return ()
    if choice == "adaptive":
        return ("moe",)
    parts = tuple(choice.split(PART_SEP))
    return parts if parts and all(p in MODULES for p in parts) and len(set(parts)) == len(parts) else None


def recompute_ladder(model: ModelSpec) -> tuple[str, ...]:
    """Returns the recompute choices the search tries, lightest first: none, adaptive (the routed experts),
    then the other parts added one at a time, the fewest recompute FLOPs per byte freed first (parts that
    free under 1 % of a block's activations are left out: they cost time for nothing), then full."""
    kinds = ("moe",) + (("dense",) if model.dense_layers else ())
    ratio: dict[str, float] = {}
    for kind in kinds:
        keep = block_cost(model, kind == "moe").act_bytes
        for part, (flops, freed) in part_costs(model, kind).items():
            if part != "moe" and freed >= 0.01 * keep:
                ratio[part] = min(ratio.get(part, float("inf")), flops / freed)
    out, parts = ["none", "adaptive"], ["moe"]
    for part in sorted(ratio, key=ratio.__getitem__):
        parts.append(part)
        out.append(PART_SEP.join(parts))
    return (*out, "full")


@dataclass(frozen=True)
class Layout:
    """One point of the search: sizes, schedule, fb overlap, microbatch size, recompute, TP-extends-EP
    (False, TP splitting each expert, is a reason under tp > 1: the runtime has no such path), hierarchical
    dispatch, capacity factor (None = dropless), ZeRO-1 (Adam state sharded), context-parallel ranks (each
    sequence split over cp ranks, the ring form: fmoe.parallel.context_parallel)."""

    tp: int
    pp: int
    ep: int
    dp: int
    vpp: int
    schedule: str
    overlap: bool
    micro_batch: int
    recompute: str = "none"
    tp_extends_ep: bool = True
    hierarchical: bool = False
    capacity_factor: float | None = None
    zero1: bool = True
    cp: int = 1

    @property
    def world(self) -> int:
        """tp x ep x pp x dp x cp devices."""
        return self.tp * self.ep * self.pp * self.dp * self.cp

    @property
    def data_ranks(self) -> int:
        """Ranks that read different data: dp x ep (Megatron's DP)."""
        return self.dp * self.ep

    @property
    def expert_group(self) -> int:
        """Ranks that split the routed experts: ep x tp with TP-extends-EP, else ep."""
        return self.ep * self.tp if self.tp_extends_ep else self.ep

    def microbatches(self, global_batch: int) -> int:
        """Microbatches per rank and step for `global_batch` sequences."""
        return global_batch // (self.micro_batch * self.data_ranks)

    def label(self) -> str:
        """Short name: "tp8 pp16 ep4 vpp2 dp12" plus the options that differ from the defaults."""
        parts = [
            f"tp{self.tp}",
            f"pp{self.pp}",
            f"ep{self.ep}",
            f"vpp{self.vpp}",
            f"dp{self.dp}",
            *([f"cp{self.cp}"] if self.cp > 1 else []),
            f"mb{self.micro_batch}",
        ]
        if self.tp > 1 and not self.tp_extends_ep:
            parts.append("tp-splits-experts")
        if self.hierarchical:
            parts.append("hier")
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        if self.capacity_factor is not None:
            parts.append(f"cap{self.capacity_factor:g}")
        if not self.zero1:
            parts.append("no-zero1")
        return " ".join(parts)


@functools.lru_cache(maxsize=4096)
def build_schedule(name: str, pp: int, m: int, v: int) -> S.Schedule:
    """Returns the schedule (cached); ScheduleError from the generator when (pp, m, v) does not suit it."""
    return S.build(name, pp, m, v)


@functools.lru_cache(maxsize=4096)
def executed_schedule(name: str, pp: int, m: int, v: int) -> S.Schedule:
    """Returns the lists the executor runs for that schedule (cached): `build_schedule`'s, each I whose W
    comes next on its rank run as one B (`fmoe.schedule.fuse_adjacent_iw`, the executor's default)."""
    return S.fuse_adjacent_iw(build_schedule(name, pp, m, v))


def rule_microbatches(m: int, pp: int) -> int:
    """Returns a microbatch count at most 4 pp + 2 pp that every generator accepts exactly when it accepts
    m: their rules are lower bounds of at most 2 pp and m mod pp, m mod 2 (so m minus a multiple of 2 pp
    keeps them), and building the whole schedule for thousands of microbatches would be slow."""
    if m <= 6 * pp:
        return m
    return m - 2 * pp * ((m - 4 * pp) // (2 * pp))


def problem(
    model: ModelSpec, cluster: ClusterSpec, devices: int, layout: Layout, global_batch: int
) -> str | None:
    """Returns why `layout` cannot run `model` on `devices` of `cluster` at `global_batch`, or None."""
    try:
        check_layout(
            devices,
            tp=layout.tp,
            ep=layout.ep,
            pp=layout.pp,
            dp=layout.dp,
            cp=layout.cp,
            ranks_per_node=min(cluster.devices_per_node, devices),
        )
        experts_per_rank(model.routed_experts, layout.tp if layout.tp_extends_ep else 1, layout.ep)
    except ValueError as exc:
        return str(exc)
    if layout.tp > 1 and model.heads % layout.tp:
        return f"tp {layout.tp} does not divide {model.heads} attention heads"
    if layout.cp > 1 and model.seq % (2 * layout.cp):
        return f"cp {layout.cp} cuts a sequence into {2 * layout.cp} equal chunks: seq {model.seq} does not"
    if layout.tp > 1 and (model.seq // layout.cp) % layout.tp:  # sequence parallelism within a cp rank
        per_rank = model.seq // layout.cp
        return f"tp {layout.tp} (sequence parallel) does not split {per_rank} positions per cp rank"
    if layout.tp > 1 and not layout.tp_extends_ep:
        # the runtime's MoE block under TP always extends EP (fmoe.block.attention): none splits the experts
        return "tp-splits-experts: the runtime has no MoE block whose tp ranks split each expert's weights"
    if global_batch % (layout.micro_batch * layout.data_ranks):
        return (
            f"global batch {global_batch} is not a multiple of micro batch {layout.micro_batch} x dp "
            f"{layout.dp} x ep {layout.ep}"
        )
    if recompute_parts(layout.recompute) is None:
        return (f"recompute must be one of {', '.join(RECOMPUTE)} or parts of {', '.join(MODULES)} joined "
                f"by '{PART_SEP}', got {layout.recompute!r}")
    refused = [p for p in recompute_parts(layout.recompute) if p in CP_REFUSED_PARTS]
    if layout.cp > 1 and refused:
        return f"cp {layout.cp}: fmoe train does not recompute {', '.join(refused)} under context parallelism"
    m = layout.microbatches(global_batch)
    try:
        s = build_schedule(layout.schedule, layout.pp, rule_microbatches(m, layout.pp), max(layout.vpp, 1))
        check_layers(layout.schedule, layout.pp, model.layers)  # the schedule's own rule, as fmoe train's
        S.place_layers(S.stages.chunk_placement(s.placement), model.layers, min_layers=1)
    except S.ScheduleError as exc:
        return f"{layout.schedule} with pp {layout.pp}, vpp {layout.vpp}, {m} microbatches: {exc}"
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_sizes(model: ModelSpec, devices: int) -> tuple[int, ...]:
    """The context-parallel sizes the search offers: 1, and where the sequence is long (LONG_SEQ or more)
    each size of the devices that cuts it into 2 x cp equal chunks leaving CP_MIN_POSITIONS per rank."""
    if model.seq < LONG_SEQ:
        return (1,)
    return tuple(c for c in _divisors(devices)
                 if c == 1 or (model.seq % (2 * c) == 0 and model.seq // c >= CP_MIN_POSITIONS))


def candidates(
    model: ModelSpec,
    cluster: ClusterSpec,
    devices: int,
    global_batch: int,
    *,
    micro_batches: tuple[int, ...] = (1, 2, 4),
    vpps: tuple[int, ...] = (2, 4),
    capacity_factors: tuple[float | None, ...] = (None,),
    zero1: bool = True,
    cps: tuple[int, ...] | None = None,
) -> Iterator[tuple[Layout, str | None]]:
    """Yields every (layout, problem or None) of the search space, recompute "none" only (the evaluator
    picks the cheapest recompute that fits). `cps`: the context-parallel sizes to search (None:
    `cp_sizes`). Raises PlanError for a request no layout can meet."""
    rpn = cluster.devices_per_node
    if devices < 1 or (devices > rpn and devices % rpn):
        raise PlanError(
            f"--devices {devices} is not a multiple of the {rpn} devices of a {cluster.name} node"
        )
    if model.routed_experts < 1:
        raise PlanError("the model has no routed experts")
    if global_batch < 1:
        raise PlanError(f"--global-batch must be >= 1, got {global_batch}")
    cps = cp_sizes(model, devices) if cps is None else cps
    if any(c < 1 or devices % c for c in cps):
        raise PlanError(f"--cp sizes must divide --devices {devices}, got {', '.join(map(str, cps))}")
    for cp, tp, pp, ep in itertools.product(cps, _divisors(min(rpn, devices)), _divisors(devices),
                                            _divisors(devices)):
        if devices % (tp * pp * ep * cp) or pp > model.layers or ep > model.routed_experts:
            continue
        dp = devices // (tp * pp * ep * cp)
        for mb, cap in itertools.product(micro_batches, capacity_factors):
            group = ep * tp  # TP extends EP, the runtime's only MoE block under TP
            spans_nodes = group > min(rpn, devices)
            names = SINGLE if pp == 1 else tuple(SCHEDULES)
            for name, hier in itertools.product(names, (False, True) if spans_nodes else (False,)):
                need = CHUNKS[name]
                for v in vpps if need is None else (need,):
                    for overlap in (True, False):
                        if name == "combined_1f1b" and not overlap:
                            continue  # that is plain 1f1b
                        if overlap and group == 1:
                            continue  # no all-to-all leaves the device: nothing to hide, same as off
                        lay = Layout(tp, pp, ep, dp, v, name, overlap, mb, "none", True, hier, cap, zero1, cp)
                        yield lay, problem(model, cluster, devices, lay, global_batch)
