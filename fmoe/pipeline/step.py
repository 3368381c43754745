"""One pipeline training step of the GPT: stage programs for a schedule, the executor, shared-weight
gradients summed, MoE loads reported for the once-per-step state update.

    programs = gpt_programs(cfg, s, rank, params, state, micro_batch=(B, S))
    out = gpt_pipeline_step(cfg, s, rank, params, state, batches, group=pp_group)
    out.loss, out.grads (init_gpt layout), out.loads, out.result (timeline, peaks)

`batches[mb]` = (ids_BS, targets_BS) of microbatch mb; every rank gets the same list (the first and the
last stage read it). The loss is the mean over microbatches of cross-entropy + balancing losses + the
weighted MTP loss; it lives on the rank(s) holding the last chunk and is summed across the pipeline
group so every rank returns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fmoe.config import GPTConfig
from fmoe.dispatch.local import LocalDispatcher
from fmoe.gpt_state import LayerLoad, layer_loads
from fmoe.overlap import Overlap, layer_overlap
from fmoe.parallel.collectives import CommGroup
from fmoe.parallel.shared_grads import SharedGrads
from fmoe.phases import gpt_layers, moe_layer_turns
from fmoe.pipeline.cut import ChunkSpec, cut_gpt, full_grads, holders, stage_params
from fmoe.schedule.execute import StepResult, execute
from fmoe.schedule.ir import Schedule, ScheduleError
from fmoe.structure import check_gpt, local_experts
from fmoe.transforms.program import StageProgram


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


def gpt_programs(cfg: GPTConfig, s: Schedule, rank: int, params: dict[str, Any], state: dict[str, Any],
                 *, micro_batch: tuple[int, int], chunks: tuple[ChunkSpec, ...] | None = None,
                 dispatcher: Any = None, dtype: torch.dtype = torch.float32,
                 check: bool = True, a2a_chunks: int = 1, tp: CommGroup | None = None,
                 sequence_parallel: bool = False, overlap: Overlap | None = None) -> dict[int, StageProgram]:
    """Returns {stage: StageProgram} for the stages `s` places on `rank`: the GPT cut by `chunks`
    (default `cut_gpt`), MoE layers exchanging through `dispatcher` (default: local), reading `state`.
    `micro_batch` = (B, S) sizes the hidden state that crosses stages ([B, S, D] of `dtype`).
    `check`: check the params this rank's chunks read, and their layer states, against `cfg` first
    (keys, shapes, dtypes; routed experts: the dispatcher's num_local_experts; fmoe/structure.py); the
    phases then run unchecked. False skips it, for trees that already passed. `a2a_chunks` 2: each MoE
    layer's all-to-all in two row chunks that hide each other behind their experts (`moe_layer`).
    `tp`, `sequence_parallel`: tensor parallelism (fmoe.phases.gpt_layers; `params` this rank's shards,
    the dispatcher over the ep x tp expert group). Its collectives run inside the compute phases (the
    forward's in the phase, the backward's in its dx pass), not as comm phases: each feeds the very
    next GEMM, so there is nothing to run while it travels but the other microbatch of an fb-overlap
    pair, which the executor already hands over to at the MoE exchanges; every tp rank runs the same
    program, so they issue the collectives in one order. `overlap`: each MoE layer's overlap modes
    (fmoe.overlap; instead of `a2a_chunks`), the same on every rank."""
    chunks = chunks or cut_gpt(cfg, s.placement)
    dispatcher = dispatcher or LocalDispatcher(cfg.moe.num_experts)
    B, S = micro_batch
    if cfg.mtp and S < 2:
        raise ValueError(f"MTP needs sequences of at least 2 tokens, got S={S}")
    if check and tp is None:
        paths = [p for stage in s.placement.stages_of(rank)
                 for p in chunks[s.placement.layer_chunk[stage]].param_paths(cfg)]
        check_gpt(params, cfg, state, num_local_experts=local_experts(dispatcher), paths=paths)
    if sequence_parallel and S % tp.size:
        raise ValueError(f"sequence parallelism over {tp.size} ranks: {S} positions do not split evenly")
    out = {}
    for stage in s.placement.stages_of(rank):
        chunk = chunks[s.placement.layer_chunk[stage]]
        layers = gpt_layers(cfg, params, state, dispatcher, layers=chunk.layers, first=chunk.first,
                            last=chunk.last, main_head=chunk.head, a2a_chunks=a2a_chunks, tp=tp,
                            sequence_parallel=sequence_parallel, overlap=overlap)
        S_here = S // tp.size if sequence_parallel else S  # the hidden state's positions on this rank
        spec = {} if chunk.first else {"h_BSD": ((B, S_here, cfg.d_model), dtype)}
        out[stage] = StageProgram(stage, tuple(layers), stage_params(params, chunk.param_paths(cfg)), spec)
    return out


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


def gpt_pipeline_step(cfg: GPTConfig, s: Schedule, rank: int, params: dict[str, Any], state: dict[str, Any],
                      batches: list[tuple[torch.Tensor, torch.Tensor]], *,
                      group: dist.ProcessGroup | None = None,
                      chunks: tuple[ChunkSpec, ...] | None = None, dispatcher: Any = None,
                      shared: SharedGrads | None = None, overlap: bool = True, engine: str = "autograd",
                      check: bool = True, timeout: timedelta = timedelta(seconds=120),
                      on_stage_done: Any = None, grad_dtype: torch.dtype | None = None,
                      loss_scale: float = 1.0, fuse_iw: bool = True,
                      compute_model: Any = None, a2a_chunks: int = 1, tp: CommGroup | None = None,
                      sequence_parallel: bool = False, overlap_modes: Overlap | None = None) -> PipelineStep:
    """Runs one step of schedule `s` on `rank` over microbatches `batches`; returns a PipelineStep.
    `shared`: the SharedGrads of this layout (built on every rank; default built here, which creates
    process groups: pass one in to reuse it across steps). `overlap`: fb overlap of the schedule's F&B
    pairs and of lone backward steps (fmoe.schedule.execute); off runs pairs one op after the other.
    `engine`: how the compute phases are differentiated (split_vjp's "autograd" or "func").
    `check`: as in `gpt_programs` (the params and states this rank reads, against `cfg`); False skips
    it, for trees that already passed. `timeout` bounds every P2P wait of the executor;
    `on_stage_done(stage, grads)` is the executor's hook (fmoe.schedule.execute): grads are stage-keyed
    ("layers" a dict by index string), before the shared-weight sum. `grad_dtype`: the dtype weight
    gradients are summed in over microbatches (mixed precision: fp32 for bf16 params). `loss_scale`: the
    gradients come back multiplied by it (fp16 loss scaling; the loss does not). `fuse_iw`: as in
    `fmoe.schedule.execute` (an I whose W comes next runs as one B). `compute_model`: the executor's
    (each compute phase held to a modelled duration; None: off). `a2a_chunks`, `tp`,
    `sequence_parallel`: as in `gpt_programs`; `overlap_modes`: its `overlap` (each MoE layer's modes,
    fmoe.overlap)."""
    if len(batches) != s.m:
        raise ScheduleError(f"{len(batches)} microbatches for schedule {s.name} with m={s.m}")
    shapes = {tuple(ids.shape) for ids, _ in batches} | {tuple(t.shape) for _, t in batches}
    if len(shapes) != 1:
        raise ValueError(f"every microbatch's ids and targets must have one shape [B, S], got "
                         f"{sorted(shapes)}")
    chunks = chunks or cut_gpt(cfg, s.placement)
    (B, S), = shapes
    programs = gpt_programs(cfg, s, rank, params, state, micro_batch=(B, S), chunks=chunks,
                            dispatcher=dispatcher, dtype=params["embed"]["table"].dtype, check=check,
                            a2a_chunks=a2a_chunks, tp=tp, sequence_parallel=sequence_parallel,
                            overlap=overlap_modes)
    data = [{"ids_BS": ids, "targets_BS": t} for ids, t in batches]
    result = execute(s, rank, programs, lambda mb: data[mb], group=group, overlap=overlap,
                     engine=engine, timeout=timeout, on_stage_done=on_stage_done, grad_dtype=grad_dtype,
                     loss_scale=loss_scale, fuse_iw=fuse_iw, compute_model=compute_model,
                     stage_turns=gpt_stage_turns(cfg, s, chunks, dispatcher, overlap_modes))
    if s.pp > 1:
        if shared is None:
            shared = SharedGrads(holders(cfg, s.placement, chunks), group)
        shared.reduce(result.grads)
    loss = _step_loss(result, params)
    if s.pp > 1:
        dist.all_reduce(loss, group=group)
    loads = layer_loads(stats for *_, stats in result.stats)
    return PipelineStep(loss, full_grads(result.grads, cfg), loads, result)


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
    stages add no loss contributes a zero made here, on the params' device and in the loss dtype of the
    ranks that have one (the executor's empty sum is not to be trusted for either: NCCL / HCCL reduce
    device tensors only, and every rank must reduce the same dtype)."""
    if result.losses:
        return result.loss.clone()
    table = params["embed"]["table"]  # every rank's params hold the whole tree's top-level leaves
    return torch.zeros((), dtype=torch.promote_types(table.dtype, torch.float32), device=table.device)
