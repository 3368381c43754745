"""What `fmoe train` picks for the machine it runs on, as pure functions checked on CPU: the device type,
backend, device and device_id of each rank (device counts faked), and the precision and fp32 matmul
defaults per device type. On a CPU-only machine nothing changes: gloo, fp32, torch's matmul precision."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from fmoe.precision import POLICIES, Policy, default_policy, float32_matmul_precision
from fmoe.train import launch
from fmoe.train.config import TrainConfig

FP32 = Policy(torch.float32, torch.float32, torch.float32)


@pytest.mark.parametrize("requested,counts,want", [
    ("auto", {"cuda": 0, "npu": 0}, "cpu"),
    ("auto", {"cuda": 8, "npu": 0}, "cuda"),
    ("auto", {"cuda": 0, "npu": 8}, "npu"),
    ("cpu", {"cuda": 8, "npu": 0}, "cpu"),  # --device cpu forces gloo on a GPU machine
    ("cuda", {"cuda": 2, "npu": 0}, "cuda"),
])
def test_the_device_type_follows_the_machine_unless_forced(requested: str, counts: dict, want: str) -> None:
    assert launch.choose_device(requested, counts) == want


def test_a_device_the_machine_lacks_or_too_few_of_them_fail_before_any_rank_starts(monkeypatch,
                                                                                   capsys) -> None:
    with pytest.raises(ValueError, match="no cuda device"):
        launch.choose_device("cuda", {"cuda": 0, "npu": 0})
    monkeypatch.setattr(launch, "device_counts", lambda: {"cuda": 2, "npu": 0})
    assert launch.launch(TrainConfig(pp=2, ep=2)) == 2  # 4 ranks, 2 GPUs
    assert "4 ranks" in capsys.readouterr().err


@pytest.mark.parametrize("device_type,local_rank,want", [
    ("cpu", 3, ("gloo", torch.device("cpu"), None)),
    ("cuda", 3, ("nccl", torch.device("cuda", 3), torch.device("cuda", 3))),
])
def test_each_rank_gets_its_backend_device_and_device_id(device_type: str, local_rank: int, want) -> None:
    assert launch.rank_device(device_type, local_rank) == want
    assert launch.BACKENDS["npu"] == "hccl"  # torch.device("npu") needs torch_npu, absent here


def test_spawned_device_ranks_bind_their_device_and_pass_device_id(monkeypatch) -> None:
    """A spawned rank on a (faked) 2-GPU machine: set_device(local rank), then NCCL with device_id."""
    calls = []
    monkeypatch.setattr(launch, "_set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(launch, "ParallelLayout", lambda **kw: kw)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda p: calls.append(("matmul", p)))
    tc = TrainConfig(pp=2, ep=1)
    world = launch._world(tc, 1, "tcp://127.0.0.1:1", 1, 2, device_type="cuda")
    assert calls[:2] == [("set_device", torch.device("cuda", 1)), ("matmul", "high")]
    backend, kw = calls[2]
    assert backend == "nccl" and kw["device_id"] == torch.device("cuda", 1)
    assert world.device == torch.device("cuda", 1) and world.layout["device_type"] == "cuda"


def test_on_cpu_the_rank_joins_gloo_without_a_device_id(monkeypatch) -> None:
    seen = []
    real = dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: (seen.append((backend, kw)),
                                                                            real(backend, **kw)))
    tc = TrainConfig(pp=1, ep=1)
    try:
        world = launch._world(tc, 0, f"file://{tempfile.mktemp()}", 0, 1)
    finally:
        dist.destroy_process_group()
    assert world.device == torch.device("cpu") and seen[0][0] == "gloo" and "device_id" not in seen[0][1]


@pytest.mark.parametrize("device_type,bf16,fp16,dtype,want,warns", [
    ("cpu", None, False, torch.float32, FP32, False),  # CPU: unchanged
    ("cpu", True, False, torch.float32, POLICIES["bf16-mixed"], False),
    ("cuda", None, False, torch.float32, POLICIES["bf16-mixed"], False),  # the default on a device
    ("npu", None, False, torch.float32, POLICIES["bf16-mixed"], False),
    ("cuda", False, False, torch.float32, FP32, True),  # --no-bf16: fp32 by choice, with a warning
    ("cuda", None, True, torch.float32, POLICIES["fp16-mixed"], False),
    ("cuda", None, False, torch.float64, Policy(torch.float64, torch.float64, torch.float64), False),
])
def test_precision_defaults_fit_the_device(device_type, bf16, fp16, dtype, want, warns) -> None:
    policy, warning = default_policy(device_type, bf16=bf16, fp16=fp16, dtype=dtype)
    assert policy == want and (warning is not None) == warns
    if warns:
        assert "grouped" in warning and "--bf16" in warning


def test_tf32_for_fp32_matmuls_on_cuda_unless_told_otherwise() -> None:
    assert float32_matmul_precision("cuda", tf32=True) == "high"
    assert float32_matmul_precision("cuda", tf32=False) is None
    assert float32_matmul_precision("cpu", tf32=True) is None
    assert float32_matmul_precision("npu", tf32=True) is None


def test_the_config_resolves_its_policy_per_device() -> None:
    tc = TrainConfig(pp=1, ep=1)
    assert tc.policy == FP32 and tc.policy_for("cpu") == FP32 and tc.precision_warning("cpu") is None
    assert tc.policy_for("cuda") == POLICIES["bf16-mixed"] and tc.precision_warning("cuda") is None
    explicit = TrainConfig(pp=1, ep=1, bf16=False)
    assert explicit.policy_for("cuda") == FP32 and "fp32 on cuda" in explicit.precision_warning("cuda")
    assert TrainConfig(pp=1, ep=1, tf32=False, device="cpu").problem() is None
    assert "--device" in TrainConfig(pp=1, ep=1, device="tpu").problem()


def test_deterministic_mode_pins_cublas_and_nccl_on_cuda_only() -> None:
    assert launch.deterministic_env("cuda") == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
    assert launch.deterministic_env("cpu") == {} and launch.deterministic_env("npu") == {}


def test_deterministic_training_runs_with_torch_in_deterministic_mode(tmp_path) -> None:
    """`fmoe train --deterministic` (one process, CPU): every rank turns torch's deterministic mode on
    (an op without a deterministic kernel would raise there), and the losses are the same as without."""
    import json
    import subprocess
    import sys

    losses = {}
    for flag in ("--deterministic", "--no-deterministic"):
        metrics = tmp_path / f"m{flag}.jsonl"
        code = ("import sys, torch, atexit; from fmoe.cli.main import main; atexit.register(lambda: "
                "print('deterministic', torch.are_deterministic_algorithms_enabled())); sys.exit(main())")
        proc = subprocess.run([sys.executable, "-c", code, "train", "--pp", "1", "--ep", "1", "--steps", "2",
                               "--device", "cpu", "--no-progress", "--global-batch-size", "4",
                               "--micro-batch-size", "2", flag, "--metrics", str(metrics)],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"deterministic {flag == '--deterministic'}" in proc.stdout
        losses[flag] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert losses["--deterministic"] == losses["--no-deterministic"] and len(losses["--deterministic"]) == 2
