"""A small GPT with MoE layers and an optional DeepSeek-V3 multi-token-prediction (MTP) module.

    params = init_gpt(cfg, generator)
    state = init_gpt_state(cfg)
    loss, aux = gpt_loss(params, ids_BS, targets_BS, cfg, state)   # aux.new_state for the next step
    logits_BSV = gpt_logits(params, ids_BS, cfg)                    # the main model's logits

Legend (the package's, docs/moe.md): B sequences, S positions, T = B * S tokens, D model width,
V vocabulary.

Layers: cfg.num_dense_layers dense blocks, then MoE blocks (fmoe/block.py). Loss = mean next-token
cross-entropy + sum of the MoE balancing losses + mtp_loss_weight * MTP loss.
MTP (depth 1, DeepSeek-V3 section 2.2): at position i the main model's last hidden state h_i and the
embedding of token i+1 are normalised, concatenated and projected, h'_i = proj([norm(h_i); norm(e_{i+1})]),
passed through one more MoE block, and the shared head predicts token i+2 (S - 1 positions).
The embedding and output head are shared with the main model.

Parameter layout:
{"embed": {"table": [V, D]}, "layers": [block params], "norm": [D], "head": {"w": [D, V]},
 "mtp": {"hidden_norm": [D], "embed_norm": [D], "w_proj": [2D, D], "block": block params, "norm": [D]}}
("mtp" only with cfg.mtp; hidden_norm / embed_norm normalise h_i / the embedding of token i+1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from fmoe.block import block, dense_block, init_block
from fmoe.config import GPTConfig
from fmoe.dispatch.base import Dispatcher
from fmoe.init import param_device, scaled_normal
from fmoe.layer import MoEAux, init_moe_state
from fmoe.ops import cross_entropy, embedding, linear, rms_norm
from fmoe.recompute import recomputed
from fmoe.structure import check_gpt, local_experts


@dataclass(frozen=True)
class GPTAux:
    """What `gpt_loss` reports besides the loss.

    main_loss / mtp_loss / balance_loss: detached scalars (mtp_loss 0 without MTP);
    layers: one MoEAux per MoE layer (main layers, then the MTP block); remat_layers: indices into
    `layers` of the layers whose expert activations were rematerialised; new_state: the next state.
    """

    main_loss: torch.Tensor
    mtp_loss: torch.Tensor
    balance_loss: torch.Tensor
    layers: list[MoEAux]
    remat_layers: list[int]
    new_state: dict[str, Any]


def init_gpt(cfg: GPTConfig, generator: torch.Generator | None = None,
             dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Return the GPT parameter pytree (layout in the module docstring), on the generator's device
    (fmoe/init.py)."""
    D, V = cfg.d_model, cfg.vocab_size
    dev = param_device(generator)
    params: dict[str, Any] = {
        "embed": {"table": (torch.randn(V, D, generator=generator, device=dev) * 0.02).to(dtype)},
        "layers": [init_block(cfg, generator, dtype, dense=i < cfg.num_dense_layers)
                   for i in range(cfg.n_layers)],
        "norm": torch.ones(D, dtype=dtype, device=dev),
        "head": {"w": scaled_normal((D, V), D, generator, dtype)},
    }
    if cfg.mtp:
        params["mtp"] = {"hidden_norm": torch.ones(D, dtype=dtype, device=dev),
                         "embed_norm": torch.ones(D, dtype=dtype, device=dev),
                         "w_proj": scaled_normal((2 * D, D), 2 * D, generator, dtype),
                         "block": init_block(cfg, generator, dtype),
                         "norm": torch.ones(D, dtype=dtype, device=dev)}
    return params


