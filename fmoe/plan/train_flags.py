"""The `fmoe train` options of a planned layout: what to run to train a layout `fmoe plan` ranks.

    flags = train_overrides(layout, global_batch, cluster)   # TrainConfig fields -> values
    TrainConfig.from_sources(preset="pangu-ultra-moe", overrides=flags).problem(layout.world)   # None

Field names are `fmoe.train.config.TrainConfig`'s (Megatron's vocabulary); the planner's picks assume
sequence parallelism whenever tp > 1 (its activation memory and TP collectives are those of SP), and
TP extending EP (the runtime's only TP layout for the routed experts). The command line of these
fields (`fmoe.cli.plan.train_command`) is the CLI's: the planner imports nothing of fmoe.train or fmoe.cli.
"""

from __future__ import annotations

from typing import Any

from fmoe.plan.layout import Layout
from fmoe.plan.specs import ClusterSpec, PlanError

# the planner's recompute choice -> TrainConfig's recompute fields
_RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {},
    "adaptive": {"moe_adaptive_recompute_activation": True},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def _recompute(choice: str) -> dict[str, Any]:
    """TrainConfig's recompute fields for a planner recompute choice (a RECOMPUTE name, or parts joined by
    "+": selective recompute of those modules)."""
    if choice in _RECOMPUTE:
        return _RECOMPUTE[choice]
    return {"recompute_granularity": "selective", "recompute_modules": tuple(choice.split("+"))}


def train_overrides(layout: Layout, global_batch: int, cluster: ClusterSpec,
                    overlap_modes: tuple[str, str] = ("pair", "none"),
                    seq_length: int | None = None) -> dict[str, Any]:
    """Returns the TrainConfig fields (field -> value) that run `layout` at `global_batch` sequences per
    step on `cluster`'s nodes: sizes, schedule and its chunks, fb overlap and how the MoE layers hide
    their all-to-all (`overlap_modes`, the planner's choice: in a pair, alone; fmoe.overlap), microbatch,
    recompute, the dispatcher, capacity, ZeRO-1, sequence parallelism and context parallelism (the ring).
    `seq_length`: the planned sequence length, when it is not the preset's. PlanError for what the
    runtime cannot run (tp splitting the experts' ffn instead of extending EP)."""
    if layout.tp > 1 and not layout.tp_extends_ep:
        raise PlanError(f"{layout.label()}: fmoe train runs tensor parallelism extending expert parallelism "
                        "only (the tp ranks hold whole experts), not tp splitting each expert's ffn")
    out: dict[str, Any] = {
        "tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "dp": layout.dp,
        "sequence_parallel": layout.tp > 1,
        "schedule": layout.schedule, "overlap": layout.overlap,
        "pair_overlap": overlap_modes[0], "a2a_chunks": 2 if overlap_modes[1] == "self" else 1,
        "micro_batch_size": layout.micro_batch, "global_batch_size": global_batch,
        "dispatcher": "hierarchical" if layout.hierarchical else "alltoall",
        "ranks_per_node": min(cluster.devices_per_node, layout.world),
        "moe_expert_capacity_factor": layout.capacity_factor,
        "use_distributed_optimizer": layout.zero1,
        **_recompute(layout.recompute),
    }
    if seq_length is not None:
        out["seq_length"] = seq_length
    if layout.cp > 1:  # the ring form, the one the planner prices
        out.update(context_parallel_size=layout.cp, cp_comm_type="p2p")
    if layout.schedule in ("interleaved", "interleaved+extra"):  # the schedules that take a vpp
        out["num_virtual_stages_per_pipeline_rank"] = layout.vpp
    return out

