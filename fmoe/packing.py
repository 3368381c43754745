"""Documents packed into one sequence: where each begins, and what the model does at the seams.

    packing = pack_documents(ids_BS, eod, reset_position_ids=True, reset_attention_mask=True,
                             eod_mask_loss=True)             # None when no flag is set
    loss, aux = gpt_loss(params, ids_BS, targets_BS, cfg, packing=packing)

Legend (the package's, docs/moe.md): B sequences, S positions.

A sample of the training stream holds several documents back to back, each ended by the EOD token
(fmoe/train/documents.py). Megatron's get_ltor_masks_and_position_ids reads them from the input ids: a
document ends at an EOD (which belongs to it) and the next begins at the position after. Three switches,
each as Megatron's flag of that name:
- reset_position_ids: RoPE's positions restart at 0 at each document's first token (`positions_BS`);
- reset_attention_mask: a token attends to the earlier tokens of its own document only (`segments_BS`, the
  document index of each position: query i sees key j iff j <= i and segments[i] == segments[j]);
- eod_mask_loss: no loss on the target of an EOD position, the next document's first token
  (`loss_mask_BS`), while the targets themselves stay tokens (MTP embeds them).
With all three, every document's loss and gradients are those of the document run alone as its own
sequence (tests/test_packing.py). MTP (`mtp_targets`) predicts token i+2 at position i: its target i takes
loss where the main target i+1 does (Megatron's rolled loss mask) and, with documents separated, where
positions i and i+1 are of one document (Megatron's packed-sequence roll: it never crosses a document).

Everything is computed from ids on their device with no host sync; a record stays whole-sequence [B, S]
under every parallelism (tp, sp, pp, ep: every stage's microbatch meta carries it; context parallelism
takes each rank's positions of it where it is read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fmoe.parallel.tensor import IGNORE_INDEX


@dataclass(frozen=True, eq=False)
class Packing:
    """How one microbatch's sequences hold documents (module docstring); every field int64 / bool [B, S]
    or None (None: positions 0..S-1, attention across documents, a loss on every target)."""

    positions_BS: torch.Tensor | None = None
    segments_BS: torch.Tensor | None = None
    loss_mask_BS: torch.Tensor | None = None

    def targets(self, targets_BS: torch.Tensor) -> torch.Tensor:
        """The main loss's targets: `targets_BS` with IGNORE_INDEX where the loss mask is False."""
        if self.loss_mask_BS is None:
            return targets_BS
        return targets_BS.masked_fill(~self.loss_mask_BS, IGNORE_INDEX)


def pack_documents(ids_BS: torch.Tensor, eod: int, *, reset_position_ids: bool = False,
                   reset_attention_mask: bool = False, eod_mask_loss: bool = False) -> Packing | None:
    """Returns the `Packing` of input ids [B, S] whose documents end at token `eod` (Megatron's
    get_ltor_masks_and_position_ids, batched), or None when no switch is set."""
    if not (reset_position_ids or reset_attention_mask or eod_mask_loss):
        return None
    if ids_BS.dim() != 2:
        raise ValueError(f"pack_documents: ids must be [B, S], got {tuple(ids_BS.shape)}")
    is_eod_BS = ids_BS == eod
    segments_BS = positions_BS = None
    if reset_attention_mask:
        # the EODs strictly before each position: the document index (an EOD ends its own document)
        segments_BS = (is_eod_BS.long().cumsum(1) - is_eod_BS.long())
    if reset_position_ids:
        S = ids_BS.shape[1]
        i_BS = torch.arange(S, device=ids_BS.device).expand_as(ids_BS)
        # a document starts after an EOD: the latest such start at or before each position, by a running max
        after_BS = torch.zeros_like(i_BS)
        after_BS[:, 1:] = torch.where(is_eod_BS[:, :-1], i_BS[:, 1:], 0)
        positions_BS = i_BS - after_BS.cummax(1).values
    return Packing(positions_BS=positions_BS, segments_BS=segments_BS,
                   loss_mask_BS=~is_eod_BS if eod_mask_loss else None)


def mtp_targets(targets_BS: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
    """Returns MTP's targets [B, S]: token i+2 at position i (targets[:, i+1]); IGNORE_INDEX at the last
    position (no token S+1 in the window), where the main target i+1 takes no loss, and, with documents
    separated, at each document's last position (module docstring)."""
    later_BS = torch.cat([targets_BS[:, 1:], targets_BS.new_full((targets_BS.shape[0], 1), IGNORE_INDEX)], 1)
    if packing is None:
        return later_BS
    keep_BS = torch.ones_like(later_BS, dtype=torch.bool)
    if packing.loss_mask_BS is not None:
        keep_BS[:, :-1] = packing.loss_mask_BS[:, 1:]
    if packing.segments_BS is not None:
        keep_BS[:, :-1] &= packing.segments_BS[:, 1:] == packing.segments_BS[:, :-1]
    return later_BS.masked_fill(~keep_BS, IGNORE_INDEX)


def visible(segments_q: torch.Tensor, segments_k: torch.Tensor) -> torch.Tensor:
    """Returns bool [..., s, t]: query q and key k of one document (the document mask; causality is the
    caller's), from the document indices of the queries [..., s] and of the keys [..., t]."""
    return segments_q.unsqueeze(-1) == segments_k.unsqueeze(-2)
