"""A small GPT with MoE layers and an optional DeepSeek-V3 multi-token-prediction (MTP) module, run in one
process: the model's phases (fmoe/phases.py, the one definition a pipeline's executor runs too) in order
(fmoe.transforms.program.run_phases), differentiable by autograd and torch.func.

    params = init_gpt(cfg, generator)
    state = init_gpt_state(cfg)
    loss, aux = gpt_loss(params, ids_BS, targets_BS, cfg, state)   # aux.new_state for the next step
    logits_BSV = gpt_logits(params, ids_BS, cfg)                    # the main model's logits
    y_BSD, aux = block(block_params, x_BSD, cfg, layer_state)      # one MoE block
    y_TD, aux = moe(moe_params, x_TD, cfg.moe, layer_state)        # the MoE layer alone (fmoe.moe)

Legend (the package's, docs/moe.md): B sequences, S positions, T = B * S tokens, D model width,
V vocabulary.

Layers: cfg.num_dense_layers dense blocks, then MoE blocks (fmoe/block.py). Loss = mean next-token
cross-entropy + sum of the MoE balancing losses + mtp_loss_weight * MTP loss.
MTP (depth 1, DeepSeek-V3 section 2.2): at position i the main model's last hidden state h_i and the
embedding of token i+1 are normalised, concatenated and projected, h'_i = proj([norm(h_i); norm(e_{i+1})]),
passed through one more MoE block, and the shared head predicts token i+2. As in Megatron's MTP it runs
on all S positions (the last one's token i+2 lies outside the window: its loss is ignored, and an ignored
token i+1 embeds token 0), so it splits over the sequence like the main stream.
The embedding and output head are shared with the main model.

Parameter layout:
{"embed": {"table": [V, D]}, "layers": [block params], "norm": [D], "head": {"w": [D, V]},
 "mtp": {"hidden_norm": [D], "embed_norm": [D], "w_proj": [2D, D], "block": block params, "norm": [D]}}
("mtp" only with cfg.mtp; hidden_norm / embed_norm normalise h_i / the embedding of token i+1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fmoe._compat import trace_safe_cache, tree_flatten
from fmoe.config import GPTConfig, MoEConfig
from fmoe.dispatch.base import Dispatcher
from fmoe.dispatch.local import LocalDispatcher
from fmoe.gpt_init import init_gpt  # noqa: F401  (the model's init, re-exported)
from fmoe.gpt_state import LayerLoad, init_gpt_state, update_gpt_state
from fmoe.layer import MoEAux, make_aux, update_moe_state
from fmoe.ops import linear, rms_norm
from fmoe.outline import alone, outline, state_at
from fmoe.packing import Packing
from fmoe.parallel.context import LOCAL, ParallelContext
from fmoe.phases import H, gpt_layers, moe_layer
from fmoe.router import check_seq_len
from fmoe.structure import check_block, check_gpt, check_moe, local_experts
from fmoe.tp_layout import SPLITS, check_shard, check_tp
from fmoe.transforms.program import Layer, Ran, run_phases, tree_params
from fmoe.transforms.pytree import pytree_dataclass


@pytree_dataclass
@dataclass(frozen=True)
class GPTAux:
    """What `gpt_loss` reports besides the loss.

    main_loss / mtp_loss / balance_loss: detached scalars (mtp_loss 0 without MTP);
    layers: one MoEAux per MoE layer (main layers, then the MTP block); new_state: the next state;
    remat_layers (property): indices into `layers` of the layers whose expert activations were
    rematerialised. A pytree (transforms/pytree.py): `grad_and_value(..., has_aux=True)` and `tree_map`
    see its tensors.
    """

    main_loss: torch.Tensor
    mtp_loss: torch.Tensor
    balance_loss: torch.Tensor
    layers: list[MoEAux]
    new_state: dict[str, Any]

    @property
    def remat_layers(self) -> list[int]:
        """Indices into `layers` of the layers whose expert activations were rematerialised."""
        return [i for i, a in enumerate(self.layers) if a.remat]


def _run(layers: list, params: dict[str, Any], acts: dict[str, torch.Tensor],
         meta: dict[str, Any]) -> Ran:
    """Runs `layers` (fmoe/phases.py) in order over `params` (the whole tree: phases pick theirs)."""
    return run_phases(layers, tree_params(params), acts, meta)


def _routes(ran: Ran) -> list[tuple[str, torch.Tensor, Any]]:
    """(layer name, differentiable balancing loss, MoERoute) per MoE layer that ran, in order."""
    return [(name, ran.losses[f"balance:{name}"], st["route"]) for name, _, st in ran.stats]


def _layer_aux(ran: Ran, cfg: MoEConfig, state: dict[str, Any] | None, check: bool) -> MoEAux:
    """The MoEAux of the one MoE layer that ran, its next state moved from its load (update_moe_state)."""
    (_, loss, route), = _routes(ran)
    load = LayerLoad.of(route)
    new_state = update_moe_state(state or {}, cfg, load.tokens_per_expert_E, load.max_load, load.missed,
                                 check=check)
    return make_aux(loss, route, new_state)


def _gpt_layers(cfg: GPTConfig, parallel: ParallelContext) -> tuple[Layer, ...]:
    """`gpt_loss`'s layers: the whole model as one chunk."""
    return tuple(gpt_layers(cfg, outline(cfg).chunk(range(cfg.n_layers), first=True, head=True, last=True),
                            parallel))


