"""Which weights one rank holds, under global names, and how their gradients are reduced.

Every rank draws only its share of the model from the seed's keyed draws (fmoe/gpt_init.py: the leaves of
its pipeline stages, its tensor-parallel part, the experts of its expert rank: rows [e0, e0 + L) of each
[E, ...] expert tensor), so every layout starts from the same weights, and trains those leaves. A leaf's
key is its path in `init_gpt`'s tree joined by dots
("layers.3.moe.experts.w_up"): the same name in every layout, which is what checkpoints store.

Gradient reduction (expert parallelism is carved out of data parallelism): a stage's non-expert
gradients are summed over the "data" group (dp x ep ranks, each with its own microbatches), a rank's
expert gradients over "dp" only (its experts already received every EP rank's tokens); both are then
divided by dp x ep, so the step's gradient is that of the mean loss over all microbatches. The global
gradient norm counts every weight once: a leaf counts on the lowest pipeline rank that holds it, on data
rank 0 (dense) or on dp rank 0 (experts, whose EP ranks hold different rows).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fmoe.config import GPTConfig
from fmoe.tp_layout import tp_split_axis

Path = tuple[str, ...]
BUCKET_BYTES = 16 * 2**20  # gradient all-reduce bucket size


@dataclass(frozen=True)
class Leaf:
    """One trained tensor of this rank: `key` (global name), `where` (its position in the params tree:
    keys and list indices), `expert` (sharded by EP along dim 0; row 0 is global expert `expert_offset`),
    `counts` (this rank counts it in the global gradient norm) and `decay` (weight decay applies)."""

    key: str
    where: tuple[str | int, ...]
    expert: bool
    expert_offset: int
    counts: bool
    decay: bool
    nbytes: int


def _walk(node: Any, where: tuple[str | int, ...]) -> Iterable[tuple[tuple[str | int, ...], torch.Tensor]]:
    if isinstance(node, dict):
        for k in node:
            yield from _walk(node[k], (*where, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, (*where, i))
    elif isinstance(node, torch.Tensor):
        yield where, node


def get(tree: Any, where: tuple[str | int, ...]) -> Any:
    """Returns the node of `tree` at `where` (dict keys and list indices)."""
    for k in where:
        tree = tree[k]
    return tree


def key_of(where: tuple[str | int, ...]) -> str:
    """Returns the global name of a tree position: its parts joined by dots."""
    return ".".join(str(k) for k in where)


def _tree_where(path: Path) -> tuple[str | int, ...]:
    return tuple(int(k) if i == 1 and path[0] == "layers" else k for i, k in enumerate(path))


def decays(where: tuple[str | int, ...]) -> bool:
    """Whether weight decay applies to the leaf at `where` (not to norms and biases)."""
    # Norm gains and biases are not decayed (Megatron's rule): "norm", "attn_norm", "mlp.norm",
    # "mtp.hidden_norm", ... The router's expert bias is state, not a parameter: it never gets here.
    name = str(where[-1])
    named_norm = name.endswith("norm") or (len(where) > 1 and str(where[-2]).endswith("norm"))
    return not (named_norm or name.startswith("b_") or name == "bias")


def rank_leaves(params: dict[str, Any], cfg: GPTConfig, paths: Iterable[Path],
                holders: dict[Path, tuple[int, ...]] | None, *, pp_rank: int, ep_rank: int,
                num_local_experts: int, counts_dense: bool, counts_expert: bool,
                tp_rank: int = 0) -> list[Leaf]:
    """Returns the leaves of `params` under the parameter paths `paths` (those of this rank's stages), in
    order, each once. `holders` (path -> pipeline ranks; None: one pipeline rank) decides which pipeline
    rank counts a shared leaf in the norm; `counts_dense` / `counts_expert`: whether this rank is the data
    rank (dense) / dp rank (experts) that counts its leaves. `ep_rank`: the rank in the ep x tp expert
    group (its experts' first row); `tp_rank`: a leaf replicated over the tensor-parallel ranks counts on
    tp rank 0 only (a split one, fmoe/tp_layout.py, and the experts count on each)."""
    out: dict[str, Leaf] = {}
    for path in paths:
        first_holder = holders is None or min(holders[path]) == pp_rank
        for where, t in _walk(get(params, _tree_where(path)), _tree_where(path)):
            key = key_of(where)
            expert = "experts" in where and "moe" in where
            counts = first_holder and (counts_expert if expert else counts_dense) and (
                expert or tp_rank == 0 or tp_split_axis(where) is not None)
            out.setdefault(key, Leaf(key, where, expert, ep_rank * num_local_experts if expert else 0,
                                     counts, decays(where), t.numel() * t.element_size()))
    return list(out.values())


class GradientReducer:
    """Sums this rank's gradients over the ranks holding the same weights and reading other data (dense
    leaves over `data_group`, experts over `dp_group`; None: no reduction), then divides by `data_ranks`.

    Buckets of at most BUCKET_BYTES are fixed at construction from `order` (leaf keys, the order their
    gradients become final; default: reversed, the order a backward produces them) and issued strictly
    in bucket order, so every rank of a group issues the same all-reduces in the same order. `ready`
    marks gradients final and issues every complete bucket whose predecessors are issued (the training
    loop calls it from gradient-accumulation hooks during the last microbatch's backward, as DDP
    overlaps its all-reduce with it, or as pipeline stages finish their last weight gradient); `finish`
    issues the rest, waits, and writes the sums back. `early` counts the buckets issued before `finish`."""

    def __init__(self, leaves: list[Leaf], *, data_group: Any, dp_group: Any, data_ranks: int,
                 order: list[str] | None = None):
        self.data_ranks = data_ranks
        self.leaves = leaves
        by_key = {lf.key: lf for lf in leaves}
        ordered = [by_key[k] for k in order] if order is not None else list(reversed(leaves))
        if len(ordered) != len(leaves) or {lf.key for lf in ordered} != set(by_key):
            raise ValueError("GradientReducer: `order` must list every leaf key once")
        self.buckets: list[tuple[Any, list[str]]] = []
        for group, expert in ((data_group, False), (dp_group, True)):
            if group is None or dist.get_world_size(group) == 1:
                continue
            for bucket in _buckets([lf for lf in ordered if lf.expert == expert]):
                self.buckets.append((group, [lf.key for lf in bucket]))
        self._works: list[tuple[list[torch.Tensor], torch.Tensor, Any]] = []
        self._grads: dict[str, torch.Tensor] = {}
        self.early = 0

    def ready(self, grads: dict[str, torch.Tensor]) -> None:
        """Marks `grads` (key -> final gradient) ready and issues the buckets that are now complete."""
        self._grads.update(grads)
        while len(self._works) < len(self.buckets) and all(
                k in self._grads for k in self.buckets[len(self._works)][1]):
            self._issue()
            self.early += 1

    def _issue(self) -> None:
        group, keys = self.buckets[len(self._works)]
        bucket = [self._grads[k] for k in keys]
        flat = torch.cat([g.reshape(-1) for g in bucket])
        self._works.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))

    def finish(self, grads: dict[str, torch.Tensor]) -> None:
        """Issues the buckets not issued yet (from `grads`, key -> gradient), waits for all and writes
        the sums into the gradients in place, then divides every leaf's gradient by data_ranks. Resets
        for the next step."""
        for k, g in grads.items():
            if k in self._grads and self._grads[k] is not g:
                raise RuntimeError(f"GradientReducer: the gradient of {k} changed after it was marked ready")
        self._grads.update(grads)
        while len(self._works) < len(self.buckets):
            self._issue()
        for bucket, flat, work in self._works:
            work.wait()
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._works, self._grads = [], {}
        if self.data_ranks > 1:
            for lf in self.leaves:
                grads[lf.key].div_(self.data_ranks)


def _buckets(leaves: list[Leaf]) -> Iterable[list[Leaf]]:
    """Groups consecutive leaves into lists of at most BUCKET_BYTES of gradient (one leaf alone may
    exceed it); the sizes come from the leaves' shapes and dtypes."""
    bucket: list[Leaf] = []
    size = 0
    for t in leaves:
        nbytes = t.nbytes
        if bucket and size + nbytes > BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def global_grad_norm(leaves: list[Leaf], grads: dict[str, torch.Tensor], group: Any) -> torch.Tensor:
    """Returns the L2 norm (float64 0-dim) of the whole model's gradient: each rank sums the squares of
    the leaves it counts, and the sums are added over `group` (the world; None: this process alone)."""
    device = next(iter(grads.values())).device if grads else torch.device("cpu")
    counted = [grads[lf.key] for lf in leaves if lf.counts]
    total = torch.zeros((), dtype=torch.float64, device=device)
    if counted:  # one fused (foreach) norm over the leaves, squared: the sums add over ranks
        total += torch.nn.utils.get_total_norm(counted, 2.0, foreach=True).double().square()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt()
