"""A flag that modifies another, given without it, is refused in one line before launch (issue 48): one
table (fmoe.train.modifiers.TRAIN_MODIFIERS, and fmoe plan's PLAN_MODIFIERS), walked here entry by entry:
each modifier alone is refused naming itself and the flag it needs; with that flag in effect the rule
says nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from fmoe.cli.plan import PLAN_MODIFIERS
from fmoe.train.config import TrainConfig
from fmoe.train.modifiers import TRAIN_MODIFIERS, unmodified

DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
# a value other than the default, for the fields whose type gives none by itself
OTHER = {"data_kind": "bin16", "moe_token_drop_policy": "position", "lr_wsd_decay_style": "cosine",
         "cp_comm_type": "all_gather", "split": "90,10,0", "recompute_method": "block",
         "recompute_modules": ("moe",), "tokenizer_model": "tok.json", "wandb_exp_name": "run",
         "wandb_save_dir": "wb"}
# the table's flag -> fields that put it in effect
ENABLE: dict[str, dict[str, Any]] = {
    "--moe-dynamic-capacity-window > 0": {"moe_dynamic_capacity_window": 4},
    "--data FILE": {"data": "tokens.bin"},
    "--data markov (the default, without --data-path)": {},
    "--data FILE or --data-path (the Markov corpus draws its validation set apart)": {"data_path": ("p",)},
    "--eval-interval > 0": {"eval_interval": 5},
    "--save DIR": {"save": "ckpt"},
    "--resume or --load": {"load": "ckpt"},
    "--trace FILE": {"trace": "t.json"},
    "--wandb-project": {"wandb_project": "p"},
    "--fp16": {"fp16": True},
    "--tp > 1": {"tp": 2},
    "--context-parallel-size > 1": {"context_parallel_size": 2},
    "--mtp": {"mtp": True},
    "--multi-latent-attention": {"multi_latent_attention": True},
    "--moe-router-score-function softmax": {},
    "--moe-expert-capacity-factor": {"moe_expert_capacity_factor": 1.25},
    "--moe-adaptive-recompute-activation": {"moe_adaptive_recompute_activation": True},
    "--recompute-granularity full": {"recompute_granularity": "full"},
    "--recompute-granularity selective": {"recompute_granularity": "selective"},
    "--lr-decay-style WSD": {"lr_decay_style": "WSD"},
    "--lr-warmup-iters > 0": {},
    "a decaying --lr-decay-style (not constant)": {},
    "--tokenizer-type": {"tokenizer_type": "ByteLevelTokenizer"},
    "--data-path": {"data_path": ("p",)},
    "--data-path with --tokenizer-type": {"data_path": ("p",), "tokenizer_type": "ByteLevelTokenizer"},
    "--schedule dualpipev": {},
    "--no-progress (the bar shows every step)": {"progress": False},
}
# what turns the flag off where the default has it on
DISABLE = {"--data markov (the default, without --data-path)": {"data_path": ("p",)},
           "--moe-router-score-function softmax": {"moe_router_score_function": "sigmoid"},
           "--lr-warmup-iters > 0": {"lr_warmup_iters": 0},
           "a decaying --lr-decay-style (not constant)": {"lr_decay_style": "constant"},
           "--schedule dualpipev": {"pp": 1, "ep": 1}}


def _other(name: str) -> Any:
    if name in OTHER:
        return OTHER[name]
    default, kind = DEFAULTS[name], str(TrainConfig.__dataclass_fields__[name].type)
    if kind.startswith("bool"):
        return not default
    if kind.startswith("int"):
        return (default or 0) + 1
    return (default or 1.0) * 2


@pytest.mark.parametrize("name", list(TRAIN_MODIFIERS))
def test_each_train_modifier_needs_its_flag(name: str) -> None:
    needs = TRAIN_MODIFIERS[name]
    flag = "--" + name.replace("_", "-")
    alone = TrainConfig(**{**DISABLE.get(needs.flag, {}), name: _other(name)})
    message = unmodified(TRAIN_MODIFIERS, alone, DEFAULTS)
    assert message == f"{flag} applies to {needs.flag} only: give {needs.flag} or leave out {flag}"
    with_it = TrainConfig(**{**ENABLE[needs.flag], name: _other(name)})
    assert unmodified(TRAIN_MODIFIERS, with_it, DEFAULTS) is None, name
    assert unmodified(TRAIN_MODIFIERS, TrainConfig(), DEFAULTS) is None  # the tiny preset gives none


@pytest.mark.parametrize("flags, needle", [
    (("--moe-dynamic-capacity-margin", "1.5"), "--moe-dynamic-capacity-margin applies to "
                                               "--moe-dynamic-capacity-window > 0 only"),
    (("--data-kind", "bin16"), "--data-kind applies to --data FILE only"),
    (("--trace-step", "2"), "--trace-step applies to --trace FILE only"),
])
def test_the_command_line_refuses_a_lone_modifier_in_one_line(capsys, no_launch: None, flags: tuple,
                                                               needle: str) -> None:
    from fmoe.cli.main import main

    assert main(["train", "--no-progress", *flags]) == 2
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if ln.strip()]
    assert lines == [f"fmoe train: error: {needle}: give {needle.split(' applies to ')[1][:-5]} or leave out "
                     f"{flags[0]}"], lines


@pytest.mark.parametrize("flag", ["--first-extra", "--last-extra", "--placement"])
def test_simulate_refuses_a_layer_placement_flag_without_layers(capsys, flag: str) -> None:
    from fmoe.cli.main import main
    from fmoe.cli.simulate import SIMULATE_MODIFIERS

    assert set(SIMULATE_MODIFIERS) == {"first_extra", "last_extra", "placement"}
    value = "even" if flag == "--placement" else "1"
    assert main(["simulate", flag, value]) == 2
    want = f"error: {flag} applies to --layers N only: give --layers N or leave out {flag}"
    assert capsys.readouterr().out.strip() == want
    assert main(["simulate", "--layers", "8", flag, value]) == 0


def test_plan_refuses_a_schedule_without_explain(capsys) -> None:
    from fmoe.cli.main import main

    assert set(PLAN_MODIFIERS) == {"schedule"}
    assert main(["plan", "--model", "tiny", "--cluster", "local", "--devices", "2", "--schedule", "zbv"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("fmoe plan: error: --schedule applies to --explain LAYOUT only: give --explain LAYOUT or "
                   "leave out --schedule"), err
