"""Every rank checked, and a run that cannot go on stops (issue 34, findings 3, 4 and 5), through
`fmoe train` as a subprocess on CPU with small shapes (and the launch check called directly on 2 gloo
ranks).

Each end-to-end test failed on the code before its fix: ranks with different --seed under torchrun
trained to exit 0; an --fp16 run whose loss turned NaN skipped every later step and exited 0; SIGINT to
the launcher left its ranks training to --steps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from dist_utils import spawn

from fmoe.precision import LossScale
from fmoe.train.config import TrainConfig
from fmoe.train.launch import _free_port, _world
from fmoe.train.loop import Trainer
from fmoe.train.overflow import MAX_SKIPPED_IN_A_ROW, check_fp16_step
from fmoe.train.rank_agreement import check_ranks_agree
from fmoe.train.run_errors import RunError

RUN_TIMEOUT_S = 240
SMALL = ("--num-layers", "2", "--global-batch-size", "8", "--seq-length", "16", "--device", "cpu",
         "--no-progress")


def _cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "fmoe.cli.main", "train", *SMALL, *flags]


def _one_error_line(done: subprocess.CompletedProcess, needle: str, torchrun: bool = False) -> str:
    """Asserts the run failed and said why in `fmoe train: error:` lines holding `needle` (one per rank
    at most) and no traceback (torchrun: besides its own ChildFailedError); returns the first."""
    assert done.returncode != 0, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("fmoe train: error:")]
    assert lines and all(needle in ln for ln in lines), done.stderr
    assert done.stderr.count("Traceback") <= (1 if torchrun else 0), done.stderr  # torchrun's own
    return lines[0]


# ---- 3: ranks started with different inputs ------------------------------------------------------------


def _check_with(rank: int, world_size: int, differ: dict, data: list[str]) -> str:
    """One rank of the launch check: rank 1 takes `differ`; `data[rank]` is its --data."""
    values = {"pp": 1, "ep": 1, "dp": 2, "data": data[rank], "data_kind": "text", "vocab_size": 256}
    tc = TrainConfig(**values, **(differ if rank == 1 else {}))
    layout = {"world_size": world_size, "ranks_per_node": world_size, "device_type": "cpu",
              "backend": "gloo"}
    try:
        check_ranks_agree(tc, layout)
    except RunError as exc:
        return str(exc)
    return "agreed"


def _texts(tmp: Path, *contents: bytes) -> list[str]:
    paths = []
    for i, content in enumerate(contents):
        path = tmp / f"text{i}.txt"
        path.write_bytes(content)
        paths.append(str(path))
    return paths


DIFFERENT_FLAGS = [({"seed": 7}, "config['seed']"), ({"lr": 1e-2}, "config['lr']"),
                   ({"num_experts": 4}, "config['num_experts']")]


def _checks_with(rank: int, world_size: int, cases: dict[str, tuple[dict, list[str]]]) -> dict[str, str]:
    """`_check_with` for each case (name -> (differ, data)), one after the other on the same ranks."""
    return {name: _check_with(rank, world_size, differ, data) for name, (differ, data) in cases.items()}


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Each launch-check case of the tests below (name -> what ranks 0 and 1 said), all on one start of 2
    ranks (a rank's start costs seconds): rank 1 with each of DIFFERENT_FLAGS on the same data; rank 1 with
    other rank-only paths (metrics, loss curve, TensorBoard, W&B) and a copy of the data; rank 1 with other
    data."""
    tmp = tmp_path_factory.mktemp("texts")
    one, copy, other = _texts(tmp, b"abc" * 100, b"abc" * 100, b"abd" * 100)
    rank_only = {"metrics": str(tmp / "r1.jsonl"), "progress": False, "loss_curve": "x.png",
                 "tensorboard_dir": "tb1", "wandb_project": "p", "wandb_exp_name": "x", "wandb_save_dir": "w"}
    cases = {**{field: (differ, [one, one]) for differ, field in DIFFERENT_FLAGS},
             "rank_only": (rank_only, [one, copy]), "other_data": ({}, [one, other])}
    runs = [r.value for r in spawn(_checks_with, 2, cases)]
    return {name: [run[name] for run in runs] for name in cases}


@pytest.mark.parametrize("field", [field for _, field in DIFFERENT_FLAGS])
def test_ranks_with_a_different_flag_all_fail_naming_it(checked: dict, field: str) -> None:
    got = checked[field]
    assert got[0] == got[1], got  # every rank, the same line
    assert "\n" not in got[0] and field in got[0] and "ranks [0] and [1]" in got[0], got[0]


