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
    out = torch.empty(10, 4)
    counts = op_bytes(lambda: (torch.empty_like(a), torch.mul(a, b, out=out), out.mul_(a)))
    assert counts == {"mul": 3 * 40 * 4, "mul_": 3 * 40 * 4}  # out= writes its destination, mul_ reads it too


def test_a_bag_sum_counts_the_table_rows_it_reads():
    """embedding_bag reads one table row per index (a token row K times for K slots), whatever the table's
    size; its per-sample-weight backward reads the indexed rows and each bag's gradient row once."""
    rows_TJ, w_TJ = torch.tensor([[1, 3, 3], [0, 1, 2]]), torch.ones(2, 3)

    def bag_bytes(rows: int, features: int) -> int:
        table_XD = torch.ones(rows, features)
        counts = op_bytes(lambda: torch.nn.functional.embedding_bag(rows_TJ, table_XD, mode="sum",
                                                                    per_sample_weights=w_TJ))
        return sum(v for k, v in counts.items() if "embedding_bag" in k)

    assert bag_bytes(10, 4) == bag_bytes(1000, 4)  # the rows read, not the table
    assert bag_bytes(10, 8) - bag_bytes(10, 4) == (6 + 2) * 4 * 4  # 6 rows read, 2 written, 4 more floats
    table_XD, g_TD = torch.ones(10, 4), torch.ones(2, 4)
    starts_T, bag_N = torch.tensor([0, 3]), torch.tensor([0, 0, 0, 1, 1, 1])
    counts = op_bytes(lambda: torch.ops.aten._embedding_bag_per_sample_weights_backward(
        g_TD, table_XD, rows_TJ.reshape(-1), starts_T, bag_N, 0, -1))
    assert counts["_embedding_bag_per_sample_weights_backward"] == (
        2 * 4 * 4 + 6 * 4 * 4 + 6 * 8 + 2 * 8 + 6 * 8 + 6 * 4)  # g once, rows, indices, starts, bags, out


@pytest.mark.parametrize("shape", [(4096, 1024, 1024, 16, 4), (512, 256, 128, 8, 8)])
def test_the_layer_moves_at_most_1_65_times_the_least(shape):
    """On the meta device (the device path) in bf16: at most 1.65x docs/moe.md's least (b (7ND + 2TD +
    8NF)); the gather-and-add-per-slot permute backward, the fp32 per-slot forward sum and the fp32 copy of
    the rows for the gate-weight gradient made it 3.3x, the gathers and products before the bag sums
    2.1x, separate gate and up weights (their input gradients summed) 1.74x."""
    T, D, F, E, K = shape
    glue = sum(op_bytes(layer_step(shape, torch.bfloat16)).values())
    assert glue <= 1.65 * least_bytes(T, D, F, K, 2), glue / least_bytes(T, D, F, K, 2)
