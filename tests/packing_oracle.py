"""The documents-alone oracle of tests/test_packing.py (test-only), and the ranks of its every-layout test.

    params, ids_BS, targets_BS = windows(cfg, eods)      # samples of S + 1 tokens, EODs where eods says
    loss, grads = alone(params, ids_BS, targets_BS, cfg, mask_loss)   # each document as its own sequence
    loss, grads = packed(params, ids_BS, targets_BS, cfg, flags, engine)   # fmoe's packed batch

Legend: B sequences, S positions, V vocabulary.

`alone` knows nothing of fmoe/packing.py: it cuts each row after every EOD (Megatron's rule: an EOD ends its
own document), runs every piece through the one-process `gpt_loss` as a sequence of its own (its
targets masked after the EOD by hand under --eod-mask-loss), and weighs the pieces' means back into the
batch's: the main loss by each piece's kept targets, MTP's by its own (a piece's MTP weight is set in its
config, so one differentiable call per piece gives both terms).
"""

from __future__ import annotations

import dataclasses

import torch

from fmoe import GPTConfig, MoEConfig, gpt_loss, init_gpt, init_gpt_state
from fmoe._compat import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from fmoe.packing import pack_documents
from fmoe.transforms.testing import assert_close

DT = torch.float64
S = 8  # positions: split by cp 2's four chunks and by sp 2
V = 12
EOD = V - 1
E = 4
FLAGS = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}


def cfg_of(kind: str) -> GPTConfig:
    """A dense and an MoE block with MTP, fp64-sized: grouped-query attention ("gqa", 4 query and 2 kv
    heads) or multi-head latent attention ("mla"); dropless, no balancing loss (its statistics are the
    batch's: the one thing documents alone cannot reproduce)."""
    moe = MoEConfig(d_model=16, d_ff=8, num_experts=E, top_k=2, num_shared_experts=1)
    sizes = ({"n_heads": 4, "n_kv_heads": 2, "qk_norm": True} if kind == "gqa" else
             {"n_heads": 2, "head_dim": 4, "q_lora_rank": 6, "kv_lora_rank": 4, "qk_rope_head_dim": 2,
              "v_head_dim": 4})
    return GPTConfig(vocab_size=V, d_model=16, n_layers=2, moe=moe, num_dense_layers=1, d_ff_dense=16,
                     mtp=True, mtp_loss_weight=0.3, **sizes)


def windows(cfg: GPTConfig, eods: list[list[bool]], seed: int = 3) -> tuple:
    """(params, ids_BS, targets_BS): fp64 weights and one sample of S + 1 tokens per row of `eods`, the EOD
    where it says True and other tokens elsewhere; ids and targets the sample shifted, as the loader cuts."""
    g = torch.Generator().manual_seed(seed)
    params = init_gpt(cfg, g, DT)
    w = torch.randint(0, EOD, (len(eods), S + 1), generator=g)
    w[torch.tensor(eods)] = EOD
    return params, w[:, :-1].contiguous(), w[:, 1:].contiguous()


def _pieces(ids_S: torch.Tensor) -> list[tuple[int, int]]:
    """[a, e) of each document of a row: cut after every EOD, the tail a document of its own."""
    out, a = [], 0
    for i, t in enumerate(ids_S.tolist()):
        if t == EOD:
            out.append((a, i + 1))
            a = i + 1
    return out + ([(a, len(ids_S))] if a < len(ids_S) else [])


def _grad(f, params: dict, engine: str) -> tuple[torch.Tensor, dict]:
    """(f(params), its gradient tree) by torch.func.grad ("func") or tape autograd ("tape")."""
    if engine == "func":
        grads, loss = torch.func.grad(lambda p: (f(p),) * 2, has_aux=True)(params)
        return loss.detach(), grads
    leaves, spec = tree_flatten(params)
    mine = [t.detach().requires_grad_(True) for t in leaves]
    loss = f(tree_unflatten(mine, spec))
    return loss.detach(), tree_unflatten(list(torch.autograd.grad(loss, mine)), spec)