def test_rank_only_paths_may_differ_but_the_data_may_not(checked: dict) -> None:
    assert checked["rank_only"] == ["agreed", "agreed"]
    got = checked["other_data"]
    assert got[0] == got[1] and "disagree on data" in got[0], got


def test_under_torchrun_a_rank_with_another_seed_stops_every_rank(tmp_path: Path) -> None:
    # torchrun gives every rank the same arguments: a wrapper picks rank 1's --seed by RANK
    wrapper = tmp_path / "per_rank.py"
    wrapper.write_text(
        "import os, sys\n"
        "from fmoe.cli.main import main\n"
        f"flags = {['train', *SMALL, '--pp', '1', '--ep', '1', '--dp', '2', '--steps', '2']!r}\n"
        "sys.exit(main(flags + ['--seed', '7' if os.environ['RANK'] == '1' else '1234']))\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), str(wrapper)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    line = _one_error_line(done, "ranks started with different inputs", torchrun=True)
    assert "config['seed']: 1234 on ranks [0], 7 on ranks [1]" in line, line


# ---- 4: an fp16 run that cannot go on stops -------------------------------------------------------------


@pytest.mark.parametrize("layout", [("--pp", "1", "--ep", "1"), ("--pp", "1", "--ep", "2")])
def test_an_fp16_run_whose_loss_turns_nan_stops_with_one_line(tmp_path: Path, layout: tuple) -> None:
    # AdamW moves every weight by about --lr: at 1e4 the fp16 forward overflows from step 2 on
    done = subprocess.run(_cmd(*layout, "--fp16", "--lr", "1e4", "--lr-warmup-iters", "0", "--steps", "30"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    line = _one_error_line(done, "--fp16: the loss of step")
    assert done.returncode == 1 and "stopping" in line, done.stderr


def test_an_overflow_at_the_minimum_loss_scale_stops_the_run() -> None:
    # a scale of 2**40 overflows fp16 on the first step; it is also the floor, so nothing is left to try
    tc = TrainConfig(pp=1, ep=1, dp=1, progress=False, fp16=True, initial_loss_scale=2.0**40,
                     min_loss_scale=2.0**40, hysteresis=1)
    trainer = Trainer(tc, _world(tc, 0, f"file://{tempfile.mktemp()}", 0, 1))
    try:
        with pytest.raises(RunError, match="overflowed at the minimum loss scale"):
            trainer.step()
    finally:
        dist.destroy_process_group()


def test_the_fp16_stop_rules() -> None:
    dynamic = LossScale.dynamic_scale(1024.0, min_scale=1.0, hysteresis=2)
    check_fp16_step(1, 3.0, dynamic, False, 1)  # an overflow above the floor: skipped, scale backs off
    floor = LossScale.dynamic_scale(1.0, min_scale=1.0, hysteresis=2)
    check_fp16_step(1, 3.0, floor, False, 1)  # at the floor, one hysteresis allowance left: tolerated
    with pytest.raises(RunError, match="minimum loss scale"):
        check_fp16_step(2, 3.0, floor.adjust(False), False, 2)
    with pytest.raises(RunError, match="loss of step 3 is nan"):
        check_fp16_step(3, float("nan"), dynamic, True, 0)
    static = LossScale.static_scale(128.0)
    check_fp16_step(9, 3.0, static, False, MAX_SKIPPED_IN_A_ROW - 1)
    with pytest.raises(RunError, match="static loss scale"):
        check_fp16_step(9, 3.0, static, False, MAX_SKIPPED_IN_A_ROW)


# ---- 5: SIGINT to the launcher alone stops every rank ---------------------------------------------------


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                kids = [int(k) for k in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
                out += kids
                todo += kids
        except OSError:
            pass
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig, code, group", [(signal.SIGINT, 130, False), (signal.SIGTERM, 143, False),
                                              (signal.SIGINT, 130, True)])  # group: Ctrl-C in a terminal
def test_sigint_or_sigterm_to_the_launcher_stops_every_rank(tmp_path: Path, sig: int, code: int,
                                                            group: bool) -> None:
    metrics = tmp_path / "m.jsonl"
    flags = ("--pp", "2", "--ep", "1", "--schedule", "1f1b", "--steps", "100000",
             "--metrics", str(metrics))
    proc = subprocess.Popen(_cmd(*flags),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: signalled alone or as one
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        ranks = _descendants(proc.pid)
        assert len(ranks) >= 2, ranks
        (os.killpg if group else os.kill)(proc.pid, sig)
        out, err = proc.communicate(timeout=20)
        deadline = time.monotonic() + 5  # orphans are reaped by init just after
        while any(_running(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if _running(p)], (ranks, err)
        assert proc.returncode == code, (proc.returncode, err)
        assert f"stopped by {signal.Signals(sig).name}" in err, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
