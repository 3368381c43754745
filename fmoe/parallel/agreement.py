"""Agreement: one cheap check, at setup, that every rank holds the same config, layout and parameter shapes.

Ranks that disagree are never caught by the collectives themselves: with different expert counts the
all-gather dispatcher returns rows of zeros without an error, and other mismatches abort a rank inside
gloo or read garbage split sizes. `agree(group, **things)` is the check, run once where the layout and
the dispatchers are built (not per layer or per step):

    agree(layout.group("expert"), config=cfg, params=local_params)   # or ParallelLayout(..., agree_on=...)

Each thing is described on its rank as a list of (path, text) entries, a canonical form that is the same
in every process for equal values:
  - a dataclass (MoEConfig, GPTConfig, Topology, ...): its type and each field, recursively;
  - a ParallelLayout (or any object, not a dataclass, with a `describe()` mapping): its sizes and topology
    (`ParallelLayout.describe()`), read through that method, so this module needs no layout;
  - a pytree of dicts / lists / tuples: one entry per leaf, keyed by its path (`params['experts']['w_up']`);
  - a tensor: its shape and dtype only (never its values or device), e.g. `Tensor[4, 8, 16] torch.float32`;
  - plain values (None, bool, int, float, str, bytes, enums, torch.dtype / device): their repr.
The ranks all-gather the sha256 digests of those descriptions once (`all_gather_object`); only when the
digests differ do they gather the descriptions of the things that differ, so the error can name the
differing entries. Every rank raises the same AgreementError, e.g.

    ranks [0, 2] and [1, 3] disagree on config:
      config.num_experts: 8 on ranks [0, 2], 4 on ranks [1, 3]

A thing one rank cannot describe (an unsupported type) is reported the same way, on every rank, rather
than leaving the others waiting in the gather.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import numbers
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from fmoe.parallel.collectives import CommGroup

Entries = list[tuple[str, str]]
MAX_LISTED = 8  # differing entries named per thing; the rest are counted
NOT_GIVEN = "<not given>"  # a thing (or an entry) one rank has and another has not


class AgreementError(ValueError):
    """Ranks of a group disagree on a config, a layout or parameter shapes; the message says which."""


def _leaf(x: Any) -> str | None:
    """The text of a plain value, None when `x` is not one."""
    if x is None or isinstance(x, (numbers.Number, str, bytes, enum.Enum)):
        return repr(x)
    if isinstance(x, (torch.dtype, torch.device)):
        return str(x)
    if isinstance(x, torch.Tensor):
        return f"Tensor{list(x.shape)} {x.dtype}"
    if isinstance(x, torch.Size):
        return f"Size{list(x)}"
    return None


def _self_described(x: Any) -> bool:
    """Whether `x` says what it is itself (`x.describe()`, a mapping: a ParallelLayout); dataclasses and
    types are described field by field."""
    return (callable(getattr(x, "describe", None)) and not isinstance(x, type)
            and not dataclasses.is_dataclass(x))


def describe(value: Any, path: str) -> Entries:
    """Return the canonical description of `value`: (path, text) per leaf, paths starting at `path`.

    Raises TypeError naming the path for a value that has no canonical form (see the module docstring).
    """
    text = _leaf(value)
    if text is not None:
        return [(path, text)]
    if _self_described(value):
        return [(path, f"<{type(value).__qualname__}>"),
                *(e for k, v in value.describe().items() for e in describe(v, f"{path}.{k}"))]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: Entries = [(path, f"<{type(value).__qualname__}>")]
        for f in dataclasses.fields(value):
            out += describe(getattr(value, f.name), f"{path}.{f.name}")
        return out
    if isinstance(value, Mapping):
        if not value:
            return [(path, "{}")]
        keys = sorted(value, key=lambda k: (type(k).__name__, repr(k)))
        return [e for k in keys for e in describe(value[k], f"{path}[{k!r}]")]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple: by field name
        return [(path, f"<{type(value).__qualname__}>"),
                *(e for k in value._fields for e in describe(getattr(value, k), f"{path}.{k}"))]
    if isinstance(value, (list, tuple)):
        if not value:
            return [(path, "[]" if isinstance(value, list) else "()")]
        return [e for i, v in enumerate(value) for e in describe(v, f"{path}[{i}]")]
    raise TypeError(f"agree: cannot describe {path} of type {type(value).__qualname__}; pass plain values, "
                    "dataclasses, ParallelLayouts, tensors or dicts / lists / tuples of them")


def digest(entries: Entries) -> str:
    """Return the sha256 hex digest of a description."""
    return hashlib.sha256(repr(entries).encode()).hexdigest()


def _ranks_text(classes: list[list[int]]) -> str:
    parts = [str(c) for c in classes]
    return "ranks " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])


def _classes(keys: list[Any], ranks: list[int]) -> list[tuple[Any, list[int]]]:
    """Group `ranks` by their key, in order of each group's first rank."""
    out: dict[Any, list[int]] = {}
    for k, r in zip(keys, ranks, strict=True):
        out.setdefault(k, []).append(r)
    return list(out.items())


