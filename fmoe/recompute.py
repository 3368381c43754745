"""Which activations a training step recomputes in the backward instead of keeping them from the forward
(Megatron's --recompute-granularity / --recompute-method / --recompute-num-layers / --recompute-modules).

    cfg = GPTConfig(..., recompute=Recompute("selective", modules=("core_attn", "moe")))
    f = part(cfg.recompute, "core_attn", attention_fn)    # attention_fn itself, or its remat

- `None` (default): nothing is recomputed.
- "full": whole transformer layers keep only their input (`fmoe.transforms.remat` with
  `nothing_saveable`): every layer, or with `num_layers` N (Megatron's "block" method) the first N
  layers of each pipeline chunk. On a pipeline an MoE layer is several phases with exchanges between them
  (fmoe/pipeline/phases.py), and an exchange cannot be replayed in a backward, so there each compute
  phase of the layer keeps only its own input (fmoe/pipeline/recompute.py); in one process
  (`fmoe.model.gpt_loss`) the whole layer does. The embedding, the head and the MTP module are not
  layers and are never recomputed whole (as in Megatron).
- "selective": only the named parts (Megatron's module names where fmoe has the part): "core_attn" the
  attention core (q, k, v -> o: RoPE and the softmax of the scores), "mlp" a dense layer's SwiGLU MLP,
  "moe" the routed experts (gate, up, activation, down), "shared_experts" the shared expert. Each keeps
  only its inputs; what it returns is kept by whoever reads it, as without recompute.
The MoE layer's load-aware adaptive recompute (seed 002, `MoEConfig.adaptive_remat`) is the routed
experts' "moe" part, chosen per layer and step from the routing: it is an MoE option, not one here.

torch-free at import (fmoe/config.py holds a `Recompute`); `recomputed` loads fmoe.transforms on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GRANULARITIES = ("full", "selective")
# fmoe's layers draw no random numbers (no dropout), so a recompute need not replay the generators: remat
# would keep the CPU generator's state (5 KB) per call, more than the attention core saves. A layer that
# draws (dropout) must set this False, or its recompute would differentiate other random draws.
DRAWS_NOTHING = True
MODULES = ("core_attn", "mlp", "moe", "shared_experts")


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