def alone(params: dict, ids_BS: torch.Tensor, targets_BS: torch.Tensor, cfg: GPTConfig,
          mask_loss: bool) -> tuple[torch.Tensor, dict]:
    """(loss, gradients) of the batch as its documents run alone (module docstring)."""
    pieces = []
    for b in range(ids_BS.shape[0]):
        for a, e in _pieces(ids_BS[b]):
            ids_s, t_s = ids_BS[b, a:e], targets_BS[b, a:e].clone()
            if mask_loss:
                t_s[ids_s == EOD] = -100  # the next document's first token
            pieces.append((ids_s, t_s, int((t_s != -100).sum()), int((t_s[1:] != -100).sum())))
    N, M = sum(p[2] for p in pieces), sum(p[3] for p in pieces)
    state = init_gpt_state(cfg)

    def f(p: dict) -> torch.Tensor:
        total = p["norm"].new_zeros(())
        for ids_s, t_s, n, m in pieces:
            if n == 0:  # no target takes loss (then neither does MTP's)
                continue
            w = cfg.mtp_loss_weight * (m / M) * (N / n) if M else 0.0
            loss, _ = gpt_loss(p, ids_s[None], t_s[None], dataclasses.replace(cfg, mtp_loss_weight=w), state)
            total = total + loss * (n / N)
        return total

    return _grad(f, params, "func")


def packed(params: dict, ids_BS: torch.Tensor, targets_BS: torch.Tensor, cfg: GPTConfig,
           flags: dict[str, bool], engine: str, **kw) -> tuple[torch.Tensor, dict]:
    """(loss, gradients) of fmoe's `gpt_loss` on the packed batch under document `flags`."""
    packing = pack_documents(ids_BS, EOD, **flags)
    return _grad(lambda p: gpt_loss(p, ids_BS, targets_BS, cfg, init_gpt_state(cfg), packing=packing,
                                    **kw)[0], params, engine)


# ---- the ranks of test_every_layout_equals_each_document_alone ------------------------------------------

ROWS = [[True] + [False] * (S - 2) + [True, False],  # an EOD first and last
        [False, True, True] + [False] * 3 + [True, False, False]]  # a document of one token


def _experts_of(tree: dict, rank: int, size: int) -> dict:
    """`tree` with rank `rank`'s E / size routed experts of each MoE block."""
    L = E // size

    def cut(block: dict) -> dict:
        ex = block["moe"]["experts"]
        mine = {k: v[rank * L:(rank + 1) * L] for k, v in ex.items()}
        return {**block, "moe": {**block["moe"], "experts": mine}}

    out = {**tree, "layers": [cut(b) if "moe" in b else b for b in tree["layers"]]}
    if "mtp" in tree:
        out["mtp"] = {**tree["mtp"], "block": cut(tree["mtp"]["block"])}
    return out


def _summed(grads: dict, group=None) -> dict:
    """`grads` summed over `group` (default: every rank), as a reduction over the ranks that split the
    positions or the data does."""
    for g in tree_flatten(grads)[0]:
        torch.distributed.all_reduce(g, group=group)
    return grads


def _add(a: dict, b: dict) -> dict:
    return tree_unflatten([x + y for x, y in zip(tree_flatten(a)[0], tree_flatten(b)[0])], tree_flatten(a)[1])


