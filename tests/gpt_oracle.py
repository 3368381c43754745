"""An independent plain composition of the GPT (test-only), for checking `fmoe.model.gpt_loss`, which runs the
model's phases (fmoe/phases.py) through fmoe.transforms.program.run_phases.

Legend: B sequences, S positions, T = B * S tokens, D model width, V vocabulary.

Written from the documented semantics (fmoe/model.py's docstring): embedding by indexing, plain RMSNorm and
SwiGLU, the MoE layer by the loop oracle (tests/moe_oracle.py), the head as a matmul and torch's own
cross-entropy. Only the attention sublayer is fmoe's (`fmoe.block.self_attention`, checked on its own in
tests/test_moe_block.py and tests/test_tensor_parallel.py): nothing of the phases, the runner, the
dispatchers or the loss composition is used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from moe_oracle import oracle_moe

from fmoe.block import self_attention


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _swiglu(h: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    return (F.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def _ce(h_BSD: torch.Tensor, norm_D: torch.Tensor, w_DV: torch.Tensor, targets_BS: torch.Tensor,
        eps: float) -> torch.Tensor:
    logits = _norm(h_BSD, norm_D, eps) @ w_DV
    return F.cross_entropy(logits.flatten(0, 1), targets_BS.flatten(), ignore_index=-100)


def _moe_block(p: dict[str, Any], x_BSD: torch.Tensor, cfg: Any,
               state: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    B, S, D = x_BSD.shape
    r_BSD = self_attention(p, x_BSD, cfg)
    y_TD, loss, _ = oracle_moe(p["moe"], _norm(r_BSD, p["mlp_norm"], cfg.norm_eps).reshape(B * S, D), cfg.moe,
                               state, seq_len=S)
    return r_BSD + y_TD.reshape(B, S, D), loss


def oracle_gpt_loss(params: dict[str, Any], ids_BS: torch.Tensor, targets_BS: torch.Tensor, cfg: Any,
                    state: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Return {"loss", "main", "balance", "mtp"} (float64 params in, differentiable by autograd): the
    training loss main + balance + mtp_loss_weight * mtp."""
    state = state or {}
    layer_states = state.get("layers", [None] * cfg.n_layers)
    h = params["embed"]["table"][ids_BS]
    balance = h.new_zeros(())
    for i, p in enumerate(params["layers"]):
        if i < cfg.num_dense_layers:
            r = self_attention(p, h, cfg)
            h = r + _swiglu(_norm(r, p["mlp"]["norm"], cfg.norm_eps), p["mlp"])
        else:
            h, loss = _moe_block(p, h, cfg, layer_states[i] or None)
            balance = balance + loss
    main = _ce(h, params["norm"], params["head"]["w"], targets_BS, cfg.norm_eps)
    mtp = h.new_zeros(())
    if cfg.mtp:  # Megatron's MTP: every position, token i+1 embedded, token i+2 predicted, the last ignored
        m = params["mtp"]
        nxt = params["embed"]["table"][targets_BS.clamp(min=0)]
        hn, en = _norm(h, m["hidden_norm"], cfg.norm_eps), _norm(nxt, m["embed_norm"], cfg.norm_eps)
        z = torch.cat([hn, en], -1) @ m["w_proj"]
        z, loss = _moe_block(m["block"], z, cfg, state.get("mtp") or None)
        balance = balance + loss
        later = torch.full_like(targets_BS, -100)
        later[:, :-1] = targets_BS[:, 1:]
        if (later >= 0).any():  # torch's mean over no target is NaN; fmoe's (and Megatron's) is 0
            mtp = _ce(z, m["norm"], params["head"]["w"], later, cfg.norm_eps)
    return {"loss": main + balance + cfg.mtp_loss_weight * mtp, "main": main, "balance": balance, "mtp": mtp}
