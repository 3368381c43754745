"""Parameter initialisation shared by every fmoe init function.

Parameters are made on the generator's device (`torch.Generator(device="cuda")` initialises on the GPU),
never on torch's default device: a generator draws only on its own device, so a weight drawn elsewhere
would fail, and a constant (a norm's ones) made elsewhere would sit beside weights on another device.
Without a generator, torch's default device (and RNG) as before."""

from __future__ import annotations

import torch


def param_device(generator: torch.Generator | None) -> torch.device | None:
    """Returns the device init functions create parameters on: the generator's (None: torch's default)."""
    return None if generator is None else generator.device


def scaled_normal(shape: tuple[int, ...], fan_in: int, generator: torch.Generator | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Return a tensor of `shape` with N(0, 1 / fan_in) entries, drawn in fp32 then cast to `dtype`, on the
    generator's device."""
    device = param_device(generator)
    return (torch.randn(shape, generator=generator, device=device) / fan_in ** 0.5).to(dtype)
