"""The main job runs end to end on a small model and reports a conserved FLOP split."""

from __future__ import annotations

import pytest

from fmoe.cli.main import main


def test_demo_runs_and_conserves_flops(capsys):
    assert main(["demo", "--layers", "2", "--d-model", "16", "--d-ff", "24", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "dx + dw FLOPs == full backward FLOPs: True" in out
    assert "dw (later)" in out


@pytest.mark.parametrize("option", ["--layers", "--d-model", "--d-ff", "--tokens"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_demo_refuses_a_size_that_is_not_positive_in_one_line(capsys, option, value):
    # --tokens 0 used to divide by zero after printing half the table
    argv = ["demo", "--layers", "1", "--d-model", "8", "--d-ff", "8", "--tokens", "4"]
    argv[argv.index(option) + 1] = value
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert out == f"error: {option} must be a positive integer, got {value}\n"
