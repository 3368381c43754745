"""One pipeline training step of the GPT: stage programs for a schedule, the executor, shared-weight
gradients summed, MoE loads reported for the once-per-step state update.

    program = gpt_program(cfg, s, rank, parallel=ParallelContext(...))   # once per run
    out = gpt_pipeline_step(program, params, state, batches, group=pp_group, options=ExecOptions(...))
    out.loss, out.grads (init_gpt layout), out.loads, out.result (timeline, peaks)

`batches[mb]` = (ids_BS, targets_BS) of microbatch mb; every rank gets the same list (the first and the
last stage read it). `packings[mb]`, when given, is its documents (fmoe/packing.py): it travels in the
microbatch's meta, which the executor hands every stage, so each attention and loss reads it where it runs.
The loss is the mean over microbatches of cross-entropy + balancing losses + the weighted MTP loss; it
lives on the rank(s) holding the last chunk and is summed across the pipeline group so every rank returns
it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fmoe.config import GPTConfig
from fmoe.dispatch.local import LocalDispatcher
from fmoe.gpt_state import LayerLoad, layer_loads
from fmoe.outline import Path, reads_of
from fmoe.overlap import LayerOverlap, Overlap, layer_overlap
from fmoe.packing import Packing
from fmoe.parallel.context import LOCAL, ParallelContext
from fmoe.parallel.context_parallel import check_split
from fmoe.parallel.shared_grads import SharedGrads
from fmoe.phases import H, gpt_layers, moe_layer_turns
from fmoe.pipeline.cut import ChunkSpec, cut_gpt, full_grads, holders, stage_params
from fmoe.schedule.execute import StepResult, execute
from fmoe.schedule.ir import Schedule, ScheduleError
from fmoe.schedule.options import DEFAULTS, ExecOptions
from fmoe.structure import check_gpt, local_experts
from fmoe.transforms.program import Layer, StageProgram


def split_microbatches(ids_BS: torch.Tensor, targets_BS: torch.Tensor,
                       m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Returns a batch [B, S] of ids and targets cut into `m` microbatches of B / m sequences each, in
    order; raises ValueError unless m divides B."""
    if ids_BS.shape != targets_BS.shape or ids_BS.dim() != 2:
        raise ValueError(f"ids and targets must both be [B, S], got {tuple(ids_BS.shape)} and "
                         f"{tuple(targets_BS.shape)}")
    B = ids_BS.shape[0]
    if not isinstance(m, int) or m < 1 or B % m:
        raise ValueError(f"{m} microbatches do not split a batch of {B} sequences evenly")
    return list(zip(ids_BS.chunk(m), targets_BS.chunk(m)))


@dataclass(frozen=True)
class GPTProgram:
    """One pipeline rank's model program, built once per run (`gpt_program`): the layers of each of its
    stages (fmoe/phases.py: they hold no params and no state), the param paths each reads, and every
    stage's hand-over count (the executor's `stage_turns`). Each step pairs it with that step's params
    (`stage_programs`) and state (the microbatches' meta["state"], `gpt_pipeline_step`)."""

    cfg: GPTConfig
    schedule: Schedule
    rank: int
    chunks: tuple[ChunkSpec, ...]
    parallel: ParallelContext
    layers: Mapping[int, tuple[Layer, ...]]
    paths: Mapping[int, tuple[Path, ...]]
    stage_turns: Mapping[int, int]

    def check(self, params: dict[str, Any], state: dict[str, Any] | None) -> None:
        """Raises ValueError unless the params this rank's stages read, and their layer states, match the
        config (keys, shapes, dtypes; routed experts: the dispatcher's num_local_experts;
        fmoe/structure.py; under tensor parallelism the shards are checked where they are read)."""
        if self.parallel.tp is None:
            paths = [p for stage in sorted(self.paths) for p in self.paths[stage]]
            check_gpt(params, self.cfg, state, num_local_experts=local_experts(self.parallel.dispatcher),
                      paths=paths)

    def stage_programs(self, params: dict[str, Any], micro_batch: tuple[int, int],
                       dtype: torch.dtype = torch.float32) -> dict[int, StageProgram]:
        """Returns {stage: StageProgram} for this rank's stages over `params` (the whole tree; each stage
        holds the subtrees it reads, shared, not copied). `micro_batch` = (B, S) sizes the hidden state
        that crosses stages ([B, S, D] of `dtype`, S / cp positions under context parallelism, of which
        1 / tp under sequence parallelism)."""
        B, S = micro_batch
        if self.cfg.mtp and S < 2:
            raise ValueError(f"MTP needs sequences of at least 2 tokens, got S={S}")
        tp, cp = self.parallel.tp, self.parallel.cp
        if cp is not None:
            check_split(S, cp.size)
        # the hidden state's positions on this rank: its cp rank's share, which sequence parallelism splits
        S_here = S // self.parallel.cp_size
        if self.parallel.sequence_parallel:
            if S_here % tp.size:
                whose = "" if cp is None else " (one cp rank's)"
                raise ValueError(f"sequence parallelism over {tp.size} ranks: {S_here} positions{whose} "
                                 "do not split evenly")
            S_here //= tp.size
        out = {}
        for stage, layers in self.layers.items():
            first = self.chunks[self.schedule.placement.layer_chunk[stage]].first
            spec = {} if first else {H: ((B, S_here, self.cfg.d_model), dtype)}
            out[stage] = StageProgram(stage, layers, stage_params(params, self.paths[stage]), spec)
        return out


