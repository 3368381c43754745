"""Train an MoE GPT: spawns the local ranks its layout needs, or runs under torchrun.

Examples:
  fmoe train                                    # the tiny preset: pp 2 x ep 2, DualPipeV, fb overlap
  fmoe train --pp 1 --ep 1 --steps 50           # one process
  fmoe train --config run.toml --save ckpt --save-interval 50
  fmoe train --save ckpt --resume               # continue from the latest checkpoint in ckpt
  fmoe train --save ckpt --overwrite-save       # a fresh run that replaces the one in ckpt
  fmoe train --pp 2 --ep 1 --schedule-file my_1f1b.txt   # a schedule written out (docs/schedules.md)
  torchrun --nnodes 2 --nproc-per-node 8 ... -m fmoe.cli.main train --preset small --pp 2 --ep 8 \
      --global-batch-size 256
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings

from fmoe.recompute import MODULES as RECOMPUTE_MODULES
from fmoe.schedule.registry import ALL_NAMES
from fmoe.train.config import ACCUMULATE, DATA_KINDS, DISPATCHERS, DTYPES, PRESETS, RENAMED, TrainConfig

# flag -> help; the flag's type and field come from TrainConfig (--hidden-size -> hidden_size)
HELP = {
    "num_layers": "transformer layers", "hidden_size": "model width",
    "ffn_hidden_size": "dense-layer ffn width",
    "moe_ffn_hidden_size": "expert ffn width", "num_experts": "routed experts",
    "moe_router_topk": "experts per token", "num_attention_heads": "query heads",
    "num_query_groups": "kv heads (GQA)", "first_k_dense": "leading dense layers",
    "moe_shared_experts": "shared experts", "vocab_size": "vocabulary (the Markov corpus uses it too)",
    "mtp": "DeepSeek-V3 multi-token prediction (depth 1)", "mtp_loss_scaling_factor": "MTP loss weight",
    "kv_channels": "head dim (default: --hidden-size / --num-attention-heads)",
    "rotary_base": "RoPE base (theta)", "norm_epsilon": "RMSNorm epsilon",
    "qk_layernorm": "RMSNorm over each head's q and k before RoPE (Qwen3)",
    "multi_latent_attention": "multi-head latent attention (DeepSeek-V2/V3) instead of GQA: the flags below",
    "q_lora_rank": "MLA: query latent width (default: no query latent, a plain projection)",
    "kv_lora_rank": "MLA: key/value latent width", "qk_head_dim": "MLA: a head's non-rotary qk dim",
    "qk_pos_emb_head_dim": "MLA: a head's rotary qk dim (even)", "v_head_dim": "MLA: a head's value dim",
    "moe_router_pre_softmax": "softmax over all experts, top-k weights not renormalised (default: "
                              "renormalised over the top k, a softmax over the k selected logits)",
    "moe_router_score_function": "softmax or sigmoid", "moe_aux_loss_coeff": "load-balancing loss weight",
    "moe_router_load_balancing_type": "aux_loss (over the micro batch), seq_aux_loss (per sequence, "
                                      "DeepSeek-V3's) or none: what --moe-aux-loss-coeff weighs",
    "moe_z_loss_coeff": "router z-loss", "moe_router_bias_update_rate": "aux-loss-free expert bias rate",
    "moe_expert_capacity_factor": "capacity factor (default dropless)",
    "moe_pad_expert_input_to_capacity": "pad every expert to capacity",
    "moe_token_drop_policy": "probs or position",
    "moe_router_num_groups": "group-limited routing: expert groups (with --moe-router-group-topk)",
    "moe_router_group_topk": "group-limited routing: groups a token may pick its experts from",
    "moe_dynamic_capacity_window": "dropless, padded to a capacity forecast from the last W steps' loads and "
                                   "agreed over the expert group (0: off)",
    "moe_dynamic_capacity_margin": "the forecast's factor over the window's largest load (>= 1)",
    "router": "MODULE:FUNCTION of a router replacing fmoe.router.route (fmoe.seams.Router; "
              "docs/research.md), e.g. fmoe.examples.routers:expert_choice",
    "experts": "MODULE:FUNCTION of the routed experts replacing fmoe.experts.routed_experts "
               "(fmoe.seams.Experts)",
    "attention": "MODULE:FUNCTION of the core attention replacing fmoe.ops.attention (fmoe.seams.Attention)",
    "recompute_granularity": "full (whole layers keep only their input) or selective (--recompute-modules); "
                             "default: nothing recomputed",
    "recompute_method": "full: uniform (every layer, default) or block (the first --recompute-num-layers of "
                        "each pipeline chunk)",
    "recompute_num_layers": "full: layers per pipeline chunk recomputed (block), 1 (uniform)",
    "recompute_modules": f"selective: the parts to recompute, of {', '.join(RECOMPUTE_MODULES)} "
                         "(default core_attn)",
    "moe_adaptive_recompute_activation": "recompute a layer's routed experts in a step whose largest expert "
                                         "load exceeds the scale x the mean (seed 002)",
    "moe_adaptive_recompute_activation_scale": "the adaptive recompute's threshold (default 2.0)",
    "seq_length": "tokens per sequence",
    "micro_batch_size": "sequences per microbatch", "global_batch_size": "sequences per step, all ranks",
    "pp": "pipeline ranks",
    "ep": "expert-parallel ranks, beside the data and context ranks (data ranks: dp x ep)",
    "dp": "data-parallel replicas (with --expert-model-parallel-size: the ranks reading different data)",
    "expert_model_parallel_size": "Megatron's EP: the expert group carved from the data x context ranks "
                                  "(world pp x dp x tp x cp; it divides dp x cp, the cp ranks of a sequence "
                                  "sharing the experts); instead of --ep",
    "tp": "tensor-parallel ranks (Megatron's --tensor-model-parallel-size; extends ep for the experts)",
    "sequence_parallel": "shard the sequence over the tp ranks outside the TP regions (needs --tp > 1)",
    "context_parallel_size": "context-parallel ranks: each sequence split over them, attention across the "
                             "split (Megatron's flag)",
    "cp_comm_type": "context parallelism's attention: p2p (ring, default) or all_gather",
    "schedule": f"{', '.join(ALL_NAMES + (ACCUMULATE,))} (default: dualpipev for pp > 1, combined_1f1b for "
                "pp 1 with ep > 1, accumulate otherwise)",
    "schedule_file": "a schedule written out in its printed form (docs/schedules.md), instead of --schedule: "
                     "one line per pipeline rank (--pp), its microbatches the batch flags' per rank and step",
    "dualpipev_dw_detach": "DualPipeV's cooldown splits B into I and W",
    "overlap": "fb overlap of F&B pairs (default on)",
    "fuse_iw": "run an I whose W comes next as one B (default on)",
    "compile": "torch.compile every phase of the pipeline as three graphs, forward, dx and dw, with explicit "
               "residuals (inductor; torchtitan's flag): its time is printed after the run",
    "compile_backend": "--compile's torch.compile backend: inductor (default), or aot_eager / eager (the "
                       "same graphs, op by op)",
    "dispatcher": ", ".join(DISPATCHERS),
    "a2a_chunks": "2: a forward without an F&B pair (warmup, cooldown) moves each MoE layer's all-to-all in "
                  "two row chunks, each travelling while the other's experts run (--dispatcher alltoall)",
    "pair_overlap": "how an F&B pair hides each MoE layer's all-to-all: pair (the other microbatch's "
                    "compute, default), self (row chunks, no handover; --dispatcher alltoall), none",
    "ranks_per_node": "treat this many consecutive local ranks as one node",
    "link_model": "intra=BYTES_PER_S,inter=BYTES_PER_S[,intra_latency=S,inter_latency=S]",
    "num_layers_per_virtual_pipeline_stage": "Megatron's other vpp flag: layers per model chunk (vpp = "
                                             "num-layers / (pp x N))",
    "num_virtual_stages_per_pipeline_rank": "vpp: model chunks per rank of the interleaved schedules "
                                            "(default 2; other schedules run their own count)",
    "lr": "peak learning rate", "min_lr": "learning rate at the end of the decay (--lr-decay-iters)",
    "lr_warmup_iters": "steps of linear warmup from --lr-warmup-init to --lr (was --warmup)",
    "lr_warmup_init": "learning rate the warmup starts from",
    "lr_decay_style": "constant, linear, cosine, inverse-square-root or WSD (warmup-stable-decay)",
    "lr_decay_iters": "step at which the decay reaches --min-lr (default: --steps)",
    "lr_wsd_decay_iters": "WSD: steps of the final anneal, ending at --lr-decay-iters",
    "lr_wsd_decay_style": "WSD: linear, cosine, exponential or minus_sqrt anneal",
    "clip_grad": "global gradient-norm clip (0: off)", "weight_decay": "AdamW weight decay",
    "use_distributed_optimizer": "ZeRO-1: shard the AdamW state over the ranks replicating each weight",
    "adam_beta1": "AdamW beta1", "adam_beta2": "AdamW beta2", "adam_eps": "AdamW eps",
    "steps": "training steps",
    "seed": "weights and data order", "dtype": ", ".join(DTYPES) + " (weights and compute alike)",
    "bf16": "mixed precision: fp32 master weights and gradient sums, bf16 compute (default on CUDA/NPU; "
            "--no-bf16 computes in fp32 there)",
    "tf32": "fp32 matmuls on TF32 tensor cores on CUDA (default on)",
    "compute_model": "SCALE: from step 2 hold every executor compute phase to SCALE x its median in step 1 "
                     "(all ranks), as devices would compute while exchanges travel (0: off; measuring only)",
    "deterministic": "bitwise-reproducible steps on a device: torch.use_deterministic_algorithms, cuBLAS "
                     "workspace and NCCL's ring algorithm pinned (Megatron's --deterministic-mode; slower)",
    "device": "auto (CUDA if there are GPUs, else NPUs, else CPU), cpu, cuda or npu",
    "fp16": "mixed precision with fp16 compute and loss scaling (dynamic unless --loss-scale)",
    "loss_scale": "a fixed loss scale for --fp16 (default: dynamic)",
    "initial_loss_scale": "--fp16's first dynamic loss scale", "min_loss_scale": "the dynamic scale's floor",
    "loss_scale_window": "clean steps before the dynamic scale doubles",
    "hysteresis": "overflowing steps tolerated before the dynamic scale halves",
    "data": "'markov' (embedded corpus with a known floor) or a file",
    "data_kind": ", ".join(DATA_KINDS[1:]) + " (required with a file --data)",
    "markov_sequences": "sequences in the Markov corpus", "save": "checkpoint directory",
    "data_path": "Megatron indexed datasets (PREFIX.bin / .idx): one PREFIX, or weights and prefixes "
                 "blended (0.3 A 0.7 B); instead of --data (docs/data.md)",
    "tokenizer_type": "HuggingFaceTokenizer, SentencePieceTokenizer, ByteLevelTokenizer or NullTokenizer: "
                      "gives --vocab-size (padded) and the EOD token",
    "tokenizer_model": "the tokenizer's file: tokenizer.json (or its directory), a sentencepiece .model",
    "make_vocab_size_divisible_by": "pad the tokenizer's vocabulary to a multiple of this x --tp (default "
                                    "128; applies when --vocab-size is not given)",
    "eod_mask_loss": "no loss on the target after an end-of-document token (--data-path with a tokenizer)",
    "reset_position_ids": "RoPE positions restart at 0 after each end-of-document token (--data-path with a "
                          "tokenizer; Megatron's)",
    "reset_attention_mask": "attention within a document only: a token sees the earlier tokens of its own "
                            "document (--data-path with a tokenizer; Megatron's)",
    "override_data": "--resume / --load on other data (source, blend, split, seed, --seq-length, files) than "
                     "the checkpoint's (refused without it: the run would not continue its sample stream)",
    "save_interval": "steps between checkpoints (and one at the end)",
    "load": "checkpoint directory (or a --save directory: its latest) to start from",
    "resume": "continue from the latest checkpoint in --save (refused when there is none)",
    "overwrite_save": "a fresh run deletes the checkpoints already in --save (refused without it)",
    "override_opt_param_scheduler": "--resume / --load with another LR schedule (--lr, --min-lr, --lr-* or "
                                    "--steps) than the checkpoint's (refused without it: the LR would jump)",
    "split": "train,valid,test weights over a data file's windows or --data-path's documents (Megatron's "
             "--split; the Markov corpus draws its validation set apart)",
    "eval_interval": "steps between held-out evaluations, and one after the last step (0: none)",
    "eval_iters": "global batches of held-out data per evaluation",
    "tensorboard_dir": "also write the metrics as TensorBoard events here (rank 0; pip install "
                       "'fmoe[tensorboard]')",
    "wandb_project": "also log the metrics to this Weights & Biases project (rank 0; needs wandb)",
    "wandb_exp_name": "the W&B run's name", "wandb_save_dir": "W&B's local directory (default: --save/wandb)",
    "metrics": "JSON line per step to this file",
    "trace": "measured Chrome trace of one step (and its PNG)", "trace_step": "which step --trace records",
    "loss_curve": "loss-curve PNG", "progress": "progress bar (default on)",
    "moe_per_layer_logging": "each MoE layer's tokens per expert (and the aux-loss-free expert bias) every "
                             "step: in the metrics file, and as per-expert histograms in TensorBoard / W&B",
    "log_interval": "without the bar (--no-progress): a line every N steps (Megatron's; 0: none)",
    "timeout": "seconds a collective may wait before the run fails",
    "keep_host_memory": "CPU ranks keep freed heap memory for the next step (default on; glibc)",
}


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return " ".join(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def defaults_text(name: str) -> str:
    """What `--help` adds after field `name`'s help: " [default: V]" (the tiny preset's, TrainConfig's),
    with each preset that sets another value ("; small: 8"); "" where the default is None (the help
    says what not giving it means)."""
    default = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == name)
    others = [f"{preset}: {_shown(values[name])}" for preset, values in PRESETS.items()
              if name in values and values[name] != default]
    if default is None and not others:
        return ""
    return f" [default: {'none' if default is None else _shown(default)}{''.join('; ' + o for o in others)}]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers `fmoe train`'s options on `parser`: --preset, --config and one flag per TrainConfig field
    (given flags override the config file, which overrides the preset)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--config", help="TOML file setting the same fields (flags override it)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).split("|")[0].strip()
        text = HELP[f.name] + defaults_text(f.name)
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=text)
        elif kind.startswith("tuple"):  # tuple[str, ...]: names after the flag, as Megatron's lists
            parser.add_argument(flag, nargs="+", metavar="NAME", default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(flag, type={"int": int, "float": float, "str": str}[kind],
                                default=argparse.SUPPRESS, help=text)
    for old, new in RENAMED.items():  # still read, with a warning (TrainConfig.build)
        parser.add_argument("--" + old.replace("_", "-"), type=int, default=argparse.SUPPRESS,
                            help=f"deprecated: --{new.replace('_', '-')}")


def run(args: argparse.Namespace) -> int:
    """Builds the TrainConfig from the preset, --config and the given flags, and launches the job;
    returns its exit code (2 with one `fmoe train: error: ...` line for a bad option or layout)."""
    from fmoe.train.launch import launch

    given = {k: v for k, v in vars(args).items() if k not in ("command", "preset", "config")}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FutureWarning)
            tc = TrainConfig.from_sources(args.preset, args.config, given)
    except ValueError as exc:
        print(f"fmoe train: error: {exc}")
        return 2
    for w in caught:  # a deprecated flag or TOML key: one line, not a warning with its source line
        print(f"fmoe train: warning: {w.message}", file=sys.stderr)
    return launch(tc)
