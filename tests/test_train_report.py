"""What `fmoe train` shows while it runs (issue 48): the run's description first, a line every
--log-interval steps without the bar, where its outputs are at the end, what a --load starts from, the
loss curve of a resumed run over the whole run, and a stopped run's PNG and how to continue it.

One-rank runs in this process (`launch` runs a one-rank job in-process), 2 layers, a few steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fmoe.train import launch as launch_mod
from fmoe.train.config import TrainConfig
from fmoe.train.launch import launch
from fmoe.train.loop import Trainer

SMALL = {"pp": 1, "ep": 1, "num_layers": 2, "seq_length": 16, "global_batch_size": 8, "progress": False,
         "device": "cpu", "lr_warmup_iters": 0, "markov_sequences": 256, "keep_host_memory": False}


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The steps each loss curve was drawn from (the real function still draws)."""
    steps: list[list[int]] = []
    real = launch_mod.write_loss_curve

    def spy(history, *args, **kwargs):
        steps.append([m["step"] for m in history])
        return real(history, *args, **kwargs)

    monkeypatch.setattr(launch_mod, "write_loss_curve", spy)
    return steps


def test_a_run_says_what_it_is_first_logs_every_n_steps_and_ends_with_its_paths(tmp_path: Path, capsys,
                                                                                 drawn) -> None:
    metrics, curve, save = tmp_path / "m.jsonl", tmp_path / "loss.png", tmp_path / "ckpt"
    files = {"metrics": str(metrics), "loss_curve": str(curve), "save": str(save)}
    tc = TrainConfig(**SMALL, steps=4, log_interval=2, save_interval=2, **files)
    assert launch(tc) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("fmoe train: 2 layers, D 64") and "pp 1 x ep 1" in out[0], out
    assert "markov" in out[0] and "floor 1.878 nats/token" in out[0] and "steps 1-4" in out[0], out[0]
    assert [ln.split()[3] for ln in out if ln.startswith("fmoe train: step ")] == ["2/4", "4/4"], out
    assert f"  metrics: {metrics}" in out and f"  loss curve: {curve}" in out, out
    assert f"  checkpoints: {save} (latest step_00000004)" in out, out
    assert drawn == [[1, 2, 3, 4]]

    # resumed: the curve is the whole run's (the metrics file's earlier steps), not the resumed half
    resumed = TrainConfig(**SMALL, steps=6, log_interval=2, save_interval=2, resume=True,
                          override_opt_param_scheduler=True, **files)
    assert launch(resumed) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(ln.startswith(f"fmoe train: resumed from {save}") and ln.endswith("at step 4") for ln in out)
    assert drawn[-1] == [1, 2, 3, 4, 5, 6]
    assert [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]

    # stopped by Ctrl-C after step 5 of 8: the PNG drawn from the metrics file, and how to continue
    real_step = Trainer.step

    def step_then_stop(self: Trainer) -> dict:
        if self.step_done == 7:
            raise KeyboardInterrupt
        return real_step(self)

    curve.unlink()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "step", step_then_stop)
        code = launch(TrainConfig(**{**SMALL, "steps": 8, "save_interval": 2, "resume": True,
                                     "override_opt_param_scheduler": True, **files}))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130, err
    assert err[-1].startswith("fmoe train: stopped by SIGINT"), err
    assert f"continue from {save / 'step_00000006'} (step 6): the same command with --resume" in err[-1]
    assert f"loss curve of its 7 steps: {curve}" in err[-1], err
    assert curve.stat().st_size > 0 and drawn[-1] == [1, 2, 3, 4, 5, 6, 7]


def test_load_of_a_converted_checkpoint_says_what_it_loaded(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_00000000"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({"step": 0, "hf_config": {"model_type": "qwen3_moe"}}))
    line = launch_mod._started_from(TrainConfig(steps=5, load=str(tmp_path)), str(ckpt), 0)
    assert "resumed" not in line, line
    assert line == (f"fmoe train: loaded the weights (a fresh optimizer) of {ckpt}, converted from Hugging "
                    "Face qwen3_moe; training steps 1-5")


def test_train_help_shows_each_default_and_the_presets_own() -> None:
    from fmoe.cli.train import defaults_text

    assert defaults_text("num_layers") == " [default: 4; deepseek-v3: 61; pangu-ultra-moe: 61; small: 8]"
    assert defaults_text("micro_batch_size") == " [default: 4; deepseek-v3: 1; pangu-ultra-moe: 1]"
    assert defaults_text("progress") == " [default: on]" and defaults_text("lr") == " [default: 0.003]"
    assert defaults_text("kv_channels") == ""  # None: the help says what leaving it out means


def test_the_sequence_wise_aux_loss_has_a_flag(capsys, no_launch: None) -> None:
    from fmoe.cli.main import main

    seq = TrainConfig(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.02).model().moe
    assert (seq.aux_loss_coef, seq.seq_aux_loss_coef) == (0.0, 0.02)
    plain = TrainConfig().model().moe
    assert (plain.aux_loss_coef, plain.seq_aux_loss_coef) == (1e-2, 0.0)
    none = TrainConfig(moe_router_load_balancing_type="none").model().moe
    assert (none.aux_loss_coef, none.seq_aux_loss_coef) == (0.0, 0.0)
    assert main(["train", "--moe-router-load-balancing-type", "sinkhorn"]) == 2
    err = capsys.readouterr().err
    assert "--moe-router-load-balancing-type must be one of aux_loss, seq_aux_loss, none" in err, err


def test_the_readme_lists_every_job() -> None:
    from fmoe.cli.main import COMMANDS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = " ".join(readme[readme.index("Other jobs:"):].split("\n\n")[0].split())
    assert all(f"`{name}`" in line for name in COMMANDS), (line, list(COMMANDS))


def test_the_command_after_a_conversion_runs_a_two_layer_model(tmp_path: Path) -> None:
    import shlex

    from fmoe.cli.convert import _toml, train_command

    toml = tmp_path / "model.toml"
    fields = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "moe_ffn_hidden_size": 16,
              "num_experts": 4, "moe_router_topk": 2, "num_attention_heads": 4, "num_query_groups": 2,
              "first_k_dense": 0, "moe_shared_experts": 0, "vocab_size": 128, "mtp": False}
    toml.write_text(_toml(fields))
    command = train_command(str(toml), str(tmp_path))
    args = shlex.split(command)[2:]
    given = {args[k][2:].replace("-", "_"): args[k + 1] for k in range(0, len(args), 2)}
    toml_path = given.pop("config")
    flags = {k: int(v) if v.isdigit() else v for k, v in given.items()}
    tc = TrainConfig.from_sources("tiny", toml_path, flags)
    assert tc.num_layers == 2 and tc.problem() is None, (command, tc.problem())
    # the preset's own layout refuses 2 layers: the command had to choose another
    assert TrainConfig.from_sources("tiny", str(toml), {"load": str(tmp_path)}).problem() is not None
