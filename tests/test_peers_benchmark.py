"""benchmarks/peers.py's op split: every aten call of a step timed, GEMMs apart from the other ops."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import peers  # noqa: E402


def test_the_op_split_counts_gemms_apart_from_the_other_ops() -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    split = peers.op_split({"mm": lambda: (a @ b).relu().sum(), "add": lambda: a + b}, rounds=3)
    assert [len(v) for v in split.values()] == [3, 3]
    assert all(o.gemm > 0 and o.other > 0 and o.ops == 2 and o.step > 0 for o in split["mm"])  # relu, sum
    assert all(o.gemm == 0 and o.ops == 1 for o in split["add"])


def test_the_op_split_runs_fmoes_step() -> None:
    split = peers.op_split({"fmoe": peers.build("fmoe", (8, 6, 3, 2, 10), "fp32")[0]}, rounds=1)
    (o,) = split["fmoe"]
    assert o.gemm > 0 and o.other > 0 and o.ops > 10
