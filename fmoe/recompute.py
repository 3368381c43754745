"""Which activations a training step recomputes in the backward instead of keeping them from the forward
(Megatron's --recompute-granularity / --recompute-method / --recompute-num-layers / --recompute-modules).

    cfg = GPTConfig(..., recompute=Recompute("selective", modules=("core_attn", "moe")))
    f = part(cfg.recompute, "core_attn", attention_fn)    # attention_fn itself, or its remat

- `None` (default): nothing is recomputed.
- "full": whole transformer layers keep only their input (`fmoe.transforms.remat` with
  `nothing_saveable`): every layer, or with `num_layers` N (Megatron's "block" method) the first N
  layers of each pipeline chunk (one process is one chunk). An MoE layer is several phases with exchanges
  between them (fmoe/phases.py), and an exchange cannot be replayed in a backward, so each compute phase
  of the layer keeps only its own input (`chunk_layers`); the exchanges run once. The embedding, the
  head and the MTP module are not layers and are never recomputed whole (as in Megatron).
- "selective": only the named parts (Megatron's module names where fmoe has the part): "core_attn" the
  attention core (q, k, v -> o: RoPE and the softmax of the scores), "mlp" a dense layer's SwiGLU MLP,
  "moe" the routed experts (gate, up, activation, down), "shared_experts" the shared expert, "layernorm"
  the block's RMSNorms, "mla_up_proj" MLA's up projections. Each keeps only its inputs
  (`fmoe.transforms.remat` holds none of a region's outputs: they live as long as their readers keep
  them). remat cannot drop an output that its reader saved (Megatron's output-discarding checkpoint), so
  a norm's output is freed only where the linears that read it are recomputed with it.
  - "layernorm": every RMSNorm of a block is recomputed. MLA's attention norm runs with the down
    projections that read it (w_q_a and w_kv_a, fmoe/mla.py), and a dense layer's MLP norm with its gate
    and up products (without TP; fmoe/dense.py): their outputs are not kept (without a query latent MLA's
    normed input is the queries' input, and stays). The others run alone under remat, their outputs kept
    by their readers, only what the norm saves besides its input going (its fp32 working copies): GQA's
    attention norm (fmoe/block.py runs it without the q, k, v projections), GQA's q/k norms, MLA's latent
    norms outside "mla_up_proj", the MoE layer's MLP norm (the router, the permutation and the shared
    expert read its output), and every norm that a TP collective separates from its linears.
  - "mla_up_proj" (MLA; GQA has no up projection: nothing there): from the latents to the attention
    output, the latent norms (where no TP collective separates them from the up projections), the up
    projections (w_q_b or w_q, w_kv_b), RoPE and the attention core, so that the normed latents and the
    up-projected q, k, v are not kept (the attention core saves its inputs: recomputing the projections
    without it would free nothing). It includes "core_attn" for MLA.
The MoE layer's load-aware adaptive recompute (seed 002, `MoEConfig.adaptive_remat`) is the routed
experts' "moe" part, chosen per layer and step from the routing: it is an MoE option, not one here.

`chunk_layers` applies a choice to the layers of a model chunk (fmoe/phases.py): "full" puts every compute
phase of a recomputed layer (and the side phase its dispatch carries) under remat. The other parts are
recomputed inside the block functions the phases call (fmoe/block.py), except the shared expert, which
runs as a side phase of its own (`shared_expert` takes no config), so "shared_experts" wraps that phase
here. Layers are found by the names fmoe/phases.py gives them: "L<i>" for model layer i, "MTP" for the MTP
block (not a layer: never recomputed whole, its shared expert is a part).

torch-free at import (fmoe/config.py holds a `Recompute`); `recomputed` loads fmoe.transforms on first use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fmoe.transforms.program import Layer, Phase

GRANULARITIES = ("full", "selective")
# fmoe's layers draw no random numbers (no dropout), so a recompute need not replay the generators: remat
# would keep the CPU generator's state (5 KB) per call, more than the attention core saves. A layer that
# draws (dropout) must set this False, or its recompute would differentiate other random draws.
DRAWS_NOTHING = True
MODULES = ("core_attn", "mlp", "moe", "shared_experts", "layernorm", "mla_up_proj")


@dataclass(frozen=True)
class Recompute:
    """The recompute choice (module docstring). granularity: None, "full" or "selective"; modules:
    selective's parts (MODULES); num_layers: full's first N layers per pipeline chunk (None: all)."""

    granularity: str | None = None
    modules: tuple[str, ...] = ()
    num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.granularity not in (None, *GRANULARITIES):
            raise ValueError(f"Recompute.granularity must be None, 'full' or 'selective', got "
                             f"{self.granularity!r}")
        modules = tuple(self.modules)
        unknown = [m for m in modules if m not in MODULES]
        if unknown:
            raise ValueError(f"Recompute.modules: {', '.join(map(repr, unknown))} not among "
                             f"{', '.join(MODULES)}")
        if modules and self.granularity != "selective":
            raise ValueError("Recompute.modules name the parts of granularity 'selective'")
        if self.granularity == "selective" and not modules:
            raise ValueError("Recompute granularity 'selective' needs modules to recompute")
        if self.num_layers is not None:
            if self.granularity != "full":
                raise ValueError("Recompute.num_layers counts the layers of granularity 'full'")
            n = self.num_layers
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"Recompute.num_layers must be a positive int, got {self.num_layers!r}")
        object.__setattr__(self, "modules", tuple(dict.fromkeys(modules)))

    def layer(self, k: int) -> bool:
        """Whether the k-th layer (0-based) of a pipeline chunk is recomputed whole."""
        return self.granularity == "full" and (self.num_layers is None or k < self.num_layers)

    def module(self, name: str) -> bool:
        """Whether part `name` (one of MODULES) is recomputed on its own."""
        return name in self.modules


def recomputed(f: Callable[..., Any]) -> Callable[..., Any]:
    """Returns f under `fmoe.transforms.remat`: it keeps its inputs, the backward recomputes the rest."""
    from fmoe.transforms.remat import nothing_saveable, remat

    return remat(f, nothing_saveable, preserve_rng_state=not DRAWS_NOTHING)


def part(rc: Recompute, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """Returns f, or `recomputed(f)` when `rc` recomputes part `name`."""
    return recomputed(f) if rc.module(name) else f


SHARED = "shared"  # the side phase of the dispatch that runs the shared expert (phases.moe_layer)


def _remat(ph: Phase) -> Phase:
    return dataclasses.replace(ph, fn=recomputed(ph.fn))


def recompute_phases(layer: Layer, whole: bool, shared: bool) -> Layer:
    """Returns `layer` with every compute phase under remat (`whole`), or only its shared-expert side
    phase (`shared`); `layer` itself when neither. A whole layer whose exchanges are all local (nothing
    leaves the process, so its backward may replay them) becomes one compute phase under remat, which
    keeps the layer's input only."""
    if not (whole or shared):
        return layer
    if whole and layer.lone_phases is None and all(ph.local for ph in layer.phases if ph.kind == "comm"):
        return _whole_layer(layer)

    def wrapped(phases: tuple[Phase, ...]) -> tuple[Phase, ...]:
        out = []
        for ph in phases:
            if ph.kind == "compute" and whole:
                ph = _remat(ph)
            if ph.side is not None and (whole or (shared and ph.side.name == SHARED)):
                ph = dataclasses.replace(ph, side=_remat(ph.side))
            out.append(ph)
        return tuple(out)

    lone = None if layer.lone_phases is None else wrapped(layer.lone_phases)
    return dataclasses.replace(layer, phases=wrapped(layer.phases), lone_phases=lone)


