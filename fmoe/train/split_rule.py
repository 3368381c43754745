"""Megatron's `--split`: the (train, valid, test) fractions of a "969,30,1" string and the index ranges they
cut, for windows of a token file and documents of an indexed dataset alike (fmoe.train.splits,
fmoe.train.documents). No imports of the training job: both data layers read it.
"""

from __future__ import annotations

import re


def parse_split(text: str) -> tuple[float, float, float]:
    """Returns the normalized (train, valid, test) weights of a `--split` string such as "969,30,1" or
    "98,2" (missing weights are 0), as Megatron's parse_and_normalize_split; ValueError naming the flag."""
    numbers = re.findall(r"[^,/\s]+", text)
    try:
        weights = [float(x) for x in numbers]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(not w >= 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"--split must be 1 to 3 weights >= 0 'train,valid,test' with a positive sum (e.g. "
                         f"969,30,1), got {text!r}")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


def split_bounds(num_windows: int, split: str) -> tuple[range, range, range]:
    """Returns the window ranges (train, valid, test) of `split` over `num_windows` windows."""
    train, valid, _ = parse_split(split)
    a = int(round(train * num_windows))
    b = int(round((train + valid) * num_windows))
    return range(0, a), range(a, b), range(b, num_windows)
