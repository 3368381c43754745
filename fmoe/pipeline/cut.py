"""Cut the GPT into pipeline chunks: which layers, and which of embedding / head / MTP, each chunk holds.

Legend: S stages, C model chunks (C = S, except DualPipe where two stages run each chunk), n layers.

A schedule's placement says where stages live and which chunk each runs (`layer_chunk`). The layers are
spread over the chunks by `fmoe.schedule.balance_layers` (the cut that minimises the costliest rank under
the FLOP model of fmoe.flops: dense and MoE layers priced apart, the embedding on the first chunk, the
head + loss + MTP on the last) or by explicit counts. The first chunk holds the embedding, the last the
final norm, head, loss and the MTP module; or, where that evens the ranks (Pangu's placement of MTP and
the loss, feature 23), the last chunk holds only the MTP module and the chunk before it the final norm,
head and loss, which passes the hidden state on. On a V placement both ends are on rank 0; with MTP the
last chunk also reads the embedding table and the head, so those are held by two stages (and maybe two
ranks): `holders` says which ranks hold each parameter path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fmoe import schedule
from fmoe.config import GPTConfig
from fmoe.flops import gpt_tail_part_flops
from fmoe.outline import Site, outline, reads_of
from fmoe.schedule.ir import Placement, ScheduleError
from fmoe.schedule.stages import chunk_placement, cost_placement

Path = tuple[str, ...]


@dataclass(frozen=True)
class ChunkSpec:
    """One model chunk: `layers` (global layer indices, in order), and whether it holds the embedding
    (`first`), the final norm / head / main loss (`head`; None: the same as `last`) and the end of the path
    (`last`: the MTP module when the model has one, else the head). A `head` chunk that is not `last`
    passes the hidden state on to an MTP-only last chunk."""

    chunk: int
    layers: tuple[int, ...]
    first: bool
    last: bool
    head: bool | None = None

    def __post_init__(self) -> None:
        if self.head is None:
            object.__setattr__(self, "head", self.last)

    def sites(self, cfg: GPTConfig) -> tuple[Site, ...]:
        """Returns the sites (fmoe.outline) this chunk runs, in program order."""
        return outline(cfg).chunk(self.layers, first=self.first, head=self.head, last=self.last)

    def param_paths(self, cfg: GPTConfig) -> tuple[Path, ...]:
        """Returns the parameter paths (global keys) this chunk reads, in program order."""
        return reads_of(self.sites(cfg))


def _tail(cfg: GPTConfig, seq: int) -> tuple[tuple[float, ...], float, float, float]:
    """(per-layer FLOPs, embedding, head + loss + MTP, the MTP part) of fmoe.flops."""
    layers, first, (head, mtp) = gpt_tail_part_flops(cfg, seq)
    return layers, first, head + mtp, mtp


def balanced_cut(cfg: GPTConfig, placement: Placement, seq: int = 0,
                 min_layers: int | None = None) -> schedule.LayerPlacement:
    """Returns the `balance_layers` cut of cfg's layers over the chunks of `placement`, costs in
    FLOPs per token at sequence length `seq` (fmoe.flops), at least `min_layers` per chunk. None: a
    layer per chunk, or chunks without layers (only the embedding, only the head + loss + MTP, only the
    MTP module after a chunk ending in the loss, or one passing the hidden state on) where that lowers
    the imbalance enough (`balance_layers_or_empty`; `split_last` > 0 where MTP runs alone); a model
    with fewer layers than chunks is refused."""
    layers, first, last, mtp = _tail(cfg, seq)
    chunks = cost_placement(placement)
    if min_layers is None:
        return schedule.balance_layers_or_empty(chunks, layers, first, last, split_last=mtp)
    return schedule.balance_layers(chunks, layers, first, last, min_layers)


def cut_costs(cfg: GPTConfig, placement: Placement, chunks: tuple[ChunkSpec, ...],
              seq: int = 0) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Returns the modelled compute (FLOPs per token of fmoe.flops) of the cut `chunks`: per rank [pp]
    (DualPipe: per pair of ranks j and pp-1-j, which carry the same load, `cost_placement`) and per
    chunk [C]."""
    layers, first, last, mtp = _tail(cfg, seq)
    counts = tuple(len(c.layers) for c in chunks)
    split = mtp if not chunks[-1].head else 0.0
    at = cost_placement(placement)
    return (schedule.cost_rank_costs(at, layers, counts, first, last, split),
            schedule.cost_stage_costs(at, layers, counts, first, last, split))