@trace_safe_cache(maxsize=8)
def _local_gpt_layers(cfg: GPTConfig) -> tuple[Layer, ...]:
    """`_gpt_layers` in one process, built once per config (layers hold no params and no state)."""
    return _gpt_layers(cfg, LOCAL)


@trace_safe_cache(maxsize=32)
def _local_moe_layer(cfg: MoEConfig, remat: bool | None, seq_len: int | None) -> Layer:
    """`moe`'s layer over the local dispatcher (phases hold no params and no state: one serves every call)."""
    return moe_layer(cfg, alone("moe"), ParallelContext(dispatcher=LocalDispatcher(cfg.num_experts)),
                     remat=remat, bare=True, seq_len=seq_len)


def moe(params: dict[str, Any], x_TD: torch.Tensor, cfg: MoEConfig, state: dict[str, Any] | None = None,
        *, seq_len: int | None = None, dispatcher: Dispatcher | None = None,
        remat: bool | None = None, check: bool = True) -> tuple[torch.Tensor, MoEAux]:
    """Return (y_TD, aux): the MoE layer's output [T, D] (x's dtype) and its `MoEAux` (fmoe/layer.py): the
    phases of `fmoe.phases.moe_layer(bare=True)` in order.

    `state`: the layer's state pytree (default: init_moe_state); aux.new_state is the next one.
    `seq_len`: tokens per sequence for the sequence-wise loss (T = B * seq_len, sequence-major; a
    positive int dividing T, None = one sequence). `dispatcher`: how rows reach the experts (default
    LocalDispatcher); it gets whole tokens where it declares so (`uses_token_dispatch`).
    `remat`: force (True) or forbid (False) rematerialising the expert activations; None =
    cfg.adaptive_remat rule. `check`: check params and state against `cfg` first (keys, shapes, dtypes;
    the routed experts are the dispatcher's num_local_experts; fmoe/structure.py); pass False only
    for trees that already passed. aux.loss is differentiable: add it to the loss you differentiate.
    """
    if x_TD.dim() != 2 or x_TD.shape[1] != cfg.d_model:
        raise ValueError(f"moe: x must be [T, {cfg.d_model}], got {tuple(x_TD.shape)}")
    check_seq_len(seq_len, x_TD.shape[0])
    if check:
        check_moe(params, cfg, state, num_local_experts=local_experts(dispatcher))
    if dispatcher is None:  # the local layer, built once per (cfg, remat, seq_len): it holds no state
        layer = _local_moe_layer(cfg, remat, seq_len)
    else:
        layer = moe_layer(cfg, alone("moe"), ParallelContext(dispatcher=dispatcher), remat=remat, bare=True,
                          seq_len=seq_len)
    ran = _run([layer], params, {"x_TD": x_TD}, {"state": state})
    return ran.acts["out_TD"].to(x_TD.dtype), _layer_aux(ran, cfg, state, check)


