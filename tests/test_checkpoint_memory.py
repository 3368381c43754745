"""A checkpoint's save and load make no copy of the live tensors (issue 45, C4): the weights and AdamW's
moments go to DCP as they are, and DCP stages them through host memory one tensor at a time (its
FileSystemWriter's loaders copy a device tensor to the host, or clone a host view to its own elements;
its reader reads into host memory and copies into the target). The old save cloned every tensor on its
device first and the old load read into fresh device tensors: about 12 bytes per parameter at the peak.

Here DCP itself is replaced by a recorder (it would run on these CPU tensors, where the device is the
host) and a dispatch mode counts the bytes of every new storage fmoe's save and load allocate: a copy
of the state is its bytes again, views and in-place writes are none.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from fmoe.train import checkpoint


class _NewStorage(TorchDispatchMode):
    """Counts the bytes of op outputs whose storage none of the op's inputs had (fresh allocations)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.bytes += t.untyped_storage().nbytes()
        return out


def _items() -> dict[str, torch.Tensor]:
    """A rank's checkpoint items as `state_items` makes them: weights, two experts' rows (views of one
    leaf), AdamW's moments and step, the train step."""
    g = torch.Generator().manual_seed(0)
    w, experts = torch.randn(64, 32, generator=g), torch.randn(2, 32, 16, generator=g)
    items = {"model/w": w, "model/experts/expert0": experts[0], "model/experts/expert1": experts[1]}
    for name, t in list(items.items()):
        key = name.removeprefix("model/")
        items[f"optim/{key}/exp_avg"] = torch.randn(t.shape, generator=g)
        items[f"optim/{key}/exp_avg_sq"] = torch.rand(t.shape, generator=g)
        items[f"optim/{key}/step"] = torch.tensor(3.0)
    items["train/step"] = torch.tensor(7, dtype=torch.int64)
    return items


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_save_and_load_copy_no_tensor_of_the_state(tmp_path: Path, monkeypatch, one_rank) -> None:
    written: dict[str, torch.Tensor] = {}

    def save(state, checkpoint_id):  # DCP: what it was handed (its values copied after the count)
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        handed.update(state)

    def load(state, storage_reader):  # DCP: writes the saved values into the tensors it is handed
        for k, v in state.items():
            v.copy_(written[k])

    handed: dict[str, torch.Tensor] = {}
    monkeypatch.setattr(checkpoint, "_dcp", lambda: types.SimpleNamespace(save=save, load=load))
    items = _items()
    state_bytes = sum(t.numel() * t.element_size() for t in items.values())
    want = {k: v.clone() for k, v in items.items()}

    with _NewStorage() as during_save:
        checkpoint.save(tmp_path, 1, items, {})
    assert all(handed[k].untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
               for k, v in items.items()), "a save handed DCP copies, not the live tensors"
    written.update({k: v.clone() for k, v in handed.items()})

    for v in items.values():  # the run goes on: the live tensors change
        v.zero_()
    with _NewStorage() as during_load:
        checkpoint.load(tmp_path / "step_00000001", items, verified=True)
    for k, v in items.items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    # the old save cloned every tensor (state_bytes), the old load made a fresh one of each
    assert during_save.bytes < state_bytes / 10, (during_save.bytes, state_bytes)
    assert during_load.bytes < state_bytes / 10, (during_load.bytes, state_bytes)
