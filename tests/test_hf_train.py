"""`fmoe train` on checkpoints converted from Hugging Face (issue 34): the architecture flags
(--kv-channels, --rotary-base, --norm-epsilon, --qk-layernorm, --moe-router-pre-softmax) that
`fmoe convert hf-to-fmoe` writes into model.toml, the original config.json carried through training into
the export, and an --fp16 run's fresh loss scale when its --load checkpoint has none.

End to end through the CLI on one process (pp 1, ep 1: `fmoe train` runs the rank in this process),
against transformers' own models (random weights, no download; helpers of tests/test_hf.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from test_hf import ATOL, _hf_logits, _hf_model, _ids, _saved
from transformers import AutoModelForCausalLM

from fmoe.cli.main import main as fmoe_main
from fmoe.hf import load_hf, read_config
from fmoe.hf.checkpoint import load_fmoe, one_process
from fmoe.model import gpt_logits
from fmoe.train.checkpoint import CheckpointError
from fmoe.train.config import TrainConfig, read_toml

# a tiny run: 2 steps of 2 sequences of 8 tokens; no warmup, so both steps change the weights
RUN = ["--pp", "1", "--ep", "1", "--device", "cpu", "--no-progress", "--no-keep-host-memory", "--seq-length",
       "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--markov-sequences", "16", "--steps", "2",
       "--lr-warmup-iters", "0"]
NEW_FLAGS = ("kv_channels", "rotary_base", "norm_epsilon", "qk_layernorm", "moe_router_pre_softmax")


def _convert(model: torch.nn.Module, tmp_path: Path) -> tuple[Path, Path]:
    hf_dir = _saved(model, tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    assert fmoe_main(["convert", "hf-to-fmoe", "--hf", str(hf_dir), "--save", str(ckpt)]) == 0
    return hf_dir, ckpt


def test_the_architecture_flags_build_the_model_and_default_to_the_old_one() -> None:
    """Megatron's names, passed to GPTConfig / MoEConfig; the defaults build what fmoe train built before;
    `fmoe train --help` and TrainConfig's docstring list them; pre-softmax is a softmax-router option."""
    old = TrainConfig().model()
    assert (old.head_dim, old.rope_theta, old.norm_eps, old.qk_norm, old.moe.topk_norm) == (
        16, 1e4, 1e-6, False, "after")
    cfg = TrainConfig(kv_channels=32, rotary_base=5e5, norm_epsilon=1e-5, qk_layernorm=True,
                      moe_router_pre_softmax=True).model()
    assert (cfg.head_dim, cfg.rope_theta, cfg.norm_eps, cfg.qk_norm, cfg.moe.topk_norm) == (
        32, 5e5, 1e-5, True, "before")
    assert TrainConfig(pp=1, ep=1, qk_layernorm=True, kv_channels=32).problem() is None
    assert "--moe-router-pre-softmax applies to --moe-router-score-function softmax" in TrainConfig(
        pp=1, ep=1, moe_router_pre_softmax=True, moe_router_score_function="sigmoid").problem()
    with pytest.raises(SystemExit):
        fmoe_main(["train", "--help"])
    from fmoe.cli.train import HELP

    for name in NEW_FLAGS:
        assert name in TrainConfig.__doc__ and HELP[name], name


def test_a_converted_qwen3_moe_trains_and_exports_without_arch(tmp_path: Path, capsys) -> None:
    """Qwen3-MoE (q/k norms, head_dim 16 != hidden / heads, RoPE base 5e5, eps 1e-5, no top-k
    renormalisation, a leading dense layer) -> hf-to-fmoe -> fmoe train --config model.toml --load, 2
    steps -> fmoe-to-hf without --arch: transformers loads it, its logits are the trained fmoe model's,
    and the original config.json's unmapped fields are back."""
    model = _hf_model("qwen3_moe", norm_topk_prob=False, bos_token_id=3, max_position_embeddings=77)
    hf_dir, ckpt = _convert(model, tmp_path)
    said = capsys.readouterr().out
    assert f"train from it: fmoe train --config {ckpt / 'model.toml'} --load {ckpt}" in said, said
    assert "--kv-channels 16 --rotary-base 500000.0 --norm-epsilon 1e-05 --qk-layernorm" in said, said
    toml = read_toml(str(ckpt / "model.toml"))
    assert {k: toml[k] for k in NEW_FLAGS} == {"kv_channels": 16, "rotary_base": 5e5, "norm_epsilon": 1e-5,
                                               "qk_layernorm": True, "moe_router_pre_softmax": True}

    run = tmp_path / "run"
    assert fmoe_main(["train", "--config", str(ckpt / "model.toml"), "--load", str(ckpt), "--save", str(run),
                      *RUN]) == 0
    cfg, trained, meta = load_fmoe(run)
    imported, original = load_hf(hf_dir)
    assert meta["step"] == 2 and meta["hf_config"] == read_config(hf_dir)
    assert replace(cfg, moe=cfg.moe.replace(aux_loss_coef=imported.moe.aux_loss_coef)) == imported
    assert (cfg.head_dim, cfg.rope_theta, cfg.norm_eps, cfg.qk_norm) == (16, 5e5, 1e-5, True)
    assert not torch.equal(trained["layers"][1]["q_norm"], original["layers"][1]["q_norm"])  # it trained

    out = tmp_path / "out"
    assert fmoe_main(["convert", "fmoe-to-hf", "--load", str(run), "--out", str(out)]) == 0
    assert "(qwen3_moe)" in capsys.readouterr().out
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(model)
    ids = _ids()
    torch.testing.assert_close(_hf_logits(back, ids), gpt_logits(trained, ids, cfg), atol=ATOL, rtol=0)
    exported = read_config(out)
    for k in ("bos_token_id", "max_position_embeddings", "router_aux_loss_coef", "head_dim", "rms_norm_eps",
              "rope_parameters", "norm_topk_prob", "mlp_only_layers"):
        assert exported[k] == read_config(hf_dir)[k], k


