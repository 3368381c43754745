"""Read a torch.distributed.checkpoint `.metadata` file without running what a crafted one holds.

torch 2.13's `FileSystemReader.read_metadata` is `pickle.load` of `DIR/.metadata`: a checkpoint someone
shares can run any code on every rank that loads it (torch.load's `weights_only` does not apply there).
`read_metadata` unpickles with a `find_class` that knows only what DCP's own metadata is made of, and
`SafeFileSystemReader` is DCP's reader with that read plugged in (`dcp.load(..., storage_reader=...)`).

The allowed set is what a real `.metadata` of `fmoe train` holds, found by unpickling the checkpoints of
a one-process run and of a pp 2 x ep 2 --fp16 --mtp ZeRO-1 run with a recording `find_class`: DCP's
metadata dataclasses, the per-shard `_StorageInfo`, `torch.Size`, dtypes, `torch.serialization.
_get_layout` (how torch pickles a layout: a dict lookup by name) and `pathlib` paths (`StorageMeta.
checkpoint_id`). Nothing there opens a file or calls into the interpreter. Checked on torch 2.13.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from fmoe.train.run_errors import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset({"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                              "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                              "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
}


class MetadataRefused(pickle.UnpicklingError):
    """A `.metadata` pickle that names something other than DCP's metadata classes."""


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        # dtypes are attributes of torch (torch.float32, ...), not classes: allow exactly those
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise MetadataRefused(f"refused to unpickle {module}.{name}: not part of a checkpoint's metadata")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """Returns the DCP Metadata in file `path`; CheckpointError when the pickle names anything outside
    `ALLOWED` (nothing it names is called) or is not DCP metadata."""
    data = Path(path).read_bytes()
    try:
        md = _Restricted(io.BytesIO(data)).load()
    except MetadataRefused as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except Exception as exc:  # a truncated or garbled pickle
        raise CheckpointError(f"{path}: not a readable checkpoint metadata file "
                              f"({type(exc).__name__}: {exc})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path}: holds a {type(md).__name__}, not a checkpoint's Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `read_metadata` through the restricted unpickler (the tensors themselves
    are read with torch.load(weights_only=True) by DCP already)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP's fallback: the rank-local metadata file of a no-collective save
        md = read_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(md, "storage_meta", None) is None:  # as FileSystemReader does
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
