"""The wire order: the one order in which every rank issues its point-to-point sends and receives.

Legend: r rank, Dep a message's key (deps.py). NCCL ignores a message's tag and runs every send and receive
between two ranks on one stream in the order the host issued them (HCCL does the same): the k-th send from
a to b meets the k-th receive on b from a, and a receive holds up whatever the rank issues after it on that
stream. Posting receives wherever their consumer wants them (a gradient's receive right after its
forward, before the activation send) deadlocks every schedule there, and a receiver that consumes two
messages in another order than they were sent gets them swapped. Gloo matches by tag and never shows it.

The rule: every rank issues its P2P ops in the order of one global list of messages, the order in which
`verify.replay` (every rank as far as it can, in turn, with blocking receives) sends them. That list
orders each rank's sends as its own list does and puts every message after everything it depends on, so:
- per pair of ranks both sides issue the pair's messages in the same order (no mismatch, no two receives
  facing each other);
- across pairs and groups the issue orders of all ranks are parts of one total order, so even a device
  that runs every communicator's ops in issue order (one queue) cannot wait in a cycle;
- a rank can always issue its next op when it gets there: a send when its Send action runs; a receive no
  later than its consumer, and before any later send, with its buffer's shapes known (an ACT's from the
  stage's input spec; a GRAD's from this rank's own forward, which ran before the message it answers).
Receives may go out early, but never past an op that comes before them in the wire order, except on a
transport that matches by tag (`tag_matched`: gloo), where a posted receive holds nothing up and meets its
own message whatever came before it: there a receive goes out as soon as it is asked for (sends and the
receives not asked for early keep the wire order).
"""

from __future__ import annotations

import torch.distributed as dist

from fmoe.schedule.ir import Recv, Schedule, Send
from fmoe.schedule.verify import replay

TAG_MATCHED_BACKENDS = ("gloo",)
"""torch.distributed backends that match a point-to-point message by (peer, tag) and post a receive
without holding up the sender's next op: gloo (its pairs keep a buffer slot per tag). NCCL and HCCL match
by issue order on one stream."""


def wire_order(full: Schedule) -> tuple[tuple[Send | Recv, ...], ...]:
    """Returns, per rank, the P2P ops it issues in the order it must issue them (see the module doc);
    `full` is a schedule with explicit comms (verify's result)."""
    per_rank: list[list[Send | Recv]] = [[] for _ in full.ranks]
    for src, dst, dep in replay(full):
        per_rank[src].append(Send(dep.kind.value, dep.stage, dep.mb, dst))
        per_rank[dst].append(Recv(dep.kind.value, dep.stage, dep.mb, src))
    return tuple(tuple(ops) for ops in per_rank)



def tag_matched(group: dist.ProcessGroup | None) -> bool:
    """True when the P2P messages of `group` (None: the default group) are matched by tag
    (`TAG_MATCHED_BACKENDS`), so receives may leave the wire order (module docstring); False without a
    process group."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    return dist.get_backend(group) in TAG_MATCHED_BACKENDS
