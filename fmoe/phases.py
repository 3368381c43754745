"""The GPT's layers as executor phases (fmoe.transforms.program): embedding, dense and MoE blocks, MTP, head.

Legend (the package's, docs/moe.md): B sequences, S positions, T = B*S tokens, D width, K top-k slots,
R rows of this rank's expert-sorted layout, M rows this rank's experts receive.

An MoE layer is the four phases of seed 000, plus the small compute tail of combine:
  attention (compute): norm, attention, residual, norm, router             -> normed_TD, probs_TK
  counts    (comm):    the count exchange (host sync), issued as soon as routing is known, waited before
                       the dispatch (Phase.defer_wait)
  permute   (compute): permute-1, while the counts travel (a token-level dispatcher permutes itself)
                                                                            -> rows_RD (+ probs_R)
  dispatch  (comm):    rows to the experts' ranks                          -> rows_MD
            + shared  (compute, a side phase run while the dispatch travels): the shared expert
  mlp       (compute): permute-2, routed experts, inverse permute-2
  combine   (comm):    rows back                                            -> rows_RD
  unpermute (compute): unpermute-1 with the gate weights, + shared, + residual  -> h_BSD
A bare MoE layer (`moe_layer(..., bare=True)`, fmoe.model.moe) starts from acts["x_TD"] with a "route"
phase (router only) and ends with acts["out_TD"] (no residual). Dense layers, the embedding and the head
+ loss are one compute phase each. Phases without weights take
no params. `acts` is the whole live state between phases (other keys pass through a phase untouched);
routing metadata lives in `meta` under the layer's name. Each attention phase reports its layer's routing
facts in meta["stats"], so the MoE state can be updated once per step (fmoe.layer.update_moe_state).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fmoe import block
from fmoe.config import GPTConfig, MoEConfig
from fmoe.dispatch.exchange import Exchange
from fmoe.dispatch.sync import as_exchange
from fmoe.experts import routed_experts
from fmoe.layer import plan_route
from fmoe.ops import (
    cross_entropy,
    embedding,
    linear,
    local_experts,
    local_experts_pay,
    permute,
    permute_probs,
    rms_norm,
)
from fmoe.outline import Site, outline, state_at
from fmoe.overlap import LayerOverlap, Overlap, check_names, layer_overlap
from fmoe.packing import Packing, mtp_targets
from fmoe.parallel.alltoall import row_chunks
from fmoe.parallel.collectives import all_reduce
from fmoe.parallel.context import LOCAL, ParallelContext
from fmoe.parallel.context_parallel import take_positions
from fmoe.parallel.phased import RowPlan
from fmoe.parallel.tensor import (
    IGNORE_INDEX,
    copy_to_tp,
    gather_sequence,
    reduce_from_tp,
    tp_weight,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from fmoe.recompute import chunk_layers
from fmoe.seams import experts_of
from fmoe.structure import block_keys
from fmoe.transforms.program import Layer, Phase, Ready

H = "h_BSD"  # the hidden state that crosses layers and stages


def local_positions(x_BS: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """Returns this rank's part of a whole-sequence [B, S, ...] tensor (token ids, targets): its positions
    under context parallelism (fmoe.parallel.context_parallel), all of it without."""
    if parallel.cp is None:
        return x_BS
    return take_positions(x_BS, parallel.positions(x_BS.shape[1], x_BS.device))


def _cp_mean(loss: torch.Tensor, targets_BS: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """The mean over the whole sequence from this rank's mean over its positions' valid targets: weighted
    by its share of the group's valid targets and summed over the cp group (gradient passed back
    unchanged: each rank's reaches its own positions)."""
    valid = (targets_BS != IGNORE_INDEX).sum().to(loss.dtype)
    total = all_reduce(valid.detach(), parallel.cp, op="cp.count")
    return reduce_from_tp(loss * valid / total.clamp_min(1), parallel.cp, op="cp.loss")