def gpt_program(cfg: GPTConfig, s: Schedule, rank: int, *, chunks: tuple[ChunkSpec, ...] | None = None,
                parallel: ParallelContext | None = None, a2a_chunks: int = 1,
                overlap: Overlap | None = None) -> GPTProgram:
    """Returns the GPTProgram of `rank` for schedule `s`: the GPT cut by `chunks` (default `cut_gpt`), every
    layer laid over ranks by `parallel` (fmoe.parallel.ParallelContext; None: one process; its dispatcher
    moves the MoE rows, default local). `a2a_chunks` 2: each MoE layer's all-to-all in two row chunks that
    hide each other behind their experts (`moe_layer`); `overlap`: each MoE layer's overlap modes
    (fmoe.overlap; instead of `a2a_chunks`), the same on every rank. Tensor parallelism's collectives run
    inside the compute phases (the forward's in the phase, the backward's in its dx pass), not as comm
    phases: each feeds the very next GEMM, so there is nothing to run while it travels but the other
    microbatch of an fb-overlap pair, which the executor already hands over to at the MoE exchanges;
    every tp rank runs the same program, so they issue the collectives in one order."""
    chunks = chunks or cut_gpt(cfg, s.placement)
    parallel = parallel or LOCAL
    layers, paths = {}, {}
    for stage in s.placement.stages_of(rank):
        sites = chunks[s.placement.layer_chunk[stage]].sites(cfg)
        layers[stage] = tuple(gpt_layers(cfg, sites, parallel, a2a_chunks=a2a_chunks, overlap=overlap))
        paths[stage] = reads_of(sites)
    turns = gpt_stage_turns(cfg, s, chunks, parallel.dispatcher,
                            overlap if overlap is not None else LayerOverlap.of_chunks(a2a_chunks))
    return GPTProgram(cfg, s, rank, chunks, parallel, layers, paths, turns)


@dataclass
class PipelineStep:
    """loss: the step's loss (0-dim, the same on every rank); grads: this rank's gradients in the layout
    of init_gpt params (None / absent where the rank holds nothing), shared weights summed across holders;
    loads: per MoE layer (its param path), the step's LayerLoad (for `update_gpt_state`); result: the
    executor's StepResult (timeline, peaks, per-loss values)."""

    loss: torch.Tensor
    grads: dict[str, Any]
    loads: dict[tuple[str, ...], LayerLoad]
    result: StepResult


