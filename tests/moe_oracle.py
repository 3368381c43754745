"""The independent loop oracle of the MoE layer (test-only): one token, one slot, one expert at a time.

Legend: T tokens, D model width, F expert width, E experts, K experts per token.

It follows the semantics documented in fmoe/config.py and fmoe/balance.py written out as plain python
loops over scalar-sized tensor ops in float64 (tape autograd gives its gradients). It imports nothing
from fmoe: selection is python `sorted` (stable: ties go to the lowest expert / group index), capacity
is a per-expert list, the layout (drop-and-pad included) is a list of pair indices built expert by
expert, dynamic capacity replays the documented forecast on a python list, combine is an accumulation.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import torch


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def _silu(v: torch.Tensor) -> torch.Tensor:
    return v / (1 + torch.exp(-v))


def _swiglu_row(h_D: torch.Tensor, w_gate_DF: torch.Tensor, w_up_DF: torch.Tensor) -> torch.Tensor:
    return _silu(h_D @ w_gate_DF) * (h_D @ w_up_DF)


def oracle_route(w_DE: torch.Tensor, x_TD: torch.Tensor, cfg: Any, bias_E: list[float] | None,
                 seq_len: int | None) -> dict[str, Any]:
    """Per-token routing; returns ids (list of lists), probs (list of lists of 0-d tensors), losses."""
    T, E, K = x_TD.shape[0], cfg.num_experts, cfg.top_k
    ids, probs, dists, lses = [], [], [], []
    for t in range(T):
        logits = [x_TD[t] @ w_DE[:, e] for e in range(E)]
        if cfg.score_func == "softmax":
            m = max(float(v.detach()) for v in logits)
            ex = [torch.exp(v - m) for v in logits]
            z = sum(ex)
            scores = [v / z for v in ex]
            dist = scores
        else:
            scores = [1 / (1 + torch.exp(-v)) for v in logits]
            z = sum(scores)
            dist = [s / z for s in scores]
        m = max(float(v.detach()) for v in logits)
        lses.append(m + torch.log(sum(torch.exp(v - m) for v in logits)))
        shift = bias_E if bias_E is not None else [0.0] * E
        choice = [float(s.detach()) + shift[e] for e, s in enumerate(scores)]
        allowed = set(range(E))
        if cfg.num_groups > 1 and cfg.topk_groups < cfg.num_groups:
            size = E // cfg.num_groups
            gscore = []
            for g in range(cfg.num_groups):
                members = sorted((choice[e] for e in range(g * size, (g + 1) * size)), reverse=True)
                gscore.append((sum(members[:min(2, size)]), g))
            best = sorted(gscore, key=lambda p: -p[0])[:cfg.topk_groups]
            allowed = {e for _, g in best for e in range(g * size, (g + 1) * size)}
        chosen = sorted(sorted(allowed), key=lambda e: -choice[e])[:K]
        p = [scores[e] for e in chosen]
        if cfg.topk_norm == "after":
            s = sum(p)
            p = [v / s for v in p]
        p = [v * cfg.topk_scale for v in p]
        ids.append(chosen)
        probs.append(p)
        dists.append(dist)
    counts = [sum(row.count(e) for row in ids) for e in range(E)]
    zero = w_DE.sum() * 0
    aux = zero
    if cfg.aux_loss_coef:
        for e in range(E):
            f = counts[e] / (T * K)
            P = sum(d[e] for d in dists) / T
            aux = aux + cfg.aux_loss_coef * E * f * P
    seq_aux = zero
    if cfg.seq_aux_loss_coef:
        S = seq_len or T
        B = T // S
        for b in range(B):
            rows = range(b * S, (b + 1) * S)
            for e in range(E):
                f = E / (K * S) * sum(ids[t].count(e) for t in rows)
                P = sum(dists[t][e] for t in rows) / S
                seq_aux = seq_aux + cfg.seq_aux_loss_coef * f * P / B
    z = zero
    if cfg.z_loss_coef:
        z = cfg.z_loss_coef * sum(v * v for v in lses) / T
    return {"ids": ids, "probs": probs, "counts": counts, "losses": {"aux": aux, "seq_aux": seq_aux, "z": z}}


def _ceil_times(factor: float, *ints: int, divisor: int = 1) -> int:
    """ceil(factor * prod(ints) / divisor) with the factor taken as the decimal it was written as."""
    prod = Decimal(repr(factor))
    for v in ints:
        prod *= v
    q, r = divmod(prod, divisor)
    return int(q) + (r > 0)


def oracle_capacity(cfg: Any, T: int, counts: list[int],
                    state: dict[str, Any] | None) -> tuple[int | None, bool | None, dict[str, list[int]]]:
    """Return (C, missed, new dynamic state as python lists): C None when dropless without padding."""
    if cfg.capacity_factor is not None:
        return _ceil_times(cfg.capacity_factor, T, cfg.top_k, divisor=cfg.num_experts), None, {}
    if not cfg.dynamic_capacity_window:
        return None, None, {}
    W = cfg.dynamic_capacity_window
    state = state or {}
    history = [int(v) for v in state["load_history_W"]] if "load_history_W" in state else [0] * W
    misses = int(state.get("capacity_misses", 0))
    steps = int(state.get("capacity_steps", 0))
    peak = max(counts) if counts else 0
    C = _ceil_times(cfg.dynamic_capacity_margin, max(history))
    missed = peak > C
    if missed:
        C = peak
    return C, missed, {"load_history_W": history[1:] + [peak], "capacity_misses": misses + missed,
                       "capacity_steps": steps + 1}


def oracle_keep(ids: list[list[int]], probs: list[list[torch.Tensor]], cfg: Any,
                T: int) -> set[tuple[int, int]]:
    """The (t, k) pairs that survive the capacity rule (ties in gate weight: earlier token first)."""
    pairs = [(t, k) for t in range(T) for k in range(len(ids[t]))]
    if cfg.capacity_factor is None:
        return set(pairs)
    C = _ceil_times(cfg.capacity_factor, T, cfg.top_k, divisor=cfg.num_experts)
    keep = set()
    for e in range(cfg.num_experts):
        mine = [(t, k) for (t, k) in pairs if ids[t][k] == e]  # token order
        if cfg.drop_policy == "probs":
            mine = sorted(mine, key=lambda tk: -float(probs[tk[0]][tk[1]].detach()))
        keep.update(mine[:C])
    return keep


def oracle_rows(ids: list[list[int]], keep: set[tuple[int, int]], cfg: Any, T: int,
                capacity: int | None) -> list[int]:
    """The layout: pair index t * K + k of each row, expert by expert, kept pairs in token order; in the
    padded modes (pad_to_capacity, dynamic capacity) each expert has exactly `capacity` rows, the padding
    rows marked T * K."""
    K = cfg.top_k
    padded = cfg.pad_to_capacity or bool(cfg.dynamic_capacity_window)
    rows = []
    for e in range(cfg.num_experts):
        mine = [t * K + k for t in range(T) for k in range(K) if ids[t][k] == e and (t, k) in keep]
        rows += mine
        if padded:
            rows += [T * K] * (capacity - len(mine))
    return rows


def oracle_moe(params: dict[str, Any], x_TD: torch.Tensor, cfg: Any, state: dict[str, Any] | None = None,
               seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Return (y_TD, loss, info) in float64 from float64 leaves of `params` and `x_TD`.

    info: ids, counts (load before drops), dropped (pairs), losses, capacity (C or None), missed
    (dynamic capacity, else None), rows (the layout, see oracle_rows), capacity_state (dynamic entries
    of the next state), overloaded (max load > remat_load_scale * mean load), new_bias (list, when
    a bias is in state).
    """
    T = x_TD.shape[0]
    bias = None
    if state and "expert_bias_E" in state:
        bias = [float(v) for v in state["expert_bias_E"]]
    r = oracle_route(params["router"]["w"], x_TD, cfg, bias, seq_len)
    keep = oracle_keep(r["ids"], r["probs"], cfg, T)
    capacity, missed, capacity_state = oracle_capacity(cfg, T, r["counts"], state)
    ex = params["experts"]
    rows = []
    for t in range(T):
        acc = x_TD[t] * 0
        for k, e in enumerate(r["ids"][t]):
            if (t, k) not in keep:
                continue
            F = ex["w_down"].shape[1]  # w_gate_up [E, D, 2F]: the gate's columns, then the up's
            a = _swiglu_row(x_TD[t], ex["w_gate_up"][e][:, :F], ex["w_gate_up"][e][:, F:])
            if cfg.probs_in_expert:
                acc = acc + (a * r["probs"][t][k]) @ ex["w_down"][e]
            else:
                acc = acc + r["probs"][t][k] * (a @ ex["w_down"][e])
        if "shared" in params:
            sh = params["shared"]
            s = _swiglu_row(x_TD[t], sh["w_gate"], sh["w_up"]) @ sh["w_down"]
            if "w_out_gate" in sh:
                s = s * (1 / (1 + torch.exp(-(x_TD[t] @ sh["w_out_gate"][:, 0]))))
            acc = acc + s
        rows.append(acc)
    y_TD = torch.stack(rows) if rows else x_TD * 0
    loss = r["losses"]["aux"] + r["losses"]["seq_aux"] + r["losses"]["z"]
    total = sum(r["counts"])
    info = {"ids": r["ids"], "counts": r["counts"], "dropped": T * cfg.top_k - len(keep),
            "losses": r["losses"], "capacity": capacity, "missed": missed, "capacity_state": capacity_state,
            "rows": oracle_rows(r["ids"], keep, cfg, T, capacity),
            "overloaded": total > 0 and max(r["counts"]) > cfg.remat_load_scale * total / cfg.num_experts}
    if bias is not None:
        mean = sum(r["counts"]) / cfg.num_experts
        rate = cfg.bias_update_rate
        info["new_bias"] = [b + rate * ((mean > c) - (mean < c)) for b, c in zip(bias, r["counts"])]
    return y_TD, loss, info
