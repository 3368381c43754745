"""The model's outline (fmoe/outline.py) against the trees the model builds and an independent restatement:
every site named once, its params and state where init_gpt / init_gpt_state put them, chunks that cover
every site exactly once, and the param paths a chunk reads as the pipeline's ChunkSpec read them before
the outline existed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe import GPTConfig, MoEConfig, init_gpt, init_gpt_state
from fmoe.gpt_state import LayerLoad, update_gpt_state
from fmoe.layer import update_moe_state
from fmoe.outline import outline, reads_of, state_at, with_state_at
from fmoe.pipeline.cut import ChunkSpec
from fmoe.transforms.program import subtree


def _cfg(n_layers: int, dense: int, mtp: bool, bias: float = 0.1) -> GPTConfig:
    moe = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, bias_update_rate=bias)
    return GPTConfig(vocab_size=16, d_model=8, n_layers=n_layers, n_heads=2, num_dense_layers=dense, moe=moe,
                     mtp=mtp)


def _former_param_paths(cfg: GPTConfig, chunk: ChunkSpec) -> tuple[tuple[str, ...], ...]:
    """What ChunkSpec.param_paths returned before the outline (the oracle, written out)."""
    paths: list[tuple[str, ...]] = [("embed",)] if chunk.first else []
    paths += [("layers", str(i)) for i in chunk.layers]
    if chunk.head:
        paths += [("norm",), ("head",)]
    if chunk.last and cfg.mtp:
        paths += [("embed",), ("mtp",), ("head",)]
    return tuple(dict.fromkeys(paths))


@settings(max_examples=40, deadline=None)
@example(n_layers=1, dense=0, mtp=False)   # one MoE layer, nothing else
@example(n_layers=3, dense=3, mtp=False)   # every layer dense: no MoE site
@example(n_layers=2, dense=1, mtp=True)
@given(n_layers=st.integers(1, 5), dense=st.integers(0, 5), mtp=st.booleans())
def test_sites_are_where_the_model_puts_them(n_layers: int, dense: int, mtp: bool) -> None:
    cfg = _cfg(n_layers, min(dense, n_layers), mtp)
    o = outline(cfg)
    names = [s.name for s in o.sites]
    assert len(set(names)) == len(names)
    want_moe = [f"L{i}" for i in range(cfg.num_dense_layers, n_layers)] + (["MTP"] if mtp else [])
    assert [s.name for s in o.moe] == want_moe
    params, state = init_gpt(cfg, torch.Generator().manual_seed(0)), init_gpt_state(cfg)
    for i in range(n_layers):
        site = o.layer(i)
        assert site.layer == i and o.site(site.name) is site and o.at(site.params) is site
        assert subtree(params, site.params) is params["layers"][i]
        assert site.is_moe == (i >= cfg.num_dense_layers) == ("moe" in params["layers"][i])
    for site in o.moe:  # the state and the checkpoint key of every MoE site
        assert set(state_at(state, site)) == {"expert_bias_E"}
        assert "router" in subtree(params, site.params)["moe"]
        assert site.key == ("mtp" if site.name == "MTP" else f"layers.{site.layer}")
    assert {p[0] for s in o.sites for p in s.reads} == set(params)  # every top-level tree is read


@pytest.mark.parametrize("counts, mtp_alone", [((2, 1, 1), False), ((1, 3, 0), True), ((4,), False)])
@pytest.mark.parametrize("mtp", [False, True])
def test_chunks_cover_every_site_once_and_read_what_they_did(counts: tuple[int, ...], mtp_alone: bool,
                                                             mtp: bool) -> None:
    if mtp_alone and not mtp:
        return
    cfg = _cfg(4, 1, mtp)
    n, start, chunks = len(counts), 0, []
    for c, k in enumerate(counts):
        head = c == n - 2 if mtp_alone else c == n - 1
        chunks.append(ChunkSpec(c, tuple(range(start, start + k)), first=c == 0, last=c == n - 1, head=head))
        start += k
    seen = [s.name for ch in chunks for s in ch.sites(cfg)]
    assert sorted(seen) == sorted(s.name for s in outline(cfg).sites)
    for ch in chunks:
        assert ch.param_paths(cfg) == _former_param_paths(cfg, ch) == reads_of(ch.sites(cfg))


def test_unknown_sites_name_what_exists() -> None:
    o = outline(_cfg(2, 0, False))
    with pytest.raises(KeyError, match="no site 'MTP'; its sites are embed, L0, L1, head"):
        o.site("MTP")
    with pytest.raises(KeyError, match="no site of the model has its parameters at 'layers.7'"):
        o.at(("layers", "7"))
    with pytest.raises(IndexError, match="layers 0..1, not 2"):
        o.layer(2)


@settings(max_examples=25, deadline=None)
@example(seed=0, mtp=True)
@given(seed=st.integers(0, 2**16), mtp=st.booleans())
def test_one_state_move_is_update_moe_state_per_site(seed: int, mtp: bool) -> None:
    """update_gpt_state against a plain loop over the MoE layers with update_moe_state; sites without a
    load keep their state object, and the input state is not mutated."""
    cfg = _cfg(3, 1, mtp)
    state = init_gpt_state(cfg)
    g = torch.Generator().manual_seed(seed)
    loads = {}
    for site in outline(cfg).moe[::2]:  # every other MoE site reports a load
        tokens_E = torch.randint(0, 9, (4,), generator=g)
        loads[site.params] = LayerLoad(tokens_E, tokens_E.max(), False)
    new = update_gpt_state(cfg, state, loads)
    for i in range(3):
        path = ("layers", str(i))
        if path in loads:
            want = update_moe_state(state["layers"][i], cfg.moe, loads[path].tokens_per_expert_E,
                                    loads[path].max_load, False)
            assert torch.equal(new["layers"][i]["expert_bias_E"], want["expert_bias_E"])
        else:
            assert new["layers"][i] is state["layers"][i]
    if mtp:
        assert (new["mtp"] is state["mtp"]) == (("mtp", "block") not in loads)
    fresh = init_gpt_state(cfg)  # the input stays as it was
    assert all(torch.equal(a["expert_bias_E"], b["expert_bias_E"]) for a, b in zip(state["layers"][1:],
                                                                                  fresh["layers"][1:]))
    moved = with_state_at(state, outline(cfg).site("L1"), {"expert_bias_E": torch.ones(4)})
    assert torch.equal(state_at(moved, outline(cfg).site("L1"))["expert_bias_E"], torch.ones(4))
    assert state_at(state, outline(cfg).site("L1")) is state["layers"][1]
