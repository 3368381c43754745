"""What one training run is: `TrainConfig` (Megatron's vocabulary, snake-cased), its presets, a TOML file
that sets the same fields, and the checks that run before any process starts.

    tc = TrainConfig.from_sources(preset="tiny", toml_path=None, overrides={"pp": 1})
    problem = tc.problem(world_size=None)      # None, or one line saying what is wrong with its fields
                                               # (fmoe.train.preflight.problem: the whole job's checks)
    cfg = tc.model()                           # the GPTConfig

Precedence: the preset's values, then the TOML file's, then the flags'. Every field of the TOML file must
be a TrainConfig field (a typo fails instead of being ignored).

Layout: world = pp x ep x dp ranks. Expert parallelism is carved out of data parallelism (as in
Megatron): the pp-stage replicas of one stage are dp x ep ranks that each read their own data, so a
global batch of G sequences is G / (micro_batch x dp x ep) microbatches per rank and step.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fmoe.config import GPTConfig, MoEConfig
from fmoe.import_path import check_seam
from fmoe.overlap import PAIRED
from fmoe.precision import LossScale, Policy, default_policy
from fmoe.recompute import MODULES as RECOMPUTE_MODULES
from fmoe.recompute import Recompute

if TYPE_CHECKING:
    from fmoe.schedule.ir import Schedule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
DISPATCHERS = ("alltoall", "allgather", "hierarchical")
DATA_KINDS = ("markov", "bin16", "bin32", "text")
DEVICES = ("auto", "cpu", "cuda", "npu")
# Megatron's --moe-router-load-balancing-type: what --moe-aux-loss-coeff weighs (the batch's load-balancing
# loss, DeepSeek-V3's sequence-wise one, or nothing)
BALANCING = ("aux_loss", "seq_aux_loss", "none")
# torch.compile's backends --compile offers: inductor generates kernels; aot_eager and eager run the same
# three graphs op by op, captured by dynamo with and without AOT autograd's pass (to tell a compiler problem
# from a graph one, as torchtitan's backend option)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
ACCUMULATE = "accumulate"  # pp = 1: microbatches one after the other, plain autograd, no executor


@dataclass(frozen=True)
class TrainConfig:
    """Every option of `fmoe train`. Sizes follow Megatron's flags (--hidden-size -> hidden_size, ...).

    Model: num_layers, hidden_size, ffn_hidden_size (dense layers), moe_ffn_hidden_size, num_experts,
    moe_router_topk, num_attention_heads, num_query_groups (kv heads; None = num_attention_heads),
    first_k_dense (leading dense layers), moe_shared_experts, vocab_size, mtp (+ mtp_loss_scaling_factor),
    kv_channels (head dim; None = hidden_size / num_attention_heads), rotary_base (RoPE theta),
    norm_epsilon (RMSNorm eps), qk_layernorm (an RMSNorm over each head's q and k, as Qwen3).
    Multi-head latent attention (DeepSeek-V2/V3, fmoe/mla.py; Megatron's flags): multi_latent_attention
    switches it on, with q_lora_rank (the query latent; None = a plain query projection), kv_lora_rank
    (the key/value latent), qk_head_dim (a head's non-rotary qk dim; kv_channels does not apply),
    qk_pos_emb_head_dim (its rotary dim) and v_head_dim; without the switch they are not read.
    Routing and balancing: moe_router_score_function, moe_router_pre_softmax (softmax over all experts,
    then the top k kept as they are; default: renormalised over the top k, i.e. a softmax over the k
    selected logits, as Megatron's default and Mixtral; softmax only: fmoe's MoEConfig.topk_norm
    "before" / "after"), moe_aux_loss_coeff, moe_z_loss_coeff,
    moe_router_load_balancing_type (Megatron's: what moe_aux_loss_coeff weighs, "aux_loss" over the
    micro batch, "seq_aux_loss" per sequence as DeepSeek-V3, "none"), moe_router_bias_update_rate
    (aux-loss-free), moe_expert_capacity_factor (None = dropless),
    moe_pad_expert_input_to_capacity, moe_token_drop_policy, moe_router_num_groups / moe_router_group_topk
    (group-limited routing, Megatron's and DeepSeek-V3's: a token picks its experts from its group_topk best
    of num_groups groups; both or neither), moe_dynamic_capacity_window / moe_dynamic_capacity_margin
    (dropless with a capacity forecast from the last W steps' loads, agreed over the expert group;
    fmoe/capacity.py; 0 = off).
    Seams (fmoe/seams.py, docs/research.md): router, experts, attention: import paths
    "package.module:function" of a router, routed-experts or core-attention function replacing fmoe's
    (None = fmoe's own); every rank loads them, the ranks compare the paths, and a path that does not
    import or is not callable fails before launch.
    Recompute (Megatron's flags; fmoe/recompute.py): recompute_granularity (None, "full" or "selective"),
    recompute_method ("uniform": every layer; "block": the first recompute_num_layers of each pipeline
    chunk), recompute_modules (selective's parts, fmoe.recompute.MODULES: core_attn, mlp, moe, shared_experts,
    layernorm, mla_up_proj; default core_attn),
    moe_adaptive_recompute_activation (MindSpeed's load-aware recompute of seed 002: a layer's routed
    experts are recomputed in a step whose largest expert load exceeds
    moe_adaptive_recompute_activation_scale x the mean).
    Batch: seq_length, micro_batch_size, global_batch_size (sequences per step over all ranks).
    Layout: pp, ep, dp, schedule (None = dualpipev for pp > 1, combined_1f1b for pp = 1 with ep > 1,
    "accumulate" otherwise), schedule_file (a schedule written out in its printed form instead of a named
    one: fmoe.schedule.load_schedule; read and verified before launch, its rank lines must be pp, its
    microbatches `microbatches`, its chunks per rank the vpp given), dualpipev_dw_detach, overlap, fuse_iw
    (an I whose W comes next runs as one B; fmoe.schedule.fuse_adjacent_iw), compile / compile_backend
    (every executor phase as three torch.compile'd graphs, forward, dx and dw: transforms/compiled.py;
    not with "accumulate"), a2a_chunks (1, or 2: a
    forward with no F&B pair moves each MoE layer's all-to-all in two row chunks that travel while the
    other chunk's experts run, so it hides its combine too; all-to-all dispatcher only), pair_overlap
    (how an F&B pair hides each MoE layer's all-to-all, fmoe.overlap: "pair", the other microbatch's
    compute, the default; "self", row chunks and no handover, all-to-all dispatcher only; "none"),
    dispatcher,
    ranks_per_node,
    link_model ("intra=BYTES_PER_S,inter=BYTES_PER_S[,intra_latency=S,inter_latency=S]"),
    num_layers_per_virtual_pipeline_stage (Megatron's other spelling of vpp: layers per model chunk, so
    vpp = num_layers / (pp x N)),
    num_virtual_stages_per_pipeline_rank (vpp: model chunks per rank of the interleaved schedules, default
    2; the other schedules run their own count and refuse another: fmoe.schedule.registry.chunks_per_rank).
    Optimizer: lr, min_lr, lr_warmup_iters (linear warmup from lr_warmup_init), lr_decay_style (constant,
    linear, cosine, inverse-square-root, WSD), lr_decay_iters (None = steps), lr_wsd_decay_iters and
    lr_wsd_decay_style (WSD's final anneal): Megatron's schedule, fmoe/train/lr_schedule.py (`warmup`, the
    old name of lr_warmup_iters, is still read, with a FutureWarning), clip_grad
    (global norm; 0 = off), weight_decay, adam_beta1/2, adam_eps, use_distributed_optimizer (ZeRO-1:
    AdamW state sharded over the data-parallel ranks that replicate each weight).
    Run: steps, seed, dtype (of everything, weights included), bf16 (mixed precision instead: fp32
    master weights, optimizer state and gradient sums, bf16 compute; None = not given: on with CUDA / NPU
    and dtype float32, off on CPU), tf32 (fp32 matmuls on TF32 tensor cores on CUDA), deterministic
    (Megatron's --deterministic-mode: torch.use_deterministic_algorithms on every rank), compute_model
    (0: off; s > 0: from the second step on, every compute phase of the executor is held to s x its median
    over all ranks' first step, fmoe.schedule.compute_model, so that ranks sharing a few cores behave like
    devices that compute while their exchanges travel; for measuring overlap), fp16 (the same
    with fp16 compute and loss scaling: loss_scale fixes the scale, else dynamic from
    initial_loss_scale, halved after `hysteresis` overflowing steps down to min_loss_scale, doubled
    after loss_scale_window clean ones; an overflowing step is skipped), data ("markov" or a file path),
    data_kind (for files: bin16, bin32, text), markov_sequences, data_path (Megatron's --data-path: indexed
    datasets, one prefix or weights and prefixes, fmoe/train/documents.py; instead of data), tokenizer_type
    and tokenizer_model (fmoe/train/tokenizer.py: the vocabulary, padded to make_vocab_size_divisible_by x
    tp unless vocab_size is given, and the EOD), eod_mask_loss (no loss on the token after an EOD),
    reset_position_ids / reset_attention_mask (RoPE positions restart at each document / attention within a
    document only: the documents --data-path's EODs end, fmoe/packing.py),
    override_data (a resume or load whose data differs from the checkpoint's; refused without it), save,
    save_interval, load, resume,
    overwrite_save (a fresh run may delete the checkpoints already in --save; refused otherwise),
    override_opt_param_scheduler (a resumed or loaded run may change the LR schedule's values),
    split (Megatron's train,valid,test weights over a data file's windows; fmoe/train/splits.py),
    eval_interval (steps between held-out evaluations; 0 = none), eval_iters (global batches per
    evaluation), tensorboard_dir, wandb_project / wandb_exp_name / wandb_save_dir (rank 0 logs there too;
    fmoe/train/log_backends.py),
    metrics, trace, trace_step, loss_curve, progress, log_interval (Megatron's: steps between the lines
    a run without the bar prints; 0 = none), moe_per_layer_logging (Megatron's: every step's tokens per
    expert of each MoE layer, and the aux-loss-free expert bias, into the metrics and as histograms to
    TensorBoard / W&B), timeout (seconds a collective may wait before the
    run fails), keep_host_memory (CPU ranks keep what malloc frees instead of faulting it back in every
    step: fmoe/train/host_memory.py), device (auto: CUDA if the machine has GPUs, else Ascend NPUs, else
    CPU; or cpu / cuda / npu).
    """

    # model
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    moe_ffn_hidden_size: int = 64
    num_experts: int = 8
    moe_router_topk: int = 2
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    first_k_dense: int = 1
    moe_shared_experts: int = 1
    vocab_size: int = 64
    mtp: bool = False
    mtp_loss_scaling_factor: float = 0.3
    kv_channels: int | None = None
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-6
    qk_layernorm: bool = False
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # routing and balancing
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_aux_loss_coeff: float = 1e-2
    moe_router_load_balancing_type: str = "aux_loss"
    moe_z_loss_coeff: float = 0.0
    moe_router_bias_update_rate: float = 0.0
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_dynamic_capacity_window: int = 0
    moe_dynamic_capacity_margin: float = 1.0
    router: str | None = None
    experts: str | None = None
    attention: str | None = None
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: tuple[str, ...] | None = None
    moe_adaptive_recompute_activation: bool = False
    moe_adaptive_recompute_activation_scale: float = 2.0
    # batch
    seq_length: int = 64
    micro_batch_size: int = 4
    global_batch_size: int = 32
    # layout
    pp: int = 2
    ep: int = 2
    expert_model_parallel_size: int | None = None
    dp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    schedule: str | None = None
    schedule_file: str | None = None
    dualpipev_dw_detach: bool = False
    overlap: bool = True
    fuse_iw: bool = True
    compile: bool = False
    compile_backend: str = "inductor"
    a2a_chunks: int = 1
    pair_overlap: str = "pair"
    dispatcher: str = "alltoall"
    ranks_per_node: int | None = None
    link_model: str | None = None
    num_virtual_stages_per_pipeline_rank: int | None = None
    num_layers_per_virtual_pipeline_stage: int | None = None
    # optimizer
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_iters: int = 20
    lr_warmup_init: float = 0.0
    lr_decay_style: str = "cosine"
    lr_decay_iters: int | None = None
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "exponential"
    clip_grad: float = 1.0
    weight_decay: float = 0.1
    use_distributed_optimizer: bool = False
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    # run
    steps: int = 150
    seed: int = 1234
    dtype: str = "float32"
    bf16: bool | None = None
    fp16: bool = False
    tf32: bool = True
    deterministic: bool = False
    compute_model: float = 0.0
    loss_scale: float | None = None
    initial_loss_scale: float = 65536.0
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    data: str = "markov"
    data_kind: str | None = None
    data_path: tuple[str, ...] | None = None
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    make_vocab_size_divisible_by: int = 128
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    override_data: bool = False
    markov_sequences: int = 16384
    split: str = "969,30,1"
    eval_interval: int = 0
    eval_iters: int = 10
    save: str | None = None
    save_interval: int = 0
    load: str | None = None
    resume: bool = False
    overwrite_save: bool = False
    override_opt_param_scheduler: bool = False
    metrics: str | None = None
    trace: str | None = None
    trace_step: int = 3
    loss_curve: str | None = None
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    progress: bool = True
    log_interval: int = 10
    moe_per_layer_logging: bool = False
    timeout: float = 300.0
    keep_host_memory: bool = True
    device: str = "auto"

    # ---- sources ----------------------------------------------------------------------------------------

    @classmethod
    def from_sources(cls, preset: str = "tiny", toml_path: str | None = None,
                     overrides: dict[str, Any] | None = None) -> TrainConfig:
        """Returns the preset's config updated by the TOML file's fields, then by `overrides` (the flags
        given). Raises ValueError naming an unknown preset, an unknown field or a field of the wrong type."""
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        values = dict(PRESETS[preset])
        given = read_toml(toml_path) if toml_path is not None else {}
        given.update(overrides or {})
        if given.get("tokenizer_type") not in (None, "NullTokenizer"):
            values.pop("vocab_size", None)  # the preset's: the tokenizer's is the default now (resolve_vocab)
        values.update(given)
        carved = given.get("expert_model_parallel_size")
        if carved is not None:  # Megatron's flag: its ep, carved from the data x context ranks
            if given.get("ep", carved) != carved:
                raise ValueError(f"--ep ({given['ep']}) and --expert-model-parallel-size ({carved}) "
                                 "disagree: give --expert-model-parallel-size alone for the expert group "
                                 "carved from the data x context ranks, or --ep alone for one beside them")
            values["ep"] = carved
        return cls.build(values)

    @classmethod
    def build(cls, values: dict[str, Any]) -> TrainConfig:
        """Returns the config with `values` (field -> value) over the defaults, types checked; without
        vocab_size, a --tokenizer-type's padded vocabulary (fmoe.train.data_source.resolve_vocab)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = _renamed(values)
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}  # TOML, argparse
        values = _virtual_stages(values, {k: f.default for k, f in fields.items()})
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)}")
        for name, value in values.items():
            _check_type(name, value, fields[name].type)
        from fmoe.train.data_source import resolve_vocab

        return cls(**resolve_vocab(values))

    def as_dict(self) -> dict[str, Any]:
        """Returns the fields as a plain dict (what checkpoints record)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # ---- derived ----------------------------------------------------------------------------------------

    def model(self) -> GPTConfig:
        """Returns the GPTConfig of this run (ValueError from the config classes on bad sizes)."""
        balancing = self.moe_router_load_balancing_type
        if balancing not in BALANCING:
            raise ValueError(f"--moe-router-load-balancing-type must be one of {', '.join(BALANCING)}, got "
                             f"{balancing!r}")
        moe = MoEConfig(d_model=self.hidden_size, d_ff=self.moe_ffn_hidden_size, num_experts=self.num_experts,
                        top_k=self.moe_router_topk, score_func=self.moe_router_score_function,
                        topk_norm="before" if self.moe_router_pre_softmax else "after",
                        aux_loss_coef=self.moe_aux_loss_coeff if balancing == "aux_loss" else 0.0,
                        seq_aux_loss_coef=self.moe_aux_loss_coeff if balancing == "seq_aux_loss" else 0.0,
                        z_loss_coef=self.moe_z_loss_coeff,
                        bias_update_rate=self.moe_router_bias_update_rate,
                        capacity_factor=self.moe_expert_capacity_factor,
                        pad_to_capacity=self.moe_pad_expert_input_to_capacity,
                        drop_policy=self.moe_token_drop_policy, num_shared_experts=self.moe_shared_experts,
                        num_groups=self.moe_router_num_groups or 1,
                        topk_groups=self.moe_router_group_topk or 1,
                        dynamic_capacity_window=self.moe_dynamic_capacity_window,
                        dynamic_capacity_margin=self.moe_dynamic_capacity_margin,
                        adaptive_remat=self.moe_adaptive_recompute_activation,
                        remat_load_scale=self.moe_adaptive_recompute_activation_scale,
                        router=self.router, experts=self.experts)
        return GPTConfig(vocab_size=self.vocab_size, d_model=self.hidden_size, n_layers=self.num_layers,
                         n_heads=self.num_attention_heads, n_kv_heads=self.num_query_groups,
                         d_ff_dense=self.ffn_hidden_size, num_dense_layers=self.first_k_dense,
                         moe=moe, recompute=self.recompute_choice(),
                         mtp=self.mtp, mtp_loss_weight=self.mtp_loss_scaling_factor,
                         rope_theta=self.rotary_base, norm_eps=self.norm_epsilon,
                         qk_norm=self.qk_layernorm, attention=self.attention, **self._attention_sizes())

    def _attention_sizes(self) -> dict[str, Any]:
        """GPTConfig's head sizes: --kv-channels, or with --multi-latent-attention the MLA flags'."""
        if not self.multi_latent_attention:
            return {"head_dim": self.kv_channels}
        if self.kv_channels is not None:
            raise ValueError("--kv-channels is grouped-query attention's head dim: with "
                             "--multi-latent-attention give --qk-head-dim (and --v-head-dim)")
        return {"head_dim": self.qk_head_dim, "q_lora_rank": self.q_lora_rank or 0,
                "kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_pos_emb_head_dim,
                "v_head_dim": self.v_head_dim}

    def recompute_choice(self) -> Recompute:
        """The Recompute the recompute flags ask for; ValueError naming the flag that cannot be one."""
        g, method, n, modules = (self.recompute_granularity, self.recompute_method, self.recompute_num_layers,
                                 self.recompute_modules)
        if g not in (None, "full", "selective"):
            raise ValueError(f"--recompute-granularity must be full or selective, got {g!r}")
        # --recompute-method / -num-layers / -modules without their granularity: fmoe.train.modifiers
        if g == "selective":
            modules = modules or ("core_attn",)  # Megatron's default
            unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
            if unknown:
                raise ValueError(f"--recompute-modules: {', '.join(unknown)} is not one of "
                                 f"{', '.join(RECOMPUTE_MODULES)}")
            return Recompute("selective", modules=tuple(modules))
        if g is None:
            return Recompute()
        if method not in (None, "uniform", "block"):
            raise ValueError(f"--recompute-method must be uniform or block, got {method!r}")
        if n is not None and n < 1:
            raise ValueError(f"--recompute-num-layers must be a positive integer, got {n}")
        if method == "block":
            if n is None:
                raise ValueError("--recompute-method block recomputes the first --recompute-num-layers N "
                                 "layers of each pipeline chunk: give N")
            return Recompute("full", num_layers=n)
        if n not in (None, 1):
            # Megatron's uniform N checkpoints groups of N layers; an MoE layer's exchanges already split
            # it into phases on a pipeline, so fmoe recomputes one layer (its phases) at a time
            raise ValueError(f"--recompute-method uniform recomputes one layer at a time here: "
                             f"--recompute-num-layers must be 1, got {n} (or --recompute-method block)")
        return Recompute("full")

    def _check_recompute(self) -> None:
        rc = self.recompute_choice()
        if self.moe_adaptive_recompute_activation and (rc.granularity == "full" or rc.module("moe")):
            what = "every layer" if rc.granularity == "full" else "every layer's experts"
            raise ValueError(f"--moe-adaptive-recompute-activation has no effect when "
                             f"--recompute-granularity {rc.granularity} already recomputes {what}")
        if not self.moe_adaptive_recompute_activation_scale > 0:
            raise ValueError("--moe-adaptive-recompute-activation-scale must be > 0, got "
                             f"{self.moe_adaptive_recompute_activation_scale}")

    @property
    def cp(self) -> int:
        """The context-parallel size (--context-parallel-size): ranks that split each sequence."""
        return self.context_parallel_size

    @property
    def ep_over_cp(self) -> bool:
        """Whether the expert group is carved from the data x context ranks (--expert-model-parallel-size,
        Megatron's layout: the cp ranks of a sequence share the experts) instead of standing beside them
        (--ep: each cp rank holds all of its expert group's experts)."""
        return self.expert_model_parallel_size is not None

    @property
    def world_size(self) -> int:
        """pp x ep x dp x tp x cp; pp x dp x tp x cp when the expert group is carved from dp x cp."""
        return self.pp * self.dp * self.tp * self.cp * (1 if self.ep_over_cp else self.ep)

    @property
    def data_ranks(self) -> int:
        """Ranks that read different data: dp x ep (expert parallelism is carved out of data parallelism);
        dp when the expert group is carved from the data x context ranks."""
        return self.dp if self.ep_over_cp else self.dp * self.ep

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts, over which their gradients are summed: dp x cp, or dp x cp / ep
        when the expert group is carved from them."""
        return self.dp * self.cp // (self.ep if self.ep_over_cp else 1)

    def layout_text(self) -> str:
        """The world as the flags give it, e.g. "--pp 2 x --ep 2 x --dp 1 x --tp 1 = 4" (cp where > 1;
        a carved expert group named after the product)."""
        cp = f" x --context-parallel-size {self.cp}" if self.cp > 1 else ""
        if self.ep_over_cp:
            return (f"--pp {self.pp} x --dp {self.dp} x --tp {self.tp}{cp} = {self.world_size} (the "
                    f"--expert-model-parallel-size {self.ep} ranks carved from dp x cp)")
        return f"--pp {self.pp} x --ep {self.ep} x --dp {self.dp} x --tp {self.tp}{cp} = {self.world_size}"

    def data_ranks_text(self) -> str:
        """The data ranks as the flags give them: "dp (D) x ep (E)", or "dp (D)" under a carved ep."""
        return f"dp ({self.dp})" if self.ep_over_cp else f"dp ({self.dp}) x ep ({self.ep})"

    @property
    def microbatches(self) -> int:
        """Microbatches per rank and step: global_batch_size / (micro_batch_size x dp x ep)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_ranks)

    @property
    def schedule_name(self) -> str:
        """The schedule this run uses (the default filled in; "file PATH" for --schedule-file)."""
        if self.schedule_file is not None:
            return f"file {self.schedule_file}"
        if self.schedule is not None:
            name = self.schedule
        elif self.pp > 1:
            name = "dualpipev"
        else:
            name = "combined_1f1b" if self.ep > 1 else ACCUMULATE
        if name == "dualpipev" and self.dualpipev_dw_detach:
            name = "dualpipev+dw_detach"
        return name

    def pipeline_schedule(self) -> Schedule:
        """The schedule the executor runs (not the accumulate path): --schedule-file's as written, else the
        named one built for pp, the microbatches and vpp. ScheduleError for a file that cannot be read or
        parsed, or a schedule that cannot be built."""
        from fmoe import schedule as S

        if self.schedule_file is not None:
            return S.load_schedule(self.schedule_file)
        vpp = self.num_virtual_stages_per_pipeline_rank
        return S.build(self.schedule_name, self.pp, self.microbatches, vpp)

    @property
    def policy(self) -> Policy:
        """The precision policy on CPU: --bf16 / --fp16 are mixed precision (fp32 master weights and
        gradients, bf16 / fp16 compute, as Megatron's flags); otherwise everything in --dtype."""
        return self.policy_for("cpu")

    def policy_for(self, device_type: str) -> Policy:
        """The precision policy on `device_type`: as `policy`, except that on CUDA / NPU a run that gives
        neither --bf16 / --no-bf16 nor --fp16 (nor another --dtype) is bf16-mixed
        (fmoe.precision.default_policy)."""
        return default_policy(device_type, bf16=self.bf16, fp16=self.fp16, dtype=DTYPES[self.dtype])[0]

    def precision_warning(self, device_type: str) -> str | None:
        """One line when this run computes in fp32 on an accelerator by choice (--no-bf16), else None."""
        return default_policy(device_type, bf16=self.bf16, fp16=self.fp16, dtype=DTYPES[self.dtype])[1]

    def lr_warning(self) -> str | None:
        """One line when the whole run trains inside the LR warmup (--steps <= --lr-warmup-iters, without
        --lr-decay-iters: an --lr-decay-iters at or below the warmup is refused), else None. A warning, not
        an error, because the warmup defaults to 20 steps and short trial runs are common."""
        if self.lr_decay_iters is None and self.steps <= self.lr_warmup_iters:
            return (f"--steps ({self.steps}) is at or below --lr-warmup-iters ({self.lr_warmup_iters}): the "
                    "whole run trains inside the LR warmup and never reaches --lr; give --lr-warmup-iters "
                    "below --steps (0: no warmup)")
        return None

    def loss_scaler(self) -> LossScale | None:
        """The initial loss-scaling state of an --fp16 run (None otherwise); ValueError on bad flags."""
        if not self.fp16:
            return None
        try:
            if self.loss_scale is not None:
                return LossScale.static_scale(self.loss_scale)
            return LossScale.dynamic_scale(self.initial_loss_scale, growth_interval=self.loss_scale_window,
                                           min_scale=self.min_loss_scale, hysteresis=self.hysteresis)
        except ValueError as exc:
            raise ValueError(f"--fp16 loss scaling (--loss-scale, --initial-loss-scale, --min-loss-scale, "
                             f"--loss-scale-window, --hysteresis): {exc}") from None

    def problem(self, world_size: int | None = None) -> str | None:
        """Returns one line saying what is wrong with this run before any process starts, or None.
        `world_size`: the ranks a launcher gives (torchrun); None when `fmoe train` spawns them itself."""
        try:
            self._check(world_size)
        except (ValueError, TypeError) as exc:
            return str(exc).splitlines()[0]
        return None

    def _check(self, world_size: int | None) -> None:
        from fmoe import schedule as S
        from fmoe.parallel.link_model import parse_link_model
        from fmoe.parallel.topology import check_layout
        from fmoe.pipeline.cut import cut_gpt
        from fmoe.train.modifiers import TRAIN_MODIFIERS, unmodified

        # a flag given without the flag it modifies would be ignored: one rule, one table
        modifier = unmodified(TRAIN_MODIFIERS, self, {f.name: f.default for f in dataclasses.fields(self)})
        if modifier is not None:
            raise ValueError(modifier)
        for name in ("pp", "ep", "dp", "tp", "context_parallel_size", "steps", "seq_length",
                     "micro_batch_size", "global_batch_size", "markov_sequences",
                     "expert_model_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be a positive integer, got {getattr(self, name)}")
        for name in ("save_interval", "lr_warmup_iters", "eval_interval", "log_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        for f in dataclasses.fields(self):  # inf or nan reached AdamW or a timedelta before
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"--{_flag(f.name)} must be a finite number, got {value}")
        from fmoe.train.data import MAX_SEED

        if not 0 <= self.seed < MAX_SEED:  # the data order's seed range; inside the ranks otherwise
            raise ValueError(f"--seed must lie in [0, 2**40), got {self.seed}")
        for name in ("lr", "timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{_flag(name)} must be > 0, got {getattr(self, name)}")
        for name in ("min_lr", "clip_grad", "weight_decay", "adam_eps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("bf16", "fp16"):
            if getattr(self, name) and self.dtype != "float32":
                raise ValueError(f"--{name} keeps fp32 master weights and computes in {name}: leave --dtype "
                                 f"at float32 (got {self.dtype})")
        if self.bf16 and self.fp16:
            raise ValueError("give --bf16 or --fp16, not both")
        if self.fp16:
            self.loss_scaler()  # its own checks, with the flags named
        if not (math.isfinite(self.compute_model) and self.compute_model >= 0):
            raise ValueError(f"--compute-model must be a finite scale >= 0, got {self.compute_model}")
        if self.compute_model and self.schedule_name == ACCUMULATE:
            raise ValueError("--compute-model holds the executor's phases: it needs a schedule (pp > 1, "
                             "ep > 1 or --schedule combined_1f1b), not the one-process accumulate path")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"--dispatcher must be one of {', '.join(DISPATCHERS)}, got {self.dispatcher!r}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"--compile-backend must be one of {', '.join(COMPILE_BACKENDS)}, got "
                             f"{self.compile_backend!r}")
        if self.compile and self.schedule_name == ACCUMULATE:
            raise ValueError("--compile compiles the pipeline executor's phases (forward, dx and dw graphs); "
                             "pp 1 x ep 1 runs without it ('accumulate'): pass --schedule 1f1b to run "
                             "through the executor, or drop --compile")
        if self.compile and (self.tp > 1 or self.cp > 1):
            raise ValueError("--compile traces each compute phase into graphs, and under --tp / "
                             "--context-parallel-size their collectives run inside those phases, which the "
                             "trace cannot hold: drop --compile, or run tp 1 and cp 1")
        if self.a2a_chunks not in (1, 2):
            raise ValueError(f"--a2a-chunks must be 1 or 2, got {self.a2a_chunks}")
        if self.a2a_chunks == 2 and self.dispatcher != "alltoall":
            raise ValueError(f"--a2a-chunks 2 splits the all-to-all's rows: it needs --dispatcher alltoall, "
                             f"not {self.dispatcher}")
        if self.pair_overlap not in PAIRED:
            raise ValueError(f"--pair-overlap must be one of {', '.join(PAIRED)}, got {self.pair_overlap!r}")
        if self.pair_overlap == "self" and self.dispatcher != "alltoall":
            raise ValueError(f"--pair-overlap self splits the all-to-all's rows: it needs --dispatcher "
                             f"alltoall, not {self.dispatcher}")
        self._check_data()
        if world_size is not None and world_size != self.world_size:
            raise ValueError(f"the launcher gives {world_size} ranks but {self.layout_text()}")
        if self.num_experts % (self.ep * self.tp):
            raise ValueError(f"--num-experts ({self.num_experts}) must be divisible by --ep ({self.ep}) x "
                             f"--tp ({self.tp}): tensor parallelism extends expert parallelism, each of the "
                             f"{self.ep * self.tp} ranks of an expert group holding whole experts")
        if self.global_batch_size % (self.micro_batch_size * self.data_ranks):
            raise ValueError(f"--global-batch-size ({self.global_batch_size}) must be a multiple of "
                             f"--micro-batch-size ({self.micro_batch_size}) x {self.data_ranks_text()}")
        if self.resume and self.load:
            raise ValueError("give --resume or --load, not both")
        if self.load and not Path(self.load).is_dir():
            raise ValueError(f"--load: no checkpoint directory {self.load}")
        if self.trace_step < 1:
            raise ValueError(f"--trace-step must be a step number >= 1, got {self.trace_step}")
        if self.trace and self.trace_step > self.steps:
            raise ValueError(f"--trace-step {self.trace_step} is past the run's last step (--steps "
                             f"{self.steps}): --trace would write nothing")
        if self.link_model is not None:
            parse_link_model(self.link_model)
        vpp = self.num_virtual_stages_per_pipeline_rank
        if vpp is not None and vpp < 1:
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank must be a positive integer, got {vpp}")
        self._check_carved()
        rpn = self.ranks_per_node or self.world_size
        check_layout(self.world_size, tp=self.tp, ep=self.ep, pp=self.pp, dp=self.dp, cp=self.cp,
                     ranks_per_node=rpn, ep_over_cp=self.ep_over_cp)
        self._check_routing()
        self._check_cp()
        self._check_tp()
        for name in ("router", "experts", "attention"):  # the flag named, before the model names its field
            check_seam(f"--{name}", getattr(self, name))
        self._check_recompute()
        cfg = self.model()
        if self.schedule_file is not None:
            self._check_schedule_file(cfg)
            return
        name = self.schedule_name
        if name == ACCUMULATE:
            if self.pp != 1 or self.ep != 1:
                raise ValueError("--schedule accumulate runs one process alone (pp 1, ep 1, data parallel "
                                 f"allowed); got pp {self.pp}, ep {self.ep}")
            if self.num_virtual_stages_per_pipeline_rank is not None:
                raise ValueError("--num-virtual-stages-per-pipeline-rank cuts a pipeline: give an "
                                 "interleaved schedule (accumulate runs the whole model in one process)")
            if self.trace:
                raise ValueError("--trace records the executor's timeline: give a schedule (e.g. --schedule "
                                 "1f1b); accumulate runs without the executor")
            return
        try:
            # layers: the schedule's own rule (DualPipeV's multiple of 2pp; the embedding, head and MTP
            # module ride on the end chunks and are not layers), then the cut (a layer per chunk)
            s = S.build(name, self.pp, self.microbatches, self.num_virtual_stages_per_pipeline_rank,
                        layers=self.num_layers)
            cut_gpt(cfg, s.placement, seq=self.seq_length)
        except S.ScheduleError as exc:
            vpp = "" if self.num_virtual_stages_per_pipeline_rank is None else (
                f", vpp {self.num_virtual_stages_per_pipeline_rank}")
            raise ValueError(f"--schedule {name} with pp {self.pp}{vpp} and {self.microbatches} microbatches "
                             f"per rank: {exc}") from None

    def _check_schedule_file(self, cfg: GPTConfig) -> None:
        """--schedule-file: read, verified, and fitting the layout (its rank lines = pp, its microbatches =
        the batch flags' per rank and step, its chunks per rank = vpp when given, a layer per chunk)."""
        from fmoe import schedule as S
        from fmoe.pipeline.cut import cut_gpt

        flag = f"--schedule-file {self.schedule_file}"
        if self.schedule is not None:
            raise ValueError(f"give --schedule or --schedule-file, not both (got --schedule {self.schedule} "
                             f"and {flag})")
        if self.dualpipev_dw_detach:
            raise ValueError(f"--dualpipev-dw-detach changes the built DualPipeV: write its I and W ops into "
                             f"{flag} instead")
        try:
            s = self.pipeline_schedule()
        except S.ScheduleError as exc:
            raise ValueError(f"--schedule-file {exc}") from None
        if s.pp != self.pp:
            raise ValueError(f"{flag} has {s.pp} rank lines but --pp is {self.pp}")
        if s.m != self.microbatches:
            raise ValueError(f"{flag} runs {s.m} microbatches but the batch flags give {self.microbatches} "
                             f"per rank and step (--global-batch-size {self.global_batch_size} / "
                             f"(--micro-batch-size {self.micro_batch_size} x {self.data_ranks_text()}))")
        try:
            S.verify(s)
        except S.ScheduleError as exc:
            raise ValueError(f"--schedule-file {exc}") from None
        chunks = len(set(s.placement.layer_chunk)) // s.pp  # DualPipe's two copies run one cut
        vpp = self.num_virtual_stages_per_pipeline_rank
        if vpp is not None and vpp != chunks:
            raise ValueError(f"{flag} runs {chunks} model chunk{'s' if chunks > 1 else ''} per rank "
                             f"({s.placement.kind} placement), not --num-virtual-stages-per-pipeline-rank "
                             f"{vpp}")
        try:
            cut_gpt(cfg, s.placement, seq=self.seq_length)
        except S.ScheduleError as exc:
            raise ValueError(f"{flag} cuts the model into {chunks} chunk{'s' if chunks > 1 else ''} per rank "
                             f"on {self.pp} ranks: {exc}") from None

    def _check_tp(self) -> None:
        """--tp and --sequence-parallel, with what they need of the model, the batch and the other flags."""
        from fmoe.tp_layout import check_tp

        if self.tp == 1:
            return
        check_tp(self.model(), self.tp, dense=self.first_k_dense > 0)
        if self.vocab_size % self.tp:
            raise ValueError(f"--vocab-size ({self.vocab_size}) must be divisible by --tp ({self.tp}) "
                             "(vocab-parallel embedding and head)")
        # under context parallelism a tp group holds one cp rank's positions (checked to split first)
        seq, seq_flag = self.seq_length // self.cp, "--seq-length" if self.cp == 1 else (
            "--seq-length / --context-parallel-size")
        tokens = self.micro_batch_size * seq
        if self.sequence_parallel:
            if seq % self.tp:
                raise ValueError(f"--sequence-parallel: {seq_flag} ({seq}) must be divisible by --tp "
                                 f"({self.tp})")
        elif tokens % self.tp:
            raise ValueError(f"--tp {self.tp}: each tp rank routes 1/{self.tp} of a microbatch's tokens: "
                             f"--micro-batch-size x {seq_flag} ({tokens}) must divide by it")
        if self.router is not None:
            raise ValueError("--tp > 1 needs the built-in router: its balancing losses take the tp group's "
                             "statistics, which a --router function does not reduce")
        if self.moe_dynamic_capacity_window:
            raise ValueError("--moe-dynamic-capacity-window under --tp > 1: the forecast would be per rank")

    def _check_carved(self) -> None:
        """--expert-model-parallel-size: the expert group carved from the data x context ranks."""
        carved = self.expert_model_parallel_size
        if carved is None:
            return
        if carved != self.ep:  # TrainConfig built directly (from_sources sets ep from it)
            raise ValueError(f"--expert-model-parallel-size ({carved}) is the expert group's size: leave "
                             f"--ep ({self.ep}) at it or unset")
        if (self.dp * self.cp) % carved:
            raise ValueError(f"--expert-model-parallel-size ({carved}) must divide --dp x "
                             f"--context-parallel-size ({self.dp} x {self.cp} = {self.dp * self.cp}): the "
                             "expert group is carved from the data x context ranks (Megatron's layout)")

    def _check_cp(self) -> None:
        """--context-parallel-size and --cp-comm-type, with what context parallelism cannot run yet."""
        from fmoe.parallel.context_parallel import KINDS

        if self.cp_comm_type not in KINDS:
            raise ValueError(f"--cp-comm-type must be one of {', '.join(KINDS)}, got {self.cp_comm_type!r}")
        if self.cp == 1:
            return
        if self.seq_length % (2 * self.cp):
            raise ValueError(f"--context-parallel-size {self.cp} cuts each sequence into {2 * self.cp} "
                             f"equal chunks (causal load balancing): --seq-length ({self.seq_length}) must "
                             f"divide by {2 * self.cp}")
        refused = {"--attention": self.attention is not None, "--router": self.router is not None,
                   "--moe-dynamic-capacity-window": bool(self.moe_dynamic_capacity_window),
                   "core_attn recompute": self.recompute_choice().module("core_attn"),
                   "mla_up_proj recompute": self.recompute_choice().module("mla_up_proj")}
        for flag, given in refused.items():
            if given:
                raise ValueError(f"--context-parallel-size {self.cp} with {flag} is not built yet")

    def _check_routing(self) -> None:
        """Group-limited routing and dynamic capacity, named by their flags (MoEConfig checks them too)."""
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together (group-limited "
                             "routing: a token picks experts from its group-topk best groups)")
        if groups is not None:
            if groups < 1 or self.num_experts % groups:
                raise ValueError(f"--moe-router-num-groups ({groups}) must divide --num-experts "
                                 f"({self.num_experts})")
            if not 1 <= group_topk <= groups:
                raise ValueError(f"--moe-router-group-topk must lie in [1, --moe-router-num-groups = "
                                 f"{groups}], got {group_topk}")
            reach = group_topk * (self.num_experts // groups)
            if self.moe_router_topk > reach:
                raise ValueError(f"--moe-router-topk ({self.moe_router_topk}) exceeds the {reach} experts of "
                                 f"{group_topk} groups")
        window = self.moe_dynamic_capacity_window
        if window < 0:
            raise ValueError(f"--moe-dynamic-capacity-window must be >= 0, got {window}")
        if window and self.moe_expert_capacity_factor is not None:
            raise ValueError("--moe-dynamic-capacity-window is dropless with a forecast capacity: leave out "
                             "--moe-expert-capacity-factor")
        if not self.moe_dynamic_capacity_margin >= 1.0:
            raise ValueError(f"--moe-dynamic-capacity-margin must be >= 1, got "
                             f"{self.moe_dynamic_capacity_margin}")

    def _check_data(self) -> None:
        from fmoe.train.data_source import check_data_source

        check_data_source(self)
        if self.data == "markov":
            return
        if not Path(self.data).is_file():
            raise ValueError(f"--data: no such file {self.data}")
        kinds = ", ".join(DATA_KINDS[1:])
        if self.data_kind is None:
            # the file's name says nothing reliable about its tokens: a text file read as bin16 fails
            # only inside the ranks, at the first token over the vocabulary
            raise ValueError(f"--data {self.data} needs --data-kind ({kinds})")
        if self.data_kind not in DATA_KINDS[1:]:
            raise ValueError(f"--data-kind must be one of {kinds}, got {self.data_kind!r}")
        if self.data_kind == "text" and self.vocab_size < 256:
            raise ValueError("--data-kind text is byte level: --vocab-size must be >= 256, got "
                             f"{self.vocab_size}")
        from fmoe.train.data import file_dataset  # memory-maps the file: reads nothing

        file_dataset(self.data, self.data_kind, self.seq_length, self.vocab_size)  # its size fits a window


def _flag(name: str) -> str:
    return name.replace("_", "-")


# old field -> its Megatron name: still read (TOML files, flags), with a FutureWarning
RENAMED = {"warmup": "lr_warmup_iters"}


def _renamed(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with each RENAMED field under its new name (a FutureWarning says so); ValueError when both
    names are given different values."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out and out[new] != value:
            raise ValueError(f"--{_flag(old)} ({value}) is the old name of --{_flag(new)} ({out[new]}): "
                             f"give --{_flag(new)} only")
        warnings.warn(f"--{_flag(old)} is deprecated: use --{_flag(new)} (same meaning; the LR schedule now "
                      "follows Megatron's, see docs/train.md)", FutureWarning, stacklevel=3)
        out[new] = value
    return out


def _virtual_stages(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`values` with Megatron's --num-layers-per-virtual-pipeline-stage N turned into the vpp it means,
    num_layers / (pp x N) chunks per pipeline rank; ValueError unless that divides, or when
    --num-virtual-stages-per-pipeline-rank says otherwise."""
    n = values.get("num_layers_per_virtual_pipeline_stage")
    if n is None:
        return values
    layers = values.get("num_layers", defaults["num_layers"])
    pp = values.get("pp", defaults["pp"])
    if not isinstance(n, int) or n < 1 or layers % (pp * n):
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage ({n}) must be a positive integer that "
                         f"divides --num-layers ({layers}) / --pp ({pp})")
    vpp = layers // (pp * n)
    given = values.get("num_virtual_stages_per_pipeline_rank")
    if given is not None and given != vpp:
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {n} means {vpp} virtual stages per "
                         f"pipeline rank, but --num-virtual-stages-per-pipeline-rank is {given}: give one")
    return {**values, "num_virtual_stages_per_pipeline_rank": vpp}


def _check_type(name: str, value: Any, annotation: Any) -> None:
    """Raises ValueError unless `value` fits the field's annotation (a string like "int | None")."""
    kinds = {"int": int, "float": (int, float), "bool": bool, "str": str}
    text = str(annotation)
    if value is None and "None" in text:
        return
    base = text.split("|")[0].strip()
    if base.startswith("dict"):
        return
    if base.startswith("tuple"):  # tuple[str, ...]
        if not (isinstance(value, tuple) and value and all(isinstance(v, str) for v in value)):
            raise ValueError(f"option {_flag(name)} must be a non-empty list of names, got {value!r}")
        return
    ok = isinstance(value, kinds[base]) and (base == "bool" or not isinstance(value, bool))
    if not ok:
        raise ValueError(f"option {_flag(name)} must be {text}, got {value!r}")


def read_toml(path: str) -> dict[str, Any]:
    """Returns the fields a TOML config file sets (flat keys, Megatron's names with - or _)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config: no such file {path}")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8-sig"))  # a BOM (Windows editors) is no statement
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in out:  # TOML sees two keys; kept silently, the later one would win
            raise ValueError(f"--config {path}: {spelled[name]!r} and {key!r} both set {_flag(name)}; "
                             "keep one")
        out[name], spelled[name] = value, key
    return out


def _deepseek_like(hidden: int, vocab: int, seq: int) -> dict[str, Any]:
    """A DeepSeek-V3-shaped preset: 61 layers (3 dense of ffn 18432), MLA of 128 heads (q_lora 1536,
    kv_lora 512, qk 128 + rope 64, v 128), 256 routed experts of ffn 2048 + 1 shared, top 8 of sigmoid
    scores from 4 of 8 groups with an aux-loss-free bias, MTP; laid out on 8 expert-parallel ranks."""
    return {"num_layers": 61, "hidden_size": hidden, "ffn_hidden_size": 18432, "moe_ffn_hidden_size": 2048,
            "num_experts": 256, "moe_router_topk": 8, "num_attention_heads": 128, "first_k_dense": 3,
            "moe_shared_experts": 1, "vocab_size": vocab, "mtp": True, "multi_latent_attention": True,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
            "v_head_dim": 128, "moe_router_score_function": "sigmoid", "moe_router_num_groups": 8,
            "moe_router_group_topk": 4, "moe_router_bias_update_rate": 1e-3, "moe_aux_loss_coeff": 1e-4,
            "seq_length": seq, "micro_batch_size": 1, "global_batch_size": 64, "pp": 1, "ep": 8}


PRESETS: dict[str, dict[str, Any]] = {
    # pp 2 x ep 2 = 4 ranks, DualPipeV with fb overlap, on CPU, about a minute on 2 cores
    "tiny": {},
    # the planner's architectures (fmoe/plan/specs.py MODEL_PRESETS), for the config check's judgement of a
    # layout (`fmoe train --preset deepseek-v3 --pp .. --ep ..` fails or passes before launch); 671B and
    # 718B of weights: not for building on one machine
    "deepseek-v3": _deepseek_like(7168, 129280, 4096),
    "pangu-ultra-moe": _deepseek_like(7680, 153376, 8192),
    "small": {"num_layers": 8, "hidden_size": 128, "ffn_hidden_size": 384, "moe_ffn_hidden_size": 128,
              "num_experts": 16, "moe_router_topk": 4, "num_attention_heads": 8, "num_query_groups": 4,
              "vocab_size": 256, "seq_length": 128, "global_batch_size": 64, "steps": 300},
}
