"""The traffic around the expert GEMMs: the op-bytes counter's rules, and the MoE layer against the least it
must move (docs/moe.md, "Traffic around the expert GEMMs").

Legend: T tokens, D model width, F expert width, E experts, K top-k slots, N = T * K rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fmoe.transforms.op_bytes import op_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from glue_bytes import layer_step, least_bytes  # noqa: E402


def test_the_counter_counts_elementwise_ops_gathers_by_rows_and_leaves_gemms_and_views_out():
    a, b = torch.ones(10, 4), torch.ones(10, 4)
    index = torch.tensor([1, 3])
    counts = op_bytes(lambda: (a + b, a.t(), a @ b.t(), a.index_select(0, index)))
    assert counts["add"] == 3 * 40 * 4          # two inputs and the output
    assert counts["index_select"] == 2 * (2 * 4 * 4) + index.numel() * 8  # rows read, rows written, index
    assert set(counts) == {"add", "index_select"}  # t is a view, mm a GEMM


@pytest.mark.parametrize("shape", [(4096, 1024, 1024, 16, 4), (512, 256, 128, 8, 8)])
def test_the_layer_moves_at_most_2_3_times_the_least(shape):
    """On the meta device (the device path) in bf16: at most 2.3x docs/moe.md's least (b (7ND + 2TD + 8NF));
    the gather-and-add-per-slot permute backward, the fp32 per-slot forward sum and the fp32 copy of the
    rows for the gate-weight gradient made it 3.3x."""
    T, D, F, E, K = shape
    glue = sum(op_bytes(layer_step(shape, torch.bfloat16)).values())
    assert glue <= 2.3 * least_bytes(T, D, F, K, 2), glue / least_bytes(T, D, F, K, 2)
