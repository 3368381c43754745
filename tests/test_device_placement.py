"""Every tensor the library creates lives on the device of the data or parameters it serves, checked on
CPU: AdamW's state where torch's own lazy init puts it (`meta` parameters stand for an accelerator, whose
optimizer is fused), and the optimizer, the pipeline step and the train step under the default-device
trap (tests/device_trap.py: default device `meta` while the real data lives on CPU)."""

from __future__ import annotations

import tempfile

import pytest
import test_pipeline_gpt
import test_train
import torch
import torch.distributed as dist
from device_trap import default_device_trap
from dist_utils import spawn

from fmoe import GPTConfig, MoEConfig, init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.pipeline import gpt_program
from fmoe.pipeline import step as pipeline_step
from fmoe.schedule.execute import StepResult
from fmoe.train.config import TrainConfig
from fmoe.train.launch import _world
from fmoe.train.loop import Trainer
from fmoe.train.optim import LeafOptimizer
from fmoe.train.shards import Leaf


@pytest.fixture(params=["plain", "trap"])
def placement(request):
    """Runs the test as it is, and once more inside the default-device trap."""
    if request.param == "plain":
        yield
    else:
        with default_device_trap():
            yield


# ---- AdamW's state ----------------------------------------------------------------------------------

def _optimizer(device: str, dtype: torch.dtype = torch.float32) -> LeafOptimizer:
    tensors = {"w": torch.zeros(4, 3, device=device, dtype=dtype),
               "b": torch.zeros(3, device=device, dtype=dtype)}
    leaves = [Leaf("w", ("w",), False, 0, True, True, 48), Leaf("b", ("b",), False, 0, True, False, 12)]
    return LeafOptimizer(TrainConfig(pp=1, ep=1), leaves, tensors)


def _torch_rule(p: torch.Tensor, group: dict) -> tuple[torch.device, torch.dtype]:
    """Where torch/optim/adam.py's lazy init puts `step`: on p's device in fp32 when fused or capturable,
    else on the CPU in the default float dtype's scalar type (fp64 under a float64 default, else fp32)."""
    if group["fused"] or group["capturable"]:
        return p.device, torch.float32
    return torch.device("cpu"), torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@pytest.mark.parametrize("device", ["meta", "cpu"], ids=["accelerator_fused", "cpu_foreach"])
def test_adamw_state_is_created_where_torchs_lazy_init_puts_it(device: str, placement) -> None:
    """The fused kernel reads `step` through a device pointer: a CPU `step` beside CUDA parameters is an
    illegal memory access at the first step (torch skips its device check for a non-empty state)."""
    opt = _optimizer(device)
    (local,) = opt._locals()
    fused = device != "cpu"
    for group in local.param_groups:
        assert bool(group["fused"]) == fused and bool(group["foreach"]) == (not fused)
        for p in group["params"]:
            st = local.state[p]
            assert (st["step"].device, st["step"].dtype) == _torch_rule(p, group)
            assert st["step"].shape == () and (st["step"].is_meta or float(st["step"]) == 0.0)
            for k in ("exp_avg", "exp_avg_sq"):
                assert (st[k].device, st[k].dtype, st[k].shape) == (p.device, p.dtype, p.shape)


def test_adamw_state_matches_torchs_own_after_a_step() -> None:
    """The pre-created state is the one torch's lazy init would have made: same keys, devices, dtypes."""
    ours = _optimizer("cpu", torch.float64)
    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    ref = torch.optim.AdamW([p], foreach=True)
    p.grad = torch.ones_like(p)
    ref.step()
    want = {k: (v.device, v.dtype) for k, v in ref.state[p].items()}
    for st in ours._locals()[0].state.values():
        assert {k: (v.device, v.dtype) for k, v in st.items()} == want


def test_adamw_steps_under_the_trap() -> None:
    opt = _optimizer("cpu")
    for t in opt.tensors.values():
        t.grad = torch.ones_like(t)
    with default_device_trap():
        opt.step()
    assert all(float(opt.state_of(k)["step"]) == 1.0 for k in opt.tensors)


# ---- the pipeline step ------------------------------------------------------------------------------

def _cfg() -> GPTConfig:
    moe = MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2, num_shared_experts=1)
    return GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, moe=moe, num_dense_layers=1)


class _NoShare:
    def reduce(self, grads) -> None:
        pass


