"""Cut the GPT into pipeline chunks: which layers, and which of embedding / head / MTP, each chunk holds.

Legend: S stages, C model chunks (C = S, except DualPipe where two stages run each chunk), n layers.

A schedule's placement says where stages live and which chunk each runs (`layer_chunk`). The layers are
spread over the chunks by `fmoe.schedule.place_layers` (balanced: the embedding costs `first_extra`
layers on the first chunk, the head + loss + MTP `last_extra` on the last) or by explicit counts. The
first chunk holds the embedding, the last the final norm, head, loss and the MTP module. On a V
placement both ends are on rank 0; with MTP the last chunk also reads the embedding table, so that table
is held by two stages (and maybe two ranks): `holders` says which ranks hold each parameter path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fmoe import schedule
from fmoe.config import GPTConfig
from fmoe.schedule.ir import Placement, ScheduleError
from fmoe.schedule.stages import chunk_placement

Path = tuple[str, ...]


@dataclass(frozen=True)
class ChunkSpec:
    """One model chunk: `layers` (global layer indices, in order), and whether it holds the embedding
    (`first`) and the final norm / head / loss / MTP (`last`)."""

    chunk: int
    layers: tuple[int, ...]
    first: bool
    last: bool

    def param_paths(self, cfg: GPTConfig) -> tuple[Path, ...]:
        """Returns the parameter paths (global keys) this chunk reads, in program order."""
        paths: list[Path] = [("embed",)] if self.first else []
        paths += [("layers", str(i)) for i in self.layers]
        if self.last:
            if cfg.mtp:
                paths += [("embed",), ("mtp",)]
            paths += [("norm",), ("head",)]
        return tuple(dict.fromkeys(paths))


def cut_gpt(cfg: GPTConfig, placement: Placement, layers: tuple[int, ...] | None = None,
            first_extra: float = 1.0, last_extra: float = 1.0) -> tuple[ChunkSpec, ...]:
    """Returns one ChunkSpec per model chunk of `placement`. `layers`: explicit layer counts per chunk
    (default: the balanced `place_layers` placement with the given extra costs, in layers). Raises
    ScheduleError when the counts do not sum to cfg.n_layers or a chunk would get none."""
    chunks = chunk_placement(placement)
    n = chunks.num_stages
    if layers is None:
        layers = schedule.place_layers(chunks, cfg.n_layers, first_extra, last_extra, min_layers=1).layers
    layers = tuple(layers)
    if len(layers) != n or sum(layers) != cfg.n_layers or min(layers) < 1:
        raise ScheduleError(f"layer counts {layers} must give each of the {n} chunks at least one of the "
                            f"model's {cfg.n_layers} layers")
    out, start = [], 0
    for c, k in enumerate(layers):
        out.append(ChunkSpec(c, tuple(range(start, start + k)), first=c == 0, last=c == n - 1))
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
