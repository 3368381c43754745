"""Parameter initialisation shared by every fmoe init function."""

from __future__ import annotations

import torch


def scaled_normal(shape: tuple[int, ...], fan_in: int, generator: torch.Generator | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Return a tensor of `shape` with N(0, 1 / fan_in) entries, drawn in fp32 then cast to `dtype`."""
    return (torch.randn(shape, generator=generator) / fan_in ** 0.5).to(dtype)