def logits_loss(h_BSD: torch.Tensor, norm_D: torch.Tensor, head_DV: torch.Tensor, targets_BS: torch.Tensor,
                cfg: GPTConfig, parallel: ParallelContext = LOCAL) -> torch.Tensor:
    """Return the mean next-token cross-entropy (scalar) of head(rms_norm(h)) against targets_BS (the main
    model's and MTP's). `parallel.tp`: head_DV is this rank's vocabulary columns [D, V/P] (vocab-parallel
    head and cross-entropy); h replicated, or with sequence parallelism this rank's positions (gathered).
    `parallel.cp`: h is this rank's positions, targets_BS the whole sequence's; the mean is the whole's."""
    tp, sequence_parallel = parallel.tp, parallel.sequence_parallel
    if parallel.cp is not None:
        targets_BS = local_positions(targets_BS, parallel)
        # this rank's mean (over its positions; with tp the group's, vocab-parallel), then the whole's
        mean = logits_loss(h_BSD, norm_D, head_DV, targets_BS, cfg, dataclasses.replace(parallel, cp=None))
        return _cp_mean(mean, targets_BS, parallel)
    if tp is None:
        B, S, D = h_BSD.shape
        logits_TV = linear(rms_norm(h_BSD, norm_D, cfg.norm_eps).reshape(B * S, D), head_DV)
        return cross_entropy(logits_TV, targets_BS.reshape(B * S))
    # under SP the norm sees this rank's positions only: its scale's gradient is summed over the group
    h_BSD = rms_norm(h_BSD, tp_weight(norm_D, tp) if sequence_parallel else norm_D, cfg.norm_eps)
    h_BSD = gather_sequence(h_BSD, tp) if sequence_parallel else copy_to_tp(h_BSD, tp)
    logits_TV = linear(h_BSD.flatten(0, 1), head_DV)
    return vocab_parallel_cross_entropy(logits_TV, targets_BS.flatten(), tp, cfg.vocab_size)


def mtp_input(mtp: dict[str, Any], table_VD: torch.Tensor, h_BSD: torch.Tensor, targets_BS: torch.Tensor,
              cfg: GPTConfig, parallel: ParallelContext = LOCAL) -> torch.Tensor:
    """Return z_BSD [B, S, D], MTP's input (fmoe/model.py): proj([norm(h_i); norm(embed(token i+1))])
    from the main model's last hidden state and the targets (token i+1 = targets[:, i]; an ignored
    target embeds token 0); `mtp` the MTP params (its hidden_norm, embed_norm, w_proj), `table_VD` the
    shared embedding (with `parallel.tp` this rank's vocabulary rows; h and z replicated on the group, or
    with sequence parallelism this rank's positions; with `parallel.cp` h is this rank's positions and
    targets_BS the whole sequence's)."""
    tp, sequence_parallel = parallel.tp, parallel.sequence_parallel
    targets_BS = local_positions(targets_BS, parallel)

    def shared(w: torch.Tensor) -> torch.Tensor:  # under SP used on this rank's positions: grads summed
        return tp_weight(w, tp) if sequence_parallel else w

    hn_BSD = rms_norm(h_BSD, shared(mtp["hidden_norm"]), cfg.norm_eps)
    ids_BS = targets_BS.clamp(min=0)
    next_BSD = embedding(ids_BS, table_VD) if tp is None else vocab_parallel_embedding(
        ids_BS, table_VD, tp, cfg.vocab_size, sequence_parallel=sequence_parallel)
    e_BSD = rms_norm(next_BSD, shared(mtp["embed_norm"]), cfg.norm_eps)
    return linear(torch.cat([hn_BSD, e_BSD], dim=-1), shared(mtp["w_proj"]))


def exchange_of(dispatcher: Any, moe_cfg: MoEConfig) -> tuple[Exchange, bool]:
    """Returns (the Exchange the MoE phases drive, whether it takes whole tokens): the dispatcher's own
    issue / wait form, its token-level one when it says so for `moe_cfg` (Exchange.token_level), or for a
    dispatcher with only the synchronous Dispatcher protocol (a research script's) its calls run inline
    (fmoe.dispatch.sync.as_exchange)."""
    ex = as_exchange(dispatcher)
    token_level = ex.token_level(moe_cfg)
    return (ex.token_exchange() if token_level else ex), token_level