def test_a_pipeline_rank_without_a_loss_all_reduces_a_zero_on_its_device(monkeypatch) -> None:
    """A rank whose stages add no loss gets the executor's empty sum (a zero on the executor's device:
    schedule/execute.py). The step must all-reduce a zero on that device and in the loss's dtype (the loss
    rank's is float64 here), or NCCL rejects it / the ranks' dtypes differ; not one made from the
    embedding table, a meta tensor on a rank that holds neither the embedding nor the head (issue 45, C1)."""
    cfg = _cfg()
    s = S.build("1f1b", 2, 2)
    params = init_gpt(cfg, torch.Generator().manual_seed(0), torch.float64)
    ids = torch.zeros(2, 4, dtype=torch.int64)
    reduced = []

    def fake_execute(*args, **kwargs):  # what execute returns on a rank without a loss
        return StepResult(sum({}.values(), torch.zeros((), device="cpu")), {}, {}, [], [], 0, 0)

    def all_reduce(t, group=None):
        reduced.append(t)

    monkeypatch.setattr(pipeline_step, "execute", fake_execute)
    monkeypatch.setattr(pipeline_step, "full_grads", lambda grads, cfg: {})
    monkeypatch.setattr(pipeline_step.dist, "all_reduce", all_reduce)  # the trap wraps this one
    with default_device_trap():
        out = pipeline_step.gpt_pipeline_step(gpt_program(cfg, s, 0), params, init_gpt_state(cfg),
                                              [(ids, ids)] * 2, shared=_NoShare())
    (loss,) = reduced
    assert loss is out.loss
    assert (loss.device, loss.dtype, float(loss)) == (torch.device("cpu"), torch.float64, 0.0)


# ---- init and the train step ------------------------------------------------------------------------

def _ops_offsets_on_cpu() -> bool:
    """Whether fmoe/ops/_grouped_linear.py makes its (cached) CPU group offsets on the CPU in the trap."""
    from fmoe.ops import _grouped_linear as gl

    with default_device_trap():
        return not gl._cpu_offsets.__wrapped__((1, 2), torch.int32).is_meta


def test_grouped_linear_cpu_offsets_are_made_on_the_cpu() -> None:
    """The grouped GEMM's cached CPU offsets are made on the CPU whatever the default device (an lru cache
    that kept a meta tensor would hand it to every later call)."""
    assert _ops_offsets_on_cpu()


def test_init_makes_params_on_the_generators_device() -> None:
    cfg = _cfg()
    with default_device_trap():
        params = init_gpt(cfg, torch.Generator().manual_seed(0), torch.float32)
    leaves = [t for t in torch.utils._pytree.tree_leaves(params) if isinstance(t, torch.Tensor)]
    assert leaves and all(t.device.type == "cpu" for t in leaves)
    plain = init_gpt(cfg, torch.Generator().manual_seed(0), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(leaves, torch.utils._pytree.tree_leaves(plain)))


def _trainer_run(fn, **flags):
    """Returns fn(trainer) for a one-process Trainer (pp 1 x ep 1: the accumulate path); the group closed."""
    tc = TrainConfig(pp=1, ep=1, dp=1, progress=False, steps=3, **flags)
    world = _world(tc, 0, f"file://{tempfile.mktemp()}", 0, 1)
    try:
        return fn(Trainer(tc, world))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flags", [{}, {"bf16": True}], ids=["fp32", "bf16"])
def test_train_steps_saves_and_loads_under_the_trap(tmp_path, flags: dict) -> None:
    """One process (the accumulate path): build, two steps, a checkpoint, a load, all inside the trap,
    and the same numbers as outside it."""
    def run(trainer: Trainer) -> list[float]:
        losses = [trainer.step()["loss"] for _ in range(2)]
        trainer.load(trainer.save(str(tmp_path / "ckpt")))
        assert trainer.step_done == 2
        return losses

    want = _trainer_run(run, **flags)
    with default_device_trap():
        got = _trainer_run(run, **flags)
    assert got == want


def test_fp16_train_step_body_under_the_trap(tmp_path) -> None:
    """test_train's fp16 test (skipped steps, loss-scale state checkpointed) run as is, inside the trap."""
    with default_device_trap():
        test_train.test_fp16_overflowing_steps_are_skipped_and_the_scale_state_is_checkpointed(tmp_path)


def _trapped_rank(rank: int, world: int, runs: list, m: int) -> dict:
    with default_device_trap():
        return test_pipeline_gpt._rank(rank, world, runs, m)


def test_pipeline_step_under_the_trap() -> None:
    """test_pipeline_gpt's pp 2 run of two schedules (MTP on and off), each rank inside the trap: the
    executor's receive buffers and loss sums, the phases, the shared-weight sums and the step's loss."""
    runs = [("1f1b", 4, False), ("dualpipev", 4, True)]
    results = spawn(_trapped_rank, 2, runs, 4, timeout_s=300)
    test_pipeline_gpt._check(results, runs, 4)
