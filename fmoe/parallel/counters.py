"""Communication counters: bytes this rank sends per collective and link class, and time spent waiting.

A `CommCounters` is an explicit object handed to the collectives (no module state); pass None to count
nothing. Bytes are logical payload bytes under a direct-exchange model: an all-to-all sends split j to
rank j; an all-gather sends this rank's chunk to every other rank; a reduce-scatter sends chunk j to
rank j; an all-reduce counts as reduce-scatter + all-gather. Bytes to oneself are not counted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from fmoe.parallel.topology import LINK_CLASSES


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
