"""Where `fmoe train` logs besides its JSON lines (fmoe/train/log_backends.py): TensorBoard events read back
with tensorboard's EventAccumulator, and Weights & Biases through a fake `wandb` module (wandb is not a
dependency); the eval losses beside the training ones in all three; a flag whose package is missing fails
before launch.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fmoe.train.config import TrainConfig
from fmoe.train.launch import launch
from fmoe.train.log_backends import TAGS, LogBackends


class FakeWandb(types.ModuleType):
    """What fmoe train calls of wandb: init(...) -> a run with log(values, step=) and finish()."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = 0

    def init(self, **kwargs: object) -> FakeWandb:
        self.inits.append(kwargs)
        return self

    def log(self, values: dict, step: int) -> None:
        self.logged.append((step, dict(values)))

    def finish(self) -> None:
        self.finished += 1


def _scalars(directory: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_metrics_go_to_tensorboard_and_wandb_beside_the_json_lines(tmp_path: Path, monkeypatch,
                                                                    capsys) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    board, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    tc = TrainConfig(pp=1, ep=1, num_layers=2, seq_length=16, global_batch_size=8, steps=3, eval_interval=2,
                     eval_iters=2, fp16=True, progress=False, device="cpu", metrics=str(metrics),
                     tensorboard_dir=str(board), wandb_project="proj", wandb_exp_name="run1",
                     wandb_save_dir=str(tmp_path / "wb"))
    assert launch(tc) == 0  # one rank: in this process, so it sees the fake module
    summary = capsys.readouterr().out
    assert "held-out eval after step 3" in summary, summary
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [("eval_loss" in m, "eval_main_loss" in m) for m in lines] == [(False, False), (True, True),
                                                                          (True, True)]  # every 2 and the end
    got = _scalars(board)
    for m in lines:
        for key, tag in TAGS.items():
            if key in m:  # fp32 events: the JSON line's value to float32 precision
                assert got[tag][m["step"]] == pytest.approx(m[key], rel=1e-6, abs=1e-12), (tag, m["step"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/loss_scale",
                "eval/loss", "eval/main_loss"):
        assert tag in got, (tag, sorted(got))
    assert set(got["eval/main_loss"]) == {2, 3}
    want = {"project": "proj", "name": "run1", "dir": str(tmp_path / "wb"), "config": tc.as_dict()}
    assert fake.inits == [want]
    assert [step for step, _ in fake.logged] == [1, 2, 3] and fake.finished == 1
    for (_, values), m in zip(fake.logged, lines, strict=True):
        assert values == {tag: float(m[key]) for key, tag in TAGS.items() if key in m}


def test_a_logging_flag_without_its_package_fails_before_launch(monkeypatch, capsys, no_launch: None) -> None:
    from fmoe.cli.main import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, whatever this machine has
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    cases = [(("--wandb-project", "p"), "wandb is not installed (pip install wandb)"),
             (("--wandb-exp-name", "x"), "--wandb-exp-name applies to --wandb-project only"),
             (("--tensorboard-dir", "tb"), "tensorboard is not installed (pip install 'fmoe[tensorboard]')")]
    for flags, needle in cases:
        code = main(["train", "--no-progress", *flags])
        out = capsys.readouterr()
        text = (out.out + out.err).strip()
        assert code == 2 and needle in text and len(text.splitlines()) == 1, (flags, text)


def test_a_resumed_run_replaces_the_tensorboard_steps_past_its_checkpoint(tmp_path: Path) -> None:
    """As the metrics file: the steps a crashed run made past its checkpoint appear once, the resumed
    run's (SummaryWriter's purge_step); a fresh run in the same directory hides the older run's."""
    tc = TrainConfig(tensorboard_dir=str(tmp_path))
    def run(first: int, last: int, loss: float) -> None:
        backends = LogBackends.open(tc, first)
        for step in range(first + 1, last + 1):
            backends.log({"step": step, "loss": loss + step})
        backends.close()

    run(0, 4, 10.0)  # crashed after step 4, its checkpoint at step 2
    run(2, 5, 20.0)
    assert _scalars(tmp_path)["train/loss"] == {1: 11.0, 2: 12.0, 3: 23.0, 4: 24.0, 5: 25.0}
    run(0, 2, 30.0)
    assert _scalars(tmp_path)["train/loss"] == {1: 31.0, 2: 32.0}


def test_per_layer_expert_loads_and_bias_go_to_the_metrics_and_histograms(tmp_path: Path, monkeypatch,
                                                                         capsys) -> None:
    """--moe-per-layer-logging: each MoE layer's tokens per expert (every token reaches top-k experts:
    they sum to tokens x k, dropless) and the aux-loss-free bias (from 0: rate x sign(mean - load), then
    that plus the next step's), in the JSON lines, TensorBoard's histograms (one bucket per expert) and
    W&B's."""
    import torch

    fake = FakeWandb()
    fake.Histogram = lambda np_histogram: ("hist", tuple(np_histogram[0]), tuple(np_histogram[1]))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    board, metrics, rate = tmp_path / "tb", tmp_path / "m.jsonl", 1e-2
    tc = TrainConfig(pp=1, ep=1, num_layers=2, first_k_dense=0, seq_length=16, global_batch_size=8, steps=2,
                     lr_warmup_iters=0, progress=False, device="cpu", metrics=str(metrics),
                     moe_router_bias_update_rate=rate, moe_per_layer_logging=True,
                     tensorboard_dir=str(board), wandb_project="proj", markov_sequences=256)
    assert launch(tc) == 0
    capsys.readouterr()
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    layers = sorted(lines[0]["expert_load"])
    assert len(layers) == 2, layers
    bias = {k: torch.zeros(tc.num_experts, dtype=torch.float64) for k in layers}
    for m in lines:
        for k in layers:
            load = torch.tensor(m["expert_load"][k], dtype=torch.float64)
            assert len(load) == tc.num_experts and load.sum() == 8 * 16 * tc.moe_router_topk, (k, load)
            bias[k] = bias[k] + rate * torch.sign(load.mean() - load)
            assert m["expert_bias"][k] == pytest.approx(bias[k].tolist(), rel=1e-6), (m["step"], k)  # fp32
    acc = EventAccumulator(str(board), size_guidance={"histograms": 0})
    acc.Reload()
    for k in layers:
        events = acc.Histograms(f"moe/expert_load/{k}")
        assert [e.step for e in events] == [1, 2]
        for e, m in zip(events, lines, strict=True):
            assert list(e.histogram_value.bucket) == pytest.approx(m["expert_load"][k])
        assert f"moe/expert_bias/{k}" in acc.Tags()["histograms"]
    for (step, values), m in zip(fake.logged, lines, strict=True):
        assert values[f"moe/expert_load/{layers[0]}"] == (
            "hist", tuple(m["expert_load"][layers[0]]), tuple(range(tc.num_experts + 1))), step
