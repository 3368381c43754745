"""The main job runs end to end on a small model and reports a conserved FLOP split."""

from __future__ import annotations

from fmoe.cli.main import main


def test_demo_runs_and_conserves_flops(capsys):
    assert main(["demo", "--layers", "2", "--d-model", "16", "--d-ff", "24", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "dx + dw FLOPs == full backward FLOPs: True" in out
    assert "dw (later)" in out
