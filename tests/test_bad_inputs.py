"""Inputs that used to end in a torch, JSON, TOML or Key error that did not name the user's mistake (issue
48's study) now fail in one line that names it. Each case is reproduced as the user met it (a command
line, a file, a call) and checked for the line, before any process starts where the input enters there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fmoe.cli.main import main, negatives_as_values


def _one_line(capsys: pytest.CaptureFixture, argv: list[str], code: int = 2) -> str:
    got = main(argv)
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if ln.strip()]
    assert got == code and len(lines) == 1, (argv, got, lines)
    return lines[0]


@pytest.mark.parametrize("flags, needle", [
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--adam-eps", "-inf"], "--adam-eps must be a finite number, got -inf"),
    (["--lr-warmup-init", "-1e-3"], "--lr-warmup-init must lie in [0, --lr 0.003], got -0.001"),
    (["--seed", str(2**63)], f"--seed must lie in [0, 2**40), got {2**63}"),
])
def test_a_bad_number_is_named_before_launch(capsys, no_launch: None, flags: list[str], needle: str) -> None:
    line = _one_line(capsys, ["train", "--no-progress", *flags])
    assert line == f"fmoe train: error: {needle}", line


def test_negative_numbers_after_a_flag_are_its_values() -> None:
    assert negatives_as_values(["train", "--lr-warmup-init", "-1e-3", "--steps", "-5", "--x", "-.5E+2"]) == [
        "train", "--lr-warmup-init=-1e-3", "--steps=-5", "--x=-.5E+2"]
    plain = ["train", "--no-progress", "--pp", "1"]
    assert negatives_as_values(plain) == plain


def test_a_toml_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    from fmoe.train.config import TrainConfig

    toml = tmp_path / "run.toml"
    toml.write_bytes(b"\xef\xbb\xbfsteps = 7\n")  # what Windows editors save as "UTF-8"
    assert TrainConfig.from_sources("tiny", str(toml)).steps == 7


NOT_OBJECTS = [("{not json", "is not JSON"), ("[1, 2]", "must hold a JSON object"),
               ('"qwen3"', "must hold a JSON object")]


@pytest.mark.parametrize("text, needle", NOT_OBJECTS)
def test_a_damaged_meta_json_names_the_file(tmp_path: Path, text: str, needle: str) -> None:
    from fmoe.train.checkpoint import CheckpointError, read_meta

    (tmp_path / "meta.json").write_text(text)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'meta.json'} {needle}"):
        read_meta(tmp_path)


@pytest.mark.parametrize("text, needle", NOT_OBJECTS)
def test_an_hf_config_that_is_no_json_object_names_the_file(tmp_path: Path, capsys, text: str,
                                                           needle: str) -> None:
    (tmp_path / "config.json").write_text(text)
    line = _one_line(capsys, ["convert", "hf-to-fmoe", "--hf", str(tmp_path), "--save", str(tmp_path / "s")])
    assert f"{tmp_path / 'config.json'} " in line and needle in line, line


def test_a_truncated_safetensors_file_names_the_file(tmp_path: Path) -> None:
    import safetensors.torch
    import torch

    from fmoe.hf.files import read_state_dict

    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.ones(64, 64)}, str(path))
    path.write_bytes(path.read_bytes()[:100])  # a download cut short
    with pytest.raises(ValueError, match=f"{path} is not a readable safetensors file"):
        read_state_dict(tmp_path)
