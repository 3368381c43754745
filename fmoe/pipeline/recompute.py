"""Recompute on a pipeline (fmoe/recompute.py): the layers of a stage program with their compute phases
under `fmoe.transforms.remat`, so that the executor keeps each phase's input only.

    layers = chunk_layers(cfg.recompute, chunk.layers, layers)   # in gpt_programs, once per stage

"full" puts every compute phase of a recomputed layer (and the side phase its dispatch carries) under
remat; the exchanges between them run once, as they are not differentiated (fmoe.transforms.program). The
other parts are recomputed inside the block functions the phases call (fmoe/block.py), except the shared
expert, which the pipeline runs as a side phase on its own (`shared_expert` takes no config), so
"shared_experts" wraps that phase here.

Layers are found by the names fmoe/pipeline/phases.py gives them: "L<i>" for model layer i, "MTP" for the
MTP block (not a layer: never recomputed whole, its shared expert is a part).
"""

from __future__ import annotations

import dataclasses

from fmoe.recompute import Recompute, recomputed
from fmoe.transforms.program import Layer, Phase

SHARED = "shared"  # the side phase of the dispatch that runs the shared expert (phases.moe_layer)


def _remat(ph: Phase) -> Phase:
    return dataclasses.replace(ph, fn=recomputed(ph.fn))


def recompute_phases(layer: Layer, whole: bool, shared: bool) -> Layer:
    """Returns `layer` with every compute phase under remat (`whole`), or only its shared-expert side
    phase (`shared`); `layer` itself when neither."""
    if not (whole or shared):
        return layer

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


def chunk_layers(rc: Recompute, chunk_layers: tuple[int, ...], layers: list[Layer]) -> list[Layer]:
    """Returns the stage program's `layers` (embedding, model layers `chunk_layers` in order, MTP, head)
    with `rc` applied: the k-th model layer of the chunk whole when `rc.layer(k)`, the shared expert of
    every MoE layer (MTP's too) with part "shared_experts"."""
    k_of = {f"L{i}": k for k, i in enumerate(chunk_layers)}
    shared = rc.module("shared_experts")
    return [recompute_phases(layer, layer.name in k_of and rc.layer(k_of[layer.name]), shared)
            for layer in layers]
