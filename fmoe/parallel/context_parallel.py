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
  diagonal ones masked, those below it attended whole: every step computes two of its four chunk pairs
  (the first step two half-masked and one whole), 1 / N of the rank's attention. One op (`_Ring`) with
  flash attention's backward: each block's probabilities recomputed from the saved log-sum-exp (no
  [s, t] scores kept; the N received blocks are), and each block's key / value gradient, summed as it
  goes, passed one rank on after each step while the next step's blocks run, reaching its owner at the
  last step: N - 1 shifts each way, each hidden behind a step's compute.
- "all_gather": the group's keys and values gathered (backward: reduce-scattered), this rank's queries
  attend to all of them under the mask of true positions. Simpler, plain differentiable ops; S x d per
  rank in memory, and the [s, S] scores kept for the backward.
Both compute in fp32 for half inputs.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from fmoe._compat import Function
from fmoe.balance import TokenShard
from fmoe.ops._attention import document_mask, rope
from fmoe.ops._dtypes import compute_dtype
from fmoe.parallel.async_comm import CommHandle
from fmoe.parallel.collectives import CommGroup, all_gather
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


def _block_grads(q_BHsd: torch.Tensor, k_BHtd: torch.Tensor, v_BHte: torch.Tensor, g_BHse: torch.Tensor,
                 lse_BHs: torch.Tensor, delta_BHs: torch.Tensor,
                 mask_st: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv) of one block of `_block` given the output's gradient g and the whole row's
    log-sum-exp and rowsum(g * o) (delta): the block's probabilities recomputed from them (flash
    attention's backward), so no [s, t] scores are kept from the forward."""
    scale = q_BHsd.shape[-1] ** -0.5
    scores = q_BHsd @ k_BHtd.transpose(-1, -2) * scale
    if mask_st is not None:
        scores = scores.masked_fill(~mask_st, torch.finfo(scores.dtype).min / 4)
    p = torch.exp(scores - lse_BHs.unsqueeze(-1))
    ds = p * (g_BHse @ v_BHte.transpose(-1, -2) - delta_BHs.unsqueeze(-1))
    return ds @ k_BHtd * scale, ds.transpose(-1, -2) @ q_BHsd * scale, p.transpose(-1, -2) @ g_BHse


ROW_TILE = 512  # query rows a ring block computes at once: transient scores [H, 512, C], not [H, C, C]