def block(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig, state: dict[str, Any] | None = None,
          *, parallel: ParallelContext | None = None, remat: bool | None = None,
          check: bool = True, packing: Packing | None = None) -> tuple[torch.Tensor, MoEAux]:
    """Return (y_BSD, aux): an MoE block (fmoe/block.py), the phases of `fmoe.phases.moe_layer` in order,
    the exchanges through `parallel.dispatcher` (default local); aux.loss is the differentiable balancing
    loss. `remat`: as in `moe`. `check`: check the block params (routed experts: the dispatcher's
    num_local_experts) and the state against `cfg` first; False skips it (for trees that already
    passed). `parallel` (fmoe.parallel.ParallelContext; None: one process): with `tp` the tensor-parallel
    group, `params` this rank's shard (fmoe/tp_layout.py: attention heads split, norms, router and shared
    expert replicated, the dispatcher's local experts whole: TP extends EP, the dispatcher's group being
    the ep x tp expert group); x and y replicated on the group, or with `sequence_parallel` this rank's
    positions [B, S/P, D]. Each rank routes its own share of the tokens; the balancing loss is the
    group's (equal to one process's). `packing`: the sequences' documents (fmoe/packing.py), as in
    `gpt_loss`."""
    parallel = parallel or LOCAL
    tp, dispatcher = parallel.tp, parallel.exchange(cfg.moe.num_experts)
    if check:
        _check_input_dtype("block", x_BSD, params)
        n = local_experts(dispatcher)
        if tp is None:
            check_block(params, cfg, state, num_local_experts=n)
        else:
            check_tp(cfg, tp.size, dense=False)
            check_shard(params, cfg, tp.size, tuple(SPLITS))
            check_block(params, cfg, state, num_local_experts=n, paths=(("mlp_norm",), ("moe",)))
    layer = moe_layer(cfg, alone("block"), parallel, remat=remat)
    ran = _run([layer], params, {"h_BSD": x_BSD}, {"state": state, "packing": packing})
    return ran.acts["h_BSD"], _layer_aux(ran, cfg.moe, state, check)


