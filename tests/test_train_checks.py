"""`fmoe train` options that cannot work fail in one line before any rank starts (issue 34).

Each case runs the command line in-process with the `no_launch` fixture (starting a process or joining a
process group fails the test) and checks the exit code 2, the one line and what it names.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fmoe.train import checkpoint
from fmoe.train.config import TrainConfig


def _refused(capsys: pytest.CaptureFixture, *flags: str) -> str:
    """Runs `fmoe train` with `flags`; asserts exit 2 and one line; returns that line."""
    from fmoe.cli.main import main

    code = main(["train", "--no-progress", *flags])
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if ln.strip()]
    assert code == 2, (flags, lines)
    assert len(lines) == 1 and lines[0].startswith("fmoe train: error: "), (flags, lines)
    return lines[0]


@pytest.mark.parametrize("step", ["0", "-1", "6"])
def test_a_trace_step_outside_the_run_is_refused(capsys, tmp_path: Path, no_launch: None, step: str) -> None:
    line = _refused(capsys, "--steps", "5", "--trace", str(tmp_path / "t.json"), "--trace-step", step)
    assert "--trace-step" in line and step in line, line


def test_a_trace_step_before_the_resumed_checkpoint_is_refused(capsys, tmp_path: Path,
                                                                 no_launch: None) -> None:
    done = tmp_path / "ckpt" / "step_00000004"
    done.mkdir(parents=True)
    (done / checkpoint.META).write_text(json.dumps({"step": 4}))
    (tmp_path / "ckpt" / checkpoint.LATEST).write_text("step_00000004\n")
    line = _refused(capsys, "--steps", "8", "--save", str(tmp_path / "ckpt"), "--resume", "--trace",
                    str(tmp_path / "t.json"), "--trace-step", "3")
    assert "--trace-step 3" in line and "step 4" in line, line
    # without --trace the step number is not used: the default 3 stays valid for a 2-step run
    assert TrainConfig(steps=2).problem() is None


def test_a_config_file_setting_one_field_twice_is_refused(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("hidden-size = 32\nhidden_size = 48\n")
    with pytest.raises(ValueError, match="'hidden-size' and 'hidden_size' both set hidden-size"):
        TrainConfig.from_sources("tiny", str(toml))


def test_a_data_file_without_its_kind_is_refused(capsys, tmp_path: Path, no_launch: None) -> None:
    text = tmp_path / "book.txt"
    text.write_text("a text file read as uint16 tokens would fail inside every rank\n" * 200)
    line = _refused(capsys, "--data", str(text), "--vocab-size", "256")
    assert "--data-kind" in line and "bin16, bin32, text" in line, line
    short = tmp_path / "short.bin"
    np.arange(10, dtype=np.uint16).tofile(short)  # fewer tokens than one window of seq_length + 1
    line = _refused(capsys, "--data", str(short), "--data-kind", "bin16")
    assert "one window needs" in line, line
    assert TrainConfig(pp=1, ep=1, data=str(text), data_kind="text", vocab_size=256).problem() is None


def test_dualpipev_takes_layers_in_a_multiple_of_2pp(capsys, no_launch: None) -> None:
    # seed 001 (MindSpeed's --schedules-method dualpipev): layers >= 2P and a multiple of 2P; the embedding,
    # head and MTP module sit on the ends' chunks and are not layers
    line = _refused(capsys, "--num-layers", "5")  # the tiny preset: pp 2, dualpipev
    assert "dualpipev" in line and "multiple of 2*pp = 4, got 5" in line, line
    line = _refused(capsys, "--num-layers", "6", "--pp", "2", "--dualpipev-dw-detach")
    assert "multiple of 2*pp = 4, got 6" in line, line
    assert TrainConfig(num_layers=8).problem() is None
    assert TrainConfig(num_layers=4, mtp=True).problem() is None
    assert TrainConfig(num_layers=5, schedule="1f1b").problem() is None  # a loop of 2 stages cuts any count
