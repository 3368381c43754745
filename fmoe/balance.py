"""Load balancing: the auxiliary losses and the aux-loss-free expert-bias update.

Legend (the package's, docs/moe.md): T tokens, E experts, K top-k slots, B sequences (T = B * S),
S tokens per sequence.

All losses take fp32 (fp64) router quantities and return a differentiable scalar. `probs_TE` is the
full per-token score distribution (softmax scores, or sigmoid scores divided by their per-token sum)
and `counts_E` the number of (token, slot) pairs routed to each expert before any capacity drop.
With perfectly uniform routing (probs 1/E, counts T*K/E) both balance losses equal their coefficient.
Under tensor parallelism each rank routes an equal shard of the tokens: given a `TokenShard`, the losses
take the group's statistics, so every rank computes the one-process loss of all the tokens.
A loss whose coefficient is 0 is an exact 0 (`graph_zero`), not 0 * (a function of the data): a NaN or
an infinity in one token must not turn a switched-off loss into NaN (0 * NaN = NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenShard:
    """This rank's tokens as an equal shard of its tensor-parallel group's (each rank routes its own).

    total: the group's sum of a statistic, its gradient passed back unchanged (fmoe.parallel.tensor's
    reduce_from_tp); seq_ids_T: int64 [T] the sequence (0 .. num_seqs - 1) of each of this rank's tokens;
    num_tokens, num_seqs, seq_len: the group's T, B and S (T = B * S).
    """

    total: Callable[[torch.Tensor], torch.Tensor]
    seq_ids_T: torch.Tensor
    num_tokens: int
    num_seqs: int
    seq_len: int


def graph_zero(x_TX: torch.Tensor) -> torch.Tensor:
    """Return an exact 0 scalar of x's dtype that is on x's autograd graph (its gradient w.r.t. x is 0)
    without reading x's values: the sum of an empty slice. `x.sum() * 0` would be NaN for a NaN in x."""
    return x_TX[:0].sum()


def aux_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int, coef: float,
             shard: TokenShard | None = None) -> torch.Tensor:
    """Return coef * E * sum_e f_e * P_e: f_e = counts_E[e] / (T*K), P_e = mean_t probs_TE[t, e]
    (an exact 0 when coef is 0); with `shard`, T, the counts and the sums of probs are the group's."""
    T, E = probs_TE.shape
    if not coef:
        return graph_zero(probs_TE)
    if shard is None:
        f_E = counts_E.to(probs_TE.dtype) / max(T * top_k, 1)
        P_E = probs_TE.mean(0) if T else probs_TE.sum(0)
    else:
        T_all = shard.num_tokens
        f_E = shard.total(counts_E).to(probs_TE.dtype) / max(T_all * top_k, 1)
        P_E = shard.total(probs_TE.sum(0)) / max(T_all, 1)
    return coef * E * (f_E * P_E).sum()


def seq_aux_loss(probs_TE: torch.Tensor, ids_TK: torch.Tensor, seq_len: int, coef: float,
                 shard: TokenShard | None = None) -> torch.Tensor:
    """Return DeepSeek-V3's sequence-wise balance loss, averaged over the B = T / seq_len sequences.

    Per sequence: coef * sum_e f_e P_e with f_e = E / (K * S) * (tokens of the sequence choosing e) and
    P_e the mean over the sequence of probs_TE[:, e]. Tokens are sequence-major (t = b * S + s).
    With `shard`, the sequences are the group's (`seq_len` unused): each one's counts and sums of probs
    are summed over the ranks holding its tokens.
    An exact 0 when coef is 0; ValueError unless seq_len is a positive int dividing T.
    """
    T, E = probs_TE.shape
    K = ids_TK.shape[1]
    if shard is not None:
        if not coef:
            return graph_zero(probs_TE)
        B, S = shard.num_seqs, shard.seq_len
        counts_BE = torch.zeros(B, E, dtype=probs_TE.dtype, device=probs_TE.device).index_put(
            (shard.seq_ids_T.repeat_interleave(K), ids_TK.flatten()),
            torch.ones(T * K, dtype=probs_TE.dtype, device=probs_TE.device), accumulate=True)
        sums_BE = torch.zeros(B, E, dtype=probs_TE.dtype, device=probs_TE.device).index_add(
            0, shard.seq_ids_T, probs_TE)
        f_BE = shard.total(counts_BE) * (E / (K * S))
        P_BE = shard.total(sums_BE) / S
        return coef * (f_BE * P_BE).sum(1).mean()
    if seq_len <= 0 or T % seq_len:
        raise ValueError(f"seq_aux_loss: {T} tokens are not a whole number of sequences of {seq_len}")
    if not coef:
        return graph_zero(probs_TE)
    B = T // seq_len
    ids_BN = ids_TK.reshape(B, seq_len * K)
    # Out of place: vmap batches scatter_add, not its in-place form into an unbatched zeros.
    counts_BE = torch.zeros(B, E, dtype=probs_TE.dtype, device=probs_TE.device).scatter_add(
        1, ids_BN, torch.ones_like(ids_BN, dtype=probs_TE.dtype))
    f_BE = counts_BE * (E / (K * seq_len))
    P_BE = probs_TE.reshape(B, seq_len, E).mean(1)
    return coef * (f_BE * P_BE).sum(1).mean()


def z_loss(logits_TE: torch.Tensor, coef: float, shard: TokenShard | None = None) -> torch.Tensor:
    """Return coef * mean_t logsumexp(logits_TE[t])^2 (ST-MoE router z-loss); an exact 0 when coef is 0
    or there are no tokens. With `shard`, the mean over the group's tokens."""
    if logits_TE.shape[0] == 0 or not coef:
        return graph_zero(logits_TE)
    if shard is None:
        return coef * torch.logsumexp(logits_TE, dim=-1).square().mean()
    return coef * shard.total(torch.logsumexp(logits_TE, dim=-1).square().sum()) / shard.num_tokens


@torch.no_grad()
def update_expert_bias(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float) -> torch.Tensor:
    """Return bias_E + rate * sign(mean(counts_E) - counts_E): the aux-loss-free update (no gradient).

    Under-loaded experts are pushed up, over-loaded ones down; the bias changes selection only.
    """
    load_E = counts_E.to(bias_E.dtype)
    return bias_E + rate * torch.sign(load_E.mean() - load_E)


def max_over_mean(counts_E: torch.Tensor) -> torch.Tensor:
    """Return max(counts_E) / mean(counts_E) as a float tensor (1.0 = perfectly balanced; 0 if no load)."""
    load_E = counts_E.float()
    mean = load_E.mean()
    return torch.where(mean > 0, load_E.max() / mean.clamp(min=1e-12), torch.zeros_like(mean))