def _check_input_dtype(name: str, x: torch.Tensor, params: dict[str, Any]) -> None:
    """ValueError when `x`'s dtype is not the params' (a float32 input to float64 weights failed inside a
    matmul, "expected m1 and m2 to have the same dtype")."""
    leaves = tree_flatten(params)[0]
    dtypes = {t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if len(dtypes) == 1 and x.dtype not in dtypes:
        want = next(iter(dtypes))
        raise ValueError(f"{name}: the input is {x.dtype} but the params are {want}: cast one to the other "
                         f"(x.to({want}))")


def gpt_logits(params: dict[str, Any], ids_BS: torch.Tensor, cfg: GPTConfig,
               state: dict[str, Any] | None = None, *, parallel: ParallelContext | None = None,
               check: bool = True, packing: Packing | None = None) -> torch.Tensor:
    """Return logits_BSV [B, S, V] of the main model, head(rms_norm(h)) (no MTP, no loss): what an
    inference framework computes, e.g. to compare with an imported checkpoint (fmoe/hf). `parallel`: its
    dispatcher (tensor parallelism is not taken here). `check`, `packing`: as in `gpt_loss`."""
    state = state or init_gpt_state(cfg, ids_BS.device)
    parallel = parallel or LOCAL
    if parallel.tp is not None:
        raise ValueError("gpt_logits runs one process's whole head: no tensor parallelism (use gpt_loss)")
    if check:
        check_gpt(params, cfg, state, num_local_experts=local_experts(parallel.dispatcher))
    sites = outline(cfg).chunk(range(cfg.n_layers), first=True, head=False, last=False)
    meta = {"ids_BS": ids_BS, "state": state, "packing": packing}
    x_BSD = _run(gpt_layers(cfg, sites, parallel), params, {}, meta).acts[H]
    return linear(rms_norm(x_BSD, params["norm"], cfg.norm_eps), params["head"]["w"])


def gpt_loss(params: dict[str, Any], ids_BS: torch.Tensor, targets_BS: torch.Tensor, cfg: GPTConfig,
             state: dict[str, Any] | None = None, *, parallel: ParallelContext | None = None,
             check: bool = True, packing: Packing | None = None) -> tuple[torch.Tensor, GPTAux]:
    """Return (loss, aux): the differentiable training loss (fp32 scalar) and a `GPTAux`: the GPT's
    layers (fmoe.phases.gpt_layers, one chunk with every layer) run in order.

    ids_BS: input token ids; targets_BS: the next tokens (targets[:, i] = token i + 1; -100 ignored).
    `check`: check params and state against `cfg` first (every layer present, keys, shapes, dtypes; the
    routed experts are the dispatcher's num_local_experts; fmoe/structure.py), then run the blocks
    unchecked; False skips it, for trees that already passed (e.g. from a loop's second step on).
    `parallel` (fmoe.parallel.ParallelContext; None: one process): its dispatcher moves the MoE rows;
    with `tp` (and `sequence_parallel`) tensor parallelism (`params` this rank's
    `fmoe.tp_layout.shard_gpt` with the dispatcher's local experts, the dispatcher over the ep x tp expert
    group; ids and targets the same on the group's ranks); the loss is the whole model's on every rank.
    `packing` (fmoe/packing.py, `pack_documents`): the documents packed in each sequence, [B, S] whole
    under every parallelism: RoPE positions restarting per document, attention within a document, the
    targets' loss mask (MTP's rolled from it, never across a document); None: one document per sequence.
    """
    if ids_BS.dim() != 2 or targets_BS.shape != ids_BS.shape:
        raise ValueError(f"gpt_loss: targets_BS must have ids_BS's shape [B, S] = {tuple(ids_BS.shape)} "
                         f"(targets[:, i] = token i + 1), got {tuple(targets_BS.shape)}")
    state = state or init_gpt_state(cfg, ids_BS.device)
    parallel = parallel or LOCAL
    if check and parallel.tp is None:
        check_gpt(params, cfg, state, num_local_experts=local_experts(parallel.dispatcher))
    elif check:
        _check_tp_shards(params, cfg, parallel.tp_size)
    layers = _local_gpt_layers(cfg) if parallel is LOCAL else _gpt_layers(cfg, parallel)
    ran = _run(layers, params, {}, {"ids_BS": ids_BS, "targets_BS": targets_BS, "state": state,
                                    "packing": packing})
    main = ran.losses["ce"]
    routes = _routes(ran)
    balance = sum((b for _, b, _ in routes), main.new_zeros(()))
    loss = main + balance.to(main.dtype) + ran.losses.get("mtp", main.new_zeros(()))
    o = outline(cfg)
    new_state = update_gpt_state(cfg, state, {o.site(name).params: LayerLoad.of(r) for name, _, r in routes},
                                 check=False)  # checked above with the params
    moe_aux = [make_aux(b, r, state_at(new_state, o.site(name))) for name, b, r in routes]
    mtp = ran.meta.get("mtp_loss", main.new_zeros(()))
    aux = GPTAux(main_loss=main.detach(), mtp_loss=mtp.detach(), balance_loss=balance.detach(),
                 layers=moe_aux,
                 new_state=new_state)
    return loss, aux


def _check_tp_shards(params: dict[str, Any], cfg: GPTConfig, size: int) -> None:
    """Raises ValueError naming what `size` tp ranks do not split, or a block weight that is not its shard
    (fmoe/tp_layout.py)."""
    check_tp(cfg, size, dense=cfg.num_dense_layers > 0)
    for p in params["layers"] + ([params["mtp"]["block"]] if "mtp" in params else []):
        check_shard(p, cfg, size, tuple(SPLITS))
    want = cfg.vocab_size // size
    if params["embed"]["table"].shape[0] != want or params["head"]["w"].shape[1] != want:
        raise ValueError(f"vocab-parallel embedding and head: {want} of the {cfg.vocab_size} tokens per tp "
                         f"rank, got {params['embed']['table'].shape[0]} and {params['head']['w'].shape[1]}")