def _tiled_block(q_BHsd: torch.Tensor, k_BHtd: torch.Tensor, v_BHte: torch.Tensor,
                 mask_st: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`_block` over ROW_TILE query rows at a time (each row's softmax is its own: the same result)."""
    rows = [slice(r, r + ROW_TILE) for r in range(0, q_BHsd.shape[2], ROW_TILE)]
    tiles = [_block(q_BHsd[:, :, t], k_BHtd, v_BHte, None if mask_st is None else mask_st[..., t, :])
             for t in rows]
    return torch.cat([o for o, _ in tiles], dim=2), torch.cat([lse for _, lse in tiles], dim=2)


def _tiled_block_grads(q_BHsd: torch.Tensor, k_BHtd: torch.Tensor, v_BHte: torch.Tensor,
                       g_BHse: torch.Tensor, lse_BHs: torch.Tensor, delta_BHs: torch.Tensor,
                       mask_st: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_block_grads` over ROW_TILE query rows at a time: dq tile by tile, dk and dv summed over them."""
    dq, dk, dv = [], None, None
    for r in range(0, q_BHsd.shape[2], ROW_TILE):
        rows = slice(r, r + ROW_TILE)
        dq_t, dk_t, dv_t = _block_grads(q_BHsd[:, :, rows], k_BHtd, v_BHte, g_BHse[:, :, rows],
                                        lse_BHs[:, :, rows], delta_BHs[:, :, rows],
                                        None if mask_st is None else mask_st[..., rows, :])
        dq.append(dq_t)
        dk, dv = _plus(dk, dk_t), _plus(dv, dv_t)
    return torch.cat(dq, dim=2), dk, dv


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


def _documents(segments_BS: torch.Tensor | None, mask: torch.Tensor | None, q_chunk: slice | torch.Tensor,
               k_chunk: slice | torch.Tensor) -> torch.Tensor | None:
    """`mask` ([s, t] or None) and, with documents (`segments_BS`, the whole sequence's [B, S]), their
    mask [B, 1, s, t] of the query and key positions `q_chunk`, `k_chunk` (slices or int64 indices)."""
    if segments_BS is None:
        return mask
    docs = document_mask(segments_BS[:, q_chunk], segments_BS[:, k_chunk]).unsqueeze(1)
    return docs if mask is None else docs & mask


def _pair_mask(segments_BS: torch.Tensor | None, mask: torch.Tensor | None, rank: int, src: int, N: int,
               a: int, b: int, C: int) -> torch.Tensor | None:
    """The mask of query chunk a of `rank` against key chunk b of `src` (chunks of C positions): `mask`
    ([C, C] or None) and, with documents, theirs ([B, 1, C, C])."""
    qc, kc = chunks_of(rank, N)[a], chunks_of(src, N)[b]
    return _documents(segments_BS, mask, slice(qc * C, (qc + 1) * C), slice(kc * C, (kc + 1) * C))


def _pairs(rank: int, src: int, N: int) -> list[tuple[int, int, bool]]:
    """The chunk pairs a ring step with rank `src`'s block computes, (a, b, diagonal): query chunk a of this
    rank's two against key chunk b of src's two, those on or below the causal diagonal (the diagonal's
    masked); above it every key is later than every query."""
    mine, theirs = chunks_of(rank, N), chunks_of(src, N)
    return [(a, b, kc == qc) for a, qc in enumerate(mine) for b, kc in enumerate(theirs) if kc <= qc]


def _kv_heads(kv_BtGe: torch.Tensor, d: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_BHtd, v_BHte) of a key / value block (k, d wide, and v side by side on the last axis)."""
    k_BtGd, v_BtGe = kv_BtGe.split([d, kv_BtGe.shape[-1] - d], dim=-1)
    return _heads_first(k_BtGd, H), _heads_first(v_BtGe, H)


def _kv_grad(dk_BHtd: torch.Tensor, dv_BHte: torch.Tensor, G: int) -> torch.Tensor:
    """The gradient of a key / value block [B, t, G, d + e] from its H query heads' (each kv head's summed
    over the H / G heads `_heads_first` repeated it for)."""
    folded = [g.unflatten(1, (G, g.shape[1] // G)).sum(2).transpose(1, 2) for g in (dk_BHtd, dv_BHte)]
    return torch.cat(folded, dim=-1)


def _plus(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else a + b


def _chunks_or_zeros(grads: list[torch.Tensor | None], like: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A block's gradient from its two chunks' (zeros for a chunk no query of the step saw)."""
    return torch.cat([g if g is not None else torch.zeros_like(x) for g, x in zip(grads, like)], dim=2)


class _Ring(Function):
    """Ring attention (module docstring) as one op over this rank's queries q_BHsd (its two chunks, in
    order) and its key / value block kv_BsGe (k, d wide, and v side by side, already rotated). Forward:
    the blocks go round the group, each merged into the running softmax while the next travels; returns
    (o_BHse, lse_BHs, the N blocks it saw, stacked). Backward (flash attention's): each block's
    probabilities recomputed from q, k and the saved log-sum-exp (no [s, t] scores kept between forward
    and backward), the blocks taken in the order 1, .., N-1, 0, so that the gradient of rank j's block,
    summed as it goes, travels one rank on after each step while the next step's blocks run, and reaches
    rank j (the block's owner) for the last step: N - 1 shifts, each hidden behind a step."""

    @staticmethod
    def forward(q_BHsd, kv_BsGe, d, S, cp, segments_BS):
        H, N = q_BHsd.shape[1], cp.size
        C = S // (2 * N)
        q_chunks = q_BHsd.split(C, dim=2)
        outs: list[list] = [[None, None], [None, None]]  # per query chunk: (o, lse)
        causal_CC = torch.ones(C, C, dtype=torch.bool, device=q_BHsd.device).tril()
        blocks = [kv_BsGe]
        for i in range(N):
            # the next block travels while this one runs
            nxt, handle = _shift(blocks[i], cp, "cp.ring", back=False) if i < N - 1 else (None, None)
            k_BHtd, v_BHte = _kv_heads(blocks[i], d, H)
            k_chunks, v_chunks = k_BHtd.split(C, dim=2), v_BHte.split(C, dim=2)
            for a, b, diagonal in _pairs(cp.rank, (cp.rank - i) % N, N):
                mask = _pair_mask(segments_BS, causal_CC if diagonal else None, cp.rank, (cp.rank - i) % N,
                                  N, a, b, C)
                o_b, lse_b = _tiled_block(q_chunks[a], k_chunks[b], v_chunks[b], mask)
                outs[a] = list(_merge(outs[a][0], outs[a][1], o_b, lse_b))
            if handle is not None:
                handle.wait()
                blocks.append(nxt)
        o_BHse = torch.cat([outs[0][0], outs[1][0]], dim=2)
        lse_BHs = torch.cat([outs[0][1], outs[1][1]], dim=2)
        return o_BHse, lse_BHs, torch.stack(blocks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q_BHsd, _, ctx.d, ctx.S, ctx.cp, ctx.segments_BS = inputs
        o_BHse, lse_BHs, blocks_NBsGe = output
        ctx.save_for_backward(q_BHsd, o_BHse, lse_BHs, blocks_NBsGe)
        ctx.mark_non_differentiable(lse_BHs, blocks_NBsGe)

    @staticmethod
    def backward(ctx, g_BHse, _g_lse, _g_blocks):
        # first order only: under torch.func.grad (create_graph) a recorded backward would keep every
        # block's probabilities alive until the transform returns
        with torch.no_grad():
            return _Ring._backward(ctx, g_BHse)

    @staticmethod
    def _backward(ctx, g_BHse):
        q_BHsd, o_BHse, lse_BHs, blocks_NBsGe = ctx.saved_tensors
        d, cp = ctx.d, ctx.cp
        H, N, G = q_BHsd.shape[1], cp.size, blocks_NBsGe.shape[3]
        C = ctx.S // (2 * N)
        causal_CC = torch.ones(C, C, dtype=torch.bool, device=q_BHsd.device).tril()
        delta_BHs = (g_BHse * o_BHse).sum(-1)  # rowsum(dO * O): the softmax backward's correction
        q_c, g_c, lse_c, delta_c = (t.split(C, dim=2) for t in (q_BHsd, g_BHse, lse_BHs, delta_BHs))
        dq: list[torch.Tensor | None] = [None, None]
        recv, handle, dkv_BsGe = None, None, None
        for step, i in enumerate([*range(1, N), 0]):  # the block of rank - i; this rank's own last
            k_BHtd, v_BHte = _kv_heads(blocks_NBsGe[i], d, H)
            k_c, v_c = k_BHtd.split(C, dim=2), v_BHte.split(C, dim=2)
            dk: list[torch.Tensor | None] = [None, None]
            dv: list[torch.Tensor | None] = [None, None]
            for a, b, diagonal in _pairs(cp.rank, (cp.rank - i) % N, N):
                mask = _pair_mask(ctx.segments_BS, causal_CC if diagonal else None, cp.rank,
                                  (cp.rank - i) % N, N, a, b, C)
                dq_a, dk_b, dv_b = _tiled_block_grads(q_c[a], k_c[b], v_c[b], g_c[a], lse_c[a], delta_c[a],
                                                      mask)
                dq[a], dk[b], dv[b] = _plus(dq[a], dq_a), _plus(dk[b], dk_b), _plus(dv[b], dv_b)
            mine = _kv_grad(_chunks_or_zeros(dk, k_c), _chunks_or_zeros(dv, v_c), G)
            if handle is not None:  # what the earlier ranks gave this block, arrived while it ran
                handle.wait()
                mine = mine + recv
            if step < N - 1:
                recv, handle = _shift(mine, cp, "cp.ring.bwd", back=False)
            else:
                dkv_BsGe = mine
        return torch.cat(dq, dim=2), dkv_BsGe, None, None, None, None


def _ring(q_BHsd: torch.Tensor, kv_BsGe: torch.Tensor, d: int, S: int, cp: CommGroup,
          segments_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Ring attention of this rank's queries (its two chunks, in order) over every rank's keys and values
    (kv: k, d wide, and v side by side on the last axis, already rotated): `_Ring`'s output;
    `segments_BS`: documents (cp_attention)."""
    return _Ring.apply(q_BHsd, kv_BsGe, d, S, cp, segments_BS)[0]


def _gathered(q_BHsd: torch.Tensor, kv_BsGe: torch.Tensor, d: int, S: int, pos_s: torch.Tensor,
              cp: CommGroup, segments_BS: torch.Tensor | None = None) -> torch.Tensor:
    """All-gather attention: every rank's keys and values gathered, masked by their true positions (and
    documents, `segments_BS`)."""
    H = q_BHsd.shape[1]
    kv_sBGe = all_gather(kv_BsGe.transpose(0, 1), cp, op="cp.all_gather")  # ranks' blocks in rank order
    kv_BtGe = kv_sBGe.transpose(0, 1)
    pos_t = torch.cat([cp_positions(S, j, cp.size, pos_s.device) for j in range(cp.size)])
    k_BHtd, v_BHtd = (_heads_first(t, H) for t in kv_BtGe.split([d, kv_BtGe.shape[-1] - d], dim=-1))
    mask = _documents(segments_BS, pos_t.unsqueeze(0) <= pos_s.unsqueeze(1), pos_s, pos_t)
    return _block(q_BHsd, k_BHtd, v_BHtd, mask)[0]


def cp_attention(q_BsHd: torch.Tensor, k_BsGd: torch.Tensor, v_BsGd: torch.Tensor, positions_s: torch.Tensor,
                 cp: CommGroup, *, rope_theta: float = 10000.0, kind: str = "p2p",
                 rotated: bool = False, rope_positions_Bs: torch.Tensor | None = None,
                 segments_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Returns o_BsHe: causal grouped-query attention of this rank's queries over the whole sequence split
    over the cp group (module docstring), RoPE at the true `positions_s` (this rank's `cp_positions`);
    q [B, s, H, d], k [B, s, G, d], v [B, s, G, e] with G dividing H (e = d for GQA; MLA's values have
    their own width), scores scaled by 1 / sqrt(d). `rotated`: q and k come with RoPE already applied
    (MLA rotates a part of each head, fmoe/mla.py), so none is applied here. Output [B, s, H, e] in q's
    dtype; equal to `fmoe.ops.attention` on the whole sequence at these positions. Documents
    (fmoe/packing.py): `rope_positions_Bs` this rank's RoPE positions [B, s] (restarting per document;
    default positions_s), `segments_BS` the whole sequence's document index [B, S] (every rank has it: a
    block's key documents are read from it, nothing travels with the keys), attention within a document
    only."""
    if kind not in KINDS:
        raise ValueError(f"context-parallel attention: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    B, s, H, d = q_BsHd.shape
    S = s * cp.size
    if positions_s.shape != (s,):
        raise ValueError(f"cp_attention: positions must be [{s}] (this rank's), "
                         f"got {tuple(positions_s.shape)}")
    check_split(S, cp.size)
    if segments_BS is not None and tuple(segments_BS.shape) != (B, S):
        raise ValueError(f"cp_attention: segments must be the whole sequence's [{B}, {S}], "
                         f"got {tuple(segments_BS.shape)}")
    ct = compute_dtype(q_BsHd.dtype)
    if not rotated:
        rot = positions_s if rope_positions_Bs is None else rope_positions_Bs
        q_BsHd, k_BsGd = rope(q_BsHd, rot, rope_theta), rope(k_BsGd, rot, rope_theta)
    q_BHsd = q_BsHd.to(ct).transpose(1, 2)
    kv_BsGe = torch.cat([k_BsGd, v_BsGd], dim=-1).to(ct)
    if kind == "p2p":
        o_BHsd = _ring(q_BHsd, kv_BsGe, d, S, cp, segments_BS)
    else:
        o_BHsd = _gathered(q_BHsd, kv_BsGe, d, S, positions_s, cp, segments_BS)
    return o_BHsd.transpose(1, 2).to(q_BsHd.dtype)
