"""One rank of `fmoe train`: build this rank's part of the model, then train step by step.

    trainer = Trainer(tc, world)       # world: this rank's process groups (fmoe.train.launch.World)
    for _ in range(n): metrics = trainer.step()

A step: the microbatches of this rank's data position (fmoe/train/data.py); the schedule's step through
the executor (`gpt_pipeline_step`), or for pp 1 x ep 1 ("accumulate") each microbatch through `gpt_loss`
and autograd, one after the other; MoE loads summed over the data group and one state update; gradients
reduced (fmoe/train/shards.py), clipped by the global norm, AdamW.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fmoe import init_gpt_state
from fmoe._compat import tree_map
from fmoe.capacity import capacity_agreement
from fmoe.gpt_init import init_gpt_shard
from fmoe.gpt_state import LayerLoad, add_load, update_gpt_state
from fmoe.init import init_seed
from fmoe.model import gpt_loss
from fmoe.outline import outline, state_at
from fmoe.overlap import LayerOverlap
from fmoe.packing import Packing, pack_documents
from fmoe.parallel import (
    AllGatherDispatcher,
    AllToAllDispatcher,
    CommCounters,
    CommGroup,
    HierarchicalDispatcher,
    ParallelLayout,
)
from fmoe.parallel.capacity_agreement import CapacityAgreement
from fmoe.parallel.context import ParallelContext
from fmoe.parallel.link_model import parse_link_model
from fmoe.parallel.shared_grads import SharedGrads
from fmoe.parallel.tensor import sum_tp_partials
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.pipeline.cut import ChunkSpec, cut_gpt, holders
from fmoe.precision import accumulate, cast_to_compute, unscale_
from fmoe.schedule.compute_model import ComputeModel, table_from_events
from fmoe.schedule.ir import B, W, ops_of
from fmoe.schedule.options import ExecOptions
from fmoe.schedule.verify import verify
from fmoe.tp_layout import tp_partial
from fmoe.train import checkpoint
from fmoe.train.config import ACCUMULATE, TrainConfig
from fmoe.train.data import Dataset, microbatches
from fmoe.train.data_source import data_identity, document_flags, documents_eod
from fmoe.train.documents import Blend
from fmoe.train.optim import LeafOptimizer, clip_factor, lr_at
from fmoe.train.overflow import check_fp16_step
from fmoe.train.prefetch import Prefetcher
from fmoe.train.shards import GradientReducer, Leaf, get, global_grad_norm, rank_leaves
from fmoe.train.splits import train_dataset, valid_dataset
from fmoe.transforms.compiled import CompiledPhases

# a MoE state leaf (fmoe/gpt_state.py) -> the flag that makes a run keep it
MOE_STATE_FLAGS = {"expert_bias_E": "--moe-router-bias-update-rate",
                   **dict.fromkeys(("load_history_W", "capacity_misses", "capacity_steps"),
                                   "--moe-dynamic-capacity-window")}


@dataclass
class World:
    """This rank's place: global `rank` of `size`, its `layout` (process groups; None when alone) and
    the `device` its tensors live on."""

    rank: int
    size: int
    layout: ParallelLayout | None
    device: torch.device


def build_dataset(tc: TrainConfig) -> Dataset | Blend:
    """Returns the run's training data: the embedded Markov corpus, the training split of a token / text
    file, or of --data-path's documents (fmoe/train/splits.py)."""
    return train_dataset(tc)


