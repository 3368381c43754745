"""Parameter initialisation shared by every fmoe init function, and the keyed draws of sharded init.

Parameters are made on the generator's device (`torch.Generator(device="cuda")` initialises on the GPU),
never on torch's default device: a generator draws only on its own device, so a weight drawn elsewhere
would fail, and a constant (a norm's ones) made elsewhere would sit beside weights on another device.
Without a generator, torch's default device (and RNG) as before.

Init functions make every parameter through `normal`, `scaled_normal` or `ones`. Run on the meta device
they make a *spec*: shapes and dtypes with no memory, each tensor tagged with how it is drawn
(`init_of`). `draw_units` then materialises any part of a spec'd tensor from keyed seeds: the tensor is
cut along one axis into units (a head's columns, an ffn column, a vocabulary row, an expert), and unit u
of the tensor named `key` is drawn from its own generator seeded by (seed, key, u). A rank draws only
its units, and every layout that cuts the tensor along unit boundaries gets the same values
(fmoe/gpt_init.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

_TAG = "fmoe_init"  # attribute on meta tensors: ("normal", std) or ("fill", value)


def param_device(generator: torch.Generator | None) -> torch.device | None:
    """Returns the device init functions create parameters on: the generator's (None: torch's default)."""
    return None if generator is None else generator.device


def _tagged(t: torch.Tensor, how: tuple[str, float]) -> torch.Tensor:
    if t.is_meta:  # only specs carry it: real parameters stay plain tensors
        setattr(t, _TAG, how)
    return t


def normal(shape: tuple[int, ...], std: float, generator: torch.Generator | None = None,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Return a tensor of `shape` with N(0, std^2) entries, drawn in fp32 then cast to `dtype`, on the
    generator's device."""
    device = param_device(generator)
    return _tagged((torch.randn(shape, generator=generator, device=device) * std).to(dtype), ("normal", std))


def scaled_normal(shape: tuple[int, ...], fan_in: int, generator: torch.Generator | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Return a tensor of `shape` with N(0, 1 / fan_in) entries, drawn in fp32 then cast to `dtype`, on the
    generator's device."""
    return normal(shape, fan_in ** -0.5, generator, dtype)


def ones(shape: tuple[int, ...] | int, generator: torch.Generator | None = None,
         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Return a tensor of ones of `shape` (a norm's gains) on the generator's device."""
    return _tagged(torch.ones(shape, dtype=dtype, device=param_device(generator)), ("fill", 1.0))


def init_of(spec: torch.Tensor) -> tuple[str, float]:
    """Returns how the spec tensor `spec` (made by an init function on the meta device) is drawn:
    ("normal", std) or ("fill", value). ValueError for a tensor not made through this module."""
    how = getattr(spec, _TAG, None)
    if how is None:
        raise ValueError(f"a parameter of shape {tuple(spec.shape)} was not made by fmoe.init's normal, "
                         "scaled_normal or ones: sharded initialisation cannot draw it")
    return how


def init_seed(generator: torch.Generator | None) -> int:
    """Returns a seed for keyed draws taken from `generator` (None: torch's global RNG): the same
    generator state gives the same seed."""
    device = param_device(generator)
    return int(torch.randint(0, 2**62, (), generator=generator, device=device))


def unit_seed(seed: int, key: str, unit: int | None) -> int:
    """Returns the seed of unit `unit` (None: the whole tensor) of the tensor named `key`: a stable hash,
    the same in every process and on every platform."""
    digest = hashlib.blake2b(f"{seed}/{key}/{unit}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass(frozen=True)
class Units:
    """How a tensor is cut for keyed draws: along `axis` into `n` units of `width` entries each."""

    axis: int
    n: int
    width: int


def draw_units(spec: torch.Tensor, key: str, seed: int, units: Units | None, first: int = 0,
               count: int | None = None, *, device: torch.device | str | None = None,
               draw_device: torch.device | str = "cpu") -> torch.Tensor:
    """Returns units first .. first + count - 1 of the spec'd tensor `spec` named `key` (`units` None:
    the whole tensor, one draw), concatenated along the units' axis, in spec's dtype on `device`
    (None: `draw_device`). Each unit is drawn in fp32 on `draw_device` from its own generator
    (`unit_seed`) and copied into place, so the memory held at once is the result plus one unit."""
    kind, value = init_of(spec)
    shape = list(spec.shape)
    if units is not None:
        count = units.n - first if count is None else count
        if shape[units.axis] != units.n * units.width or not 0 <= first <= first + count <= units.n:
            raise ValueError(f"{key}: units {first}..{first + count} of {units} do not cut shape {shape}")
        shape[units.axis] = count * units.width
    out = torch.empty(shape, dtype=spec.dtype, device=device if device is not None else draw_device)
    if kind == "fill":
        return out.fill_(value)
    pieces = [(None, out)] if units is None else [
        (u, out.narrow(units.axis, (u - first) * units.width, units.width))
        for u in range(first, first + count)]
    for unit, piece in pieces:
        g = torch.Generator(device=draw_device).manual_seed(unit_seed(seed, key, unit))
        piece.copy_(torch.randn(piece.shape, generator=g, device=draw_device) * value)
    return out
