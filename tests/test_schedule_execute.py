"""The generic executor on a toy model: every generator, real gloo ranks, against torch.func.vjp of the
whole model run microbatch after microbatch in one process (the oracle never touches the executor)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import spawn
from fmoe.schedule.execute import execute
from fmoe.schedule.program import Layer, Phase, Ready, StageProgram

from fmoe import schedule as S
from fmoe.ops import linear

D, T = 8, 6


def _params(num_chunks: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"c{c}": {"w": torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5,
                      "b": torch.randn(D, generator=g, dtype=torch.float64)}
            for c in range(num_chunks)}


def _data(m: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(T, D, generator=g, dtype=torch.float64),
             "y": torch.randn(T, D, generator=g, dtype=torch.float64)} for _ in range(m)]


def _chunk(p: dict, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(linear(h, p["w"]) + p["b"])


def _doubling() -> Phase:
    """A linear comm phase (x2 there, x2 back), so the executor's exchange path runs without a group."""
    return Phase("double", "comm", start=lambda a, m: Ready(({"h": 2 * a["h"]}, m)),
                 start_transpose=lambda ct, m: Ready({"h": 2 * ct["h"]}))


def _program(s: S.Schedule, stage: int, params: dict) -> StageProgram:
    chunk = s.placement.layer_chunk[stage]
    first = {s.path(mb)[0] for mb in range(s.m)}
    last = {s.path(mb)[-1] for mb in range(s.m)}
    key = f"c{chunk}"

    def body(p: tuple, acts: dict, meta: dict) -> tuple[dict, dict]:
        h = meta["x"] if stage in first else acts["h"]
        return {"h": _chunk(p[0], h)}, meta

    def loss(p: tuple, acts: dict, meta: dict) -> tuple[dict, dict]:
        return {"mse": ((acts["h"] - meta["y"]) ** 2).mean()}, meta

    phases = [Phase("body", "compute", fn=body, param_paths=((key,),)), _doubling()]
    if stage in last:
        phases.append(Phase("loss", "compute", fn=loss, losses=("mse",)))
    spec = {} if stage in first else {"h": ((T, D), torch.float64)}
    return StageProgram(stage, (Layer(f"L{chunk}", tuple(phases)),), {key: params[key]}, spec)


def _oracle(s: S.Schedule, params: dict) -> tuple[float, dict]:
    data = _data(s.m)

    def total(p: dict) -> torch.Tensor:
        out = 0.0
        for mb in range(s.m):
            h = data[mb]["x"]
            for st in s.path(mb):
                h = 2 * _chunk(p[f"c{s.placement.layer_chunk[st]}"], h)
            out = out + ((h - data[mb]["y"]) ** 2).mean()
        return out / s.m

    loss, vjp = torch.func.vjp(total, params)
    return float(loss), vjp(torch.ones(()))[0]


def _rank(rank: int, world: int, names: tuple[str, ...], m: int) -> dict:
    out = {}
    for name in names:  # one spawn runs every schedule: process start-up dominates at these sizes
        s = S.build(name, world, m)
        params = _params(max(s.placement.layer_chunk) + 1)
        data = _data(m)
        programs = {st: _program(s, st, params) for st in s.placement.stages_of(rank)}
        res = execute(s, rank, programs, lambda mb, data=data: data[mb])
        sim = S.simulate(s, S.Costs(f=1, i=1, w=1))
        grads = {c: {k: v.tolist() for k, v in g.items()} for c, g in res.grads.items()}  # no shared memory
        out[name] = (float(res.loss), grads, res.peak_activations, sim.peak_activations[rank])
    return out


CASES = {2: (S.registry.NAMES, 4), 4: (("1f1b", "interleaved", "dualpipev"), 8)}


@pytest.mark.parametrize("pp", sorted(CASES))
def test_every_schedule_matches_the_single_process_oracle(pp: int) -> None:
    names, m = CASES[pp]
    results = spawn(_rank, pp, names, m, timeout_s=240)
    for name in names:
        s = S.build(name, pp, m)
        want_loss, want = _oracle(s, _params(max(s.placement.layer_chunk) + 1))
        got_loss = sum(r.value[name][0] for r in results)
        assert got_loss == pytest.approx(want_loss, rel=1e-12), name
        summed: dict = {}
        for r in results:
            for c, g in r.value[name][1].items():
                for k, v in g.items():
                    v = torch.tensor(v, dtype=torch.float64)
                    summed.setdefault(c, {}).setdefault(k, torch.zeros_like(v)).add_(v)
        assert summed.keys() == want.keys(), name
        for c in want:
            for k in want[c]:
                torch.testing.assert_close(summed[c][k], want[c][k], rtol=1e-10, atol=1e-12, msg=name)
        for r in results:
            assert r.value[name][2] == r.value[name][3], f"{name} rank {r.rank}: peak activations vs simulated"
