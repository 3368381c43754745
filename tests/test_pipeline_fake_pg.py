"""Every pipeline rank's step, for every schedule and a range of layouts, without starting a process per
rank: each rank runs alone in this process over torch's fake process group (c10d's "fake" backend: every
collective and P2P op completes at once and moves no bytes), under the default-device trap
(tests/device_trap.py: a tensor made without a device is meta, and c10d refuses meta tensors), with every
op it issues recorded (tests/nccl_rules.py). The ranks' logs are then replayed together under NCCL's
matching rules: a rank whose stages make no loss must still all-reduce a loss tensor of the same shape
and dtype, on its device, as the ranks that do (issue 45, C1: a rank of dense layers only, holding
neither the embedding nor the head, reduced a meta tensor).

What the fake group cannot show is the data: received buffers hold whatever torch.empty left there, so
nothing here reads a value (tests/test_pipeline_gpt.py and test_train.py check the numbers on gloo).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from device_trap import default_device_trap
from nccl_rules import recording, replay
from torch.testing._internal.distributed.fake_pg import FakeStore

from fmoe import init_gpt_state
from fmoe.gpt_init import init_gpt_shard
from fmoe.init import init_seed
from fmoe.parallel.shared_grads import SharedGrads
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.pipeline.cut import cut_gpt, holders
from fmoe.schedule.options import DEFAULTS, ExecOptions
from fmoe.train.config import TrainConfig

S_ = 8  # positions per sequence

# (schedule, pp, layers, leading dense layers, mtp): dense and MoE mixes, a rank of dense layers only
# (C1) in the middle and at the start, MTP on the last stage, both directions of DualPipeV
CASES = [
    ("1f1b", 3, 6, 4, False),        # rank 1: dense layers only, no embedding, no head (C1)
    ("1f1b", 2, 4, 4, False),        # every layer dense
    ("gpipe", 2, 2, 0, False),       # every layer MoE
    ("1f1b", 4, 8, 3, True),         # MTP: the last stage reads the embedding too
    ("interleaved", 2, 8, 5, False),  # two chunks per rank, rank 0's both dense
    ("zb_h1", 4, 4, 2, False),
    ("zbv", 2, 4, 1, True),
    ("dualpipev", 2, 8, 3, True),
    ("dualpipev", 3, 6, 2, False),
    ("dualpipe", 2, 4, 1, False),
]


def _rank_log(tc: TrainConfig, rank: int, options: ExecOptions = DEFAULTS) -> list:
    """Runs pipeline rank `rank`'s step of `tc` alone over the fake group, under the device trap (with the
    executor's `options`); returns what it issued to c10d (nccl_rules.recording's log)."""
    cfg, s = tc.model(), tc.pipeline_schedule()
    chunks = cut_gpt(cfg, s.placement, seq=S_)
    paths = [p for st in s.placement.stages_of(rank)
             for p in chunks[s.placement.layer_chunk[st]].param_paths(cfg)]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=s.pp)
    try:
        params = init_gpt_shard(cfg, init_seed(torch.Generator().manual_seed(0)), torch.float32, holds=paths,
                                device="cpu")
        state = init_gpt_state(cfg)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, cfg.vocab_size, (1, S_), generator=g),) * 2 for _ in range(s.m)]
        program = gpt_program(cfg, s, rank, chunks=chunks)
        shared = SharedGrads(holders(cfg, s.placement, chunks), dist.group.WORLD)
        with default_device_trap(), recording() as log:
            out = gpt_pipeline_step(program, params, state, batches, group=dist.group.WORLD, shared=shared,
                                    options=options)
        assert out.loss.device == torch.device("cpu"), (rank, out.loss.device)
        return log
    finally:
        dist.destroy_process_group()


IDS = [f"{c[0]}-pp{c[1]}-L{c[2]}-d{c[3]}{'-mtp' if c[4] else ''}" for c in CASES]


@pytest.mark.parametrize("schedule,pp,layers,dense,mtp", CASES, ids=IDS)
def test_every_rank_issues_device_tensors_that_match_its_peers(schedule: str, pp: int, layers: int,
                                                                 dense: int, mtp: bool) -> None:
    tc = TrainConfig.from_sources("tiny", None, {
        "schedule": schedule, "pp": pp, "ep": 1, "dp": 1, "num_layers": layers, "first_k_dense": dense,
        "mtp": mtp, "global_batch_size": 2 * pp, "micro_batch_size": 1, "seq_length": S_,
        "hidden_size": 16, "ffn_hidden_size": 16, "moe_ffn_hidden_size": 8, "num_attention_heads": 2,
        "num_experts": 4, "vocab_size": 32})
    logs = {rank: _rank_log(tc, rank) for rank in range(pp)}
    assert replay(logs) == []
