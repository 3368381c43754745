"""Documents packed into sequences (fmoe/packing.py: --reset-position-ids, --reset-attention-mask,
--eod-mask-loss) against independent oracles, fp64:
- the packing record against megatron-core's own `_get_ltor_masks_and_position_ids`, row by row;
- MTP's targets against a plain loop of Megatron's rolls (the loss mask rolled, and with documents
  separated the packed-sequence roll that never crosses a document);
- the model: a packed batch's loss and every gradient equal to each document run alone as its own
  sequence through the one-process model (`_alone`: plain `gpt_loss` calls on the slices, weighted by
  their targets), GQA and MLA, MTP on, under tape autograd and torch.func;
- the same equality under tp 2 with sequence parallelism, a pp 2 pipeline (1F1B: the documents travel in
  the microbatch's meta, the generic way every schedule hands it to its stages), ep 2 and cp 2 (ring and
  all-gather), all in one spawn of 2 gloo ranks (tests/test_packing_ranks.py's functions).

Legend: B sequences, S positions, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from dist_utils import spawn
from hypothesis import example, given, settings
from hypothesis import strategies as st
from packing_oracle import DT, EOD, S, alone, cfg_of, packed, windows

from fmoe.packing import mtp_targets, pack_documents
from fmoe.transforms.testing import assert_close

with warnings.catch_warnings():  # megatron-core warns that Transformer Engine and Apex are absent
    warnings.simplefilter("ignore")
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

rows = st.lists(st.lists(st.booleans(), min_size=S + 1, max_size=S + 1), min_size=2, max_size=2)
ONE_DOC = [[False] * (S + 1)] * 2
EDGES = [[True] + [False] * (S - 2) + [True, False], [False, True, True] + [False] * (S - 2)]


@settings(max_examples=30)
@given(ids=st.lists(st.integers(0, 5), min_size=1, max_size=12), flags=st.tuples(*[st.booleans()] * 3))
@example(ids=[5], flags=(True, True, True))  # one EOD alone
@example(ids=[5, 5, 1, 5], flags=(True, True, True))  # EODs at the start and the end, one after another
def test_packing_is_megatrons_masks_and_positions(ids: list[int], flags: tuple[bool, ...]) -> None:
    reset_pos, reset_attn, mask_loss = flags
    ids_S = torch.tensor(ids)
    got = pack_documents(ids_S[None], 5, reset_position_ids=reset_pos, reset_attention_mask=reset_attn,
                         eod_mask_loss=mask_loss)
    if not any(flags):
        assert got is None
        return
    masked_11SS, loss_mask_S, positions_S = _get_ltor_masks_and_position_ids(ids_S, 5, reset_pos, reset_attn,
                                                                             mask_loss, True)
    arange_S = torch.arange(len(ids))
    assert torch.equal(positions_S, arange_S if got.positions_BS is None else got.positions_BS[0])
    assert torch.equal(loss_mask_S > 0, torch.ones(len(ids), dtype=torch.bool) if got.loss_mask_BS is None
                       else got.loss_mask_BS[0])
    causal_SS = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    same_SS = (torch.ones_like(causal_SS) if got.segments_BS is None
               else got.segments_BS[0][:, None] == got.segments_BS[0][None, :])
    assert torch.equal(~masked_11SS[0], causal_SS & same_SS)


@settings(max_examples=30)
@given(ids=st.lists(st.integers(0, 3), min_size=2, max_size=10), reset_attn=st.booleans())
@example(ids=[3, 3, 3], reset_attn=True)
def test_mtp_targets_roll_the_loss_mask_and_stay_in_their_document(ids: list[int], reset_attn: bool) -> None:
    """Megatron's MTP: labels and loss mask rolled one left, the last position 0; packed sequences roll
    within each document (multi_token_prediction._roll_tensor_packed_seq), so a document's last position
    takes no MTP loss."""
    ids_S = torch.tensor(ids)
    targets_S = torch.tensor(ids[1:] + [2]) + 10  # tokens as targets are: never -100
    packing = pack_documents(ids_S[None], 3, reset_attention_mask=reset_attn, eod_mask_loss=True)
    loss_mask = [t != 3 for t in ids]
    doc = [sum(t == 3 for t in ids[:i]) for i in range(len(ids))]
    want = []
    for i in range(len(ids)):
        inside = i + 1 < len(ids) and (not reset_attn or doc[i + 1] == doc[i])
        want.append(int(targets_S[i + 1]) if inside and loss_mask[i + 1] else -100)
    assert mtp_targets(targets_S[None], packing)[0].tolist() == want


@settings(max_examples=8, deadline=None)
@given(eods=rows, kind=st.sampled_from(["gqa", "mla"]), engine=st.sampled_from(["tape", "func"]),
       reset_positions=st.booleans(), mask_loss=st.booleans())
@example(eods=ONE_DOC, kind="gqa", engine="func", reset_positions=True, mask_loss=True)  # one document
@example(eods=EDGES, kind="gqa", engine="tape", reset_positions=True, mask_loss=True)  # EOD first and last,
@example(eods=EDGES, kind="mla", engine="func", reset_positions=False, mask_loss=True)  # length-1 documents
def test_packed_documents_equal_each_document_alone(eods: list[list[bool]], kind: str, engine: str,
                                                    reset_positions: bool, mask_loss: bool) -> None:
    """The loss and every gradient of a packed batch (--reset-attention-mask, with or without
    --reset-position-ids: RoPE's relative angles make the two agree within a document; --eod-mask-loss
    or not) equal those of its documents run alone, weighted by their targets; MTP included."""
    cfg = cfg_of(kind)
    params, ids, targets = windows(cfg, eods)
    want_loss, want = alone(params, ids, targets, cfg, mask_loss)
    got_loss, got = packed(params, ids, targets, cfg, dict(reset_position_ids=reset_positions,
                                                           reset_attention_mask=True,
                                                           eod_mask_loss=mask_loss), engine)
    assert_close(got_loss, want_loss, dtype=DT, msg="loss")
    assert_close(got, want, dtype=DT, msg="grads")


def test_documents_change_the_model_only_where_they_say() -> None:
    """The flags do something (a check that can fail): packed attention differs from attention across
    the documents; --reset-position-ids alone (attention across documents) differs from no flag; and a
    custom attention, which takes no documents, is refused in one line."""
    cfg = cfg_of("gqa")
    params, ids, targets = windows(cfg, EDGES)
    plain, _ = packed(params, ids, targets, cfg, {}, "tape")
    across, _ = packed(params, ids, targets, cfg, {"reset_position_ids": True}, "tape")
    within, _ = packed(params, ids, targets, cfg, {"reset_attention_mask": True}, "tape")
    assert abs(float(plain - across)) > 1e-6 and abs(float(plain - within)) > 1e-6
    custom = dataclasses.replace(cfg, attention="fmoe.ops:attention")
    with pytest.raises(ValueError, match="custom attention"):
        packed(params, ids, targets, custom, {"reset_attention_mask": True}, "tape")
    assert EOD == cfg.vocab_size - 1


def test_every_layout_equals_each_document_alone() -> None:
    """tp 2 + sp (experts over the pair; GQA and MLA), pp 2 (1F1B, two microbatches), ep 2 (each rank its
    own sequence) and cp 2 (p2p and all_gather): each rank's loss and gradients (summed over the ranks that
    split them) equal the documents-alone oracle's, fp64, MTP and --eod-mask-loss on."""
    from packing_oracle import layouts_rank

    for r in spawn(layouts_rank, 2, timeout_s=240):  # a rank's failed check fails the spawn, naming it
        assert r.value == ["tp2+sp gqa", "tp2+sp mla", "cp2 p2p", "cp2 all_gather", "ep2", "pp2"]


