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

from fmoe.parallel.topology import INTER, INTRA


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


_LINK_FIELDS = {"intra": "intra_bytes_per_s", "inter": "inter_bytes_per_s",
                "intra_latency": "intra_latency_s", "inter_latency": "inter_latency_s"}


def parse_link_model(text: str) -> LinkModel:
    """Returns the LinkModel of "intra=BYTES_PER_S,inter=BYTES_PER_S[,intra_latency=S,inter_latency=S]"
    (fields left out keep LinkModel's defaults). Raises ValueError naming a bad field or value."""
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in _LINK_FIELDS:
            names = ", ".join(f"{k}=..." for k in _LINK_FIELDS)
            raise ValueError(f"--link-model: {item!r} is not one of {names}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--link-model: {key}={value!r} is not a number") from None
        latency = key.strip().endswith("latency")
        if not (number >= 0 if latency else number > 0) or number != number or number == float("inf"):
            raise ValueError(f"--link-model: {key} must be {'>= 0' if latency else '> 0'} and finite, "
                             f"got {value}")
        values[_LINK_FIELDS[key.strip()]] = number
    if not values:
        raise ValueError("--link-model: give at least one of intra=, inter=, intra_latency=, inter_latency=")
    return LinkModel(**values)
