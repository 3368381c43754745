"""Context parallelism: one sequence split over the N ranks of a cp group, attention across the split.

    pos_s = cp_positions(S, rank, N)                        # this rank's positions of the sequence
    x_BsD = take_positions(x_BSD, pos_s)                    # its part of any [B, S, ...] tensor
    o_BsHd = cp_attention(q_BsHd, k_BsGd, v_BsGd, pos_s, cp, rope_theta=..., kind="p2p")

Legend (the package's, docs/moe.md): B sequences, S the whole sequence's positions, N cp ranks,
C = S / 2N positions per chunk, s = S / N this rank's positions (two chunks), t a key block's positions,
H query heads, G key/value heads, d the query / key head dim, e the value head dim (d for GQA; MLA's
values have their own width, its queries and keys a RoPE part, rotated by the caller: `rotated=True`).

Causal load balancing (Megatron-core, Transformer Engine): the sequence is cut into 2N chunks and rank r
holds chunks r and 2N-1-r, so under the causal mask every rank has as many (query, key) pairs to attend.

Two exact forms of attention over the split, each on keys and values rotated by RoPE at their true
positions (a key block travels with its own rotation):
- "p2p" (ring attention): N steps; at step i this rank holds the keys and values of rank r - i, sends
  them on to rank r + 1 while it attends to them, and merges each block's softmax into the running one
  by its log-sum-exp (the online softmax). Chunk pairs above the causal diagonal are skipped, the
  diagonal ones masked, those below it attended whole. The backward is autograd's: each step's shift
  transposes to the reverse shift, so a rank's keys receive every rank's gradient.
- "all_gather": the group's keys and values gathered (backward: reduce-scattered), this rank's queries
  attend to all of them under the mask of true positions. Simpler; S x d per rank in memory.
Both are plain differentiable ops (fp32 softmax for half inputs); the [s, t] scores of a block are kept
for the backward.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from fmoe._compat import Function
from fmoe.balance import TokenShard
from fmoe.ops._attention import rope
from fmoe.ops._dtypes import compute_dtype
from fmoe.parallel.async_comm import CommHandle
from fmoe.parallel.collectives import CommGroup, _Box, _finish, all_gather
from fmoe.parallel.tensor import reduce_from_tp

KINDS = ("p2p", "all_gather")


def check_split(S: int, size: int) -> None:
    """Raises ValueError unless `size` cp ranks split S positions into 2 x size equal chunks."""
    if S % (2 * size):
        raise ValueError(f"context parallelism over {size} ranks cuts a sequence into {2 * size} equal "
                         f"chunks (causal load balancing): {S} positions do not split; use a multiple of "
                         f"{2 * size}")


def chunks_of(rank: int, size: int) -> tuple[int, int]:
    """Returns the two chunks (of 2 x size) that cp rank `rank` holds: rank and 2 x size - 1 - rank."""
    return rank, 2 * size - 1 - rank


def cp_positions(S: int, rank: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Returns int64 [S / size]: the positions of a length-S sequence that cp rank `rank` holds (its two
    chunks, in order)."""
    check_split(S, size)
    C = S // (2 * size)
    return torch.cat([torch.arange(c * C, (c + 1) * C, device=device) for c in chunks_of(rank, size)])


def take_positions(x_BS: torch.Tensor, positions_s: torch.Tensor) -> torch.Tensor:
    """Returns x's part at `positions_s` along dim 1 (x is [B, S, ...]; differentiable: the backward
    scatters into zeros)."""
    return x_BS.index_select(1, positions_s.to(x_BS.device))


def cp_token_shard(cp: CommGroup, B: int, s: int, device: torch.device | str = "cpu") -> TokenShard:
    """Returns this rank's tokens (its s positions of each of B sequences, sequence-major) as a shard of
    the cp group's: the routing statistics are the group's sums, their gradient passed back unchanged, so
    each rank's loss holds the whole sequence's balancing terms and its gradient reaches its own tokens;
    summed over the group with the other gradients, it is the one-process gradient."""
    return TokenShard(total=partial(reduce_from_tp, comm=cp, op="cp.router_stats"),
                      seq_ids_T=torch.arange(B, device=device).repeat_interleave(s),
                      num_tokens=B * s * cp.size, num_seqs=B, seq_len=s * cp.size)


