"""Sharded initialisation (fmoe/gpt_init.py): a rank's share drawn alone equals the same part of the whole
model, every layout gets the same weights, and a rank's peak memory is its share's, not the model's.

Oracles: the whole tree `init_gpt` draws, cut by `fmoe.tp_layout.shard_gpt` (tensor parallelism's table)
and by plain slicing of the expert rows; the drawing distribution against its definition (N(0, 1/fan_in),
the embedding's N(0, 0.02^2), ones for norms); memory by torch.profiler's allocation events
(`tracked_peak_bytes`), not by timing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.config import GPTConfig, MoEConfig
from fmoe.gpt_init import gpt_spec, init_gpt_shard, leaf_units
from fmoe.init import init_of, init_seed
from fmoe.model import init_gpt
from fmoe.tp_layout import shard_gpt
from fmoe.train.shards import key_of
from fmoe.transforms.testing import tracked_peak_bytes


def _cfg(heads: int = 4, kv: int = 2, ffn: int = 8, vocab: int = 16, experts: int = 4, mtp: bool = True,
         dense: int = 1, layers: int = 3, shared: int = 1) -> GPTConfig:
    moe = MoEConfig(d_model=8, d_ff=4, num_experts=experts, top_k=min(2, experts), num_shared_experts=shared)
    return GPTConfig(vocab_size=vocab, d_model=8, n_layers=layers, n_heads=heads, n_kv_heads=kv, head_dim=2,
                     moe=moe, num_dense_layers=dense, d_ff_dense=ffn, mtp=mtp, qk_norm=True)


def _leaves(tree: object, where: tuple = ()) -> dict[str, torch.Tensor]:
    if isinstance(tree, dict):
        return {k: v for name, sub in tree.items() for k, v in _leaves(sub, (*where, name)).items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _leaves(sub, (*where, i)).items()}
    return {key_of(where): tree}


def _expected_share(whole: dict, cfg: GPTConfig, tp: tuple[int, int], experts: tuple[int, int]) -> dict:
    """The oracle: the whole tree cut by shard_gpt (tp) and by slicing expert rows."""
    cut = shard_gpt(whole, cfg, *tp) if tp[1] > 1 else whole
    L = cfg.moe.num_experts // experts[1]
    rows = slice(experts[0] * L, (experts[0] + 1) * L)
    return {k: (v[rows] if ".moe.experts." in k else v) for k, v in _leaves(cut).items()}


@settings(max_examples=12)
@given(heads=st.sampled_from([2, 4]), ffn=st.sampled_from([4, 8]), vocab=st.sampled_from([8, 12]),
       experts=st.sampled_from([1, 2, 4]), mtp=st.booleans(), dense=st.integers(0, 2),
       tp=st.sampled_from([1, 2]), data=st.data())
@example(heads=2, ffn=4, vocab=8, experts=1, mtp=False, dense=0, tp=1, data=None)  # one expert, one rank
@example(heads=4, ffn=8, vocab=12, experts=4, mtp=True, dense=2, tp=2, data=None)  # all layers dense
def test_a_shard_drawn_alone_equals_that_part_of_the_whole_model(
        heads: int, ffn: int, vocab: int, experts: int, mtp: bool, dense: int, tp: int,
        data: st.DataObject | None) -> None:
    cfg = _cfg(heads=heads, kv=2, ffn=ffn, vocab=vocab, experts=experts, mtp=mtp, dense=dense)
    sizes = [n for n in (1, 2, 4) if experts % n == 0]  # the expert group's size (ep x tp in a layout)
    if data is None:  # the examples: the last rank of the largest group
        expert_size = sizes[-1]
        tp_rank, expert_rank = tp - 1, expert_size - 1
    else:
        expert_size = data.draw(st.sampled_from(sizes))
        tp_rank, expert_rank = data.draw(st.integers(0, tp - 1)), data.draw(st.integers(0, expert_size - 1))
    g = torch.Generator().manual_seed(11)
    whole = init_gpt(cfg, g.clone_state(), torch.float64)
    mine = init_gpt_shard(cfg, init_seed(g), torch.float64, tp=(tp_rank, tp),
                          experts=(expert_rank, expert_size))
    got, want = _leaves(mine), _expected_share(whole, cfg, (tp_rank, tp), (expert_rank, expert_size))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == torch.float64 and torch.equal(got[k], want[k]), k


def test_the_tp_ranks_shares_put_back_together_are_the_one_process_model() -> None:
    cfg = _cfg()
    seed = 5
    whole = _leaves(init_gpt_shard(cfg, seed))
    parts = [_leaves(init_gpt_shard(cfg, seed, tp=(r, 2), experts=(r, 2))) for r in range(2)]
    spec = gpt_spec(cfg)
    for key, w in whole.items():
        where = tuple(int(k) if k.isdigit() else k for k in key.split("."))
        cut = leaf_units(cfg, where)
        if cut is None:
            assert all(torch.equal(p[key], w) for p in parts), key  # replicated: every rank the same
        else:
            assert torch.equal(torch.cat([p[key] for p in parts], dim=cut[0].axis), w), key
    assert _leaves(spec).keys() == whole.keys()


def test_draws_follow_their_definition_and_units_are_independent() -> None:
    cfg = _cfg(heads=8, kv=8, ffn=64, vocab=64, experts=8)
    params = init_gpt_shard(cfg, 3)
    spec = _leaves(gpt_spec(cfg))
    for key, t in _leaves(params).items():
        kind, value = init_of(spec[key])
        if kind == "fill":
            assert torch.equal(t, torch.ones_like(t)), key
            assert key.endswith("norm"), key
    table, w_up = params["embed"]["table"], params["layers"][0]["mlp"]["w_up"]
    assert abs(table.std().item() - 0.02) < 0.004
    assert abs(w_up.std().item() - cfg.d_model ** -0.5) < 0.08
    experts = params["layers"][1]["moe"]["experts"]["w_gate_up"]
    assert not torch.equal(experts[0], experts[1])  # each expert its own seed
    assert not torch.equal(table[0], table[1])
    assert not torch.equal(params["layers"][1]["w_q"], params["layers"][2]["w_q"])  # each layer its own key
    assert not torch.equal(init_gpt_shard(cfg, 4)["head"]["w"], params["head"]["w"])  # the seed matters


def test_leaves_of_other_stages_stay_meta_and_bad_shares_are_refused() -> None:
    cfg = _cfg()
    mine = _leaves(init_gpt_shard(cfg, 1, holds=[("embed",), ("layers", "0")]))
    for key, t in mine.items():
        held = key.startswith("embed.") or key.startswith("layers.0.")
        assert t.is_meta != held, key
    with pytest.raises(ValueError, match="do not split over 3 tp ranks"):
        init_gpt_shard(cfg, 1, tp=(0, 3))
    with pytest.raises(ValueError, match="experts|units"):
        init_gpt_shard(cfg, 1, experts=(0, 3))


def test_a_ranks_peak_memory_at_initialisation_is_its_share() -> None:
    """tp 2 x expert group 4 x half the stages: the rank holds about a tenth of the model, and its
    initialisation's peak allocation is what it keeps plus a few units' draws, not the model."""
    cfg = _cfg(heads=8, kv=4, ffn=256, vocab=512, experts=8, layers=4, dense=1)
    cfg = GPTConfig(**{**cfg.__dict__, "d_model": 64,
                       "moe": MoEConfig(d_model=64, d_ff=32, num_experts=8, top_k=2, num_shared_experts=1)})
    holds = [("layers", "2"), ("layers", "3"), ("mtp",), ("norm",), ("head",), ("embed",)]
    share, peak_share = tracked_peak_bytes(
        lambda: init_gpt_shard(cfg, 1, tp=(1, 2), experts=(3, 4), holds=holds))
    whole, peak_whole = tracked_peak_bytes(lambda: init_gpt_shard(cfg, 1))
    kept = sum(t.numel() * t.element_size() for t in _leaves(share).values() if not t.is_meta)
    total = sum(t.numel() * t.element_size() for t in _leaves(whole).values())
    unit = 64 * 32 * 4  # the largest unit drawn: one expert's [D, F] in fp32
    assert total <= peak_whole <= total + 2 * unit + 4096  # the tracker sees the whole model's draw
    assert kept <= peak_share <= kept + 2 * unit + 4096
    assert kept < 0.35 * total
