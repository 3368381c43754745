"""SwiGLU experts: the routed experts on `grouped_linear`, and the shared expert on `linear`.

    y_MD = routed_experts(p["experts"], x_MD, counts_E)      # rows grouped by expert
    s_TD = shared_experts(p["shared"], x_TD)

Legend (the package's, docs/moe.md): M rows grouped by expert (counts_E[e] consecutive rows for expert
e), T tokens, D model width, F ffn width (d_ff for a routed expert, num_shared_experts * d_ff for the
shared one), E experts (the local ones, L, in expert parallelism), Z = 2 F (gate | up).

Parameter layout (weights are [in, out], y = x @ w):
- routed: {"w_gate_up": [E, D, 2F] (gate's columns [0, F), up's [F, 2F): Megatron's fused fc1),
  "w_down": [E, F, D]}. One grouped product makes gate and up, its input gradient is one GEMM (two
  products' input gradients summed moved 3 M D elements more: BENCHMARKS.md, "Glue bytes").
- shared: {"w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]} plus "w_out_gate": [D, 1] when gated.
Host syncs: `routed_experts` makes one `fmoe.ops.Counts` for its three grouped products (and their
backward): counts on an accelerator stay there (no sync); on CPU, or for the "loop" backend, they are
read once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fmoe.config import MoEConfig
from fmoe.init import scaled_normal
from fmoe.ops import (
    Counts,
    group_counts,
    grouped_linear,
    linear,
    linear_pair,
    swiglu_linear,
    swiglu_packed,
    swiglu_packed_grouped_linear,
)


def init_experts(cfg: MoEConfig, generator: torch.Generator | None = None,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Return the routed experts {"w_gate_up": [E, D, 2F] (gate | up), "w_down": [E, F, D]}."""
    E, D, F = cfg.num_experts, cfg.d_model, cfg.d_ff
    return {"w_gate_up": scaled_normal((E, D, 2 * F), D, generator, dtype),
            "w_down": scaled_normal((E, F, D), F, generator, dtype)}


def init_shared(cfg: MoEConfig, generator: torch.Generator | None = None,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Return the shared expert {"w_gate": [D, F], "w_up": [D, F], "w_down": [F, D] (, "w_out_gate": [D, 1])}
    with F = num_shared_experts * d_ff."""
    D, F = cfg.d_model, cfg.num_shared_experts * cfg.d_ff
    p = {"w_gate": scaled_normal((D, F), D, generator, dtype),
         "w_up": scaled_normal((D, F), D, generator, dtype),
         "w_down": scaled_normal((F, D), F, generator, dtype)}
    if cfg.shared_expert_gate:
        p["w_out_gate"] = scaled_normal((D, 1), D, generator, dtype)
    return p


def routed_experts(p: dict[str, torch.Tensor], x_MD: torch.Tensor,
                   counts_E: torch.Tensor | Sequence[int] | Counts,
                   probs_M: torch.Tensor | None = None, backend: str | None = None, *,
                   donate: bool = False) -> torch.Tensor:
    """Return y_MD [M, D] = w_down(swiglu(gate | up = w_gate_up x) [* probs_M]) per expert block of rows.

    `probs_M` (optional) multiplies each row's activation by its gate weight before w_down (gate
    weights inside the expert; padding rows have weight 0). `backend` is passed to grouped_linear.
    `donate`: x_MD is handed over, not to be read after the backward (`grouped_linear`'s donate: on
    the CPU its memory takes its own gradient). The rows the experts make themselves are donated always.
    """
    counts = group_counts(counts_E, x_MD, p["w_gate_up"], backend)  # once for the two products
    gate_up_MZ = grouped_linear(x_MD, p["w_gate_up"], counts, backend, donate=donate)
    # gate_up is made here and read nowhere else: its memory takes its own gradient (donate)
    if probs_M is None:  # fused: a split backward then holds gate | up, not also their product
        return swiglu_packed_grouped_linear(gate_up_MZ, p["w_down"], counts, backend, donate=True)
    h_MF = swiglu_packed(gate_up_MZ, donate=True) * probs_M.to(gate_up_MZ.dtype).unsqueeze(-1)
    return grouped_linear(h_MF, p["w_down"], counts, backend, donate=True)


def shared_experts(p: dict[str, torch.Tensor], x_TD: torch.Tensor) -> torch.Tensor:
    """Return s_TD [T, D] = w_down(swiglu(w_gate x, w_up x)), times sigmoid(x @ w_out_gate) when gated."""
    s_TD = swiglu_linear(*linear_pair(x_TD, p["w_gate"], p["w_up"]), p["w_down"])
    if "w_out_gate" in p:
        s_TD = s_TD * torch.sigmoid(linear(x_TD, p["w_out_gate"]))
    return s_TD