# ---- the ring's shift: send to rank + 1, receive from rank - 1 -------------------------------------------

def _shift(x: torch.Tensor, comm: CommGroup, op: str, back: bool) -> tuple[torch.Tensor, CommHandle]:
    """Issues the shift of `x` one rank on (back: one rank back); returns (the received tensor, handle)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n, step = comm.size, -1 if back else 1
    to, frm = (comm.rank + step) % n, (comm.rank - step) % n
    sent = [0] * n
    sent[to] = x.numel() * x.element_size()
    not_before = comm._account(op, sent)
    # even ranks send first, odd ranks receive first: where a device runs one queue and a send completes
    # only with its receive (NCCL's rendezvous), a ring where every rank sent first would wait all around
    # (tests/nccl_rules.py's "device" model); this order pairs each send with a receive already at the front
    def send() -> dist.Work:
        return dist.isend(x, comm.global_ranks[to], group=comm.group)

    def recv() -> dist.Work:
        return dist.irecv(out, comm.global_ranks[frm], group=comm.group)

    works = [send(), recv()] if comm.rank % 2 == 0 else [recv(), send()]
    return out, CommHandle(op, works, device=x.device, timeout=comm.timeout, keep=(x, out),
                           not_before=not_before, counters=comm.counters, ranks=comm.global_ranks)


class _Shift(Function):
    @staticmethod
    def forward(x, comm, op, back, box):
        out, h = _shift(x, comm, op, back)
        return _finish(out, h, box)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.comm, ctx.op, ctx.back, _ = inputs

    @staticmethod
    def backward(ctx, g):
        return _Shift.apply(g, ctx.comm, ctx.op + ".bwd", not ctx.back, None), None, None, None, None


def ring_shift_async(x: torch.Tensor, comm: CommGroup, *, op: str = "cp.ring") -> tuple[torch.Tensor, _Box]:
    """Returns (what rank - 1 sent, a box whose `handle` to wait before reading it): `x` goes to rank + 1.
    Differentiable: the gradient travels the other way (synchronously, in the backward)."""
    box = _Box()
    return _Shift.apply(x, comm, op, False, box), box


# ---- attention blocks with their log-sum-exp --------------------------------------------------------

def _block(q_BHsd: torch.Tensor, k_BHtd: torch.Tensor, v_BHtd: torch.Tensor,
           mask_st: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o_BHsd, lse_BHs): softmax attention of q over one key block and its log-sum-exp; `mask_st`
    True where a key is visible (None: all). A row with no visible key gets a log-sum-exp near the dtype's
    lowest, so it weighs nothing when merged (never -inf, whose gradient would be NaN)."""
    scores = q_BHsd @ k_BHtd.transpose(-1, -2) * q_BHsd.shape[-1] ** -0.5
    if mask_st is not None:
        scores = scores.masked_fill(~mask_st, torch.finfo(scores.dtype).min / 4)
    lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v_BHtd, lse


