"""Load balancing: the auxiliary losses and the aux-loss-free expert-bias update.

Legend (the package's, docs/moe.md): T tokens, E experts, K top-k slots, B sequences (T = B * S),
S tokens per sequence.

All losses take fp32 (fp64) router quantities and return a differentiable scalar. `probs_TE` is the
full per-token score distribution (softmax scores, or sigmoid scores divided by their per-token sum)
and `counts_E` the number of (token, slot) pairs routed to each expert before any capacity drop.
With perfectly uniform routing (probs 1/E, counts T*K/E) both balance losses equal their coefficient.
Under tensor parallelism each rank routes an equal shard of the tokens (its positions of every sequence):
given `total` (the group's sum, its gradient passed back unchanged) and `shards` (the group size), the
losses take the group's statistics, so every rank computes the one-process loss of all the tokens.
A loss whose coefficient is 0 is an exact 0 (`graph_zero`), not 0 * (a function of the data): a NaN or
an infinity in one token must not turn a switched-off loss into NaN (0 * NaN = NaN).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Sums a statistic over the ranks that hold the other shards of the tokens (tensor / sequence parallelism:
# fmoe.parallel.tensor.reduce_from_tp): the balancing losses are the group's, equal to one process's.
Total = Callable[[torch.Tensor], torch.Tensor]


def graph_zero(x_TX: torch.Tensor) -> torch.Tensor:
    """Return an exact 0 scalar of x's dtype that is on x's autograd graph (its gradient w.r.t. x is 0)
    without reading x's values: the sum of an empty slice. `x.sum() * 0` would be NaN for a NaN in x."""
    return x_TX[:0].sum()


def aux_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int, coef: float,
             total: Total | None = None, shards: int = 1) -> torch.Tensor:
    """Return coef * E * sum_e f_e * P_e: f_e = counts_E[e] / (T*K), P_e = mean_t probs_TE[t, e]
    (an exact 0 when coef is 0); with `total`, T, the counts and the sums of probs are the group's."""
    T, E = probs_TE.shape
    if not coef:
        return graph_zero(probs_TE)
    if total is None:
        f_E = counts_E.to(probs_TE.dtype) / max(T * top_k, 1)
        P_E = probs_TE.mean(0) if T else probs_TE.sum(0)
    else:
        T_all = T * shards
        f_E = total(counts_E).to(probs_TE.dtype) / max(T_all * top_k, 1)
        P_E = total(probs_TE.sum(0)) / max(T_all, 1)
    return coef * E * (f_E * P_E).sum()


def seq_aux_loss(probs_TE: torch.Tensor, ids_TK: torch.Tensor, seq_len: int, coef: float,
                 total: Total | None = None, shards: int = 1) -> torch.Tensor:
    """Return DeepSeek-V3's sequence-wise balance loss, averaged over the B = T / seq_len sequences.

    Per sequence: coef * sum_e f_e P_e with f_e = E / (K * S) * (tokens of the sequence choosing e) and
    P_e the mean over the sequence of probs_TE[:, e]. Tokens are sequence-major (t = b * S + s).
    With `total`, this rank holds seq_len of the S = shards * seq_len positions of every sequence, and
    each sequence's counts and sums of probs are the group's.
    An exact 0 when coef is 0; ValueError unless seq_len is a positive int dividing T.
    """
    T, E = probs_TE.shape
    K = ids_TK.shape[1]
    if seq_len <= 0 or T % seq_len:
        raise ValueError(f"seq_aux_loss: {T} tokens are not a whole number of sequences of {seq_len}")
    if not coef:
        return graph_zero(probs_TE)
    B = T // seq_len
    ids_BN = ids_TK.reshape(B, seq_len * K)
    counts_BE = torch.zeros(B, E, dtype=probs_TE.dtype, device=probs_TE.device)
    counts_BE.scatter_add_(1, ids_BN, torch.ones_like(ids_BN, dtype=probs_TE.dtype))
    if total is None:
        f_BE = counts_BE * (E / (K * seq_len))
        P_BE = probs_TE.reshape(B, seq_len, E).mean(1)
    else:
        S_all = seq_len * shards
        f_BE = total(counts_BE) * (E / (K * S_all))
        P_BE = total(probs_TE.reshape(B, seq_len, E).sum(1)) / S_all
    return coef * (f_BE * P_BE).sum(1).mean()


def z_loss(logits_TE: torch.Tensor, coef: float, total: Total | None = None, shards: int = 1) -> torch.Tensor:
    """Return coef * mean_t logsumexp(logits_TE[t])^2 (ST-MoE router z-loss); an exact 0 when coef is 0
    or there are no tokens. With `total`, the mean over the group's T * shards tokens."""
    if logits_TE.shape[0] == 0 or not coef:
        return graph_zero(logits_TE)
    if total is None:
        return coef * torch.logsumexp(logits_TE, dim=-1).square().mean()
    return coef * total(torch.logsumexp(logits_TE, dim=-1).square().sum()) / (logits_TE.shape[0] * shards)


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