def init_gpt_state(cfg: GPTConfig, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Return {"layers": [MoE state or {} per layer], "mtp": MoE state (if mtp)}."""
    state: dict[str, Any] = {"layers": [{} if i < cfg.num_dense_layers else init_moe_state(cfg.moe, device)
                                        for i in range(cfg.n_layers)]}
    if cfg.mtp:
        state["mtp"] = init_moe_state(cfg.moe, device)
    return state


def logits_loss(h_BSD: torch.Tensor, norm_D: torch.Tensor, head_DV: torch.Tensor, targets_BS: torch.Tensor,
                cfg: GPTConfig) -> torch.Tensor:
    """Return the mean next-token cross-entropy (scalar) of head(rms_norm(h)) against targets_BS (the main
    model's and MTP's; the pipeline's head phase calls it too)."""
    B, S, D = h_BSD.shape
    logits_TV = linear(rms_norm(h_BSD, norm_D, cfg.norm_eps).reshape(B * S, D), head_DV)
    return cross_entropy(logits_TV, targets_BS.reshape(B * S))


def mtp_input(mtp: dict[str, Any], table_VD: torch.Tensor, h_BSD: torch.Tensor, targets_BS: torch.Tensor,
              cfg: GPTConfig) -> torch.Tensor:
    """Return z_BSD [B, S-1, D], MTP's input (module docstring): proj([norm(h_i); norm(embed(token i+1))])
    from the main model's last hidden state and the targets (token i+1 = targets[:, i]); `mtp` the MTP
    params (its hidden_norm, embed_norm, w_proj), `table_VD` the shared embedding. The pipeline's MTP
    input phase calls it too."""
    hn_BSD = rms_norm(h_BSD[:, :-1], mtp["hidden_norm"], cfg.norm_eps)
    next_BSD = embedding(targets_BS[:, :-1].clamp(min=0), table_VD)
    e_BSD = rms_norm(next_BSD, mtp["embed_norm"], cfg.norm_eps)
    return linear(torch.cat([hn_BSD, e_BSD], dim=-1), mtp["w_proj"])


def _trunk(params: dict[str, Any], ids_BS: torch.Tensor, cfg: GPTConfig, state: dict[str, Any],
           dispatcher: Dispatcher | None) -> tuple[torch.Tensor, list[MoEAux], list[dict[str, Any]]]:
    """Return (h_BSD, MoEAux per MoE layer, new layer states): the embedding and every block, unchecked."""
    x_BSD = embedding(ids_BS, params["embed"]["table"])
    moe_aux: list[MoEAux] = []
    new_layers: list[dict[str, Any]] = []
    for i, (p, s) in enumerate(zip(params["layers"], state["layers"])):
        whole = cfg.recompute.layer(i)  # "full" recompute (fmoe/recompute.py): one process is one chunk
        if i < cfg.num_dense_layers:
            x_BSD = (_whole_dense if whole else dense_block)(p, x_BSD, cfg, check=False)
            new_layers.append({})
        else:
            x_BSD, a = (_whole_block if whole else block)(p, x_BSD, cfg, s, dispatcher, check=False)
            moe_aux.append(a)
            new_layers.append(a.new_state)
    return x_BSD, moe_aux, new_layers


def _whole_dense(p: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig, *, check: bool) -> torch.Tensor:
    """dense_block keeping only its input: the backward recomputes the rest (fmoe/recompute.py)."""
    return recomputed(lambda p, x: dense_block(p, x, cfg, check=check))(p, x_BSD)


def _whole_block(p: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig, s: dict[str, Any],
                 dispatcher: Dispatcher | None, *, check: bool) -> tuple[torch.Tensor, MoEAux]:
    """block keeping only its input; its balancing loss stays differentiable. The rest of MoEAux (loads,
    next state) is the forward's: remat hands back non-tensor leaves as the forward made them."""
    def run(p: dict[str, Any], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, MoEAux]:
        y_BSD, aux = block(p, x, cfg, s, dispatcher, check=check)
        return y_BSD, aux.loss, aux

    y_BSD, loss, aux = recomputed(run)(p, x_BSD)
    return y_BSD, replace(aux, loss=loss)


def gpt_logits(params: dict[str, Any], ids_BS: torch.Tensor, cfg: GPTConfig,
               state: dict[str, Any] | None = None, dispatcher: Dispatcher | None = None, *,
               check: bool = True) -> torch.Tensor:
    """Return logits_BSV [B, S, V] of the main model, head(rms_norm(h)) (no MTP, no loss): what an
    inference framework computes, e.g. to compare with an imported checkpoint (fmoe/hf). `check`: as in
    `gpt_loss`."""
    state = state or init_gpt_state(cfg, ids_BS.device)
    if check:
        check_gpt(params, cfg, state, num_local_experts=local_experts(dispatcher))
    x_BSD = _trunk(params, ids_BS, cfg, state, dispatcher)[0]
    return linear(rms_norm(x_BSD, params["norm"], cfg.norm_eps), params["head"]["w"])


def gpt_loss(params: dict[str, Any], ids_BS: torch.Tensor, targets_BS: torch.Tensor, cfg: GPTConfig,
             state: dict[str, Any] | None = None,
             dispatcher: Dispatcher | None = None, *, check: bool = True) -> tuple[torch.Tensor, GPTAux]:
    """Return (loss, aux): the differentiable training loss (fp32 scalar) and a `GPTAux`.

    ids_BS: input token ids; targets_BS: the next tokens (targets[:, i] = token i + 1; -100 ignored).
    `check`: check params and state against `cfg` first (every layer present, keys, shapes, dtypes; the
    routed experts are the dispatcher's num_local_experts; fmoe/structure.py), then run the blocks
    unchecked; False skips it, for trees that already passed (e.g. from a loop's second step on).
    """
    state = state or init_gpt_state(cfg, ids_BS.device)
    if check:
        check_gpt(params, cfg, state, num_local_experts=local_experts(dispatcher))
    x_BSD, moe_aux, new_layers = _trunk(params, ids_BS, cfg, state, dispatcher)
    main = logits_loss(x_BSD, params["norm"], params["head"]["w"], targets_BS, cfg)
    new_state: dict[str, Any] = {"layers": new_layers}
    mtp = main.new_zeros(())
    if cfg.mtp and ids_BS.shape[1] > 1:
        m = params["mtp"]
        z_BSD = mtp_input(m, params["embed"]["table"], x_BSD, targets_BS, cfg)
        z_BSD, a = block(m["block"], z_BSD, cfg, state.get("mtp"), dispatcher, check=False)
        moe_aux.append(a)
        new_state["mtp"] = a.new_state
        mtp = logits_loss(z_BSD, m["norm"], params["head"]["w"], targets_BS[:, 1:], cfg)
    elif cfg.mtp:
        new_state["mtp"] = state.get("mtp", {})
    balance = sum((a.loss for a in moe_aux), main.new_zeros(()))
    loss = main + balance.to(main.dtype) + cfg.mtp_loss_weight * mtp
    aux = GPTAux(main_loss=main.detach(), mtp_loss=mtp.detach(), balance_loss=balance.detach(),
                 layers=moe_aux, remat_layers=[i for i, a in enumerate(moe_aux) if a.remat],
                 new_state=new_state)
    return loss, aux
