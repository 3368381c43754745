"""The model's outline: every site of the GPT named once, with where its parameters and its state live.

    o = outline(cfg)
    o.sites                     # embed, L0 .. L{n-1}, head, then mtp_in, MTP, mtp_head (with cfg.mtp)
    o.moe                       # the MoE sites in program order (the main MoE layers, then MTP)
    o.site("L3").params         # ("layers", "3"): the root of its parameters
    o.site("MTP").state         # ("mtp",): where its MoE state lives in the GPT state
    o.chunk(layers, first=, head=, last=)   # the sites of one pipeline chunk, in program order

A site's `name` is the name of its layer in a stage program (fmoe/phases.py), its `reads` the top-level
parameter paths it reads (the keys of `fmoe.pipeline.cut.holders`: a shared weight such as the embedding
table is read by two sites), its `state` the path of its MoE state in `init_gpt_state`'s tree and `key`
the name that state has in checkpoints and metrics ("layers.3", "mtp"). Everything that asks which
layers exist, which are MoE, where a layer's weights or state are, or which weights a chunk reads asks
this outline: nothing parses a layer name back into an index.

Paths are tuples of strings ("layers", "3"): a list on the way is indexed by a key of digits
(fmoe.transforms.program.subtree), so one path form serves the params, the state and the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from fmoe._compat import trace_safe_cache
from fmoe.config import GPTConfig

Path = tuple[str, ...]
SiteKind = Literal["embed", "dense", "moe", "head", "mtp_in", "mtp_head"]


@dataclass(frozen=True)
class Site:
    """One site of the model. `name`: its layer's name in a stage program; `kind`; `layer`: the model
    layer index (dense and main MoE layers; None elsewhere); `params`: the root of its parameters;
    `reads`: the top-level parameter paths it reads; `state`: where its MoE state lives (MoE sites only);
    `key`: that state's name in checkpoints and metrics (MoE sites only)."""

    name: str
    kind: SiteKind
    params: Path
    reads: tuple[Path, ...]
    layer: int | None = None
    state: Path | None = None
    key: str | None = None

    @property
    def is_moe(self) -> bool:
        """Whether the site is an MoE block (it routes, and has a state)."""
        return self.kind == "moe"


@dataclass(frozen=True)
class Outline:
    """The sites of one GPTConfig's model in program order (module docstring)."""

    sites: tuple[Site, ...]
    n_layers: int
    mtp: bool
    # Indexes made once with the outline (not functools.cached_property: its lock, on Python 3.11, stops
    # torch.compile from tracing a lookup).
    _by_name: dict[str, Site] = field(init=False, repr=False, compare=False)
    _by_params: dict[Path, Site] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {s.name: s for s in self.sites})
        object.__setattr__(self, "_by_params", {s.params: s for s in self.sites})

    @property
    def moe(self) -> tuple[Site, ...]:
        """The MoE sites in program order: the main model's MoE layers, then the MTP block."""
        return tuple(s for s in self.sites if s.is_moe)

    def site(self, name: str) -> Site:
        """Returns the site named `name` ("embed", "L3", "MTP", ...); raises KeyError naming the sites."""
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"the model has no site {name!r}; its sites are "
                           f"{', '.join(self._by_name)}") from None

    def at(self, params: Path) -> Site:
        """Returns the site whose parameters are rooted at `params` (("layers", "3"), ("mtp", "block"))."""
        try:
            return self._by_params[tuple(params)]
        except KeyError:
            raise KeyError(f"no site of the model has its parameters at {'.'.join(params)!r}") from None

    def layer(self, i: int) -> Site:
        """Returns model layer `i`'s site (dense or MoE)."""
        if not 0 <= i < self.n_layers:
            raise IndexError(f"the model has layers 0..{self.n_layers - 1}, not {i}")
        return self.sites[1 + i]

    def chunk(self, layers: tuple[int, ...] | range, *, first: bool, head: bool,
              last: bool) -> tuple[Site, ...]:
        """Returns the sites of one model chunk in program order: the embedding when `first`, model layers
        `layers`, the final norm + head + loss when `head`, and the MTP module when `last` (with MTP)."""
        out = [self.site("embed")] if first else []
        out += [self.layer(i) for i in layers]
        if head:
            out.append(self.site("head"))
        if last and self.mtp:
            out += [self.site("mtp_in"), self.site("MTP"), self.site("mtp_head")]
        return tuple(out)


def alone(name: str = "block") -> Site:
    """Returns the site of one MoE block (or, `name` "moe", one MoE layer) run alone, outside a GPT
    (fmoe.model.block / moe): its params and its state are the whole trees handed in (root paths)."""
    return Site(name, "moe", (), ((),), state=())


def reads_of(sites: tuple[Site, ...]) -> tuple[Path, ...]:
    """Returns the top-level parameter paths `sites` read, each once, in program order."""
    return tuple(dict.fromkeys(p for s in sites for p in s.reads))


@trace_safe_cache(maxsize=64)
def outline(cfg: GPTConfig) -> Outline:
    """Returns the Outline of `cfg`'s GPT (cached per config; frozen)."""
    sites = [Site("embed", "embed", ("embed",), (("embed",),))]
    for i in range(cfg.n_layers):
        path = ("layers", str(i))
        if i < cfg.num_dense_layers:
            sites.append(Site(f"L{i}", "dense", path, (path,), layer=i))
        else:
            sites.append(Site(f"L{i}", "moe", path, (path,), layer=i, state=path, key=".".join(path)))
    sites.append(Site("head", "head", (), (("norm",), ("head",))))
    if cfg.mtp:
        sites += [Site("mtp_in", "mtp_in", ("mtp",), (("embed",), ("mtp",))),
                  Site("MTP", "moe", ("mtp", "block"), (("mtp",),), state=("mtp",), key="mtp"),
                  Site("mtp_head", "mtp_head", ("mtp",), (("mtp",), ("head",)))]
    return Outline(tuple(sites), cfg.n_layers, cfg.mtp)


def state_at(state: dict[str, Any] | None, site: Site) -> Any:
    """Returns `site`'s MoE state in a GPT state tree ({"layers": [...], "mtp": ...}; for a site whose
    state path is (), the layer state itself); None where absent (None: a fresh state)."""
    node: Any = state
    for k in site.state or ():
        if isinstance(node, (list, tuple)):
            node = node[int(k)]
        elif isinstance(node, dict):
            node = node.get(k)
        else:
            return None
    return node


def with_state_at(state: dict[str, Any], site: Site, value: Any) -> dict[str, Any]:
    """Returns a copy of the GPT state tree with `site`'s MoE state replaced by `value` (containers on the
    way copied, the other leaves shared)."""
    top, *rest = site.state
    if not rest:
        return {**state, top: value}
    layers = list(state[top])
    layers[int(rest[0])] = value
    return {**state, top: layers}