@pytest.mark.parametrize("flag, value, says", [
    ("kv_channels", 8, "head_dim: checkpoint 16, this run 8"),
    ("rotary_base", 1e4, "rope_theta: checkpoint 500000.0, this run 10000.0"),
    ("norm_epsilon", 1e-6, "norm_eps: checkpoint 1e-05, this run 1e-06"),
    ("qk_layernorm", False, "qk_norm: checkpoint True, this run False"),
    ("moe_router_pre_softmax", True, "moe.topk_norm: checkpoint 'after', this run 'before'"),
])
def test_load_refuses_a_converted_model_its_flags_do_not_build(tmp_path: Path, flag: str, value: Any,
                                                               says: str) -> None:
    """model.toml as written loads; one architecture flag changed is refused naming the field."""
    _, ckpt = _convert(_hf_model("qwen3_moe"), tmp_path)
    from fmoe.train.loop import Trainer, World

    fields = {**read_toml(str(ckpt / "model.toml")), "pp": 1, "ep": 1, "progress": False}
    with one_process():
        Trainer(TrainConfig.build(fields), World(0, 1, None, torch.device("cpu"))).load(
            str(ckpt / "step_00000000"))
        trainer = Trainer(TrainConfig.build({**fields, flag: value}), World(0, 1, None, torch.device("cpu")))
        with pytest.raises(CheckpointError, match=f"holds another model \\({says}"):
            trainer.load(str(ckpt / "step_00000000"))


def _mixtral(tmp_path: Path) -> Path:
    """A converted Mixtral that fmoe train's defaults already build (the loss-scale tests need no flag)."""
    model = _hf_model("mixtral", head_dim=None, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return _convert(model, tmp_path)[1]


def test_fp16_load_of_a_checkpoint_without_loss_scale_starts_it_fresh(tmp_path: Path) -> None:
    """A converted checkpoint holds no train/loss_scale: an --fp16 --load run starts from
    --initial-loss-scale, as a fresh --fp16 run does, and saves its scale for a later --resume."""
    ckpt = _mixtral(tmp_path)
    metrics, run = tmp_path / "m.jsonl", tmp_path / "run"
    assert fmoe_main(["train", "--config", str(ckpt / "model.toml"), "--load", str(ckpt), "--fp16",
                      "--initial-loss-scale", "1024", "--metrics", str(metrics), "--save", str(run),
                      *RUN]) == 0
    lines = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2] and lines[0]["loss_scale"] == 1024.0
    assert all(math.isfinite(ln["loss"]) for ln in lines)
    from fmoe.train.checkpoint import has_key, latest

    assert has_key(latest(run), "train/loss_scale")
    assert not has_key(ckpt / "step_00000000", "train/loss_scale")


def test_fp16_resume_of_a_checkpoint_without_loss_scale_fails_naming_it(tmp_path: Path, capsys) -> None:
    """--resume continues a run as it was: an fp32 run's checkpoint resumed with --fp16 is refused with
    one line that says what is missing and what to do (was: DCP's missing-key error)."""
    ckpt = _mixtral(tmp_path)
    run = tmp_path / "run"
    model = ["--config", str(ckpt / "model.toml")]
    assert fmoe_main(["train", *model, "--load", str(ckpt), "--save", str(run), *RUN]) == 0
    capsys.readouterr()
    assert fmoe_main(["train", *model, "--save", str(run), "--resume", "--fp16", *RUN]) == 1
    err = capsys.readouterr().err
    assert "CheckpointError" in err and "has no loss-scale state (train/loss_scale)" in err, err
    assert "give --load to start this --fp16 run from it with a fresh loss scale" in err, err
