"""`fmoe train`'s recompute choices (fmoe/recompute.py; issue 34): each gives the gradients of the run
without recompute, and keeps fewer bytes between a microbatch's forward and its backward.

Oracle: the same step without recompute. Memory is counted, not timed: the bytes torch's allocator holds
when a forward has returned (its result alive) in one process (`gpt_loss`, fmoe train's accumulate
path), and on the pipeline executor the growth of the step's peak per extra microbatch under GPipe (all
forwards, then all backwards), which is what one microbatch keeps from its forward to its backward.
Choices: full (every layer, and the first layer of the chunk only), selective by each part, and the
MoE layer's load-aware adaptive recompute (scale 1: every layer whose largest load exceeds the mean).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import spawn
from torch.profiler import ProfilerActivity, profile

from fmoe import init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe._compat import tree_flatten, tree_map
from fmoe.model import gpt_loss
from fmoe.parallel import ParallelLayout
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.recompute import Recompute
from fmoe.schedule.options import ExecOptions
from fmoe.train.config import TrainConfig
from fmoe.train.loop import Trainer, World
from fmoe.transforms.testing import tracked_peak_bytes

CHOICES: dict[str, dict[str, Any]] = {
    "full": {"recompute_granularity": "full"},
    "full_first_layer": {"recompute_granularity": "full", "recompute_method": "block",
                         "recompute_num_layers": 1},
    "core_attn": {"recompute_granularity": "selective"},  # Megatron's default part
    "mlp": {"recompute_granularity": "selective", "recompute_modules": ("mlp",)},
    "moe": {"recompute_granularity": "selective", "recompute_modules": ("moe",)},
    "shared_experts": {"recompute_granularity": "selective", "recompute_modules": ("shared_experts",)},
    "adaptive": {"moe_adaptive_recompute_activation": True, "moe_adaptive_recompute_activation_scale": 1.0},
}
BASE = {"mtp": True}  # the tiny preset (a dense layer, shared experts) with an MTP block
B, SEQ = 2, 32


def _cfg(flags: dict[str, Any]):
    return TrainConfig(**BASE, **flags).model()


def _batches(m: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(m)
    return [(torch.randint(0, vocab, (B, SEQ), generator=g), torch.randint(0, vocab, (B, SEQ), generator=g))
            for _ in range(m)]


def _held_bytes(fn: Any) -> tuple[Any, int]:
    """(fn(), the bytes allocated during it and still held when it returned)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


def _one_process(cfg) -> tuple[list[torch.Tensor], int, list[int]]:
    """Gradients of one gpt_loss step, the bytes its forward holds, and the recomputed MoE layers."""
    params = tree_map(lambda t: t.requires_grad_(), init_gpt(cfg, torch.Generator().manual_seed(0)))
    (ids, targets), = _batches(1, cfg.vocab_size)
    state = init_gpt_state(cfg)
    gpt_loss(params, ids, targets, cfg, state)  # warm-up: first-call caches are not the step's memory
    (loss, aux), held = _held_bytes(lambda: gpt_loss(params, ids, targets, cfg, state))
    loss.backward()
    return [t.grad for t in tree_flatten(params)[0]], held, aux.remat_layers


