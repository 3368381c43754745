"""What benchmarks/device_check.py and its MoE layer's parts (device_parts.py) share: the device, moving
trees onto it, comparing on the CPU, timing with it synchronised."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def pick_device(name: str) -> torch.device:
    """Returns the device `name` asks for ("auto": the first CUDA or NPU device, else the CPU)."""
    if name != "auto":
        return torch.device(name if name == "cpu" else f"{name}:0")
    if torch.cuda.is_available():
        return torch.device("cuda:0")
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            return torch.device("npu:0")
    except ImportError:
        pass
    return torch.device("cpu")


def _sync(dev: torch.device) -> None:
    if dev.type != "cpu":
        torch.accelerator.synchronize(dev)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 on the CPU (0 when both are 0)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    den = float(b.norm())
    return float((a - b).norm()) / den if den else float((a - b).norm())


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree) for t in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _leaves(v)]
    return []


def _to(tree: Any, dev: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(dev, dtype) if tree.is_floating_point() else tree.to(dev)
    if isinstance(tree, dict):
        return {k: _to(v, dev, dtype) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to(v, dev, dtype) for v in tree)
    return tree


def _median_s(fn: Callable[[], Any], dev: torch.device, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds per call of fn(), each timed with the device synchronised around it."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