def _merge(o: torch.Tensor | None, lse: torch.Tensor | None, o_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax's step: two blocks' outputs weighed by their shares of the joint normaliser."""
    if o is None:
        return o_b, lse_b
    joint = torch.logaddexp(lse, lse_b)
    return o * torch.exp(lse - joint).unsqueeze(-1) + o_b * torch.exp(lse_b - joint).unsqueeze(-1), joint


def _heads_first(x_BtGd: torch.Tensor, H: int) -> torch.Tensor:
    """[B, t, G, d] -> [B, H, t, d]: kv heads repeated for their H / G query heads (grouped-query)."""
    x_BGtd = x_BtGd.transpose(1, 2)
    G = x_BGtd.shape[1]
    return x_BGtd if G == H else x_BGtd.repeat_interleave(H // G, dim=1)


def _ring(q_BHsd: torch.Tensor, kv_BsGe: torch.Tensor, d: int, S: int, cp: CommGroup) -> torch.Tensor:
    """Ring attention of this rank's queries (its two chunks, in order) over every rank's keys and values
    (kv: k, d wide, and v side by side on the last axis, already rotated)."""
    H, N = q_BHsd.shape[1], cp.size
    C = S // (2 * N)
    mine = chunks_of(cp.rank, N)
    q_chunks = q_BHsd.split(C, dim=2)
    outs: list[list] = [[None, None], [None, None]]  # per query chunk: (o, lse)
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q_BHsd.device).tril()
    cur = kv_BsGe
    for i in range(N):
        nxt, box = ring_shift_async(cur, cp) if i < N - 1 else (None, None)  # travels while this block runs
        theirs = chunks_of((cp.rank - i) % N, N)
        k_BHtd, v_BHtd = (_heads_first(t, H) for t in cur.split([d, cur.shape[-1] - d], dim=-1))
        k_chunks, v_chunks = k_BHtd.split(C, dim=2), v_BHtd.split(C, dim=2)
        for a, qc in enumerate(mine):
            for b, kc in enumerate(theirs):
                if kc > qc:  # above the causal diagonal: every key is later than every query
                    continue
                o_b, lse_b = _block(q_chunks[a], k_chunks[b], v_chunks[b], causal_CC if kc == qc else None)
                outs[a] = list(_merge(outs[a][0], outs[a][1], o_b, lse_b))
        if box is not None:
            box.handle.wait()
            cur = nxt
    return torch.cat([outs[0][0], outs[1][0]], dim=2)


def _gathered(q_BHsd: torch.Tensor, kv_BsGe: torch.Tensor, d: int, S: int, pos_s: torch.Tensor,
              cp: CommGroup) -> torch.Tensor:
    """All-gather attention: every rank's keys and values gathered, masked by their true positions."""
    H = q_BHsd.shape[1]
    kv_sBGe = all_gather(kv_BsGe.transpose(0, 1), cp, op="cp.all_gather")  # ranks' blocks in rank order
    kv_BtGe = kv_sBGe.transpose(0, 1)
    pos_t = torch.cat([cp_positions(S, j, cp.size, pos_s.device) for j in range(cp.size)])
    k_BHtd, v_BHtd = (_heads_first(t, H) for t in kv_BtGe.split([d, kv_BtGe.shape[-1] - d], dim=-1))
    return _block(q_BHsd, k_BHtd, v_BHtd, pos_t.unsqueeze(0) <= pos_s.unsqueeze(1))[0]


def cp_attention(q_BsHd: torch.Tensor, k_BsGd: torch.Tensor, v_BsGd: torch.Tensor, positions_s: torch.Tensor,
                 cp: CommGroup, *, rope_theta: float = 10000.0, kind: str = "p2p",
                 rotated: bool = False) -> torch.Tensor:
    """Returns o_BsHe: causal grouped-query attention of this rank's queries over the whole sequence split
    over the cp group (module docstring), RoPE at the true `positions_s` (this rank's `cp_positions`);
    q [B, s, H, d], k [B, s, G, d], v [B, s, G, e] with G dividing H (e = d for GQA; MLA's values have
    their own width), scores scaled by 1 / sqrt(d). `rotated`: q and k come with RoPE already applied at
    `positions_s` (MLA rotates a part of each head, fmoe/mla.py), so none is applied here. Output
    [B, s, H, e] in q's dtype; equal to `fmoe.ops.attention` on the whole sequence at these positions."""
    if kind not in KINDS:
        raise ValueError(f"context-parallel attention: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    B, s, H, d = q_BsHd.shape
    S = s * cp.size
    if positions_s.shape != (s,):
        raise ValueError(f"cp_attention: positions must be [{s}] (this rank's), "
                         f"got {tuple(positions_s.shape)}")
    check_split(S, cp.size)
    ct = compute_dtype(q_BsHd.dtype)
    if not rotated:
        q_BsHd, k_BsGd = rope(q_BsHd, positions_s, rope_theta), rope(k_BsGd, positions_s, rope_theta)
    q_BHsd = q_BsHd.to(ct).transpose(1, 2)
    kv_BsGe = torch.cat([k_BsGd, v_BsGd], dim=-1).to(ct)
    if kind == "p2p":
        o_BHsd = _ring(q_BHsd, kv_BsGe, d, S, cp)
    else:
        o_BHsd = _gathered(q_BHsd, kv_BsGe, d, S, positions_s, cp)
    return o_BHsd.transpose(1, 2).to(q_BsHd.dtype)
