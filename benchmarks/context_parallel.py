"""Context parallelism (fmoe/parallel/context_parallel.py) on CPU: peak activation memory per rank, the ring's
transfers hidden behind the attention compute, and the step time of the ring against the all-gather form.

    .venv/bin/python benchmarks/context_parallel.py                      # small preset, S 8192
    .venv/bin/python benchmarks/context_parallel.py --seq 4096 --repeats 3 --parts time

Three parts, each on spawned gloo ranks (one cp group), fp32, one sequence of S tokens:
- memory: one forward + backward of the small preset's GPT (`gpt_loss` under torch.func.grad: embedding,
  8 blocks of GQA attention and MoE, head) at cp 1, 2, 4 (the ring), each on fresh ranks; per rank the
  rise of the RSS high-water mark over the step (Linux VmHWM reset through /proc/self/clear_refs, glibc
  returning every freed block of 64 KiB or more at once: benchmarks/memory.py's measure), less the
  gradients (as large at every cp: the weights are replicated) = the activations' peak. The ratio to
  cp 1 should be about 1 / cp.
- hidden: the ring of one attention layer of the small preset (q [1, S/N, 8, 16], k and v 4 kv heads),
  forward + backward, under the compute and link models: every block of the attention core takes its
  FLOPs' time at a modelled rate (it runs, then sleeps out the rest, as schedule/compute_model.py makes a
  phase take its modelled time: asleep, a rank leaves the shared cores to the others, as a device), and
  every message `fmoe.parallel.LinkModel`'s time; both are the `--device` cluster's (fmoe/plan/specs.py:
  attention FLOP rate, intra-node link) slowed by one factor, so a step's transfer takes the share of its
  compute it would on the device. Hidden = 1 - (seconds the ring's waits blocked) / (the messages'
  modelled seconds), per rank and direction (a barrier between them), median of `--repeats`, at cp 2 and
  4; the planner's own figure (`fmoe.plan.estimate.ring_s`) next to it.
- time: the GPT's forward + backward at cp 2 in the ring form and the all-gather form, interleaved in a
  rotated order, median of `--repeats`; the RSS high-water mark's rise next to each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _ranks import measure_rss, return_freed_memory, spawn

from fmoe import gpt_loss, init_gpt, init_gpt_state
from fmoe.parallel import CommGroup, LinkModel, ParallelContext
from fmoe.parallel.context_parallel import cp_attention, cp_positions
from fmoe.parallel.counters import CommCounters
from fmoe.train.config import TrainConfig


def _model(seq: int):
    cfg = TrainConfig.from_sources(preset="small", overrides={"seq_length": seq}).model()
    g = torch.Generator().manual_seed(0)
    params = init_gpt(cfg, g, torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    return cfg, params, ids, ids.roll(-1, 1)


def _gpt_step(cfg, params, ids, targets, par):
    state = init_gpt_state(cfg)
    return torch.func.grad(lambda p: gpt_loss(p, ids, targets, cfg, state, parallel=par)[0])(params)


def _parallel(world: int, kind: str) -> ParallelContext:
    if world == 1:
        return ParallelContext()
    return ParallelContext(cp=CommGroup(torch.distributed.group.WORLD), cp_comm_type=kind)


def _memory_rank(rank: int, world: int, seq: int) -> dict:
    torch.set_num_threads(1)
    return_freed_memory()  # the rise then counts what the step holds, whatever earlier work left
    cfg, params, ids, targets = _model(seq)
    par = _parallel(world, "p2p")
    grads, _, rise = measure_rss(lambda: _gpt_step(cfg, params, ids, targets, par))
    grad_bytes = sum(g.numel() * g.element_size() for g in torch.utils._pytree.tree_leaves(grads))
    return {"peak": rise * 2**20, "grads": grad_bytes}


def _cpu_block_s(C: int, H: int, d: int) -> float:
    """Seconds this CPU (under the load it has now) takes for one ring block: a [C, d] x [d, C] chunk pair
    per head, softmax and values (best of 5)."""
    q, k = torch.randn(1, H, C, d), torch.randn(1, H, C, d)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.softmax(q @ k.transpose(-1, -2), -1) @ k
        best = min(best, time.perf_counter() - t0)
    return best


def _modelled(fn, flops_of, rate: float, overruns: list):
    """`fn` taking at least its modelled time, flops_of(*args) / rate: it runs, then sleeps out the rest (the
    compute model of schedule/compute_model.py, per ring block: asleep, a rank leaves the core to the
    others, as a device computing); a block that took longer counts in `overruns`."""
    def run(*args):
        t0 = time.perf_counter()
        out = fn(*args)
        rest = t0 + flops_of(*args) / rate - time.perf_counter()
        if rest > 0:
            time.sleep(rest)
        else:
            overruns.append(-rest)
        return out
    return run


def _block_flops(q, k, v, *rest) -> float:
    B, H, s, d = q.shape
    return 2.0 * B * H * s * k.shape[2] * (d + v.shape[-1])  # scores and probabilities x values


def _hidden_rank(rank: int, world: int, seq: int, repeats: int, device: str) -> dict:
    """The ring of one attention layer, forward + backward, under the compute model (every block its
    device's FLOP time, scaled) and the link model (every message its device link's time, scaled alike)."""
    import fmoe.parallel.context_parallel as CP
    from fmoe.plan.specs import CLUSTER_PRESETS

    torch.set_num_threads(1)
    H, G, d = 8, 4, 16
    s, C = seq // world, seq // (2 * world)
    cluster = CLUSTER_PRESETS[device]
    device_rate = cluster.flops("fp32") * cluster.attn_eff  # the small preset's dtype, the planner's rule
    pair_flops = 2.0 * H * C * C * (d + d)  # one chunk pair's forward: scores, probabilities x values
    # the model's time scale, the same on every rank: a block takes 2 x world x the slowest rank's time here
    # now (room for the ranks sharing the cores, and the backward's 2.5 x)
    slowest = torch.tensor(_cpu_block_s(C, H, d))
    torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
    rate = pair_flops / (2 * world * float(slowest))
    link = LinkModel(intra_bytes_per_s=cluster.intra_bytes_per_s * rate / device_rate,
                     intra_latency_s=cluster.intra_latency_s * device_rate / rate)
    overruns: list[float] = []
    CP._block = _modelled(CP._block, _block_flops, rate, overruns)  # forward: QK^T, PV
    CP._block_grads = _modelled(CP._block_grads, lambda *a: 2.5 * _block_flops(*a), rate, overruns)
    counters = CommCounters()
    comm = CommGroup(torch.distributed.group.WORLD, counters=counters, link_model=link)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, s, n, d, generator=g, requires_grad=True) for n in (H, G, G))
    pos = cp_positions(seq, rank, world)
    per_msg = s * G * 2 * d * 4  # this rank's k and v (fp32): one message's bytes, each way
    ops = ("cp.ring", "cp.ring.bwd")
    hidden: dict[str, list[float]] = {op: [] for op in ops}
    for _ in range(repeats + 1):  # the first a warm-up
        counters.reset()
        overruns.clear()
        torch.distributed.barrier()  # each direction from one start: the machine's skew is not the ring's
        o = cp_attention(q, k, v, pos, comm)
        torch.distributed.barrier()
        o.sum().backward()
        for op in ops:
            modelled = counters.calls[op] * link.duration({"intra": per_msg})
            hidden[op].append(1 - counters.wait_s[op] / modelled)
    return {"hidden": {op: statistics.median(v[1:]) for op, v in hidden.items()},
            "overruns": len(overruns), "msg_s": link.duration({"intra": per_msg}),
            "block_s": pair_flops / rate}


def _time_rank(rank: int, world: int, seq: int, order: list[str]) -> dict:
    torch.set_num_threads(1)
    return_freed_memory()
    cfg, params, ids, targets = _model(seq)
    out: dict[str, list] = {kind: [] for kind in set(order)}
    _gpt_step(cfg, params, ids, targets, _parallel(world, order[0]))  # warm-up
    for kind in order:
        par = _parallel(world, kind)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        _, _, rise = measure_rss(lambda par=par: _gpt_step(cfg, params, ids, targets, par))
        out[kind].append((time.perf_counter() - t0, rise))
    return out


def _planner_hidden(seq: int, cp: int, device: str) -> float:
    """The planner's hidden share of the ring's transfers for the small preset at `seq` on `device`s."""
    from fmoe.calibrate.models import load_model
    from fmoe.plan import estimate as E
    from fmoe.plan import layout as L
    from fmoe.plan.layer_costs import block_cost
    from fmoe.plan.specs import CLUSTER_PRESETS

    model, cluster = load_model("small").replace(seq=seq), CLUSTER_PRESETS[device]
    lay = L.Layout(tp=1, pp=1, ep=1, dp=1, vpp=1, schedule="1f1b", overlap=False, micro_batch=1, cp=cp)
    ctx = E.Context(model, cluster, cp, 1)
    attn = E.rank_tokens(model, lay) * block_cost(model, True).attn_flops / (cluster.flops(model.dtype)
                                                                             * cluster.attn_eff)
    fwd, bwd = E.ring_s(ctx, lay, attn)
    xfer = E._collective_s(cluster, E.ring_step_bytes(model, lay), True)
    return 1 - (fwd + bwd) / (2 * (cp - 1) * xfer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="memory,hidden,time")
    ap.add_argument("--device", default="h100", help="the cluster preset whose compute and link the hidden "
                    "part models (fmoe/plan/specs.py)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    cps = [int(c) for c in args.cps.split(",")]
    print(f"small preset, S {args.seq}, one sequence, fp32, CPU (gloo)")
    if "memory" in parts:
        base = None
        for cp in cps:
            got = spawn(_memory_rank, cp, (args.seq,), 1800, f"memory cp {cp}")
            acts = max(r["peak"] - r["grads"] for r in got)
            base = base or acts
            peak, grads = max(r["peak"] for r in got) / 2**20, got[0]["grads"] / 2**20
            print(f"memory cp {cp}: activation peak per rank {acts / 2**20:8.1f} MiB (max over ranks; "
                  f"RSS rise {peak:.1f} MiB less {grads:.1f} MiB of gradients), {acts / base:.3f} x cp 1 "
                  f"(1 / cp = {1 / cp:.3f})")
    if "hidden" in parts:
        for cp in (c for c in cps if c > 1):
            got = spawn(_hidden_rank, cp, (args.seq, args.repeats, args.device), 900, f"hidden cp {cp}")
            shares = {op: min(r["hidden"][op] for r in got) for op in ("cp.ring", "cp.ring.bwd")}
            print(f"hidden cp {cp}: forward {100 * shares['cp.ring']:5.1f} %, backward "
                  f"{100 * shares['cp.ring.bwd']:5.1f} % (min over ranks of the median of {args.repeats}; "
                  f"modelled: a message {1e3 * got[0]['msg_s']:.0f} ms, a chunk pair's forward "
                  f"{1e3 * got[0]['block_s']:.0f} ms, {sum(r['overruns'] for r in got)} blocks overran); the "
                  f"planner ({args.device}, fmoe.plan.estimate.ring_s): "
                  f"{100 * _planner_hidden(args.seq, cp, args.device):.1f} % both ways")
    if "time" in parts:
        kinds = ["p2p", "all_gather"]
        order = [kinds[(i + j) % 2] for i in range(args.repeats) for j in range(2)]  # rotated
        got = spawn(_time_rank, 2, (args.seq, order), 3600, "time cp 2")
        med = {k: statistics.median(max(r[k][i][0] for r in got) for i in range(args.repeats)) for k in kinds}
        rss = {k: statistics.median(max(r[k][i][1] for r in got) for i in range(args.repeats)) for k in kinds}
        for k in kinds:
            print(f"time cp 2 {k:10s}: {med[k]:7.2f} s per forward + backward (median of {args.repeats}), "
                  f"RSS rise {rss[k]:.0f} MiB")
        print(f"time cp 2: all_gather / p2p = {med['all_gather'] / med['p2p']:.2f}")


if __name__ == "__main__":
    main()
