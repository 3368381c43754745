"""The compute-dtype rule shared by every primitive and the router."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype math on inputs of `dtype` runs in: float64 for float64, else float32.

    Half precision (bf16, fp16) and fp32 inputs are computed and accumulated in fp32, so reductions,
    softmax and routing decisions do not depend on half-precision rounding; fp64 stays fp64 so that
    float64 gradient checks keep their precision. Results are cast back by the caller where it says so.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return t in `dtype`: t itself when it already is (what `t.to(dtype)` returns then, without its
    dispatch: a layer makes a dozen such no-op casts per call)."""
    return t if t.dtype == dtype else t.to(dtype)