def layouts_rank(rank: int, world: int) -> list[str]:
    """tp 2 + sp, pp 2, ep 2, cp 2 (p2p, all_gather) on this rank, each checked against `alone` here
    (an assertion fails the rank, naming the layout); returns the layouts checked."""
    from test_tensor_parallel_gpt import _mine

    from fmoe import schedule as sched
    from fmoe.parallel import CommGroup, ParallelContext
    from fmoe.parallel.alltoall import AllToAllDispatcher
    from fmoe.pipeline import gpt_pipeline_step, gpt_program

    comm = CommGroup(torch.distributed.group.WORLD)
    cfg = cfg_of("gqa")
    params, ids, targets = windows(cfg, ROWS)
    want_loss, want = alone(params, ids, targets, cfg, True)
    done = []

    # tp 2 with sequence parallelism: heads and vocabulary split, experts over the pair (TP extends EP);
    # GQA, and MLA (its latents gathered before the up projections, RoPE at the whole sequence's positions)
    par = ParallelContext(tp=comm, sequence_parallel=True, dispatcher=AllToAllDispatcher(comm, E))
    for kind in ("gqa", "mla"):
        c = cfg_of(kind)
        p = params if kind == "gqa" else windows(c, ROWS)[0]  # MLA's weights, the same tokens
        want_c_loss, want_c = (want_loss, want) if kind == "gqa" else alone(p, ids, targets, c, True)
        loss, grads = packed(_mine(p, c, rank, world), ids, targets, c, FLAGS, "func", parallel=par)
        assert_close(loss, want_c_loss, dtype=DT, msg=f"tp 2 + sp {kind} loss")
        assert_close(grads, _mine(want_c, c, rank, world), dtype=DT, msg=f"tp 2 + sp {kind} grads")
        done.append(f"tp2+sp {kind}")

    # cp 2: each rank two chunks of every sequence; documents from the whole sample on every rank
    for kind in ("p2p", "all_gather"):
        par = ParallelContext(cp=comm, cp_comm_type=kind)
        loss, grads = packed(params, ids, targets, cfg, FLAGS, "func", parallel=par)
        assert_close(loss, want_loss, dtype=DT, msg=f"cp 2 {kind} loss")
        assert_close(_summed(grads), want, dtype=DT, msg=f"cp 2 {kind} grads")
        done.append(f"cp2 {kind}")

    # ep 2: each rank its own sequence, the experts split; its loss is its sequence's
    par = ParallelContext(dispatcher=AllToAllDispatcher(comm, E))
    mine = _experts_of(params, rank, world)
    loss, grads = packed(mine, ids[rank:rank + 1], targets[rank:rank + 1], cfg, FLAGS, "func", parallel=par)
    rows = [alone(params, ids[r:r + 1], targets[r:r + 1], cfg, True) for r in range(world)]
    assert_close(loss, rows[rank][0], dtype=DT, msg="ep 2 loss")
    both = _add(rows[0][1], rows[1][1])  # the experts' gradients hold both ranks' tokens
    flat = {keystr(p): g for p, g in tree_flatten_with_path(grads)[0]}
    expert = {k for k in flat if "['experts']" in k}
    dense = {k: g for k, g in flat.items() if k not in expert}
    for g in dense.values():
        torch.distributed.all_reduce(g)
    want_ep = {keystr(p): g for p, g in tree_flatten_with_path(_experts_of(both, rank, world))[0]}
    for k, g in flat.items():
        assert_close(g, want_ep[k], dtype=DT, msg=f"ep 2 {k}")
    done.append("ep2")

    # pp 2, 1F1B over two microbatches: the documents ride in each microbatch's meta to both stages
    s = sched.build("1f1b", 2, 2)
    program = gpt_program(cfg, s, rank)
    batches = list(zip(ids.chunk(2), targets.chunk(2)))
    step = gpt_pipeline_step(program, params, init_gpt_state(cfg), batches, group=comm.group,
                             packings=[pack_documents(i, EOD, **FLAGS) for i, _ in batches])
    per_mb = [alone(params, i, t, cfg, True) for i, t in batches]
    assert_close(step.loss, (per_mb[0][0] + per_mb[1][0]) / 2, dtype=DT, msg="pp 2 loss")
    halves = zip(tree_flatten(per_mb[0][1])[0], tree_flatten(per_mb[1][1])[0])
    mean = tree_unflatten([(x + y) / 2 for x, y in halves], tree_flatten(want)[1])
    want_pp = {keystr(p): g for p, g in tree_flatten_with_path(mean)[0]}
    held = {keystr(p): g for p, g in tree_flatten_with_path(step.grads)[0] if g is not None}
    assert held
    for k, g in held.items():
        assert_close(g, want_pp[k], dtype=DT, msg=f"pp 2 {k}")
    done.append("pp2")
    return done
