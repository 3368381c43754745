"""A user's schedule as data (issue 31): a file in the printed form, read back with its placement
(fmoe.schedule.load_schedule), simulated (`fmoe simulate --schedule-file`), trained (`fmoe train
--schedule-file`, checked before launch, compared across ranks, recorded in checkpoints), and run by the
research script of docs/examples under torchrun.

Oracles: the generators (a printed schedule reads back equal, placement included); the built-in schedule
a hand-written file equals (the same simulation, bitwise the same training losses); one process running
the research script's own `train` at pp 1.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import spawn

from fmoe import schedule as S
from fmoe.cli.main import main
from fmoe.train import checkpoint
from fmoe.train.config import TrainConfig
from fmoe.train.launch import _free_port
from fmoe.train.rank_agreement import check_ranks_agree, compared_config
from fmoe.train.run_errors import RunError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "examples" / "pipeline_research.py"
RUN_TIMEOUT_S = 240
# 1F1B for pp 2 and 4 microbatches, written by hand: rank 0 warms up with one forward, rank 1 alternates
HAND_1F1B = """\
# 1F1B, pp 2, m 4 (fmoe.schedule.one_f_one_b(2, 4) written out)
r0: F0.0 F0.1 B0.0   F0.2 B0.1   F0.3 B0.2   B0.3   # warmup 1, steady, cooldown 1

r1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3
"""
NUMERIC = ("step", "loss", "main_loss", "balance_loss", "lr", "grad_norm", "max_over_mean_load")
TRAIN = ("--pp", "2", "--ep", "1", "--global-batch-size", "16", "--steps", "2")  # 4 microbatches of 4


def _built(pp: int) -> list[S.Schedule]:
    out = []
    for name in S.registry.NAMES:
        for m in (2 * pp, 4 * pp):
            try:
                out.append(S.build(name, pp, m))
            except S.ScheduleError:  # a generator's own constraint (DualPipe: pp even)
                pass
    return out


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_a_printed_schedule_reads_back_equal_with_its_placement(pp: int) -> None:
    built = _built(pp) + [S.build("interleaved", pp, 2 * pp, 3)]
    assert {s.placement.kind for s in built} >= {"loop", "interleaved", "vshape"} | (
        {"bidirectional"} if pp % 2 == 0 else set())
    for s in built:
        for form in (s, S.verify(s)):  # the compute order alone, and with its sends and receives
            assert S.load_schedule_text(str(form), name=s.name) == form, s.name
            noted = "# saved\n\n" + str(form).replace("\n", "  # a comment\n") + "\n"
            assert S.load_schedule_text(noted, name=s.name) == form, s.name


def test_a_hand_written_file_is_the_schedule_it_spells(tmp_path: Path) -> None:
    path = tmp_path / "1f1b.txt"
    path.write_text(HAND_1F1B)
    s = S.load_schedule(path)
    assert s.name == str(path) and dataclasses.replace(s, name="1f1b") == S.one_f_one_b(2, 4)


@pytest.mark.parametrize("text, msg", [
    ("", "no rank lines"),
    ("# only a comment\n", "no rank lines"),
    ("r0: F1.0 B1.0\nr1: F0.0 B0.0", "no placement puts the stages where the text runs them (r0: 1; r1: 0)"),
    ("r0: F0.0 B0.0\nr2: F1.0 B1.0", "malformed rank label 'r2:' at line 2, column 1"),
    ("r0: F0.0 B0.0 # fine\nr1: F1.0 B1.x", "malformed action 'B1.x' at line 2, column 10"),
])
def test_a_bad_text_is_refused_naming_its_source(text: str, msg: str) -> None:
    with pytest.raises(S.ScheduleError, match="^mine: .*" + re.escape(msg)):
        S.load_schedule_text(text, name="mine")


def test_simulate_a_schedule_file_as_the_built_schedule(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "zbv.txt"
    path.write_text(str(S.verify(S.zbv(2, 4))))  # printed with its comms, as --print-schedule shows them
    costs = ["--a2a", "0.5", "--w", "0.5"]
    assert main(["simulate", "--schedule", "zbv", "--pp", "2", "-m", "4", *costs]) == 0
    built = capsys.readouterr().out.splitlines()
    assert main(["simulate", "--schedule-file", str(path), *costs]) == 0
    got = capsys.readouterr().out.splitlines()
    assert got[0] == f"schedule file {path}: pp 2, 4 microbatches, vshape placement (4 stages, 2 per rank)"
    assert got[1] == built[0].replace("schedule zbv:", f"schedule {path}:")
    assert got[2:] == built[1:]  # the same table


def _one_error(capsys: pytest.CaptureFixture, code: int | str | None) -> str:
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    assert code == 2, text
    lines = [ln for ln in text.splitlines() if not ln.startswith(("usage:", " "))]
    assert len(lines) == 1, text
    return lines[0]


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    files = {"deadlock": "r0: F0.0 B0.0 F0.1 B0.1\nr1: F1.0 F1.1 B1.0 B1.1\n",
             "ranks": str(S.one_f_one_b(3, 4)),
             "syntax": "r0: F0.0 F0.1 B0.0 B0.1\nr1: F1.0 B1.0 F1.1 B1,1\n",
             "good": HAND_1F1B}
    for name, text in files.items():
        (tmp_path / f"{name}.txt").write_text(text)
    return {name: tmp_path / f"{name}.txt" for name in [*files, "missing"]}


def test_simulate_refuses_a_bad_file_or_flags_beside_it_in_one_line(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    f = _bad_files(tmp_path)
    cases = [([f["deadlock"]], "deadlock with blocking receives"),
             ([f["syntax"]], "malformed action 'B1,1' at line 2, column 20"),
             ([f["missing"]], "cannot read the schedule file: No such file or directory"),
             ([f["good"], "--pp", "2", "-m", "4"], "--schedule-file gives the schedule, its ranks and "
                                                   "microbatches: leave out --pp, --microbatches"),
             ([f["good"], "--schedule", "1f1b"], "leave out --schedule")]
    for (path, *flags), needle in cases:
        line = _one_error(capsys, main(["simulate", "--schedule-file", str(path), *flags]))
        assert line.startswith("error: ") and needle in line, (path, line)


def test_train_refuses_a_file_that_does_not_fit_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                              no_launch: None) -> None:
    f = _bad_files(tmp_path)
    cases = [(f["deadlock"], ("--global-batch-size", "8"), "deadlock with blocking receives"),
             (f["ranks"], (), f"--schedule-file {f['ranks']} has 3 rank lines but --pp is 2"),
             (f["syntax"], (), "malformed action 'B1,1' at line 2, column 20"),
             (f["missing"], (), "cannot read the schedule file"),
             (f["good"], ("--global-batch-size", "32"), "runs 4 microbatches but the batch flags give 8"),
             (f["good"], ("--schedule", "1f1b"), "give --schedule or --schedule-file, not both"),
             (f["good"], ("--num-virtual-stages-per-pipeline-rank", "2"), "runs 1 model chunk per rank (loop "
                                                                          "placement), not --num-virtual"),
             (f["good"], ("--num-layers", "1", "--first-k-dense", "0"), "1 layers cannot give 1 to each")]
    for path, flags, needle in cases:
        argv = ["train", "--no-progress", *TRAIN, "--schedule-file", str(path), *flags]
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        line = _one_error(capsys, code)
        assert line.startswith("fmoe train: error: ") and needle in line, (path.name, flags, line)


def _agree(rank: int, world_size: int, files: list[str]) -> str:
    """One rank of `fmoe train`'s launch check, with --schedule-file files[rank]."""
    try:
        check_ranks_agree(TrainConfig(schedule_file=files[rank]), {"world_size": world_size})
    except RunError as exc:
        return str(exc)
    return "agreed"