def embed_layer(cfg: GPTConfig | None = None, parallel: ParallelContext = LOCAL) -> Layer:
    """Returns the embedding layer: one compute phase, meta["ids_BS"] -> acts[h_BSD]. `parallel.tp`: the
    table is this rank's vocabulary rows (vocab-parallel embedding, cfg's vocabulary); h replicated, or
    with sequence parallelism this rank's positions."""
    tp, sequence_parallel = parallel.tp, parallel.sequence_parallel

    def fn(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        ids_BS = local_positions(meta["ids_BS"], parallel)  # under context parallelism this rank's positions
        if tp is None:
            return {**acts, H: embedding(ids_BS, p["embed"]["table"])}, meta
        return {**acts, H: vocab_parallel_embedding(ids_BS, p["embed"]["table"], tp, cfg.vocab_size,
                                                    sequence_parallel=sequence_parallel)}, meta

    return Layer("embed", (Phase("embed", "compute", fn=fn, param_paths=(("embed", "table"),)),))


def dense_layer(cfg: GPTConfig, i: int, parallel: ParallelContext = LOCAL) -> Layer:
    """Returns dense block `i` as one compute phase over acts[h_BSD] (`parallel`: dense_block's)."""
    def fn(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:  # p: the block's params
        h_BSD = block.dense_block(p, acts[H], cfg, check=False, parallel=parallel,
                                  packing=meta.get("packing"))
        return {**acts, H: h_BSD}, meta  # gpt_programs / gpt_loss checked

    site = outline(cfg).layer(i)
    return Layer(site.name, (Phase("dense", "compute", fn=fn, param_paths=(site.params,),
                                   param_root=site.params),))


def moe_layer(cfg: GPTConfig | MoEConfig, site: Site, parallel: ParallelContext = LOCAL,
              a2a_chunks: int = 1, *, remat: bool | None = None, bare: bool = False,
              seq_len: int | None = None, overlap: LayerOverlap | None = None) -> Layer:
    """Returns the MoE block of `site` (fmoe.outline: its name, its params at site.params, its state at
    site.state of meta["state"], read only) as six phases (module docstring) over acts[h_BSD], exchanging
    through `parallel`'s dispatcher. The layer holds no params and no state: the stage program pairs it
    with each step's (built once per run); each phase takes exactly the weights it uses (cfg's layout,
    fmoe/structure.py). `remat` forces (True) or forbids (False) rematerialising the routed experts (None:
    the config's rule). `bare`: the MoE layer alone (fmoe.model.moe), site.params its params', cfg a
    MoEConfig, acts["x_TD"] in, acts["out_TD"] out, `seq_len` the router's tokens per sequence.
    `parallel.tp`, `.sequence_parallel`: the block's tensor parallelism (fmoe.block.attention: each tp rank
    routes and dispatches its own tokens, TP extending EP; the dispatcher's group is the ep x tp expert
    group); the shared expert's replicated weights take their gradient summed over the group.
    `a2a_chunks` 2: a forward that runs alone (no F&B pair to hide its exchanges: warmup, cooldown,
    overlap off) moves the all-to-all's rows in two chunks that travel while each other's experts run
    (`chunked_moe_phases`, the layer's lone_phases); a paired forward moves them whole, since there the
    paired backward hides them and a second chunk would queue behind its exchange (BENCHMARKS.md).
    1 (default), or a dispatcher whose exchanges never leave the process: whole.
    `overlap` (fmoe.overlap.LayerOverlap, instead of `a2a_chunks`): the layer's modes in an F&B pair and
    alone. Paired "pair" hands over at the dispatch and the combine; "self" moves chunks in the pair too
    and does not hand over; "none" moves them whole and does not hand over. Lone "self" is `a2a_chunks` 2.
    None: LayerOverlap("pair", "self" if a2a_chunks == 2 else "none")."""
    if a2a_chunks not in (1, 2):
        raise ValueError(f"a2a_chunks must be 1 or 2, got {a2a_chunks!r}")
    if overlap is not None and a2a_chunks != 1:
        raise ValueError("give the lone forward's chunks as overlap.lone ('self'), not also a2a_chunks")
    overlap = overlap or LayerOverlap.of_chunks(a2a_chunks)
    if bare and parallel.tp is not None:
        raise ValueError("tensor parallelism shards a block (fmoe.model.block), not a bare MoE layer")
    moe_cfg = cfg if bare else cfg.moe
    ex, token_level = exchange_of(parallel.exchange(moe_cfg.num_experts), moe_cfg)
    if overlap.chunks and not ex.local and not ex.splits_rows:
        raise ValueError(f"self-overlap (a2a_chunks 2) splits an all-to-all's rows: {type(ex).__name__} has "
                         "another route (use AllToAllDispatcher, or move the rows whole)")
    name, moe_path = site.name, site.params if bare else (*site.params, "moe")  # where the MoE params are
    route_key, plan_key = f"route:{name}", f"plan:{name}"
    # a local layer of fmoe's own experts may run them with permute and unpermute inside (the mlp phase,
    # when fmoe.ops.local_experts_pay at run time); the permute phase then leaves the tokens in place
    fused_key = f"fused:{name}" if (ex.local and not token_level and not moe_cfg.probs_in_expert
                                     and moe_cfg.backend in (None, "grouped_mm", "loop")
                                     and experts_of(moe_cfg) is routed_experts) else None
    head = (
        _front_phase(cfg, site, parallel, remat, bare, seq_len),
        # issued as soon as routing is known, waited where the dispatch needs it: permute-1 hides it, and
        # an fb-overlap pair does not hand over at it (that would shift every later pairing by a phase)
        Phase("counts", "comm", start=lambda a, m: _Then(ex.start_plan(m[route_key]),
                                                          lambda plan: (a, {**m, plan_key: plan})),
              start_transpose=lambda ct, meta: Ready(ct), local=ex.local, switch=False, defer_wait=True),
        *(() if token_level else (Phase("permute", "compute",
                                        fn=_permute_rows(moe_cfg, route_key, fused_key)),)),
    )
    # the shared expert reads the tokens only: it runs while the dispatch travels
    shared_side = _shared_phase(moe_path, parallel) if moe_cfg.num_shared_experts else None

    def finish(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        out = block.finish(acts, meta[route_key], parallel)
        return out, {k: v for k, v in meta.items() if k not in (route_key, plan_key, fused_key)}

    hand = overlap.hands_over  # the same in both forms: a backward follows whichever its forward ran
    whole = head + _whole_moe_phases(cfg, ex, name, moe_path, shared_side, finish, token_level, hand,
                                     fused_key)
    if ex.local or not overlap.chunks:  # nothing travels, or whole in both contexts
        return Layer(name, whole)
    chunked = head + chunked_moe_phases(cfg, ex, name, moe_path, shared_side, finish, switch=hand)
    paired = chunked if overlap.paired == "self" else whole
    lone = chunked if overlap.lone == "self" else whole
    return Layer(name, paired, lone_phases=None if lone is paired else lone)


def _front_phase(cfg: GPTConfig | MoEConfig, site: Site, parallel: ParallelContext, remat: bool | None,
                 bare: bool, seq_len: int | None) -> Phase:
    """An MoE layer's first phase: the block's attention, norm and router ("attention"), or a bare layer's
    router alone ("route"); routed but not yet permuted, so the count exchange goes out right after it
    and permute-1 runs while it travels. It reads the layer's state from meta["state"] at site.state
    and reports the routing in meta["stats"]."""
    name, path = site.name, site.params
    route_key, balance = f"route:{name}", f"balance:{name}"

    def routed(acts: dict, gone: str, out: dict, route: Any, meta: dict) -> tuple[dict, dict]:
        rest = {k: v for k, v in acts.items() if k != gone}
        return {**rest, **out}, {**meta, route_key: route, "stats": {"layer": path, "route": route}}

    def attention(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:  # the block's minus its experts
        out, route = block.attention(p, acts[H], cfg, state_at(meta.get("state"), site), remat,
                                     permute_tokens=False, check=False, parallel=parallel,
                                     packing=meta.get("packing"))
        out[balance] = out.pop("loss")
        return routed(acts, H, out, route, meta)

    def route_only(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:  # a bare layer: the router
        x_TD = acts["x_TD"]
        probs_TK, loss, route = plan_route(p, x_TD, cfg, state_at(meta.get("state"), site), seq_len, remat,
                                           check=False)
        return routed(acts, "x_TD", {"normed_TD": x_TD, "probs_TK": probs_TK, balance: loss}, route, meta)

    if bare:
        return Phase("route", "compute", fn=route_only, param_paths=((*path, "router"),), param_root=path,
                     losses=(balance,))
    attn_keys = block_keys(cfg, dense=False, but=("moe",))  # attention weights and both norms
    attn_paths = tuple((*path, k) for k in attn_keys) + ((*path, "moe", "router"),)
    return Phase("attention", "compute", fn=attention, param_paths=attn_paths, param_root=path,
                 losses=(balance,))


def _permute_rows(moe_cfg: MoEConfig, route_key: str, fused_key: str | None = None) -> Any:
    """Permute-1: the normed tokens (and with probs_in_expert the gate weights) into the route's layout.
    `fused_key` (a local layer of fmoe's own experts): where `fmoe.ops.local_experts_pay` and the route is
    not rematerialised, the tokens stay as they are and meta[fused_key] holds the experts' row counts,
    for the mlp phase's `local_experts` (permute and unpermute inside)."""
    def permute_rows(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        route = meta[route_key]
        layout = route.layout
        if fused_key is not None and not route.remat and local_experts_pay(acts["normed_TD"], layout):
            counts = layout.counts or tuple(layout.counts_E.tolist())  # the CPU's: read without a wait
            return acts, {**meta, fused_key: counts}
        out = {**acts, "rows_RD": permute(acts["normed_TD"], layout)}
        if moe_cfg.probs_in_expert:  # the gate weights ride with their rows
            out["probs_R"] = permute_probs(out.pop("probs_TK"), layout)
        return out, meta
    return permute_rows


SHARED_READS = ("normed_TD",)  # what the shared expert's side phase reads (block.shared_expert)


def _shared_phase(moe_path: tuple[str, ...], parallel: ParallelContext) -> Phase:
    """The shared expert, a side phase of the dispatch (it reads the tokens only); under tensor
    parallelism its replicated weights take their gradient summed over the group."""
    tp = parallel.tp

    def shared(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        weights = p["shared"] if tp is None else {k: tp_weight(v, tp, op="tp.shared")
                                                  for k, v in p["shared"].items()}
        return {"shared_TD": block.shared_expert(weights, acts)}, meta

    return Phase("shared", "compute", fn=shared, param_paths=((*moe_path, "shared"),), param_root=moe_path)


def _whole_moe_phases(cfg: GPTConfig | MoEConfig, ex: Any, name: str, moe_path: tuple[str, ...],
                      shared_side: Phase | None, finish: Any, token_level: bool,
                      hand: bool, fused_key: str | None = None) -> tuple[Phase, ...]:
    """The phases of an MoE layer after permute-1 with whole exchanges: dispatch (+ the shared expert
    beside it), the experts, combine, unpermute; `hand`: the dispatch and combine hand over to an F&B
    pair. `fused_key`: a local layer whose permute phase may leave the tokens for `local_experts`
    (`_permute_rows`); the mlp phase runs it where meta[fused_key] says so (the exchanges move nothing,
    and the shared expert leaves the tokens in acts)."""
    route_key, plan_key = f"route:{name}", f"plan:{name}"

    def with_meta(pending: Any, meta: dict) -> Any:
        return _Then(pending, lambda a: (a, meta))

    def mlp(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        if fused_key in meta:  # the tokens, not layout rows: permute, experts and unpermute in one op
            experts = p["experts"]
            y_TD = local_experts(acts["normed_TD"], acts["probs_TK"], experts["w_gate_up"], experts["w_down"],
                                 meta[route_key].layout, meta[fused_key])
            rest = {k: v for k, v in acts.items() if k not in ("normed_TD", "probs_TK")}
            return {**rest, "y_TD": y_TD}, meta
        plan: RowPlan = meta[plan_key]
        grouped = {**acts, "rows_MD": plan.to_experts(acts["rows_MD"])}  # permute-2
        if "probs_M" in acts:
            grouped["probs_M"] = plan.to_experts(acts["probs_M"])
        out = block.experts(p, grouped, plan.counts_L, cfg, meta[route_key].remat,
                            weight_outputs=token_level, check=False)
        out["rows_MD"] = plan.from_experts(out["rows_MD"])
        return out, meta

    return (
        Phase("dispatch", "comm", start=lambda a, m: with_meta(ex.start_dispatch(m[plan_key], a), m),
              start_transpose=lambda ct, m: ex.start_dispatch_transpose(m[plan_key], ct), side=shared_side,
              side_consumes=("normed_TD",) if shared_side is not None and fused_key is None else (),
              side_reads=SHARED_READS if shared_side is not None else (), local=ex.local, switch=hand),
        Phase("mlp", "compute", fn=mlp, param_paths=((*moe_path, "experts"),), param_root=moe_path),
        Phase("combine", "comm", start=lambda a, m: with_meta(ex.start_combine(m[plan_key], a), m),
              start_transpose=lambda ct, m: ex.start_combine_transpose(m[plan_key], ct), local=ex.local,
              switch=hand),
        Phase("unpermute", "compute", fn=finish),
    )


def chunked_moe_phases(cfg: GPTConfig | MoEConfig, ex: Any, name: str, moe_path: tuple[str, ...],
                       shared_side: Phase | None, finish: Any, switch: bool = True) -> tuple[Phase, ...]:
    """Returns the phases of an MoE layer after permute-1 with its all-to-all in two row chunks
    (`fmoe.parallel.alltoall.row_chunks`; routing, capacity and the losses stay the microbatch's):
      dispatch   (comm):    chunk 0's rows to the experts        + shared expert (side)
      dispatch.1 (comm):    chunk 1's rows, deferred: mlp.0 runs while it travels
      mlp.0      (compute): chunk 0's experts
      combine.0  (comm):    chunk 0's rows back, deferred: mlp.1 runs while it travels
      mlp.1      (compute): chunk 1's experts
      combine    (comm):    chunk 1's rows back
      unpermute  (compute): both chunks' rows in layout order, then as one exchange's
    A forward that runs alone takes these by default (the layer's lone_phases): it hides chunk 1's dispatch
    and chunk 0's combine behind the other chunk's experts, and its backward, lone or paired, mirrors it
    (fmoe.transforms.program: Phase.defer_wait); a paired backward still hands over at "dispatch" and
    "combine" only, so its pairings hold (mlp.0 and mlp.1 together in the place of mlp). `switch` False:
    they hand over at neither (paired self-overlap, fmoe.overlap)."""
    plan_key, chunks_key = f"plan:{name}", f"chunks:{name}"
    moe_cfg = cfg.moe if isinstance(cfg, GPTConfig) else cfg
    probs = ("probs_R",) if moe_cfg.probs_in_expert else ()
    mlp_paths = ((*moe_path, "experts"),)

    def sent(acts: dict, chunk: Any) -> dict:
        return {k: acts[k].index_select(0, chunk.rows_R) for k in ("rows_RD", *probs)}

    def tagged(got: dict, c: int) -> dict:
        return {f"{k}.{c}": v for k, v in got.items()}

    def untagged(acts: dict, c: int) -> dict:
        return {k[:-2]: v for k, v in acts.items() if k.endswith(f".{c}")}

    def scattered(got: dict, chunk: Any) -> dict:  # a chunk's cotangents in the whole layout's rows
        return {k: v.new_zeros((chunk.num_rows, *v.shape[1:])).index_copy(0, chunk.rows_R, v)
                for k, v in got.items()}

    def dispatch0(acts: dict, meta: dict) -> Any:
        chunks = row_chunks(meta[plan_key], 2, acts["rows_RD"].device)
        meta = {**meta, chunks_key: chunks}
        return _Then(ex.start_dispatch(chunks[0].plan, sent(acts, chunks[0])),
                     lambda got: ({**acts, **tagged(got, 0)}, meta))  # rows_RD stays for chunk 1

    def dispatch0_t(ct: dict, meta: dict) -> Any:
        chunk = meta[chunks_key][0]
        mine = {k: ct[k] for k in ("rows_MD.0", "probs_M.0") if k in ct}
        rest = {k: v for k, v in ct.items() if k not in mine}

        def add(got: dict) -> dict:
            part = scattered(got, chunk)
            return {**rest, **{k: part[k] + rest[k] if k in rest else part[k] for k in part}}

        return _Then(ex.start_dispatch_transpose(chunk.plan, untagged(mine, 0)), add)

    def dispatch1(acts: dict, meta: dict) -> Any:
        chunk = meta[chunks_key][1]
        return _Then(ex.start_dispatch(chunk.plan, sent(acts, chunk)), lambda got: (tagged(got, 1), meta))

    def dispatch1_t(ct: dict, meta: dict) -> Any:
        chunk = meta[chunks_key][1]
        return _Then(ex.start_dispatch_transpose(chunk.plan, untagged(ct, 1)),
                     lambda got: scattered(got, chunk))

    def mlp(c: int) -> Any:
        def fn(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
            plan: RowPlan = meta[chunks_key][c].plan
            grouped = {k: plan.to_experts(v) for k, v in untagged(acts, c).items()}  # permute-2
            out = block.experts(p, grouped, plan.counts_L, cfg, meta[f"route:{name}"].remat, check=False)
            rest = {k: v for k, v in acts.items() if not k.endswith(f".{c}") and k != "normed_TD"}
            return {**rest, f"rows_MD.{c}": plan.from_experts(out["rows_MD"])}, meta
        return fn

    def combine(c: int) -> tuple[Any, Any]:
        def start(acts: dict, meta: dict) -> Any:
            chunk = meta[chunks_key][c]
            mine = {k: v for k, v in acts.items() if k == f"rows_MD.{c}"}
            rest = {k: v for k, v in acts.items() if k not in mine}
            return _Then(ex.start_combine(chunk.plan, untagged(mine, c)),
                         lambda got: ({**rest, **tagged(got, c)}, meta))

        def transpose(ct: dict, meta: dict) -> Any:
            mine = {k: v for k, v in ct.items() if k == f"rows_RD.{c}"}
            rest = {k: v for k, v in ct.items() if k not in mine}
            return _Then(ex.start_combine_transpose(meta[chunks_key][c].plan, untagged(mine, c)),
                         lambda got: {**rest, **tagged(got, c)})
        return start, transpose

    def merged(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        chunks = meta[chunks_key]
        order_R = torch.argsort(torch.cat([ch.rows_R for ch in chunks]))
        rows_RD = torch.cat([acts["rows_RD.0"], acts["rows_RD.1"]]).index_select(0, order_R)
        rest = {k: v for k, v in acts.items() if k not in ("rows_RD.0", "rows_RD.1")}
        out, meta = finish(p, {**rest, "rows_RD": rows_RD}, meta)
        return out, {k: v for k, v in meta.items() if k != chunks_key}

    combine0, combine0_t = combine(0)
    combine1, combine1_t = combine(1)
    return (
        Phase("dispatch", "comm", start=dispatch0, start_transpose=dispatch0_t, side=shared_side,
              side_consumes=("normed_TD",) if shared_side is not None else (),
              side_reads=SHARED_READS if shared_side is not None else (), switch=switch),
        Phase("dispatch.1", "comm", start=dispatch1, start_transpose=dispatch1_t, switch=False,
              defer_wait=True, reads=("rows_RD", *probs)),
        Phase("mlp.0", "compute", fn=mlp(0), param_paths=mlp_paths, param_root=moe_path),
        Phase("combine.0", "comm", start=combine0, start_transpose=combine0_t, switch=False, defer_wait=True,
              reads=("rows_MD.0",)),
        Phase("mlp.1", "compute", fn=mlp(1), param_paths=mlp_paths, param_root=moe_path),
        Phase("combine", "comm", start=combine1, start_transpose=combine1_t, switch=switch),
        Phase("unpermute", "compute", fn=merged),
    )


def moe_layer_turns(cfg: GPTConfig, dispatcher: Any, overlap: LayerOverlap | None = None) -> int:
    """Returns how many exchanges of one `moe_layer` hand over to an fb-overlap pair
    (fmoe.schedule.stage_turns_of counts them on a built program): the dispatch and the combine when they
    may leave the process and the layer pairs (`overlap.paired` "pair", the default; the count exchange
    never hands over), none for a local dispatcher."""
    local = exchange_of(dispatcher, cfg.moe)[0].local
    return 0 if local or not (overlap or LayerOverlap()).hands_over else 2


def mtp_in_layer(cfg: GPTConfig, parallel: ParallelContext = LOCAL) -> Layer:
    """Returns the MTP input layer: starts the MTP stream h' = proj([norm(h_i); norm(embed(token i+1))])
    from the main hidden state in acts[h_BSD] (which it replaces), on all S positions (Megatron's MTP: the
    last one's loss is ignored, `mtp_targets`), so it splits like the main stream under sequence
    parallelism. `parallel`: `mtp_input`'s."""
    def fn(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        z_BSD = mtp_input(p["mtp"], p["embed"]["table"], acts[H], meta["targets_BS"], cfg, parallel)
        return {**acts, H: z_BSD}, meta

    paths = (("embed", "table"), ("mtp", "hidden_norm"), ("mtp", "embed_norm"), ("mtp", "w_proj"))
    return Layer("mtp_in", (Phase("mtp_in", "compute", fn=fn, param_paths=paths),))


def head_layer(cfg: GPTConfig, parallel: ParallelContext = LOCAL) -> Layer:
    """Returns the head + loss layer: final norm, head, cross-entropy ("ce"). Without MTP it ends the
    path (returns the loss only); with MTP it passes the hidden state on to the MTP module, on this
    stage or the next. `parallel`: `logits_loss`'s."""
    def fn(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        packing: Packing = meta.get("packing") or Packing()  # --eod-mask-loss's mask on the targets
        targets_BS = packing.targets(meta["targets_BS"])
        ce = logits_loss(acts[H], p["norm"], p["head"]["w"], targets_BS, cfg, parallel)
        return ({**acts, "ce": ce} if cfg.mtp else {"ce": ce}), meta

    return Layer("head", (Phase("head", "compute", fn=fn, param_paths=(("norm",), ("head", "w")),
                                losses=("ce",)),))


def mtp_head_layer(cfg: GPTConfig, parallel: ParallelContext = LOCAL) -> Layer:
    """Returns the MTP module's head + loss layer: its norm, the shared head, mtp_loss_weight x the MTP
    cross-entropy ("mtp"), and the unweighted one, detached, as meta["mtp_loss"]. Ends the path: returns
    the loss only. `parallel`: `logits_loss`'s."""
    def fn(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        later_BS = mtp_targets(meta["targets_BS"], meta.get("packing"))  # within documents, rolled loss mask
        mtp = logits_loss(acts[H], p["mtp"]["norm"], p["head"]["w"], later_BS, cfg, parallel)
        return {"mtp": cfg.mtp_loss_weight * mtp}, {**meta, "mtp_loss": mtp.detach()}

    paths = (("mtp", "norm"), ("head", "w"))
    return Layer("mtp_head", (Phase("mtp_head", "compute", fn=fn, param_paths=paths, losses=("mtp",)),))


def moe_layer_names(cfg: GPTConfig) -> set[str]:
    """Returns the names `gpt_layers` gives the GPT's MoE layers (fmoe.outline: "L<i>", "MTP")."""
    return {s.name for s in outline(cfg).moe}


def gpt_layers(cfg: GPTConfig, sites: tuple[Site, ...], parallel: ParallelContext = LOCAL, *,
               a2a_chunks: int = 1, overlap: Overlap | None = None) -> list[Layer]:
    """Returns the layers of the GPT's `sites` in order (fmoe.outline: one model chunk's,
    `Outline.chunk` / `fmoe.pipeline.cut.ChunkSpec.sites`; one process is one chunk with every site), with
    cfg.recompute applied (fmoe.recompute.chunk_layers). The layers hold no params and no state: a stage
    program pairs them with each step's params, the MoE layers read their state from meta["state"] (the
    GPT state). `parallel`: how every layer is laid over ranks (tensor parallelism: params this rank's
    shards, fmoe/tp_layout.py; the dispatcher over the ep x tp expert group). `overlap`: each MoE layer's
    overlap modes (fmoe.overlap: one LayerOverlap for all, or by layer name, "L3", "MTP"), instead of
    `a2a_chunks`; None: `a2a_chunks`' (moe_layer)."""
    check_names(overlap, moe_layer_names(cfg))
    out: list[Layer] = []
    for site in sites:
        if site.kind == "embed":
            out.append(embed_layer(cfg, parallel))
        elif site.kind == "dense":
            out.append(dense_layer(cfg, site.layer, parallel))
        elif site.kind == "moe":
            out.append(moe_layer(cfg, site, parallel, a2a_chunks,
                                 overlap=None if overlap is None else layer_overlap(overlap, site.name)))
        elif site.kind == "head":
            out.append(head_layer(cfg, parallel))
        elif site.kind == "mtp_in":
            out.append(mtp_in_layer(cfg, parallel))
        else:
            out.append(mtp_head_layer(cfg, parallel))
    return chunk_layers(cfg.recompute, sites, out)


class _Then:
    """A Pending whose result is `then(inner.wait())`; forwards the inner `completed_at`."""

    def __init__(self, inner: Any, then: Any):
        self.inner, self.then = inner, then

    @property
    def completed_at(self) -> float | None:
        """When the inner exchange completed, if known."""
        return getattr(self.inner, "completed_at", None)

    @property
    def in_flight(self) -> bool:
        """Whether the inner exchange may still be travelling."""
        return bool(getattr(self.inner, "in_flight", True))

    def wait(self) -> Any:
        """Waits the inner Pending; returns `then` of its result."""
        return self.then(self.inner.wait())