def gpt_pipeline_step(program: GPTProgram, params: dict[str, Any], state: dict[str, Any],
                      batches: list[tuple[torch.Tensor, torch.Tensor]], *,
                      group: dist.ProcessGroup | None = None, shared: SharedGrads | None = None,
                      options: ExecOptions = DEFAULTS, on_stage_done: Any = None,
                      check: bool = True, packings: list[Packing | None] | None = None) -> PipelineStep:
    """Runs one step of `program` (`gpt_program`: its schedule, on its rank) over microbatches `batches`
    with this step's `params` and `state` (read by the MoE layers' routing); returns a PipelineStep.
    `group`: the pipeline process group. `shared`: the SharedGrads of this layout (built on every rank;
    default built here, which creates process groups: pass one in to reuse it across steps). `options`:
    the executor's (fmoe.schedule.options.ExecOptions: fb overlap, engine, timeout, gradient dtype, loss
    scale, fuse_iw, compute model; the gradients come back multiplied by `loss_scale`, the loss does not).
    `on_stage_done(stage, grads)` is the executor's hook (fmoe.schedule.execute): grads are stage-keyed
    ("layers" a dict by index string), before the shared-weight sum. `check`: check the params and
    states this rank reads against the config first (`GPTProgram.check`); False skips it, for trees that
    already passed. `packings`: each microbatch's documents (None: one document per sequence)."""
    s, cfg = program.schedule, program.cfg
    if len(batches) != s.m:
        raise ScheduleError(f"{len(batches)} microbatches for schedule {s.name} with m={s.m}")
    shapes = {tuple(ids.shape) for ids, _ in batches} | {tuple(t.shape) for _, t in batches}
    if len(shapes) != 1:
        raise ValueError(f"every microbatch's ids and targets must have one shape [B, S], got "
                         f"{sorted(shapes)}")
    (B, S), = shapes
    if check:
        program.check(params, state)
    programs = program.stage_programs(params, (B, S), params["embed"]["table"].dtype)
    data = microbatch_meta(batches, state, packings)
    result = execute(s, program.rank, programs, lambda mb: data[mb], group=group, options=options,
                     on_stage_done=on_stage_done, stage_turns=program.stage_turns)
    if s.pp > 1:
        if shared is None:
            shared = SharedGrads(holders(cfg, s.placement, program.chunks), group)
        shared.reduce(result.grads)
    loss = _step_loss(result, params)
    if s.pp > 1:
        dist.all_reduce(loss, group=group)
    loads = layer_loads(stats for *_, stats in result.stats)
    return PipelineStep(loss, full_grads(result.grads, cfg), loads, result)


def microbatch_meta(batches: list[tuple[torch.Tensor, torch.Tensor]], state: dict[str, Any] | None,
                    packings: list[Packing | None] | None = None) -> list[dict[str, Any]]:
    """Returns each microbatch's meta as the executor hands it to every stage: its token ids, targets and
    documents (`packings[mb]`, None without), and the step's MoE state. ValueError when `packings` is not
    one per microbatch."""
    packings = [None] * len(batches) if packings is None else list(packings)
    if len(packings) != len(batches):
        raise ValueError(f"{len(packings)} packings for {len(batches)} microbatches: give one per microbatch")
    return [{"ids_BS": ids, "targets_BS": t, "state": state, "packing": p}
            for (ids, t), p in zip(batches, packings)]


def gpt_stage_turns(cfg: GPTConfig, s: Schedule, chunks: tuple[ChunkSpec, ...],
                    dispatcher: Any = None, overlap: Overlap | None = None) -> dict[int, int]:
    """Returns, for every stage of `s` (every rank's), the exchanges at which its ops hand over to an
    fb-overlap pair (the executor's `stage_turns`): per MoE layer of its chunk (the MTP block included)
    `moe_layer_turns` under its `overlap` modes (fmoe.overlap). Every rank computes the same, so a pair's
    two messages go on the wire in the order they exist on both ends of the link. `dispatcher` None:
    local (no turns)."""
    dispatcher = dispatcher or LocalDispatcher(cfg.moe.num_experts)
    out = {}
    for stage in range(s.placement.num_stages):
        chunk = chunks[s.placement.layer_chunk[stage]]
        out[stage] = sum(moe_layer_turns(cfg, dispatcher, layer_overlap(overlap, site.name))
                         for site in chunk.sites(cfg) if site.is_moe)
    return out


def _step_loss(result: StepResult, params: dict[str, Any]) -> torch.Tensor:
    """This rank's part of the step loss, a new tensor to all-reduce over the pipeline group. A rank whose
    stages add no loss contributes a zero made here, on the executor's device (that of the rank's own
    stage params) and in the loss dtype of the ranks that have one (every rank must reduce the same
    dtype). The embedding's table gives the dtype only: on a rank that holds neither the embedding nor
    the head it is a meta tensor, which gloo reduces as 0 bytes and NCCL / HCCL refuse."""
    if result.losses:
        return result.loss.clone()
    table = params["embed"]["table"]  # every rank's params hold the whole tree's top-level leaves
    return torch.zeros((), dtype=torch.promote_types(table.dtype, torch.float32), device=result.loss.device)