def _explain(name: str, descs: list[Entries | None], ranks: list[int]) -> str:
    """The lines naming who disagrees on thing `name` and on which entries."""
    classes = _classes([None if d is None else digest(d) for d in descs], ranks)
    lines = [f"{_ranks_text([c for _, c in classes])} disagree on {name}:"]
    tables = [dict(d) if d is not None else None for d in descs]
    paths: list[str] = []
    for t in tables:
        for p in t or ():
            if p not in paths:
                paths.append(p)
    differing = []
    for p in paths:
        vals = [NOT_GIVEN if t is None else t.get(p, NOT_GIVEN) for t in tables]
        if len(set(vals)) > 1:
            differing.append((p, _classes(vals, ranks)))
    if not paths:  # the thing is missing on some ranks and empty on the others
        differing.append((name, _classes([NOT_GIVEN if t is None else "given" for t in tables], ranks)))
    for p, by in differing[:MAX_LISTED]:
        lines.append(f"  {p}: " + ", ".join(f"{v} on ranks {rs}" for v, rs in by))
    if len(differing) > MAX_LISTED:
        lines.append(f"  ... and {len(differing) - MAX_LISTED} more differing entries")
    return "\n".join(lines)


def agree(group: dist.ProcessGroup | CommGroup | None = None, **things: Any) -> None:
    """Check that every rank of `group` (default: the world) passed equal `things`; returns None.

    Collective: every rank of the group must call it, with the same keyword names. Costs one
    `all_gather_object` of a digest per thing (a second one, of the differing descriptions, only when
    ranks disagree). Raises AgreementError on every rank naming the ranks that disagree, on what and
    (up to MAX_LISTED entries per thing) where. Without an initialised process group there is no peer
    to disagree with: the things are only described (TypeError for an unsupported type).
    """
    pg = group.group if isinstance(group, CommGroup) else group
    local_error: BaseException | None = None
    descs: dict[str, Entries] = {}
    try:
        descs = {name: describe(value, name) for name, value in things.items()}
    except Exception as e:  # reported on every rank below, so no peer waits for us in the gather
        local_error = e
    if not dist.is_initialized():
        if local_error is not None:
            raise local_error
        return
    ranks = dist.get_process_group_ranks(pg or dist.group.WORLD)
    mine = (None if local_error is not None else {n: digest(d) for n, d in descs.items()},
            None if local_error is None else f"{type(local_error).__name__}: {local_error}")
    gathered: list[Any] = [None] * len(ranks)
    dist.all_gather_object(gathered, mine, group=pg)
    failed = [(r, err) for r, (_, err) in zip(ranks, gathered, strict=True) if err is not None]
    if failed:
        msg = "\n".join(f"rank {r} could not describe what it passed to agree: {err}" for r, err in failed)
        raise AgreementError(msg) from local_error
    digests = [d for d, _ in gathered]
    if all(d == digests[0] for d in digests):
        return
    names = sorted({n for d in digests for n in d})
    differing = [n for n in names if len({d.get(n) for d in digests}) > 1]
    shown: list[Any] = [None] * len(ranks)
    dist.all_gather_object(shown, {n: descs[n] for n in differing if n in descs}, group=pg)
    raise AgreementError("\n".join(_explain(n, [s.get(n) for s in shown], ranks) for n in differing))
