"""The Exchange protocol (fmoe/dispatch/exchange.py): every dispatcher declares its capabilities, the MoE
phases ask those, and a dispatcher with only dispatch / combine runs through the one adapter.

Legend (docs/moe.md): T tokens, D width, E experts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_parallel_moe import RowsOnly

from fmoe.config import MoEConfig
from fmoe.dispatch.local import LocalDispatcher
from fmoe.dispatch.sync import InlineRows, as_exchange
from fmoe.layer import init_moe, uses_token_dispatch
from fmoe.model import moe
from fmoe.outline import alone
from fmoe.parallel import AllGatherDispatcher, AllToAllDispatcher, HierarchicalDispatcher
from fmoe.parallel.context import ParallelContext
from fmoe.phases import exchange_of, moe_layer
from fmoe.transforms.testing import assert_close

E = 4
DROPLESS = MoEConfig(d_model=8, d_ff=8, num_experts=E, top_k=2)
IN_EXPERT = MoEConfig(d_model=8, d_ff=8, num_experts=E, top_k=2, probs_in_expert=True)
COMM = SimpleNamespace(size=2, rank=0)  # the dispatchers only keep their group until they exchange


SyncOnly = RowsOnly  # a research script's dispatcher: the synchronous Dispatcher protocol and nothing else


def _dispatchers() -> dict:
    return {"local": LocalDispatcher(E), "alltoall": AllToAllDispatcher(COMM, E),
            "allgather": AllGatherDispatcher(COMM, E), "hierarchical": HierarchicalDispatcher(COMM, COMM, E),
            "sync_only": SyncOnly(LocalDispatcher(E))}


def test_each_dispatcher_declares_its_capabilities() -> None:
    got = {name: (ex.local, ex.splits_rows, ex.token_level(DROPLESS), ex.token_level(IN_EXPERT))
           for name, ex in ((n, as_exchange(d)) for n, d in _dispatchers().items())}
    assert got == {"local": (True, False, False, False), "alltoall": (False, True, False, False),
                   "allgather": (False, False, False, False),
                   "hierarchical": (False, False, True, False), "sync_only": (True, False, False, False)}


def test_the_phases_drive_what_the_dispatcher_declares() -> None:
    ds = _dispatchers()
    for name, d in ds.items():
        ex, tokens = exchange_of(d, DROPLESS)
        assert tokens == uses_token_dispatch(d, DROPLESS) == (name == "hierarchical"), name
        assert ex.whole_tokens if tokens else type(ex) is type(as_exchange(d)), name
    assert isinstance(as_exchange(ds["sync_only"]), InlineRows)
    assert exchange_of(ds["hierarchical"], IN_EXPERT) == (ds["hierarchical"], False)


@pytest.mark.parametrize("name", ["allgather", "hierarchical"])
def test_self_overlap_needs_an_exchange_that_splits_rows(name) -> None:
    with pytest.raises(ValueError, match="splits an all-to-all's rows"):
        moe_layer(DROPLESS, alone("moe"), ParallelContext(dispatcher=_dispatchers()[name]), 2, bare=True)
    moe_layer(DROPLESS, alone("moe"), ParallelContext(dispatcher=_dispatchers()["alltoall"]), 2, bare=True)


def test_a_dispatcher_with_dispatch_and_combine_only_runs_inline() -> None:
    params = init_moe(DROPLESS, torch.Generator().manual_seed(0))
    x_TD = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y_ref, _ = moe(params, x_TD, DROPLESS)
    y, _ = moe(params, x_TD, DROPLESS, dispatcher=SyncOnly(LocalDispatcher(E)))
    assert_close(y, y_ref)
    (dx,) = torch.autograd.grad(y.sum(), x_TD)
    (dx_ref,) = torch.autograd.grad(y_ref.sum(), x_TD)
    assert_close(dx, dx_ref)
