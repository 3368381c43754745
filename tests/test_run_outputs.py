"""A run's output files (--metrics, --loss-curve, --trace and its PNG) are its own (issue 48): one on
another's path, on --save's folder or its checkpoint entries is refused before launch in one line, and a
second run given a live run's file fails before it starts a rank, leaving that file as it was.

The checks run in-process (`no_launch`: starting a process or joining a group fails the test); the live
run is a lock held in this process (flock is per open file, so the second open meets it as another
process would).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fmoe.train import run_outputs, save_dir
from fmoe.train.config import TrainConfig
from fmoe.train.launch import _claim_on_rank0
from fmoe.train.loop import World
from fmoe.train.run_errors import RunError


def _lines(capsys: pytest.CaptureFixture, *flags: str) -> tuple[int, list[str]]:
    from fmoe.cli.main import main

    code = main(["train", "--no-progress", "--steps", "3", "--lr-warmup-iters", "0", *flags])
    out = capsys.readouterr()
    return code, [ln for ln in (out.out + out.err).splitlines() if ln.strip()]


@pytest.mark.parametrize("other", ["--loss-curve", "--trace", "latest", "save", "trace-png"])
def test_metrics_on_another_output_is_refused_before_launch(capsys, tmp_path: Path, no_launch: None,
                                                           other: str) -> None:
    save = tmp_path / "ckpt"
    metrics = {"--loss-curve": tmp_path / "m", "--trace": tmp_path / "m", "latest": save / "latest",
               "save": save, "trace-png": tmp_path / "t.png"}[other]
    flags = ["--metrics", str(metrics), "--save", str(save)]
    if other in ("--loss-curve", "--trace"):
        flags += [other, str(metrics)]
    if other == "trace-png":
        flags += ["--trace", str(tmp_path / "t.json")]
    code, lines = _lines(capsys, *flags)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("fmoe train: error: --"), lines
    assert str(metrics) in lines[0], lines
    assert not save.exists()  # nothing written before the refusal


def test_a_second_run_on_a_live_runs_metrics_fails_and_leaves_the_file(capsys, tmp_path: Path,
                                                                        no_launch: None) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n')
    live = run_outputs.claim(TrainConfig(metrics=str(metrics)))
    try:
        code, lines = _lines(capsys, "--pp", "1", "--ep", "1", "--metrics", str(metrics))
        assert code == 1 and len(lines) == 1, lines
        assert "--metrics" in lines[0] and "in use by another fmoe train" in lines[0], lines
        assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n'  # not truncated
        # under torchrun rank 0 claims the outputs as it claims --save
        with pytest.raises(RunError, match="in use"):
            _claim_on_rank0(TrainConfig(metrics=str(metrics)), World(0, 1, None, torch.device("cpu")))
    finally:
        live.release()
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_claim_that_wrote_nothing_leaves_no_empty_file(tmp_path: Path) -> None:
    tc = TrainConfig(loss_curve=str(tmp_path / "sub" / "loss.png"), trace=str(tmp_path / "t.json"))
    held = run_outputs.claim(tc)
    assert (tmp_path / "sub" / "loss.png").exists() and (tmp_path / "t.png").exists()
    (tmp_path / "t.json").write_text("{}")
    held.release()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["t.json"]


def test_save_and_outputs_share_one_lock_rule(tmp_path: Path) -> None:
    held = save_dir.lock(str(tmp_path / "ckpt"))
    try:
        with pytest.raises(save_dir.CheckpointError, match="in use by another fmoe train .pid .*directory"):
            save_dir.lock(str(tmp_path / "ckpt"))
    finally:
        held.close()
