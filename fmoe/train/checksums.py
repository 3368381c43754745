"""A sha256 per file of a checkpoint, written at save and checked at load.

    share = digest_share(directory, rank, world)   # each rank hashes every world-th file
    write(directory, {**share_of_rank_0, ...})     # rank 0, before the checkpoint becomes `latest`
    problem = check_share(directory, rank, world)  # None, or one line naming the file

`checksums.json` maps each file of the checkpoint directory (DCP's shards and `.metadata`, and
`meta.json`) to {"sha256", "bytes"}. Ranks split the files so the hashing of a large checkpoint runs in
parallel; the split is a function of the sorted names alone, so every rank agrees on it without talking.
Pure file functions: the collectives are in fmoe/train/checkpoint.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

CHECKSUMS = "checksums.json"
_CHUNK = 1 << 20


def digest(path: str | os.PathLike) -> dict[str, Any]:
    """Returns {"sha256": hex, "bytes": size} of the file at `path`."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"sha256": h.hexdigest(), "bytes": size}


def _share(names: list[str], rank: int, world: int) -> list[str]:
    return [n for i, n in enumerate(sorted(names)) if i % world == rank]


def digest_share(directory: str | os.PathLike, rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Returns the digests of this rank's share of the regular files in `directory` (the manifest itself
    left out)."""
    root = Path(directory)
    names = [p.name for p in root.iterdir() if p.name != CHECKSUMS and stat.S_ISREG(os.lstat(p).st_mode)]
    return {n: digest(root / n) for n in _share(names, rank, world)}


def write(directory: str | os.PathLike, files: dict[str, dict[str, Any]]) -> None:
    """Writes `directory`/checksums.json for `files` (name -> digest)."""
    body = {"format": 1, "algorithm": "sha256", "files": dict(sorted(files.items()))}
    (Path(directory) / CHECKSUMS).write_text(json.dumps(body, indent=1) + "\n")


def recorded(directory: str | os.PathLike) -> dict[str, dict[str, Any]] | None:
    """Returns the recorded digests of `directory` (name -> digest), None when it has no checksums.json
    (a checkpoint written before fmoe recorded them); ValueError for an unreadable one."""
    path = Path(directory) / CHECKSUMS
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        if not all(isinstance(d, dict) and {"sha256", "bytes"} <= set(d) for d in files.values()):
            raise ValueError("an entry lacks sha256 or bytes")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from None
    return files


def check_share(directory: str | os.PathLike, files: dict[str, dict[str, Any]], rank: int,
                world: int) -> str | None:
    """Checks this rank's share of the recorded `files` in `directory`; returns one line naming the first
    file that is missing, not a regular file, of another size or another sha256, else None."""
    root = Path(directory)
    for name in _share(list(files), rank, world):
        path, want = root / name, files[name]
        if os.sep in name or name in ("", ".", ".."):
            return f"{root / CHECKSUMS} names {name!r}, not a file of the checkpoint"
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return f"{path} is missing (recorded in {CHECKSUMS})"
        if not stat.S_ISREG(mode):
            return f"{path} is not a regular file (a symlink?): refusing to read through it"
        got = digest(path)
        if got["bytes"] != want["bytes"]:
            return f"{path}: checksum mismatch: {got['bytes']} bytes, {want['bytes']} when saved (truncated?)"
        if got["sha256"] != want["sha256"]:
            return (f"{path}: checksum mismatch: sha256 {got['sha256'][:16]}..., "
                    f"saved {want['sha256'][:16]}...")
    return None