def _whole_layer(layer: Layer) -> Layer:
    """Returns `layer` (its exchanges local) as one compute phase under remat that runs its phases in
    order (fmoe.transforms.program.run_phases); its losses and routing statistics are the layer's."""
    from fmoe.transforms.program import Layer, Phase, run_phases, tree_params

    steps = [ph.side if ph.kind == "comm" else ph for ph in layer.phases
             if ph.kind == "compute" or ph.side is not None]
    paths = tuple(dict.fromkeys(q for ph in steps for q in ph.param_paths))
    losses = tuple(k for ph in layer.phases if ph.kind == "compute" for k in ph.losses)

    def run(p: Any, acts: dict, meta: dict) -> tuple[dict, dict]:  # p: the tree below (), these paths
        ran = run_phases((layer,), tree_params(p), acts, meta)
        meta = ran.meta
        if ran.stats:
            (_, _, stats), = ran.stats  # one routed layer at most
            meta = {**meta, "stats": stats}
        return {**ran.acts, **ran.losses}, meta

    return Layer(layer.name, (Phase(layer.name, "compute", fn=recomputed(run), param_paths=paths,
                                    losses=losses),))


def chunk_layers(rc: Recompute, sites: tuple[Any, ...], layers: list[Layer]) -> list[Layer]:
    """Returns the stage program's `layers` (one per site of the chunk: fmoe.outline.Site, not imported
    here since the outline reads the config, which reads this module) with `rc` applied: the k-th model
    layer of the chunk whole when `rc.layer(k)`, the shared expert of every MoE layer (MTP's too) with
    part "shared_experts"."""
    k_of = {s.name: k for k, s in enumerate(s for s in sites if s.layer is not None)}
    shared = rc.module("shared_experts")
    return [recompute_phases(layer, layer.name in k_of and rc.layer(k_of[layer.name]), shared)
            for layer in layers]
