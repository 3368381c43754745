"""How an MoE layer hides its all-to-all: adaptive pipe overlap (Pangu Ultra MoE), per layer and context.

An MoE layer's dispatch and combine depend on the compute around them, so the layer cannot hide them
behind its own next step. Three ways to hide them, each with a price:
  "pair"  cross-microbatch pairing: in an F&B pair the layer hands over to the paired op at its dispatch
          and combine, and the other microbatch's compute runs while they travel (seed 000's four
          pairings, fmoe.schedule.execute). Free where the other op has compute left; none in a lone op.
  "self"  self-overlap: the layer moves its rows in two chunks that travel while each other's experts run
          (fmoe.phases.chunked_moe_phases). Hides about three of four half-exchanges, but pays a second
          exchange's latency per peer and two half-size expert GEMMs.
  "none"  whole exchanges, issued and waited: no price, nothing hidden (the op's own side work, the shared
          expert and a lone backward's dw, still runs while they travel: it must run anyway).
`LayerOverlap(paired, lone)` is one MoE layer's choice: in an F&B pair (`paired`: one of PAIRED) and in a
lone op, warm-up and cool-down (`lone`: one of LONE; a lone op has no partner). The planner chooses them
from the costs (fmoe.plan.estimate: `overlap_choice`); `fmoe train --pair-overlap`, `--a2a-chunks` and
fmoe.phases.gpt_layers(overlap=) carry them into the programs the executor runs.

torch-free at import (fmoe.plan reads it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PAIRED = ("pair", "self", "none")
LONE = ("self", "none")


@dataclass(frozen=True)
class LayerOverlap:
    """One MoE layer's overlap modes (module docstring): `paired` in an F&B pair, `lone` in a lone op.
    The default is the executor's fb overlap with whole exchanges alone."""

    paired: str = "pair"
    lone: str = "none"

    def __post_init__(self) -> None:
        if self.paired not in PAIRED:
            raise ValueError(f"LayerOverlap.paired must be one of {', '.join(PAIRED)}, got {self.paired!r}")
        if self.lone not in LONE:
            raise ValueError(f"LayerOverlap.lone must be one of {', '.join(LONE)}, got {self.lone!r}")

    @classmethod
    def of_chunks(cls, a2a_chunks: int, paired: str = "pair") -> LayerOverlap:
        """Returns the modes `--a2a-chunks` stands for: a lone forward moves its rows in two chunks with 2,
        whole with 1; `paired` as given."""
        return cls(paired, "self" if a2a_chunks == 2 else "none")

    @property
    def hands_over(self) -> bool:
        """Whether the layer hands over to its pair at the dispatch and the combine."""
        return self.paired == "pair"

    @property
    def chunks(self) -> bool:
        """Whether either context moves the layer's rows in two chunks (the dispatcher must allow it)."""
        return "self" in (self.paired, self.lone)


Overlap = LayerOverlap | Mapping[str, LayerOverlap]


def layer_overlap(overlap: Overlap | None, name: str) -> LayerOverlap:
    """Returns MoE layer `name`'s modes ("L3", "MTP"): `overlap` itself when one LayerOverlap, its entry
    when a mapping by layer name (the default LayerOverlap() for a name it leaves out), LayerOverlap()
    for None. TypeError for anything else."""
    if overlap is None:
        return LayerOverlap()
    if isinstance(overlap, LayerOverlap):
        return overlap
    if isinstance(overlap, Mapping):
        got = overlap.get(name, LayerOverlap())
        if not isinstance(got, LayerOverlap):
            raise TypeError(f"overlap[{name!r}] must be a LayerOverlap, got {type(got).__name__}")
        return got
    raise TypeError(f"overlap must be a LayerOverlap or a mapping of layer names to them, got "
                    f"{type(overlap).__name__}")


def check_names(overlap: Overlap | None, moe_names: set[str]) -> None:
    """Raises ValueError when a mapping `overlap` names a layer that is not one of `moe_names` (the
    model's MoE layers: a typo would otherwise leave that layer at the default silently)."""
    if isinstance(overlap, Mapping):
        unknown = sorted(set(overlap) - moe_names)
        if unknown:
            raise ValueError(f"overlap names {', '.join(unknown)}: not MoE layers of the model "
                             f"({', '.join(sorted(moe_names)) or 'none'})")
