"""An opt-in latency/bandwidth model that makes a collective complete as late as a slower interconnect.

On CPU, gloo over loopback is fast and uniform, so hiding communication behind compute can't be seen.
With a `LinkModel`, a collective's wait handle does not complete before
`issue_time + max over link classes used (latency + bytes_sent / bandwidth)`: a rank's transfers over
its intra-node and inter-node links run in parallel, each class paying its own latency and bandwidth.
Work done between issue and wait hides that delay, exactly as it would hide a real transfer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fmoe.parallel.mesh import INTER, INTRA


@dataclass(frozen=True)
class LinkModel:
    """Per-link-class latency (seconds) and bandwidth (bytes per second) for simulated delays."""

    intra_latency_s: float = 5e-6
    intra_bytes_per_s: float = 150e9
    inter_latency_s: float = 20e-6
    inter_bytes_per_s: float = 25e9

    def duration(self, sent_by_link: Mapping[str, int]) -> float:
        """Return the modelled seconds for a collective sending `sent_by_link` ({link class: bytes})."""
        t = 0.0
        for link, nbytes in sent_by_link.items():
            if nbytes <= 0:
                continue
            if link == INTRA:
                t = max(t, self.intra_latency_s + nbytes / self.intra_bytes_per_s)
            elif link == INTER:
                t = max(t, self.inter_latency_s + nbytes / self.inter_bytes_per_s)
            else:
                raise ValueError(f"unknown link class {link!r}")
        return t
