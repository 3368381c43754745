"""The GPT's state and its one transition: routing reports loads, `update_gpt_state` moves the state.

    state = init_gpt_state(cfg)                      # {"layers": [MoE state or {} per layer], "mtp": ...}
    loads = layer_loads(stats)                       # per MoE site (its param path): the step's LayerLoad
    state = update_gpt_state(cfg, state, loads)      # the expert bias and the capacity window, moved once

The state of an MoE site (fmoe.outline: its `state` path) is what `fmoe.init_moe_state` makes: the
aux-loss-free expert bias and the dynamic-capacity window. Nothing else moves it: the router reads it and
reports the step's load (fmoe.layer.MoERoute), one process (fmoe.model.gpt_loss, whose aux.new_state is
this function's result for its one microbatch) and a pipeline step (fmoe.pipeline, the loads summed over
its microbatches) alike call `update_gpt_state`, which calls `fmoe.layer.update_moe_state` per site.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fmoe.config import GPTConfig
from fmoe.layer import MoERoute, init_moe_state, update_moe_state
from fmoe.outline import outline, state_at, with_state_at
from fmoe.structure import check_gpt_state
from fmoe.transforms.pytree import pytree_dataclass

Path = tuple[str, ...]


def init_gpt_state(cfg: GPTConfig, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Return {"layers": [MoE state or {} per layer], "mtp": MoE state (if mtp)}."""
    o = outline(cfg)
    state: dict[str, Any] = {"layers": [init_moe_state(cfg.moe, device) if o.layer(i).is_moe else {}
                                        for i in range(cfg.n_layers)]}
    if cfg.mtp:
        state = with_state_at(state, o.site("MTP"), init_moe_state(cfg.moe, device))
    return state


@pytree_dataclass(static=("missed",))
@dataclass(frozen=True)
class LayerLoad:
    """One MoE layer's routing over a step: tokens_per_expert_E [E] summed over microbatches, max_load the
    largest per-expert load of one microbatch, missed whether any microbatch exceeded its capacity
    forecast (dynamic capacity)."""

    tokens_per_expert_E: torch.Tensor
    max_load: torch.Tensor
    missed: bool

    @classmethod
    def of(cls, route: MoERoute) -> LayerLoad:
        """Returns one microbatch's load, from its routing."""
        tokens_E = route.tokens_per_expert_E
        return cls(tokens_E, tokens_E.max(), bool(route.capacity_missed))

    def merge(self, other: LayerLoad) -> LayerLoad:
        """Returns the load of both microbatch sets together."""
        return LayerLoad(self.tokens_per_expert_E + other.tokens_per_expert_E,
                         torch.maximum(self.max_load, other.max_load), self.missed or other.missed)


def add_load(loads: dict[Path, LayerLoad], path: Path, load: LayerLoad) -> None:
    """Merges `load` into `loads[path]` in place (the step's loads, keyed by the MoE site's param path)."""
    loads[path] = load if path not in loads else loads[path].merge(load)


def layer_loads(stats: Iterable[Mapping[str, Any]]) -> dict[Path, LayerLoad]:
    """Returns the step's loads per MoE site from the routing stats the MoE phases report
    ({"layer": param path, "route": MoERoute}, one per layer and microbatch), merged over microbatches."""
    loads: dict[Path, LayerLoad] = {}
    for st in stats:
        add_load(loads, tuple(st["layer"]), LayerLoad.of(st["route"]))
    return loads


def update_gpt_state(cfg: GPTConfig, state: dict[str, Any], loads: Mapping[Path, LayerLoad], *,
                     check: bool = True) -> dict[str, Any]:
    """Returns the GPT state after one step: `update_moe_state` once per MoE site with its step load
    (keyed by the site's param path, fmoe.outline; reduce them over data-parallel ranks first). Sites
    without a load (layers this rank does not hold) keep their state. `check`: check `state` and the
    loads' shapes against `cfg` first; False skips it."""
    if check:
        check_gpt_state(state, cfg)
    o = outline(cfg)
    new = {"layers": list(state["layers"]), **({"mtp": state["mtp"]} if "mtp" in state else {})}
    for path, load in loads.items():
        site = o.at(path)
        moved = update_moe_state(state_at(state, site) or {}, cfg.moe, load.tokens_per_expert_E,
                                 load.max_load, load.missed, check=check)
        new = with_state_at(new, site, moved)
    return new
