"""benchmarks/peers.py's op split: every aten call of a step timed, GEMMs apart from the other ops."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peers  # noqa: E402


def test_the_op_split_counts_gemms_apart_from_the_other_ops() -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    gemm, other, ops = peers.op_split(lambda: (a @ b).relu().sum(), rounds=3)
    assert gemm > 0 and other > 0 and ops == 2  # relu and sum; the mm is a GEMM


def test_the_op_split_runs_fmoes_step() -> None:
    step = peers.build("fmoe", (8, 6, 3, 2, 10), "fp32")[0]
    gemm, other, ops = peers.op_split(step, rounds=1)
    assert gemm > 0 and other > 0 and ops > 10
