"""Checkpoints that are safe to share and runs that cannot clobber each other (issue 34, findings 1, 2, 6,
7, 8, 10, a fresh run's metrics file, a changed LR schedule on resume), end to end through `fmoe train`
on CPU with small shapes: as a subprocess where a test reads what the command printed, else (the runs that
set the stage) its main in this process (tests/test_train.py's `_in_process`: a process start saved).

Each test failed on the code before the fix it names (the issue's reproductions).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from fmoe.train import checkpoint
from fmoe.train.config import TrainConfig
from fmoe.train.optim import lr_at

RUN_TIMEOUT_S = 240
# no LR warmup: these runs take 1-3 steps, and a warmup as long as the run adds its warning to the stderr
# the tests read for a one-line error
SMALL = ("--pp", "1", "--ep", "1", "--num-layers", "2", "--global-batch-size", "8", "--seq-length", "16",
         "--device", "cpu", "--no-progress", "--lr-warmup-iters", "0")
STEP2 = "step_00000002"


def _run(tmp: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fmoe.cli.main", "train", *SMALL, *flags]
    return subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def _ok(tmp: Path, *flags: str) -> subprocess.CompletedProcess:
    done = _run(tmp, *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _ok_here(tmp: Path, *flags: str) -> None:
    """`_ok` for a run whose output no test reads: the command's main in this process, its ranks spawned."""
    from test_train import _in_process

    code, out, err = _in_process(tmp, ["train", *SMALL, *flags])
    assert code == 0, out + err


def _failed(done: subprocess.CompletedProcess, needle: str, max_lines: int = 5) -> str:
    """Asserts the run failed with a short stderr holding `needle`; returns the stderr."""
    err = done.stderr.strip()
    assert done.returncode != 0, done.stdout + err
    assert needle in err, err
    assert len(err.splitlines()) <= max_lines, err
    return err


def _saved(tmp: Path, name: str = "ckpt", *flags: str) -> Path:
    """A directory holding one fresh run's checkpoint of step 2."""
    ckpt = tmp / name
    _ok_here(tmp, "--steps", "2", "--save", str(ckpt), *flags)
    assert (ckpt / STEP2 / checkpoint.META).is_file()
    return ckpt


FOREIGN_METRICS = '{"step": 7, "loss": 1.0}\n'  # another run's line, in the metrics file before a fresh run