def _pipeline(cfg) -> tuple[list[torch.Tensor], float]:
    """Gradients of a GPipe step of 2 microbatches through the executor, and the bytes one microbatch
    keeps from its forward to its backward (the peak's growth from 2 to 4 microbatches, halved)."""
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    peaks, grads = [], None
    for m in (2, 4):
        s, batches = S.build("gpipe", 1, m), _batches(m, cfg.vocab_size)
        def step(s: S.Schedule = s, batches: list = batches) -> Any:
            return gpt_pipeline_step(gpt_program(cfg, s, 0), params, init_gpt_state(cfg), batches,
                                     options=ExecOptions(overlap=False))
        step()
        out, peak = tracked_peak_bytes(step)
        peaks.append(peak)
        grads = grads or [g for g in tree_flatten(out.grads)[0] if g is not None]
    return grads, (peaks[1] - peaks[0]) / 2


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Equal to fp32 rounding of the largest gradient: a recompute differentiates the same values, its
    backward sums some of them in another order."""
    assert len(got) == len(want)
    scale = max(float(w.abs().max()) for w in want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * scale)


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    cfg = _cfg({})
    assert cfg.recompute == Recompute() and not cfg.moe.adaptive_remat
    grads, held, rematted = _one_process(cfg)
    assert rematted == []
    return {"one": (grads, held), "pipe": _pipeline(cfg)}


@pytest.mark.parametrize("name", list(CHOICES))
def test_each_choice_gives_the_gradients_without_recompute_and_keeps_less(name: str, oracle: dict) -> None:
    cfg = _cfg(CHOICES[name])
    grads, held, rematted = _one_process(cfg)
    _close(grads, oracle["one"][0])
    assert held < oracle["one"][1], (name, held, oracle["one"][1])
    if name in ("moe", "adaptive"):
        assert rematted == [0, 1, 2, 3], rematted  # the routed experts of every MoE layer, the MTP block's
    pipe_grads, per_microbatch = _pipeline(cfg)
    _close(pipe_grads, oracle["pipe"][0])
    assert per_microbatch < oracle["pipe"][1], (name, per_microbatch, oracle["pipe"][1])


def test_full_keeps_at_most_half(oracle: dict) -> None:
    cfg = _cfg(CHOICES["full"])
    assert _one_process(cfg)[1] < 0.4 * oracle["one"][1]  # layers keep their inputs only
    assert _pipeline(cfg)[1] < 0.6 * oracle["pipe"][1]  # a pipeline's MoE layer keeps each phase's input


@pytest.mark.parametrize("flags, needle", [
    ({"recompute_granularity": "all"}, "--recompute-granularity must be full or selective"),
    ({"recompute_modules": ("moe",)}, "--recompute-modules applies to --recompute-granularity selective"),
    ({"recompute_granularity": "selective", "recompute_modules": ("moe_act",)}, "moe_act is not one of"),
    ({"recompute_granularity": "full", "recompute_num_layers": 2}, "recomputes one layer at a time"),
    ({"recompute_granularity": "full", "recompute_method": "block"}, "give N"),
    ({"recompute_method": "uniform"}, "--recompute-method applies to --recompute-granularity full only"),
    ({"recompute_granularity": "full", "moe_adaptive_recompute_activation": True}, "has no effect"),
    ({"recompute_granularity": "selective", "recompute_modules": ("moe",),
      "moe_adaptive_recompute_activation": True}, "every layer's experts"),
    ({"moe_adaptive_recompute_activation": True, "moe_adaptive_recompute_activation_scale": 0.0},
     "must be > 0"),
])
def test_bad_recompute_flags_fail_before_launch(flags: dict, needle: str) -> None:
    problem = TrainConfig(**flags).problem()
    assert problem is not None and needle in problem, (flags, problem)


def test_the_command_line_takes_megatrons_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from fmoe.cli.main import main

    got = []
    monkeypatch.setattr("fmoe.train.launch.launch", lambda tc: got.append(tc) or 0)
    argv = ["train", "--recompute-granularity", "selective", "--recompute-modules", "moe", "shared_experts"]
    assert main(argv) == 0
    assert got[0].model().recompute == Recompute("selective", modules=("moe", "shared_experts"))
    assert main(["train", "--recompute-granularity", "full", "--recompute-method", "block",
                 "--recompute-num-layers", "2"]) == 0
    assert got[1].model().recompute == Recompute("full", num_layers=2)


def _ep_rank(rank: int, world: int) -> dict[str, list[float]]:
    out = {}
    for name, flags in {"none": {}, "full": CHOICES["full"],
                        "parts": {"recompute_granularity": "selective",
                                  "recompute_modules": ("moe", "shared_experts", "core_attn")}}.items():
        tc = TrainConfig(pp=1, ep=2, dp=1, steps=2, progress=False, **flags)
        trainer = Trainer(tc, World(rank, world, ParallelLayout(pp=1, ep=2, dp=1), torch.device("cpu")))
        metrics = [trainer.step() for _ in range(tc.steps)]
        out[name] = [m[k] for m in metrics for k in ("loss", "grad_norm")]
    return out


def test_expert_parallel_training_with_fb_overlap_is_unchanged_by_recompute() -> None:
    """Two ranks, ep 2, combined_1f1b with fb overlap (the executor defers the dw of recomputed phases):
    the losses and gradient norms of two steps equal the run without recompute."""
    for r in spawn(_ep_rank, 2, timeout_s=240):
        want = r.value["none"]
        for name in ("full", "parts"):
            assert r.value[name] == pytest.approx(want, rel=1e-5), (r.rank, name)


@pytest.mark.parametrize("fused", [True, False])
def test_a_recomputed_shared_expert_keeps_only_the_tokens_it_reads(fused, monkeypatch) -> None:
    """Selective recompute of the shared expert (a side phase of the dispatch, under remat) with the
    experts taking their rows over (`fused` False; True: fmoe.ops.local_experts, which makes no rows):
    the side phase is handed the tokens only (Phase.side_reads), so its remat does not keep the rows a
    later phase writes (it raised RecomputeError on them before), and the gradients are those of the run
    without recompute."""
    import fmoe.phases as phases
    from fmoe import GPTConfig, MoEConfig
    from fmoe.transforms.testing import assert_close

    monkeypatch.setattr("fmoe.ops._donate.ALWAYS_MAPPED_BYTES", 0)  # the experts take their rows over

    def grads(rc):
        cfg = GPTConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, n_kv_heads=2, recompute=rc,
                        moe=MoEConfig(d_model=8, d_ff=6, num_experts=4, top_k=2, num_shared_experts=1))
        params = init_gpt(cfg, torch.Generator().manual_seed(0), dtype=torch.float64)
        ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
        leaves = [v.detach().requires_grad_() for v in torch.utils._pytree.tree_leaves(params)]
        p = torch.utils._pytree.tree_unflatten(leaves, torch.utils._pytree.tree_structure(params))
        loss = gpt_loss(p, ids[:, :-1], ids[:, 1:], cfg)[0]
        return torch.autograd.grad(loss, leaves)

    if not fused:
        monkeypatch.setattr(phases, "local_experts_pay", lambda *a: False)
    for a, b in zip(grads(Recompute("selective", ("shared_experts",))), grads(Recompute())):
        assert_close(a, b)
