"""One rule for a flag that modifies another: given without the flag it modifies, it is refused in one line
before launch (it would be ignored silently), for `fmoe train` (TRAIN_MODIFIERS) and `fmoe plan` alike.

    problem = unmodified(TRAIN_MODIFIERS, tc, defaults)   # None, or "--x applies to --y only: ..."

A modifier counts as given when its value differs from its default (a flag, a TOML key or a preset may
set it); the table says, per modifier, the flag it needs and when that flag is in effect.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Needs:
    """What a modifier needs: `flag`, as the message names it ("--fp16", "--tp > 1"), and `active(run)`,
    whether it is in effect for `run` (a TrainConfig, an argparse Namespace)."""

    flag: str
    active: Callable[[Any], bool]


def unmodified(table: Mapping[str, Needs], run: Any, defaults: Mapping[str, Any]) -> str | None:
    """One line naming the first modifier of `table` (attribute name -> Needs) that `run` gives (its value
    differs from `defaults`) while the flag it modifies is not in effect; else None."""
    for name, needs in table.items():
        if getattr(run, name) != defaults[name] and not needs.active(run):
            flag = "--" + name.replace("_", "-")
            return f"{flag} applies to {needs.flag} only: give {needs.flag} or leave out {flag}"
    return None


def parser_defaults(add_arguments: Callable[[argparse.ArgumentParser], None],
                    names: Iterable[str]) -> dict[str, Any]:
    """The defaults a command's `add_arguments` gives the options `names` (for `unmodified` on its args)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {name: parser.get_default(name) for name in names}


def _any(*names: str, needs: Needs) -> dict[str, Needs]:
    return dict.fromkeys(names, needs)


FP16 = Needs("--fp16", lambda tc: tc.fp16)
SAVE = Needs("--save DIR", lambda tc: bool(tc.save))
MLA = Needs("--multi-latent-attention", lambda tc: tc.multi_latent_attention)
CAPACITY = Needs("--moe-expert-capacity-factor", lambda tc: tc.moe_expert_capacity_factor is not None)
WSD = Needs("--lr-decay-style WSD", lambda tc: tc.lr_decay_style == "WSD")
TOKENIZER = Needs("--tokenizer-type", lambda tc: tc.tokenizer_type is not None)
WANDB = Needs("--wandb-project", lambda tc: tc.wandb_project is not None)
CONTINUED = Needs("--resume or --load", lambda tc: tc.resume or tc.load is not None)

# TrainConfig field -> what it needs (fmoe.train.config.TrainConfig._check reads it first)
TRAIN_MODIFIERS: dict[str, Needs] = {
    "moe_dynamic_capacity_margin": Needs("--moe-dynamic-capacity-window > 0",
                                         lambda tc: tc.moe_dynamic_capacity_window > 0),
    "data_kind": Needs("--data FILE", lambda tc: tc.data != "markov"),
    "markov_sequences": Needs("--data markov (the default, without --data-path)",
                              lambda tc: tc.data == "markov" and tc.data_path is None),
    "split": Needs("--data FILE or --data-path (the Markov corpus draws its validation set apart)",
                   lambda tc: tc.data != "markov" or tc.data_path is not None),
    "eval_iters": Needs("--eval-interval > 0", lambda tc: tc.eval_interval > 0),
    **_any("save_interval", "resume", "overwrite_save", needs=SAVE),
    **_any("override_data", "override_opt_param_scheduler", needs=CONTINUED),
    "trace_step": Needs("--trace FILE", lambda tc: bool(tc.trace)),
    "log_interval": Needs("--no-progress (the bar shows every step)", lambda tc: not tc.progress),
    **_any("wandb_exp_name", "wandb_save_dir", needs=WANDB),
    **_any("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis",
           needs=FP16),
    "sequence_parallel": Needs("--tp > 1", lambda tc: tc.tp > 1),
    "cp_comm_type": Needs("--context-parallel-size > 1", lambda tc: tc.context_parallel_size > 1),
    "mtp_loss_scaling_factor": Needs("--mtp", lambda tc: tc.mtp),
    **_any("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", needs=MLA),
    "moe_router_pre_softmax": Needs("--moe-router-score-function softmax",
                                    lambda tc: tc.moe_router_score_function == "softmax"),
    **_any("moe_token_drop_policy", "moe_pad_expert_input_to_capacity", needs=CAPACITY),
    "moe_adaptive_recompute_activation_scale": Needs("--moe-adaptive-recompute-activation",
                                                     lambda tc: tc.moe_adaptive_recompute_activation),
    **_any("recompute_method", "recompute_num_layers",
           needs=Needs("--recompute-granularity full", lambda tc: tc.recompute_granularity == "full")),
    "recompute_modules": Needs("--recompute-granularity selective",
                               lambda tc: tc.recompute_granularity == "selective"),
    **_any("lr_wsd_decay_iters", "lr_wsd_decay_style", needs=WSD),
    "lr_warmup_init": Needs("--lr-warmup-iters > 0", lambda tc: tc.lr_warmup_iters > 0),
    "min_lr": Needs("a decaying --lr-decay-style (not constant)", lambda tc: tc.lr_decay_style != "constant"),
    **_any("tokenizer_model", "make_vocab_size_divisible_by", needs=TOKENIZER),
    # documents: their end-of-document token comes from --data-path's tokenizer
    **_any("eod_mask_loss", "reset_position_ids", "reset_attention_mask",
           needs=Needs("--data-path with --tokenizer-type",
                       lambda tc: tc.data_path is not None and tc.tokenizer_type is not None)),
    # a --schedule-file's own message says to write DualPipeV's I and W ops into the file
    "dualpipev_dw_detach": Needs("--schedule dualpipev", lambda tc: tc.schedule_file is not None
                                 or tc.schedule_name.startswith("dualpipev")),
}