@pytest.fixture(scope="module")
def step2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint directory of one fresh run to step 2 with no other flags but --metrics (beside it,
    m.jsonl, which held FOREIGN_METRICS before the run): the tests that break a checkpoint each break a
    copy of it (`_copied`), one run for the module rather than one per test."""
    root = tmp_path_factory.mktemp("step2")
    metrics = root / "m.jsonl"
    metrics.write_text(FOREIGN_METRICS)
    return _saved(root, "ckpt", "--metrics", str(metrics))


def _copied(saved: Path, tmp: Path) -> Path:
    """A copy of the checkpoint directory `saved` at tmp/ckpt, as `_saved(tmp)` would have written it."""
    return Path(shutil.copytree(saved, tmp / "ckpt", symlinks=True))


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


# ---- 1: a crafted .metadata runs nothing --------------------------------------------------------------


class _Payload:
    """Unpickling this creates the file `path` (what a malicious checkpoint would do, harmlessly)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_metadata_pickle_is_refused_and_runs_nothing(tmp_path: Path, step2: Path) -> None:
    ckpt = _copied(step2, tmp_path)
    marker = tmp_path / "pwned"
    (ckpt / STEP2 / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    (ckpt / STEP2 / checkpoint.CHECKSUMS).unlink(missing_ok=True)  # an "old" checkpoint: no checksums
    err = _failed(_run(tmp_path, "--steps", "3", "--load", str(ckpt / STEP2)), "CheckpointError")
    assert "refused to unpickle io.open" in err, err  # names what it refused
    assert not marker.exists()


def test_the_restricted_unpickler_reads_real_metadata_and_refuses_the_rest(tmp_path: Path) -> None:
    from fmoe.train.safe_metadata import read_metadata

    ckpt = _saved(tmp_path, "ckpt", "--mtp", "--fp16")
    md = read_metadata(ckpt / STEP2 / ".metadata")
    assert "train/step" in md.state_dict_metadata
    bad = tmp_path / "bad.metadata"
    for payload in (_Payload(str(tmp_path / "pwned")), os.system):
        bad.write_bytes(pickle.dumps(payload))
        with pytest.raises(checkpoint.CheckpointError, match="refus"):
            read_metadata(bad)
    assert not (tmp_path / "pwned").exists()


# ---- 2: a fresh run never clobbers another run's checkpoints; one run per --save -----------------------


def test_a_fresh_run_refuses_a_save_directory_holding_checkpoints(tmp_path: Path, step2: Path) -> None:
    ckpt = _copied(step2, tmp_path)
    err = _failed(_run(tmp_path, "--steps", "1", "--save", str(ckpt)), "--overwrite-save", max_lines=1)
    assert "--resume" in err
    assert (ckpt / checkpoint.LATEST).read_text().strip() == STEP2  # untouched
    _ok_here(tmp_path, "--steps", "1", "--save", str(ckpt), "--overwrite-save")
    assert (ckpt / checkpoint.LATEST).read_text().strip() == "step_00000001"
    assert not (ckpt / STEP2).exists()  # the other run's checkpoints are gone, not mixed with this one's


def test_a_second_run_on_the_same_save_directory_fails_at_once(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    metrics = tmp_path / "first.jsonl"
    cmd = [sys.executable, "-m", "fmoe.cli.main", "train", *SMALL, "--steps", "100000", "--save", str(ckpt),
           "--save-interval", "100000", "--metrics", str(metrics)]
    first = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (metrics.exists() and metrics.read_text()):  # training: it holds the directory
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        second = _run(tmp_path, "--steps", "1", "--save", str(ckpt))
        took = time.monotonic() - t0
    finally:
        first.kill()
        first.communicate()
    err = _failed(second, "in use", max_lines=1)
    assert f"pid {first.pid}" in err, err
    assert took < 30, took  # before any rank started


# ---- 6, 7: checksums; read failures as one line -------------------------------------------------------


def test_flipped_bytes_in_a_shard_fail_naming_the_file(tmp_path: Path, step2: Path) -> None:
    ckpt = _copied(step2, tmp_path)
    shard = ckpt / STEP2 / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    err = _failed(_run(tmp_path, "--steps", "3", "--save", str(ckpt), "--resume"), "CheckpointError",
                  max_lines=1)
    assert "__0_0.distcp" in err and "checksum" in err, err


def test_a_checkpoint_without_checksums_loads_with_a_warning(tmp_path: Path, step2: Path) -> None:
    ckpt = _copied(step2, tmp_path)
    (ckpt / STEP2 / checkpoint.CHECKSUMS).unlink()
    done = _ok(tmp_path, "--steps", "3", "--save", str(ckpt), "--resume", "--override-opt-param-scheduler")
    assert "no checksums" in done.stderr, done.stderr
    # the checkpoint it writes has them again
    assert (ckpt / "step_00000003" / checkpoint.CHECKSUMS).is_file()


def test_a_truncated_shard_fails_with_one_short_error_over_ranks(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _ok_here(tmp_path, "--steps", "2", "--save", str(ckpt), "--ep", "2")
    for name in ("__0_0.distcp", "__1_0.distcp"):
        shard = ckpt / STEP2 / name
        shard.write_bytes(shard.read_bytes()[:1000])
    resume = ("--steps", "3", "--save", str(ckpt), "--resume", "--ep", "2")
    err = _failed(_run(tmp_path, *resume), "CheckpointError", max_lines=3)
    assert "checksum" in err, err
    (ckpt / STEP2 / checkpoint.CHECKSUMS).unlink()  # unverified: torch's own read failure
    err = _failed(_run(tmp_path, *resume), "CheckpointError", max_lines=5)
    assert "Traceback" not in err, err


# ---- 8: --resume with nothing to resume ---------------------------------------------------------------


def test_resume_without_a_checkpoint_fails_before_launch(capsys, tmp_path: Path, no_launch: None) -> None:
    from fmoe.cli.main import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "crashed" / "step_00000002.partial").mkdir(parents=True)
    for save, needle in (("missing", "no such directory"), ("empty", "no complete checkpoint"),
                         ("crashed", "no complete checkpoint")):
        code = main(["train", *SMALL, "--save", str(tmp_path / save), "--resume"])
        out = capsys.readouterr()
        text = (out.out + out.err).strip()
        assert code == 2, (save, text)
        assert needle in text and "leave out --resume" in text, (save, text)
        assert len(text.splitlines()) == 1, text
    assert not (tmp_path / "missing").exists()


# ---- 10: symlinks in --save are never followed ------------------------------------------------------


@pytest.mark.parametrize("planted", ["step_00000003.partial", "step_00000003", ".latest.tmp"])
def test_a_symlink_planted_in_the_save_directory_is_not_written_through(tmp_path: Path, step2: Path,
                                                                       planted: str) -> None:
    ckpt = _copied(step2, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "target"
    if planted == ".latest.tmp":
        target.write_text("")
    else:
        target.mkdir()
    (ckpt / planted).symlink_to(target)
    _failed(_run(tmp_path, "--steps", "3", "--save", str(ckpt), "--resume", "--override-opt-param-scheduler"),
            "symlink", max_lines=1)
    assert (target.read_text() == "") if target.is_file() else not list(target.iterdir())
    assert (ckpt / planted).is_symlink()  # left for the user to look at
    assert (ckpt / checkpoint.LATEST).read_text().strip() == STEP2


# ---- lower: the metrics file and the LR schedule on resume ---------------------------------------------


def test_a_fresh_run_truncates_its_metrics_file_and_a_resumed_one_continues_it(tmp_path: Path,
                                                                               step2: Path) -> None:
    # the fresh run: step2's, whose metrics file held another run's step 7 (FOREIGN_METRICS) before it
    ckpt = _copied(step2, tmp_path)
    metrics = Path(shutil.copy(step2.parent / "m.jsonl", tmp_path / "m.jsonl"))
    assert _steps(metrics) == [1, 2]
    with metrics.open("a") as f:  # a step 3 that ran after the checkpoint, then the run died
        f.write('{"step": 3, "loss": 1.0}\n')
    _ok_here(tmp_path, "--steps", "4", "--save", str(ckpt), "--metrics", str(metrics), "--resume",
             "--override-opt-param-scheduler")
    assert _steps(metrics) == [1, 2, 3, 4]  # step 3 once: the one the resumed run made


def _config(*flags: str) -> TrainConfig:
    """The TrainConfig `fmoe train *SMALL *flags` runs with, built as the command builds it."""
    import argparse

    from fmoe.cli.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([*SMALL, *flags])
    given = {k: v for k, v in vars(args).items() if k not in ("preset", "config")}
    return TrainConfig.from_sources(args.preset, args.config, given)


def test_a_changed_lr_schedule_on_resume_is_refused_unless_overridden(tmp_path: Path) -> None:
    """End to end for a changed --steps (the decay's length); the other schedule fields through the check
    the resuming rank runs (Trainer.load: checkpoint.check_schedule) on the same checkpoint's meta and the
    config their flags give, one process start rather than one run each."""
    ckpt = _saved(tmp_path, "ckpt", "--lr-warmup-iters", "1")  # past the warmup: the decay depends on --steps
    same = {"--steps": "2", "--lr": "3e-3", "--min-lr": "3e-4", "--lr-warmup-iters": "1"}
    changes = (("--steps", "4"), ("--lr", "1e-3"), ("--min-lr", "1e-5"), ("--lr-warmup-iters", "0"),
               ("--lr-decay-style", "linear"))
    flags = [[x for kv in {**same, flag: value}.items() for x in kv] for flag, value in changes]
    err = _failed(_run(tmp_path, "--save", str(ckpt), "--resume", *flags[0]),
                  "--override-opt-param-scheduler", max_lines=1)
    assert "steps" in err, err
    meta = checkpoint.read_meta(ckpt / STEP2)
    sames = [x for kv in same.items() for x in kv]
    checkpoint.check_schedule(meta, _config(*sames).as_dict(), ckpt / STEP2)  # the same schedule: no error
    for (flag, _), changed in zip(changes, flags, strict=True):
        with pytest.raises(checkpoint.CheckpointError, match="--override-opt-param-scheduler") as refused:
            checkpoint.check_schedule(meta, _config(*changed).as_dict(), ckpt / STEP2)
        assert flag[2:].replace("-", "_") in str(refused.value), (flag, refused.value)
    metrics = tmp_path / "m.jsonl"
    _ok_here(tmp_path, "--save", str(ckpt), "--resume", "--steps", "4", "--lr-warmup-iters", "1",
             "--override-opt-param-scheduler", "--metrics", str(metrics))
    got = [json.loads(line) for line in metrics.read_text().splitlines()]
    want = TrainConfig(steps=4, lr_warmup_iters=1)
    assert [m["step"] for m in got] == [3, 4]
    assert [m["lr"] for m in got] == pytest.approx([lr_at(want, 2), lr_at(want, 3)])


def test_under_torchrun_rank_0_takes_the_lock_and_every_rank_stops(tmp_path: Path) -> None:
    """No fmoe launcher under torchrun: global rank 0 claims --save and tells the other ranks."""
    from fmoe.train import save_dir
    from fmoe.train.launch import _free_port

    ckpt = tmp_path / "ckpt"
    held = save_dir.lock(str(ckpt))  # another run holds it (this process)
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), "-m", "fmoe.cli.main", "train", *SMALL, "--ep", "2", "--steps", "1",
               "--save", str(ckpt)]
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    finally:
        held.close()
    assert done.returncode != 0, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if "CheckpointError" in ln]
    # each rank prints the line (torchrun may stop rank 0 before it does, once rank 1 has exited)
    assert 1 <= len(lines) <= 2 and all(f"pid {os.getpid()}" in ln for ln in lines), done.stderr
    assert not list(ckpt.glob("step_*"))