def cut_imbalance_pct(cfg: GPTConfig, placement: Placement, chunks: tuple[ChunkSpec, ...],
                      seq: int = 0) -> float:
    """Returns the modelled per-rank compute imbalance ((max/mean - 1) x 100, FLOPs of fmoe.flops) of
    the cut `chunks`."""
    return schedule.imbalance_pct(cut_costs(cfg, placement, chunks, seq)[0])


def cut_gpt(cfg: GPTConfig, placement: Placement, layers: tuple[int, ...] | None = None,
            seq: int = 0, min_layers: int | None = None, mtp_alone: bool = False) -> tuple[ChunkSpec, ...]:
    """Returns one ChunkSpec per model chunk of `placement`. `layers`: explicit layer counts per chunk
    (default: `balanced_cut` at sequence length `seq` and `min_layers`, which decides `mtp_alone` too).
    `mtp_alone` (explicit counts): the last chunk holds only the MTP module (no layers), the chunk before
    it the head and the main loss. Raises ScheduleError when the counts do not sum to cfg.n_layers, or a
    chunk gets fewer than `min_layers` (None: explicit counts need a layer per chunk, but for an MTP-only
    last chunk; the default cut may leave chunks without one, see `balanced_cut`), or `mtp_alone` without
    MTP, two chunks, or an empty last count."""
    chunks = chunk_placement(placement)
    n = chunks.num_stages
    if layers is None:
        cut = balanced_cut(cfg, placement, seq, min_layers)
        layers, mtp_alone, min_layers = cut.layers, cut.split_last > 0, 0
    layers = tuple(layers)
    if mtp_alone and (not cfg.mtp or n < 2 or layers[-1:] != (0,)):
        raise ScheduleError(f"an MTP-only last chunk needs a model with MTP, two chunks or more and no layer "
                            f"on the last chunk; got mtp={cfg.mtp}, layer counts {layers}")
    min_layers = 1 if min_layers is None else min_layers
    mins = [min_layers] * n
    if mtp_alone:
        mins[-1] = 0
    if len(layers) != n or sum(layers) != cfg.n_layers or any(k < lo for k, lo in zip(layers, mins)):
        raise ScheduleError(f"layer counts {layers} must give each of the {n} chunks at least {min_layers} "
                            f"of the model's {cfg.n_layers} layers")
    out, start = [], 0
    for c, k in enumerate(layers):
        head = c == n - 2 if mtp_alone else c == n - 1
        out.append(ChunkSpec(c, tuple(range(start, start + k)), first=c == 0, last=c == n - 1, head=head))
        start += k
    return tuple(out)


def holders(cfg: GPTConfig, placement: Placement,
            chunks: tuple[ChunkSpec, ...]) -> dict[Path, tuple[int, ...]]:
    """Returns, per parameter path, the pipeline ranks whose stages read it (sorted)."""
    out: dict[Path, set[int]] = {}
    for stage, chunk in enumerate(placement.layer_chunk):
        for path in chunks[chunk].param_paths(cfg):
            out.setdefault(path, set()).add(placement.stage_rank[stage])
    return {p: tuple(sorted(r)) for p, r in out.items()}


def stage_params(params: dict[str, Any], paths: tuple[Path, ...]) -> dict[str, Any]:
    """Returns the subset of the full GPT params at `paths`, keys kept global ("layers" becomes a dict
    keyed by the layer index as a string): tensors are shared with `params`, not copied."""
    out: dict[str, Any] = {}
    for path in paths:
        node: Any = params
        for k in path:
            node = node[int(k)] if isinstance(node, list) else node[k]
        target = out
        for k in path[:-1]:
            target = target.setdefault(k, {})
        target[path[-1]] = node
    return out


def full_grads(grads: dict[str, Any], cfg: GPTConfig) -> dict[str, Any]:
    """Returns stage-keyed grads ("layers" a dict by index string) in the layout of `init_gpt` params
    ("layers" a list, None where this rank holds no gradient)."""
    out = {k: v for k, v in grads.items() if k != "layers"}
    if "layers" in grads:
        out["layers"] = [grads["layers"].get(str(i)) for i in range(cfg.n_layers)]
    return out
