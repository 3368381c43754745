"""Communication counters: bytes this rank sends per collective and link class, and time spent waiting.

A `CommCounters` is an explicit object handed to the collectives (no module state); pass None to count
nothing. Bytes are logical payload bytes under a direct-exchange model: an all-to-all sends split j to
rank j; an all-gather sends this rank's chunk to every other rank; a reduce-scatter sends chunk j to
rank j; an all-reduce counts as reduce-scatter + all-gather. Bytes to oneself are not counted.
`all_gather_sent`, `reduce_scatter_sent` and `all_reduce_sent` are that model as formulas (the bytes one
rank sends for a collective of a given total size): the collectives count with them and the planner
(fmoe/plan/layer_costs.py) prices with them, so the two cannot drift apart.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from fmoe.parallel.topology import LINK_CLASSES


def all_gather_per_peer(total_bytes: int, P: int) -> int:
    """Returns the bytes one rank sends each peer in an all-gather whose result has `total_bytes` on P
    ranks: its own chunk."""
    return total_bytes // P


def reduce_scatter_per_peer(total_bytes: int, P: int) -> int:
    """Returns the bytes one rank sends each peer in a reduce-scatter of `total_bytes` (the input) on P
    ranks: the peer's chunk of it."""
    return total_bytes // P


def all_reduce_per_peer(total_bytes: int, P: int) -> int:
    """Returns the bytes one rank sends each peer in an all-reduce of `total_bytes` on P ranks: a
    reduce-scatter's chunk plus an all-gather's."""
    return 2 * total_bytes // P


def all_gather_sent(total_bytes: int, P: int) -> int:
    """Returns the bytes one rank sends in an all-gather of `total_bytes` (the result) on P ranks:
    (P - 1) / P of it."""
    return (P - 1) * all_gather_per_peer(total_bytes, P)


def reduce_scatter_sent(total_bytes: int, P: int) -> int:
    """Returns the bytes one rank sends in a reduce-scatter of `total_bytes` (the input) on P ranks:
    (P - 1) / P of it."""
    return (P - 1) * reduce_scatter_per_peer(total_bytes, P)


def all_reduce_sent(total_bytes: int, P: int) -> int:
    """Returns the bytes one rank sends in an all-reduce of `total_bytes` on P ranks: 2 (P - 1) / P of
    it."""
    return (P - 1) * all_reduce_per_peer(total_bytes, P)


@dataclass
class CommCounters:
    """Bytes sent per (collective, link class), calls per collective, seconds waited per collective."""

    sent: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wait_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add_sent(self, op: str, link: str, nbytes: int) -> None:
        """Count `nbytes` sent by collective `op` over links of class `link`."""
        if link not in LINK_CLASSES:
            raise ValueError(f"unknown link class {link!r}")
        self.sent[(op, link)] += int(nbytes)

    def add_call(self, op: str) -> None:
        """Count one issue of collective `op`."""
        self.calls[op] += 1

    def add_wait(self, op: str, seconds: float) -> None:
        """Count `seconds` spent blocked in wait() on collective `op`."""
        self.wait_s[op] += seconds

    def bytes_by_link(self) -> dict[str, int]:
        """Return {link class: bytes sent} summed over collectives."""
        out = {link: 0 for link in LINK_CLASSES}
        for (_, link), n in self.sent.items():
            out[link] += n
        return out

    def total_wait_s(self) -> float:
        """Seconds spent waiting on all collectives."""
        return sum(self.wait_s.values())

    def reset(self) -> None:
        """Zero every counter."""
        self.sent.clear()
        self.calls.clear()
        self.wait_s.clear()

    def as_dict(self) -> dict[str, object]:
        """A plain, picklable summary: bytes per link, bytes per op and link, calls, wait seconds."""
        return {
            "bytes_by_link": self.bytes_by_link(),
            "sent": {f"{op}/{link}": n for (op, link), n in sorted(self.sent.items())},
            "calls": dict(self.calls),
            "wait_s": dict(self.wait_s),
        }