# ---- a checkpoint from before the fused gate/up experts loads into them -------------------------------


def _as_separate_gate_and_up(src: Path, dst: Path) -> None:
    """Writes src's checkpoint to dst as fmoe wrote it before the routed experts' gate and up weights were
    one tensor: each `...experts.w_gate_up` key as `...experts.w_gate` and `...experts.w_up` (its column
    halves; the AdamW step counter under both), the same meta.json, fresh checksums."""
    import torch
    import torch.distributed.checkpoint as dcp

    from fmoe.train import checksums
    from fmoe.train.safe_metadata import SafeFileSystemReader, read_metadata

    held = read_metadata(src / ".metadata").state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in held.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load / save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(str(src)))
    old = {}
    for key, t in state.items():
        if checkpoint.FUSED not in key:
            old[key] = t
            continue
        half = t.shape[-1] // 2 if t.dim() else None
        old[key.replace(checkpoint.FUSED, checkpoint.GATE)] = t if half is None else t[..., :half].clone()
        old[key.replace(checkpoint.FUSED, checkpoint.UP)] = t if half is None else t[..., half:].clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(old, checkpoint_id=str(dst))
    shutil.copy(src / checkpoint.META, dst / checkpoint.META)
    checksums.write(dst, {p.name: checksums.digest(p) for p in dst.iterdir()})


def test_a_checkpoint_with_separate_gate_and_up_weights_resumes_as_the_fused_one(tmp_path: Path,
                                                                                   step2: Path) -> None:
    """Weights and AdamW moments of w_gate and w_up land in w_gate_up's halves: the next step's loss is the
    same bit for bit as resuming the fused checkpoint it was written from."""
    old = tmp_path / "old"
    _as_separate_gate_and_up(step2 / STEP2, old)
    assert checkpoint.has_key(old, "model/layers.1.moe.experts.w_gate/expert0")
    assert not checkpoint.has_key(old, "model/layers.1.moe.experts.w_gate_up/expert0")
    losses = []
    for name, ckpt in (("fused", step2 / STEP2), ("separate", old)):
        metrics = tmp_path / f"{name}.jsonl"
        _ok(tmp_path, "--steps", "3", "--load", str(ckpt), "--metrics", str(metrics),
            "--override-opt-param-scheduler")
        losses.append([json.loads(line)["loss"] for line in metrics.read_text().splitlines()])
    assert losses[0] == losses[1] and len(losses[0]) == 1, losses
