"""The GPT on every pipeline schedule, over real gloo ranks: the loss and every parameter gradient after
one step equal those of the same microbatches run one after the other in one process (`gpt_loss`,
differentiated by torch.func.vjp: an oracle that never touches the executor or the phases)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import share_ranks, shared_ranks

from fmoe import GPTConfig, MoEConfig, gpt_loss, init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.schedule.options import ExecOptions

DT = torch.float64


def _cfg(n_layers: int, mtp: bool, dense: int = 1) -> GPTConfig:
    moe = MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=1e-2, num_shared_experts=1)
    return GPTConfig(vocab_size=32, d_model=16, n_layers=n_layers, n_heads=2, moe=moe, mtp=mtp,
                     num_dense_layers=dense)


def _batches(cfg: GPTConfig, m: int, B: int = 2, S_: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(m):
        seq = torch.randint(0, cfg.vocab_size, (B, S_ + 1), generator=g, device="cpu")
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _flat(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out.update(_flat(v, f"{prefix}{i}."))
    elif tree is not None:
        out[prefix[:-1]] = tree
    return out


def _oracle(cfg: GPTConfig, m: int) -> tuple[float, dict[str, torch.Tensor]]:
    params = init_gpt(cfg, torch.Generator().manual_seed(0), DT)
    state = init_gpt_state(cfg)
    batches = _batches(cfg, m)

    def mean_loss(p):
        return sum(gpt_loss(p, ids, t, cfg, state)[0] for ids, t in batches) / m

    loss, vjp = torch.func.vjp(mean_loss, params)
    return float(loss), _flat(vjp(torch.ones((), dtype=DT))[0])


def _rank(rank: int, world: int, runs: list[tuple], m: int) -> dict:
    out = {}
    for name, n_layers, mtp, *engine in runs:
        cfg = _cfg(n_layers, mtp)
        s = S.build(name, world, m)
        params = init_gpt(cfg, torch.Generator().manual_seed(0), DT)
        step = gpt_pipeline_step(gpt_program(cfg, s, rank), params, init_gpt_state(cfg), _batches(cfg, s.m),
                                 options=ExecOptions(engine=engine[0] if engine else "autograd"))
        out[(name, mtp, *engine)] = (float(step.loss), {k: v.tolist() for k, v in _flat(step.grads).items()},
                            step.result.peak_activations, S.simulate(s, S.Costs()).peak_activations[rank])
    return out


def _check(results, runs: list[tuple], m: int) -> None:
    for name, n_layers, mtp, *engine in runs:
        key = (name, mtp, *engine)
        want_loss, want = _oracle(_cfg(n_layers, mtp), m)
        for r in results:
            loss, grads, peak, sim_peak = r.value[key]
            assert loss == pytest.approx(want_loss, rel=1e-12), (name, mtp, r.rank)
            assert peak == sim_peak, (name, mtp, r.rank)
        held: dict[str, torch.Tensor] = {}
        for r in results:
            for k, v in r.value[key][1].items():
                v = torch.tensor(v, dtype=DT)
                if k in held:  # a weight held by two ranks: its (summed) gradient is the same on both
                    torch.testing.assert_close(v, held[k], rtol=0, atol=0, msg=f"{name} {k}")
                held[k] = v
        assert held.keys() == want.keys(), (name, set(held) ^ set(want))
        for k in want:
            torch.testing.assert_close(held[k], want[k], rtol=1e-9, atol=1e-12, msg=f"{name} mtp={mtp} {k}")


# the executor's default engine is tape autograd; one run per pp also goes through torch.func.vjp
RUNS_PP2 = [(n, 4, mtp) for n in S.registry.NAMES for mtp in (False, True)] + [("dualpipev", 4, True, "func")]
RUNS_PP4 = [(n, 8, mtp) for n in ("1f1b", "interleaved", "dualpipev") for mtp in (False, True)] + [
    ("interleaved", 8, True, "func")]


RUNS_AT = {2: (RUNS_PP2, 4), 4: (RUNS_PP4, 8)}  # pp -> (runs, microbatches)


def _rank_at(rank: int, world: int) -> dict:
    """`_rank` with the runs and microbatches of pp = `world`."""
    return _rank(rank, world, *RUNS_AT[world])


# on the session's shared starts of the ranks (tests/dist_utils.py)
share_ranks("pipeline_gpt", tuple(RUNS_AT), _rank_at)


@pytest.mark.parametrize("pp,runs,m", [(pp, *RUNS_AT[pp]) for pp in RUNS_AT], ids=["pp2", "pp4"])
def test_gpt_pipeline_matches_single_process(pp: int, runs: list, m: int) -> None:
    results = shared_ranks(pp, "pipeline_gpt")
    _check(results, runs, m)