def test_fmoe_train_refuses_document_flags_without_documents_before_launch(tmp_path) -> None:
    """Each document flag needs --data-path's documents and a tokenizer naming the EOD, and fmoe's attention:
    refused in one line naming the flag; with them (and --mtp) the config passes."""
    import numpy as np

    from fmoe.train.config import TrainConfig
    from fmoe.train.indexed import IndexedWriter

    prefix = str(tmp_path / "docs")
    with IndexedWriter(prefix, np.uint16) as w:
        for _ in range(40):
            w.add_document([1, 2, 3, 63], [4])
    data = {"pp": 1, "ep": 1, "data_path": (prefix,), "tokenizer_type": "NullTokenizer", "vocab_size": 64,
            "seq_length": 8}
    for flag in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
        name = "--" + flag.replace("_", "-")
        bad = TrainConfig(pp=1, ep=1, **{flag: True}).problem()
        assert name in bad and "--tokenizer-type" in bad and "\n" not in bad
        bad = TrainConfig(pp=1, ep=1, tokenizer_type="NullTokenizer", **{flag: True}).problem()
        assert name in bad and "--data-path" in bad
        assert TrainConfig(**data, mtp=True, **{flag: True}).problem() is None
    bad = TrainConfig(**data, reset_attention_mask=True, attention="fmoe.ops:attention").problem()
    assert "--reset-attention-mask with --attention" in bad


@pytest.mark.parametrize("kind, modules", [("gqa", ("core_attn", "layernorm")), ("mla", ("mla_up_proj",))])
def test_recomputed_attention_keeps_the_documents(kind: str, modules: tuple[str, ...]) -> None:
    """Selective recompute replays the attention with the same documents: its loss and gradients equal the
    run that keeps the activations."""
    from fmoe.recompute import Recompute

    cfg = cfg_of(kind)
    params, ids, targets = windows(cfg, EDGES)
    flags = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}
    kept = packed(params, ids, targets, cfg, flags, "func")
    again = packed(params, ids, targets, dataclasses.replace(cfg, recompute=Recompute("selective",
                                                                                      modules=modules)),
                   flags, "func")
    assert_close(again[0], kept[0], dtype=DT, msg="loss")
    assert_close(again[1], kept[1], dtype=DT, msg="grads")
