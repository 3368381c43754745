"""`fmoe train --compile`: every executor phase as three compiled graphs (transforms/compiled.py).

Oracles: the eager run of the same layout (the `make run` one: pp 2 x ep 2, DualPipeV with fb overlap),
step by step, and its NCCL-rules replay (tests/nccl_rules.py): compiling the compute phases must change
neither the numbers nor a single message the ranks issue.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from nccl_rules import replay
from test_pipeline_fake_pg import _rank_log
from test_train import _argv, _in_process

from fmoe.schedule.options import ExecOptions
from fmoe.train.config import TrainConfig
from fmoe.transforms.compiled import CompiledPhases

STEPS = 20


def _run(tmp: Path, name: str, *flags: str) -> tuple[list[dict], str]:
    """`fmoe train` with `flags` for STEPS steps (tests/test_train.py's `_in_process`): its metric lines and
    what it printed."""
    metrics = tmp / f"{name}.jsonl"
    code, out, err = _in_process(tmp, _argv("--metrics", str(metrics), "--steps", str(STEPS), *flags))
    assert code == 0, f"{name}: {out}\n{err[-4000:]}"
    return [json.loads(line) for line in metrics.read_text().splitlines()], out


def test_compiled_phases_train_as_eager_on_the_make_run_layout(tmp_path: Path) -> None:
    eager, _ = _run(tmp_path, "eager")
    # dynamo's eager backend: each phase's three graphs captured and compiled as inductor's are, their ops
    # run as aten's (inductor's kernels: benchmarks/train_compile.py, which compares the losses too)
    compiled, out = _run(tmp_path, "compiled", "--compile", "--compile-backend", "eager")
    assert [m["step"] for m in compiled] == list(range(1, STEPS + 1))
    for want, have in zip(eager, compiled, strict=True):
        for key in ("loss", "main_loss", "balance_loss", "grad_norm"):
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (want["step"], key)
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("compiled:"))
    assert line.rstrip().endswith("traces after step 2: 0"), line  # no trace after step 2


@pytest.mark.parametrize("flags,says", [
    (("--pp", "1", "--ep", "1"), "pass --schedule 1f1b to run through the executor"),  # no executor
    (("--pp", "2", "--tp", "2"), "drop --compile, or run tp 1 and cp 1"),  # collectives inside phases
], ids=["accumulate", "tp"])
def test_compile_is_refused_before_launch_where_it_cannot_run(tmp_path: Path, flags, says,
                                                            no_launch: None) -> None:
    code, _, err = _in_process(tmp_path, _argv(*flags, "--compile", "--steps", "1"))
    assert code != 0 and says in err, err[-2000:]


def test_compiled_phases_issue_the_same_messages_and_replay_clean_under_nccl_rules() -> None:
    tc = TrainConfig.from_sources("tiny", None, {
        "schedule": "dualpipev", "pp": 2, "ep": 1, "dp": 1, "num_layers": 4, "first_k_dense": 1,
        "mtp": True, "global_batch_size": 4, "micro_batch_size": 1, "seq_length": 8,
        "hidden_size": 16, "ffn_hidden_size": 16, "moe_ffn_hidden_size": 8, "num_attention_heads": 2,
        "num_experts": 4, "vocab_size": 32})
    eager = {rank: _rank_log(tc, rank) for rank in range(2)}
    compiled = {rank: _rank_log(tc, rank, ExecOptions(compiled=CompiledPhases(None))) for rank in range(2)}
    assert replay(compiled) == []

    def messages(log: list) -> list:
        return [(name, op.kind, op.comm, op.peer, op.tag, op.sig) for name, op in log]

    for rank in range(2):
        assert messages(compiled[rank]) == messages(eager[rank]), rank
