"""Integer index helpers shared by fmoe/ (capacity layouts) and fmoe/parallel/ (row bookkeeping).

Legend (docs/moe.md): X, Y generic axes.
"""

from __future__ import annotations

import torch


def exclusive_cumsum(n_X: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Return start_X (int64, n_X's shape): start_X[i] = sum(n_X[:i]) along `dim` (0 at i = 0).

    With counts per chunk, start_X[i] is the first row of chunk i when the chunks are laid out in order.
    """
    n_X = n_X.to(torch.int64)
    return torch.cumsum(n_X, dim) - n_X