class Trainer:
    """The training state of one rank (weights, AdamW, MoE state, data position) and its step.

    `timeline`: record every pipeline step's timeline (`last_result.events`, as the calibration jobs
    read it); otherwise only the steps that need one (--trace's step, the first step under
    --compute-model): the executor's trace records are host work on every phase."""

    def __init__(self, tc: TrainConfig, world: World, *, timeline: bool = False):
        self.tc, self.world = tc, world
        self.timeline = timeline
        self.cfg = cfg = tc.model()
        layout = world.layout
        self.pp_rank = layout.local_rank("pp") if layout else 0
        self.ep_rank = layout.local_rank("ep") if layout else 0
        self.dp_rank = layout.local_rank("dp") if layout else 0
        self.tp_rank = layout.local_rank("tp") if layout else 0
        self.expert_rank = layout.local_rank("expert") if layout else 0  # in ep x tp (TP extends EP)
        self.data_rank = layout.local_rank("data") if layout else 0
        self.cp_rank = layout.local_rank("cp") if layout else 0
        self.expert_replica = layout.local_rank("dp_cp") if layout else 0  # of the ranks holding its experts
        self.pp_group = layout.group("pp") if layout and tc.pp > 1 else None
        self.data_group = layout.group("data") if layout and tc.data_ranks > 1 else None
        # the ranks an expert's AdamW state may be sharded over: its replicas of this cp rank (all of them
        # when the expert group is carved from dp x cp)
        self.dp_group = layout.group("dp") if layout and layout.size("dp") > 1 else None
        # gradients are summed over the context-parallel ranks too (each holds its positions' part)
        self.data_cp_group = layout.group("data_cp") if layout and tc.data_ranks * tc.cp > 1 else None
        self.dp_cp_group = layout.group("dp_cp") if layout and tc.expert_replicas > 1 else None
        self.world_group = dist.group.WORLD if world.size > 1 else None
        self.timeout = timedelta(seconds=tc.timeout)

        self.policy = tc.policy_for(world.device.type)  # bf16-mixed by default on CUDA / NPU
        warning = tc.precision_warning(world.device.type)
        if warning is not None and world.rank == 0:  # once per run, not once per rank
            warnings.warn(warning, stacklevel=2)
        self.loss_scale = tc.loss_scaler()  # fp16: the loss-scaling state, carried from step to step
        self.accumulate = tc.schedule_name == ACCUMULATE
        if self.accumulate:
            self.schedule, self.chunks, self.holders = None, None, None
            paths = ChunkSpec(0, tuple(range(cfg.n_layers)), first=True, last=True).param_paths(cfg)
        else:
            self.schedule = tc.pipeline_schedule()  # the named one built, or --schedule-file's
            self.chunks = cut_gpt(cfg, self.schedule.placement, seq=tc.seq_length)
            self.holders = holders(cfg, self.schedule.placement, self.chunks)
            paths = [p for st in self.schedule.placement.stages_of(self.pp_rank)
                     for p in self.chunks[self.schedule.placement.layer_chunk[st]].param_paths(cfg)]
        # Only this rank's share is drawn (its stages, its tp part, its experts), from keyed seeds: the
        # same weights as the one-process run of the seed (fmoe/gpt_init.py); leaves of other stages
        # stay meta tensors.
        self.params = init_gpt_shard(cfg, init_seed(torch.Generator().manual_seed(tc.seed)),
                                     self.policy.param_dtype, tp=(self.tp_rank, tc.tp),
                                     experts=(self.expert_rank, tc.ep * tc.tp), holds=paths,
                                     device=world.device)
        self.state = tree_map(lambda t: t.to(world.device), init_gpt_state(cfg))  # tensors only
        L = cfg.moe.num_experts // (tc.ep * tc.tp)
        self.leaves: list[Leaf] = rank_leaves(self.params, cfg, paths, self.holders, pp_rank=self.pp_rank,
                                              ep_rank=self.expert_rank, num_local_experts=L,
                                              counts_dense=self.data_rank == 0 and self.cp_rank == 0,
                                              counts_expert=self.expert_replica == 0,
                                              tp_rank=self.tp_rank)
        self.tensors = {lf.key: get(self.params, lf.where) for lf in self.leaves}
        # the MoE sites this rank holds (fmoe.outline), in their checkpoint keys' order
        held = set(paths)
        self.moe_sites = sorted((s for s in outline(cfg).moe if set(s.reads) <= held), key=lambda s: s.key)
        self._plan_reduction()
        self.opt = LeafOptimizer(tc, self.leaves, self.tensors, data_group=self.data_group,
                                 dp_group=self.dp_group)
        # how the model is laid over ranks, and the stage programs, built once per run: each step pairs
        # them with its params and state
        self.parallel = ParallelContext(
            # replicated weights' partial gradients summed once per step (`_sum_tp_partials`), not in
            # every microbatch's backward
            tp=CommGroup(layout.group("tp"), timeout=self.timeout, weight_grads_per_step=True)
            if tc.tp > 1 else None,
            sequence_parallel=tc.sequence_parallel,
            dispatcher=self._dispatcher() if tc.ep * tc.tp > 1 else None,
            cp=CommGroup(layout.group("cp"), timeout=self.timeout) if tc.cp > 1 else None,
            cp_comm_type=tc.cp_comm_type)
        self.tp_partials = [lf.key for lf in self.leaves
                            if tc.tp > 1 and tp_partial(lf.where, tc.sequence_parallel)]
        self.program = None if self.accumulate else gpt_program(
            cfg, self.schedule, self.pp_rank, chunks=self.chunks, parallel=self.parallel,
            overlap=LayerOverlap.of_chunks(tc.a2a_chunks, tc.pair_overlap))
        # --compile: every phase traced once per run into forward, dx and dw graphs (transforms/compiled.py)
        self.compiled = CompiledPhases(tc.compile_backend) if tc.compile else None
        self.compiles_by_step: list[int] = []  # traces made by the end of each step (--compile)
        self.options = ExecOptions(overlap=tc.overlap, timeout=self.timeout, fuse_iw=tc.fuse_iw,
                                   grad_dtype=self.policy.grad_dtype if self.policy.mixed else None,
                                   compiled=self.compiled)
        # dynamic capacity: the expert group pads to one agreed capacity (seed 002; fmoe/capacity.py)
        self.capacity_agreement = None
        if cfg.moe.dynamic_capacity_window and tc.ep > 1:
            expert = CommGroup(layout.group("expert"), counters=CommCounters(), timeout=self.timeout)
            self.capacity_agreement = CapacityAgreement(expert)
        self.shared = (SharedGrads(self.holders, self.pp_group) if self.pp_group is not None else None)
        self.dataset = build_dataset(tc)
        self.eod, self.document_flags = documents_eod(tc), document_flags(tc)
        self.valid = valid_dataset(tc)  # held-out windows for --eval-interval (None without it)
        self.step_done = 0
        self.consumed_samples = 0  # the data position: the next step reads the stream from here
        self.batches = Prefetcher(self._read, world.device)  # the next step's batch, read in the background
        self.hf_config: dict[str, Any] | None = None  # a loaded checkpoint's config.json (fmoe convert)
        self._checked = False
        self._skipped_in_a_row = 0  # fp16: skipped steps ending with the last one
        self.last_result: Any = None
        self.compute_model: ComputeModel | None = None  # --compute-model: built after the first step

    def _plan_reduction(self) -> None:
        """The data-parallel reducer, its bucket order, and (pipeline) which leaves each finished stage
        makes final: a leaf read by this rank's stages only, once they all ran their last dw; leaves
        shared with other pipeline ranks wait for the shared-weight sum after the step."""
        self._stage_leaves: dict[int, list[Leaf]] = {}
        if self.accumulate:
            order = None  # reversed leaves: the order the last microbatch's backward produces them
        else:
            placement = self.schedule.placement
            stages = placement.stages_of(self.pp_rank)
            held_by: dict[tuple[str, ...], set[int]] = {}
            for st in stages:
                for p in self.chunks[placement.layer_chunk[st]].param_paths(self.cfg):
                    held_by.setdefault(p, set()).add(st)
            last = {st: k for k, a in enumerate(verify(self.schedule).ranks[self.pp_rank])
                    for op in ops_of(a) if op.kind in (B, W) for st in [op.stage]}
            finished: set[int] = set()
            order = []
            for st in sorted(stages, key=lambda x: last.get(x, -1)):
                finished.add(st)
                now = [lf for lf in reversed(self.leaves) if lf.key not in order
                       and len(self.holders[_top(lf.where)]) == 1 and held_by[_top(lf.where)] <= finished]
                self._stage_leaves[st] = now
                order += [lf.key for lf in now]
            order += [lf.key for lf in reversed(self.leaves) if lf.key not in order]
        self.reducer = GradientReducer(self.leaves, data_group=self.data_cp_group, dp_group=self.dp_cp_group,
                                       data_ranks=self.tc.data_ranks, order=order)

    def _stage_done(self, stage: int, grads: dict[str, Any]) -> None:
        leaves = self._stage_leaves.get(stage, [])
        if leaves and self.reducer.buckets:
            self.reducer.ready({lf.key: get(grads, tuple(str(k) for k in lf.where)) for lf in leaves})

    def _dispatcher(self) -> Any:
        tc, layout = self.tc, self.world.layout
        link = parse_link_model(tc.link_model) if tc.link_model else None
        def comm(name: str) -> CommGroup:
            return CommGroup(layout.group(name), topology=layout.topology, link_model=link,
                             timeout=self.timeout)
        E = self.cfg.moe.num_experts
        if tc.dispatcher == "alltoall":
            return AllToAllDispatcher(comm("expert"), E)
        if tc.dispatcher == "allgather":
            return AllGatherDispatcher(comm("expert"), E)
        return HierarchicalDispatcher(comm("expert_inter"), comm("expert_intra"), E)

    # ---- one step ---------------------------------------------------------------------------------------

    def step(self) -> dict[str, Any]:
        """Runs one training step; returns its metrics (the same on every rank): step (1-based), loss,
        main_loss, balance_loss, mtp_loss, lr, grad_norm, tokens_per_s, step_s, exposed_comm_frac,
        max_over_mean_load, dropped."""
        tc = self.tc
        t0 = time.perf_counter()
        lr = lr_at(tc, self.step_done)
        self.opt.set_lr(lr)
        start, G = self.consumed_samples, tc.global_batch_size
        batches = self.batches.get(start, start + G if self.step_done + 1 < tc.steps else None)
        with capacity_agreement(self.capacity_agreement):
            if self.accumulate:
                grads, losses, loads, dropped, waited = self._accumulate(batches)
            else:
                grads, losses, loads, dropped, waited = self._pipeline(batches)
        missing = [lf.key for lf in self.leaves if lf.key not in grads]
        if missing:
            raise RuntimeError(f"rank {self.world.rank}: the step produced no gradient for {missing[:3]}")
        loads = self._reduce_loads(loads)
        # The routing statistics are the forward's, valid whether or not the backward overflowed.
        self.state = update_gpt_state(self.cfg, self.state, loads, check=not self._checked)
        self.reducer.finish(grads)
        if self.tp_partials:  # the replicated weights' partial gradients, summed over tp once per step
            sum_tp_partials([grads[k] for k in self.tp_partials], self.parallel.tp)
        used_scale = self._unscale(grads)
        norm = global_grad_norm(self.leaves, grads, self.world_group)
        # fp16: the norm is summed over every rank, so it is non-finite on all of them as soon as one
        # rank's gradients hold an inf or nan: the step is then skipped everywhere, with no extra collective.
        finite = self.loss_scale is None or math.isfinite(float(norm))
        used = self.loss_scale
        if used is not None:
            self.loss_scale = used.adjust(finite)
        if finite:
            scale = clip_factor(norm, tc.clip_grad)
            for lf in self.leaves:
                g = grads[lf.key]
                self.tensors[lf.key].grad = g.mul_(scale) if scale != 1.0 else g
            self.opt.step()
            for t in self.tensors.values():
                t.grad = None
        self._checked = True
        self.step_done += 1
        self.consumed_samples += G
        step_s = time.perf_counter() - t0
        metrics = self._metrics(losses, loads, dropped, waited, float(norm), lr, step_s)
        if tc.moe_per_layer_logging:
            metrics.update(self._per_layer(loads))
        if used is not None:
            metrics.update(loss_scale=used_scale, skipped=not finite)
            self._skipped_in_a_row = 0 if finite else self._skipped_in_a_row + 1
            # stops a run that would skip every later step (fmoe/train/overflow.py)
            check_fp16_step(self.step_done, metrics["loss"], used, finite, self._skipped_in_a_row)
        return metrics

    def packing(self, ids_BS: torch.Tensor) -> Packing | None:
        """The documents of a microbatch's ids under the run's document flags (fmoe/packing.py), made on
        the ids' device without a host sync; None without those flags."""
        if self.eod is None:
            return None
        return pack_documents(ids_BS, self.eod, **self.document_flags)

    def _read(self, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches of the global batch at stream position `start` (on the host)."""
        tc = self.tc
        return microbatches(self.dataset, 0, global_batch=tc.global_batch_size,
                            micro_batch=tc.micro_batch_size, data_rank=self.data_rank,
                            data_ranks=tc.data_ranks, seed=tc.seed, start=start)

    def _unscale(self, grads: dict[str, torch.Tensor]) -> float:
        """fp16: divides the summed gradients by the loss scale in place; returns the scale this step used
        (other precisions: 1.0, nothing done)."""
        if self.loss_scale is None:
            return 1.0
        unscale_([grads[lf.key] for lf in self.leaves], self.loss_scale)
        return self.loss_scale.scale

    def _accumulate(self, batches: list) -> tuple:
        cfg, m, policy = self.cfg, len(batches), self.policy
        params = cast_to_compute(self.params, policy) if policy.mixed else self.params
        leaves = {lf.key: get(params, lf.where) for lf in self.leaves}
        grads: dict[str, torch.Tensor] = {}
        last = [False]

        def hook(key: str):
            def after_accumulation(t: torch.Tensor) -> None:
                if policy.mixed:  # each microbatch's bf16 gradient is summed in fp32, never in bf16
                    grads[key] = accumulate(grads.get(key), t.grad, policy)
                    t.grad = None
                else:
                    grads[key] = t.grad
                if last[0]:  # the data-parallel all-reduce overlaps the last microbatch's backward
                    self.reducer.ready({key: grads[key]})
            return after_accumulation

        for t in leaves.values():
            t.requires_grad_(True)
        # Mixed precision needs the hooks on every microbatch (the fp32 sums); otherwise only the last
        # microbatch's backward has work for them (issuing the all-reduce buckets).
        hooks = ([leaves[k].register_post_accumulate_grad_hook(hook(k)) for k in leaves]
                 if policy.mixed else [])
        # the metrics' sums stay where they are made and are read once per step (_metrics): a read per
        # microbatch or per layer would make the host wait for the device each time
        sums: torch.Tensor | int = 0
        loads: dict[tuple[str, ...], LayerLoad] = {}
        dropped: torch.Tensor | int = 0
        try:
            for j, (ids, targets) in enumerate(batches):
                last[0] = j == m - 1
                if last[0] and not policy.mixed and self.reducer.buckets:
                    hooks = [leaves[k].register_post_accumulate_grad_hook(hook(k)) for k in leaves]
                loss, aux = gpt_loss(params, ids, targets, cfg, self.state, parallel=self.parallel,
                                     check=not self._checked, packing=self.packing(ids))
                (loss / m if self.loss_scale is None else loss * (self.loss_scale.scale / m)).backward()
                # in the loss's own dtype (at least fp32): a float64 run logs float64 losses
                sums = sums + torch.stack([loss.detach(), aux.main_loss, aux.mtp_loss]).to(
                    torch.promote_types(loss.dtype, torch.float32))
                for site, a in zip(outline(cfg).moe, aux.layers):  # aux.layers: the MoE sites in order
                    tokens_E = a.tokens_per_expert_E
                    add_load(loads, site.params, LayerLoad(tokens_E, tokens_E.max(), bool(a.capacity_missed)))
                    dropped = dropped + a.dropped
        finally:
            for h in hooks:
                h.remove()
            if not policy.mixed:
                grads = {k: t.grad for k, t in leaves.items() if t.grad is not None}
            for t in leaves.values():
                t.requires_grad_(False)
                t.grad = None
        return grads, (sums / m).double().cpu(), loads, dropped, 0.0

    def _pipeline(self, batches: list) -> tuple:
        policy = self.policy
        params = cast_to_compute(self.params, policy) if policy.mixed else self.params
        # what changes from step to step: the fp16 loss scale, the compute model after the first step, and
        # whether this step's timeline is read (the wait time is counted either way)
        tc = self.tc
        traced = bool(self.timeline or (tc.trace and self.step_done + 1 == tc.trace_step)
                      or (tc.compute_model and self.compute_model is None))
        options = replace(self.options, loss_scale=self.loss_scale.scale if self.loss_scale else 1.0,
                          compute_model=self.compute_model, trace=traced)
        out = gpt_pipeline_step(self.program, params, self.state, batches, group=self.pp_group,
                                shared=self.shared, options=options, on_stage_done=self._stage_done,
                                check=not self._checked, packings=[self.packing(ids) for ids, _ in batches])
        self.last_result = out.result
        if self.compiled is not None:
            self.compiles_by_step.append(self.compiled.compiles)
        if self.tc.compute_model and self.compute_model is None:
            self.compute_model = self._build_compute_model(out.result.events)
        found = {lf.key: _lookup(out.grads, lf.where) for lf in self.leaves}
        flat = {k: g for k, g in found.items() if g is not None}
        r = out.result
        mtp = r.losses.get("mtp", r.loss.new_zeros(()))
        w = self.cfg.mtp_loss_weight
        losses = torch.stack([r.loss, r.losses.get("ce", r.loss.new_zeros(())),
                              mtp / w if w else mtp]).double().cpu()
        dropped = sum(stats["route"].dropped for *_, stats in r.stats)  # read once, in _metrics
        waited = r.waited
        return flat, losses, out.loads, dropped, waited

    def _build_compute_model(self, events: list) -> ComputeModel:
        """--compute-model: the same table on every rank, tc.compute_model x the median of each (kind,
        phase) over every rank's compute events of this (the first) step (a collective)."""
        mine = [e for e in events if e.lane == "compute"]
        every: list[Any] = [None] * self.world.size
        if self.world_group is not None:
            dist.all_gather_object(every, mine, group=self.world_group)
        else:
            every = [mine]
        table = table_from_events([e for evs in every for e in evs], scale=self.tc.compute_model)
        model = ComputeModel(table)
        model.deferred_dw = self.tc.overlap  # overlap off: a B computes its dw in its dx pass
        return model

    def _reduce_loads(self, loads: dict) -> dict:
        if self.data_group is None or not loads:
            return loads
        out = {}
        for path in sorted(loads):
            load = loads[path]
            tokens = load.tokens_per_expert_E.clone()
            peak = torch.stack([load.max_load.to(torch.float64),
                                torch.tensor(float(load.missed), dtype=torch.float64, device=tokens.device)])
            dist.all_reduce(tokens, group=self.data_group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.data_group)
            out[path] = LayerLoad(tokens, peak[0].to(load.max_load.dtype), bool(peak[1]))
        return out

    def _metrics(self, losses: torch.Tensor, loads: dict, dropped: torch.Tensor | int, waited: float,
                 norm: float, lr: float, step_s: float) -> dict[str, Any]:
        tc = self.tc
        ratios = [float(ld.tokens_per_expert_E.max()) / max(float(ld.tokens_per_expert_E.double().mean()),
                                                              1e-9) for ld in loads.values()]
        # [loss, main, mtp] summed over the pipeline ranks (each holds part of the loss) and averaged over
        # the data ranks; waits and step times averaged over all ranks; loads: the largest ratio.
        vec = torch.cat([losses, torch.tensor([float(dropped), waited / step_s, step_s, 0.0],
                                              dtype=torch.float64, device="cpu")])
        vec[-1] = max(ratios, default=0.0)
        if self.world_group is not None:  # on the collective's device (NCCL / HCCL reduce device tensors)
            vec = vec.to(self.world.device)
            peak = vec[-1:].clone()
            dist.all_reduce(vec, group=self.world_group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.world_group)
            vec[-1] = peak[0]
            vec = vec.cpu()
        n = self.world.size
        loss, main, mtp = (vec[:3] / (tc.data_ranks * tc.tp * tc.cp)).tolist()  # every tp / cp rank: the loss
        # each MoE layer's drops are counted on every pipeline rank holding it once per data rank
        return {"step": self.step_done, "loss": loss, "main_loss": main, "balance_loss": loss - main - (
                    tc.mtp_loss_scaling_factor * mtp), "mtp_loss": mtp, "lr": lr, "grad_norm": norm,
                "tokens_per_s": tc.global_batch_size * tc.seq_length / (float(vec[5]) / n),
                "step_s": float(vec[5]) / n, "exposed_comm_frac": float(vec[4]) / n,
                "max_over_mean_load": float(vec[6]), "dropped": int(vec[3])}

    def _per_layer(self, loads: dict) -> dict[str, dict[str, list[float]]]:
        """Every MoE layer's step (by its checkpoint key, in key order), the same on every rank:
        "expert_load" the tokens routed to each of its E experts (summed over the data ranks), and with an
        aux-loss-free bias "expert_bias" its E values after this step's update. Each pipeline rank knows
        its own layers: the ranks exchange them (one all_gather_object)."""
        rate = self.cfg.moe.bias_update_rate
        mine: dict[str, tuple[list[float], list[float] | None]] = {}
        for site in self.moe_sites:
            load = loads.get(site.params)
            if load is None:
                continue
            bias = (state_at(self.state, site) or {}).get("expert_bias_E") if rate else None
            mine[site.key] = (load.tokens_per_expert_E.double().cpu().tolist(),
                              None if bias is None else bias.double().cpu().tolist())
        if self.world_group is not None:
            every: list[Any] = [None] * self.world.size
            dist.all_gather_object(every, mine, group=self.world_group)
            for theirs in every:
                mine.update(theirs)
        out: dict[str, dict[str, list[float]]] = {"expert_load": {k: mine[k][0] for k in sorted(mine)}}
        if rate:
            out["expert_bias"] = {k: mine[k][1] for k in sorted(mine) if mine[k][1] is not None}
        return out

    # ---- checkpoints ------------------------------------------------------------------------------------

    def _moe_state_absent(self, path: str, items: dict[str, torch.Tensor]) -> list[str]:
        """The MoE state keys this run keeps that checkpoint `path` lacks (it was trained without the
        aux-loss-free bias or dynamic capacity): for a --load; CheckpointError naming the flag for a
        --resume (it continues a run as it was) and for a state saved at another size (another window)."""
        from fmoe.train.safe_metadata import read_metadata

        saved = read_metadata(Path(path) / ".metadata").state_dict_metadata
        absent = []
        for key, t in items.items():
            if not key.startswith("moe_state/"):
                continue
            flag = MOE_STATE_FLAGS.get(key.rsplit("/", 1)[-1], "the MoE state flags")
            if key not in saved:
                if self.tc.resume:
                    raise checkpoint.CheckpointError(
                        f"{path} has no {key}: the run that saved it had no {flag}, and --resume continues a "
                        f"run as it was; give --load to start this run's state fresh from it, or leave out "
                        f"{flag}")
                absent.append(key)
            elif tuple(saved[key].size) != tuple(t.shape):
                raise checkpoint.CheckpointError(
                    f"{path} holds {key} of size {tuple(saved[key].size)}, this run's is {tuple(t.shape)}: "
                    f"give the {flag} it was trained with")
        return absent

    def _items(self, with_rng: bool) -> dict[str, torch.Tensor]:
        moe_state = {site.key: state_at(self.state, site) for site in self.moe_sites}
        tp_mesh = self.world.layout.mesh["tp"] if self.tc.tp > 1 else None
        items = checkpoint.state_items(self.leaves, self.tensors, self.opt, moe_state, self.step_done,
                                       self.world.rank, with_rng, tp_mesh)
        items["train/consumed_samples"] = torch.tensor(self.consumed_samples, dtype=torch.int64, device="cpu")
        if self.loss_scale is not None:  # fp16: the scale and its counters, so a resumed run goes on alike
            ls = self.loss_scale
            items["train/loss_scale"] = torch.tensor([ls.scale, ls.good_steps, ls.hysteresis_left],
                                                     dtype=torch.float64, device="cpu")
        return items

    def save(self, directory: str) -> str:
        """Writes a checkpoint of the current step into `directory` (collective); returns its path. Its
        meta.json records the run's whole GPTConfig ("model": a later load compares its architecture
        fields, `fmoe convert fmoe-to-hf` builds it) and carries the original config.json ("hf_config") of
        a checkpoint this run loaded, so the export needs no --arch and keeps that file's other fields."""
        meta = {"config": self.tc.as_dict(), "model": asdict(self.cfg), "world_size": self.world.size,
                "layout": {"pp": self.tc.pp, "ep": self.tc.ep, "dp": self.tc.dp, "tp": self.tc.tp,
                           "cp": self.tc.cp, "ep_over_cp": self.tc.ep_over_cp,
                           "schedule": self.tc.schedule_name},
                "data": data_identity(self.tc)}
        if self.tc.schedule_file is not None:  # what ran, printed (fmoe.schedule.load_schedule_text reads it)
            meta["layout"]["schedule_text"] = str(self.schedule)
        if self.hf_config is not None:
            meta["hf_config"] = self.hf_config
        return str(checkpoint.save(directory, self.step_done, self._items(with_rng=True), meta))

    def load(self, path: str) -> None:
        """Restores weights, AdamW state, MoE state, data position and (same layout) RNG from checkpoint
        directory `path` (collective). Raises CheckpointError for a different model, another learning-rate
        schedule (unless --override-opt-param-scheduler), or a damaged or unsafe checkpoint. An --fp16 run
        loading a checkpoint without loss-scale state (fmoe convert's, a bf16 or fp32 run's) starts its
        loss scale afresh, as a fresh --fp16 run; a --resume refuses it (it continues a run as it was)."""
        checkpoint.verify(path)  # first: meta.json is covered by the checksums too
        meta = checkpoint.read_meta(path)
        checkpoint.check_compatible(meta, self.tc.as_dict(), path)
        if not self.tc.override_opt_param_scheduler:
            checkpoint.check_schedule(meta, self.tc.as_dict(), path)
        if not self.tc.override_data:
            checkpoint.check_data(meta, data_identity(self.tc), path)
        saved = meta.get("layout", {})
        same = meta.get("world_size") == self.world.size and all(
            saved.get(k, {"tp": 1, "cp": 1, "ep_over_cp": False}.get(k)) == getattr(self.tc, k)
            for k in ("pp", "ep", "dp", "tp", "cp", "ep_over_cp"))
        items = self._items(with_rng=same)
        fresh_scale = "train/loss_scale" in items and not checkpoint.has_key(path, "train/loss_scale")
        counted = checkpoint.has_key(path, "train/consumed_samples")
        if not counted:  # an older checkpoint: its steps were of its global batch each
            del items["train/consumed_samples"]
        if fresh_scale:
            if self.tc.resume:
                raise checkpoint.CheckpointError(
                    f"{path} has no loss-scale state (train/loss_scale): it was not written by an --fp16 "
                    "run, and --resume continues a run as it was; give --load to start this --fp16 run from "
                    "it with a fresh loss scale")
            del items["train/loss_scale"]
        for key in self._moe_state_absent(path, items):
            del items[key]  # a --load starts it fresh (init_gpt_state's), as a fresh run with the flag
        checkpoint.read_gate_and_up_apart(path, items)
        checkpoint.load(path, items, verified=True)
        self.step_done = int(items["train/step"])
        self.consumed_samples = (int(items["train/consumed_samples"]) if counted else self.step_done * int(
            meta.get("config", {}).get("global_batch_size", self.tc.global_batch_size)))
        self.hf_config = meta.get("hf_config")
        if self.loss_scale is not None and not fresh_scale:
            scale, good, left = items["train/loss_scale"].tolist()
            self.loss_scale = replace(self.loss_scale, scale=scale, good_steps=int(good),
                                      hysteresis_left=int(left))
        self._checked = False


def _lookup(tree: Any, where: tuple) -> Any:
    """The node of `tree` at `where`, or None where the path is absent (a layer this rank does not hold)."""
    try:
        return get(tree, where)
    except (KeyError, IndexError, TypeError):
        return None


def _top(where: tuple) -> tuple[str, ...]:
    """The parameter path (a key of `holders`) a leaf lives under: ("layers", "3") or ("embed",)."""
    return (where[0], str(where[1])) if where[0] == "layers" else (where[0],)