def test_ranks_compare_the_schedule_a_file_holds_not_its_path(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(HAND_1F1B)
    (tmp_path / "b.txt").write_text(str(S.one_f_one_b(2, 4)))  # a copy without the comments
    (tmp_path / "c.txt").write_text(str(S.gpipe(2, 4)))
    files = {k: str(tmp_path / f"{k}.txt") for k in "abc"}
    seen = {k: compared_config(TrainConfig(schedule_file=path)) for k, path in files.items()}
    assert seen["a"] == seen["b"] and seen["a"]["schedule_file"] != seen["c"]["schedule_file"]
    assert seen["a"]["schedule_file"].startswith("loop placement, pp 2, 4 microbatches, sha256 ")
    assert compared_config(TrainConfig())["schedule_file"] is None
    got = [r.value for r in spawn(_agree, 2, [files["a"], files["c"]])]  # rank 1 reads another schedule
    assert got[0] == got[1] and "disagree on config" in got[0] and "config['schedule_file']" in got[0], got


def _train(tmp: Path, name: str, *flags: str) -> tuple[list[dict], str]:
    """`fmoe train` with `flags` (tests/test_train.py's `_in_process`: the command's main here, its ranks
    spawned): its metric lines and its stdout."""
    from test_train import _in_process

    metrics = tmp / f"{name}.jsonl"
    code, out, err = _in_process(tmp, ["train", "--no-progress", "--metrics", str(metrics), *flags])
    assert code == 0, f"{name}: {out}\n{err}"
    return [json.loads(line) for line in metrics.read_text().splitlines()], out


def test_a_hand_written_file_trains_as_the_built_schedule_it_equals(tmp_path: Path) -> None:
    path = tmp_path / "1f1b.txt"
    path.write_text(HAND_1F1B)
    built, _ = _train(tmp_path, "built", *TRAIN, "--schedule", "1f1b")
    mine, out = _train(tmp_path, "file", *TRAIN, "--schedule-file", str(path), "--save", str(tmp_path / "ck"))
    assert f"file {path}" in out
    numbers = [tuple(m[k] for k in NUMERIC) for m in (*built, *mine)]
    assert [m["step"] for m in mine] == [1, 2] and numbers[:2] == numbers[2:]  # bitwise
    layout = checkpoint.read_meta(checkpoint.latest(tmp_path / "ck"))["layout"]
    assert layout["schedule"] == f"file {path}"
    assert S.load_schedule_text(layout["schedule_text"]) == S.load_schedule_text(HAND_1F1B)


def test_the_research_script_runs_a_schedule_file_on_two_gloo_ranks(tmp_path: Path) -> None:
    # a saved ZB-V with a change: every W deferred to the end of its rank
    lines = []
    for line in str(S.zbv(2, 4)).splitlines():
        label, *acts = line.split()
        lines.append(" ".join([label, *(a for a in acts if a[0] != "W"), *(a for a in acts if a[0] == "W")]))
    path = tmp_path / "zbv_w_last.txt"
    path.write_text("\n".join(lines) + "\n")
    assert S.verify(S.load_schedule(path)) and S.load_schedule(path).placement.kind == "vshape"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), str(SCRIPT), "--schedule-file", str(path), "--steps", "2"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    got = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", done.stdout, re.M)]
    spec = importlib.util.spec_from_file_location("pipeline_research", SCRIPT)
    research = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(research)
    want = research.train(S.one_f_one_b(1, 4), 0, None, steps=2)  # one process, the whole model
    assert got == pytest.approx(want, rel=2e-5) and len(got) == 2, done.stdout
