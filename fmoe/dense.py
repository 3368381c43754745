"""A dense (MoE-free) pre-norm SwiGLU MLP stack as pure functions: the split_vjp demo and benchmark model.

Legend (the package's, docs/moe.md): T tokens, D model width, F ffn width.

    params = init_dense_stack(num_layers, d_model, d_ff, generator)
    y_TD = dense_stack(params, x_TD)     # per layer: x + down(swiglu(gate(norm(x)), up(norm(x))))

Weights are stored [in, out] (y = x @ w), as everywhere in fmoe.
"""

from __future__ import annotations

import torch

from fmoe._checks import positive
from fmoe.init import ones, scaled_normal
from fmoe.ops import linear_pair, rms_norm, swiglu_linear
from fmoe.parallel.context import LOCAL, ParallelContext
from fmoe.parallel.tensor import copy_to_tp, gather_sequence, reduce_from_tp, scatter_sequence, tp_weight
from fmoe.recompute import recomputed


def init_swiglu_mlp(d_model: int, d_ff: int, generator: torch.Generator | None = None,
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Return one MLP's params {"norm": ones [D], "w_gate": [D, F], "w_up": [D, F], "w_down": [F, D]}."""
    def normal(*shape: int) -> torch.Tensor:
        return scaled_normal(shape, shape[0], generator, dtype)

    return {"norm": ones(d_model, generator, dtype),
            "w_gate": normal(d_model, d_ff), "w_up": normal(d_model, d_ff), "w_down": normal(d_ff, d_model)}


def _normed_pair(x_TD: torch.Tensor, norm_D: torch.Tensor, eps: float, w_gate: torch.Tensor,
                 w_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (h @ w_gate, h @ w_up) with h = rms_norm(x): the norm and the products that read it."""
    return linear_pair(rms_norm(x_TD, norm_D, eps), w_gate, w_up)


def swiglu_mlp(p: dict[str, torch.Tensor], x_TD: torch.Tensor, eps: float = 1e-6,
               parallel: ParallelContext = LOCAL, recompute_norm: bool = False) -> torch.Tensor:
    """Return x_TD + w_down(swiglu(w_gate h, w_up h)) with h = rms_norm(x_TD): shape [T, D] (any leading
    axes, e.g. [B, S, D], work the same). `parallel.tp`: the tensor-parallel group, `p` this rank's shard
    (w_gate, w_up by columns, w_down by rows; fmoe/tp_layout.py); x and the result replicated on the
    group, or with `parallel.sequence_parallel` x [B, S/P, D] this rank's positions (gathered in,
    reduce-scattered out).
    `recompute_norm` (selective recompute's "layernorm", fmoe/recompute.py): without `tp` the norm and the
    gate and up products run under remat (h is not kept); with `tp` the norm alone (a collective separates
    it from the products: h stays kept, only the norm's own saved tensors go)."""
    tp, sequence_parallel = parallel.tp, parallel.sequence_parallel
    if tp is None:
        pair = (recomputed(_normed_pair) if recompute_norm else _normed_pair)(x_TD, p["norm"], eps,
                                                                              p["w_gate"], p["w_up"])
        return x_TD + swiglu_linear(*pair, p["w_down"])
    # under SP the norm sees this rank's positions only: its scale's gradient is summed over the group
    h_TD = (recomputed(rms_norm) if recompute_norm else rms_norm)(
        x_TD, tp_weight(p["norm"], tp) if sequence_parallel else p["norm"], eps)
    h_TD = gather_sequence(h_TD, tp) if sequence_parallel else copy_to_tp(h_TD, tp)
    part_TD = swiglu_linear(*linear_pair(h_TD, p["w_gate"], p["w_up"]), p["w_down"])
    # the ffn shards' partial sums
    return x_TD + (scatter_sequence(part_TD, tp) if sequence_parallel else reduce_from_tp(part_TD, tp))


def init_dense_stack(num_layers: int, d_model: int, d_ff: int, generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float32) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Return {"layers": [init_swiglu_mlp(...)] * num_layers} (independent draws)."""
    for name, size in (("num_layers", num_layers), ("d_model", d_model), ("d_ff", d_ff)):
        positive(f"init_dense_stack: {name}", size)
    return {"layers": [init_swiglu_mlp(d_model, d_ff, generator, dtype) for _ in range(num_layers)]}


def dense_stack(params: dict[str, list[dict[str, torch.Tensor]]], x_TD: torch.Tensor) -> torch.Tensor:
    """Return y_TD after every layer of the stack: shape [T, D]."""
    for layer in params["layers"]:
        x_TD = swiglu_mlp(layer, x_TD)
    return x_TD
