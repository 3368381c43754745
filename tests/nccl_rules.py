"""Replay what ranks issued to torch.distributed under NCCL's (and HCCL's) rules, on CPU.

    with recording() as log:          # in each rank: every P2P op, collective and wait, in issue order
        ...run the step...
    problems = replay(logs_by_rank)   # [] when NCCL would run it; else what deadlocks or mismatches

Gloo matches a receive to a send by tag and runs each collective on its own, so a CPU run never sees the
rules a device run lives by. NCCL ignores `tag` (the torch.distributed.isend docs say so; pytorch#94819):
ProcessGroupNCCL runs every send and receive between two ranks of one group on one communicator and
stream (key "low:high", getKeySendRecv), in the order the host issued them, and HCCL does the same. So the
k-th send from a to b meets the k-th receive on b from a, and an op on that stream runs only after the ops
issued before it there completed. Every collective of a group runs on that group's stream; its k-th call
on each rank meets the k-th on the others. A `Work.wait()` makes the compute stream wait for the op, and
every op issued afterwards waits for the compute stream (ProcessGroupNCCL syncs its stream to the current
one at issue), so a rank issues nothing past a wait until the waited op completed: the replay blocks the
rank's host there.

Two models of the device:
- "nccl" (default): one stream per P2P pair and per collective group, as ProcessGroupNCCL keeps them;
  a send completes only together with its receive (rendezvous: messages too large for NCCL's buffers).
- "device": one queue per device for every communicator. NCCL's docs ask that operations on different
  communicators be issued in one order on every rank ("Using multiple NCCL communicators concurrently"):
  when kernels cannot run side by side (CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron sets, or SMs taken),
  they run in issue order, and two ranks that issue shared communicators' ops in different orders hang.
A matched pair whose tags, sizes or dtypes differ is reported as a mismatch: NCCL would deliver the wrong
message (same size) or fail.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_P2P = ("isend", "irecv", "send", "recv")
_COLLECTIVES = ("all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor",
                "reduce_scatter_tensor", "broadcast", "barrier", "monitored_barrier", "all_gather_object",
                "gather_object", "broadcast_object_list", "all_to_all", "reduce", "gather", "scatter")


@dataclass(frozen=True)
class CommOp:
    """One op a rank issued. `comm`: the global ranks of its group; `peer`: the global peer of a P2P op
    (None for a collective); `sig`: what must agree with its match (tag, shape, dtype; the call's name,
    its tensor's dtype and, for all_reduce / broadcast / reduce, shape)."""

    rank: int
    index: int
    kind: str  # "send", "recv" or "coll"
    comm: tuple[int, ...]
    peer: int | None
    tag: int
    sig: tuple


_local = threading.local()


def _comm_of(group: Any) -> tuple[int, ...]:
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def _sig(args: tuple, kwargs: dict) -> tuple:
    t = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return () if t is None else (tuple(t.shape), str(t.dtype))


# collectives whose tensor has one shape on every rank (the others: one dtype)
_SAME_SHAPE = ("all_reduce", "broadcast", "reduce")


def _coll_sig(name: str, args: tuple, kwargs: dict) -> tuple:
    """What a collective's tensor must agree on across ranks: the dtype, and the shape where it is one."""
    sig = _sig(args, kwargs)
    return sig if name in _SAME_SHAPE or not sig else (sig[1],)


class _Work:
    """A Work that logs its wait."""

    def __init__(self, work: Any, op: CommOp, log: list):
        self._work, self._op, self._log = work, op, log

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._log.append(("wait", self._op))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def recording(order_matched: bool = True) -> Iterator[list[tuple[str, CommOp]]]:
    """Patches torch.distributed's P2P and collective calls in this process while the block runs; yields
    the log: ("issue", op) and ("wait", op) in the order they happened (a blocking call logs both).
    `order_matched`: fmoe is told that its transport matches messages by issue order, as NCCL's and HCCL's
    do (fmoe.schedule.wire.TAG_MATCHED_BACKENDS emptied): what it issues on a device; False leaves gloo's
    own rule (receives leave the wire order)."""
    from fmoe.schedule import wire

    log: list[tuple[str, CommOp]] = []
    rank = dist.get_rank()
    saved = {name: getattr(dist, name) for name in (*_P2P, *_COLLECTIVES) if hasattr(dist, name)}

    def wrap(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(_local, "inside", False):  # a collective built from others: log the outer call
                return real(*args, **kwargs)
            group = kwargs.get("group")
            if name in _P2P:
                kind = "send" if "send" in name else "recv"
                peer = kwargs.get("dst" if kind == "send" else "src", args[1] if len(args) > 1 else None)
                if peer is None:  # given as a rank of the group
                    peer = dist.get_global_rank(group, kwargs["group_dst" if kind == "send" else "group_src"])
                op = CommOp(rank, len(log), kind, _comm_of(group), int(peer), int(kwargs.get("tag", 0)),
                            _sig(args, kwargs))
            else:
                op = CommOp(rank, len(log), "coll", _comm_of(group), None, 0,
                            (name, *_coll_sig(name, args, kwargs)))
            log.append(("issue", op))
            _local.inside = True
            try:
                out = real(*args, **kwargs)
            finally:
                _local.inside = False
            if kwargs.get("async_op") or name in ("isend", "irecv"):
                return _Work(out, op, log)
            log.append(("wait", op))
            return out

        return call

    for name, real in saved.items():
        setattr(dist, name, wrap(name, real))
    matched = wire.TAG_MATCHED_BACKENDS
    if order_matched:
        wire.TAG_MATCHED_BACKENDS = ()
    try:
        yield log
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)
        wire.TAG_MATCHED_BACKENDS = matched


def _match_key(op: CommOp, seq: dict) -> tuple:
    """The key an op shares with its match(es): (comm, src, dst, k) for P2P, (comm, k) for a collective."""
    if op.kind == "coll":
        base: tuple = ("coll", op.comm)
    else:
        src, dst = (op.rank, op.peer) if op.kind == "send" else (op.peer, op.rank)
        base = ("p2p", op.comm, src, dst)
    k = seq[(op.rank, base)]  # the op's place among this rank's ops of that kind
    seq[(op.rank, base)] += 1
    return (*base, k)


def _stream(op: CommOp, model: str) -> tuple:
    if model == "device":
        return ("device",)
    if op.kind == "coll":
        return ("coll", op.comm)
    return ("p2p", op.comm, min(op.rank, op.peer), max(op.rank, op.peer))


def replay(logs: dict[int, list[tuple[str, CommOp]]], model: str = "nccl") -> list[str]:
    """Returns the problems NCCL would meet running `logs` (rank -> its recorded log): mismatched messages
    or collectives, ops with no match, and a deadlock (each rank's blocking op); [] when none."""
    if model not in ("nccl", "device"):
        raise ValueError(f"model is 'nccl' or 'device', got {model!r}")
    problems: list[str] = []
    seq: dict = defaultdict(int)
    key_of: dict[CommOp, tuple] = {}
    members: dict[tuple, list[CommOp]] = defaultdict(list)
    for rank in sorted(logs):
        for ev, op in logs[rank]:
            if ev == "issue":
                key_of[op] = _match_key(op, seq)
                members[key_of[op]].append(op)
    for key, ops in members.items():
        want = len(key[1]) if key[0] == "coll" else 2
        if len(ops) != want:
            problems.append(f"{key[0]} {key}: issued by ranks {sorted(o.rank for o in ops)} only "
                            f"({want} expected)")
        elif len({(o.tag, o.sig) for o in ops}) > 1:
            problems.append(f"mismatch at {key}: " + " vs ".join(f"r{o.rank} {o.kind} tag {o.tag} {o.sig}"
                                                                  for o in ops))
    pos = dict.fromkeys(logs, 0)
    streams: dict[tuple, deque] = defaultdict(deque)  # (rank, stream) -> issued, not completed
    done: set[CommOp] = set()
    while True:
        progress = False
        for rank, log in logs.items():  # hosts run until they wait on an op that has not completed
            while pos[rank] < len(log):
                ev, op = log[pos[rank]]
                if ev == "issue":
                    streams[(rank, _stream(op, model))].append(op)
                elif op not in done:
                    break
                pos[rank] += 1
                progress = True
        heads = {q[0] for q in streams.values() if q}
        for op in list(heads):
            group = members[key_of[op]]
            if op not in done and all(o in heads for o in group) and len(group) == (
                    len(op.comm) if op.kind == "coll" else 2):
                for o in group:
                    done.add(o)
                    streams[(o.rank, _stream(o, model))].popleft()
                    heads.discard(o)
                progress = True
        if not progress:
            break
    stuck = {rank: log[pos[rank]][1] for rank, log in logs.items() if pos[rank] < len(log)}
    if stuck:
        problems.append("deadlock: " + "; ".join(
            f"r{r} waits on its {_describe(op)} behind {_describe(streams[(r, _stream(op, model))][0])}"
            for r, op in sorted(stuck.items())))
    return problems


def _describe(op: CommOp) -> str:
    if op.kind == "coll":
        return f"{op.sig[0]} on {op.comm} (op {op.index})"
    return f"{op.kind} {'to' if op.kind == 'send' else 'from'} r{op.peer} tag {op.tag} (op {op.index})"
