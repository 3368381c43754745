"""Process layout: the dp / pp / ep / tp process groups from a DeviceMesh.

Which ranks share a node (`Topology`) and the layout rules that need no process group (`check_layout`) are
plain values of fmoe.parallel.topology. `ParallelLayout` builds one
`torch.distributed.device_mesh` with dims ("pp", "cp", "dp", "ep_inter", "ep_intra", "tp") (tp innermost,
so tp ranks are neighbours on a node; cp outside dp and ep, so every group flattened here is a run of
adjacent dims: Megatron puts cp inside ep, nearer tp, for its ring's locality) and hands out its groups
by name; rank arithmetic is left to the mesh. The expert group is ep x tp flattened: with TP-extends-EP
(MISSION.md feature 21) the tp ranks own different experts instead of slices of the same ones. Context
parallelism (cp) splits each sequence over its ranks: they read the same data and hold the same weights
(experts too), so gradients are summed over `data_cp` (dense) and `dp_cp` (experts).

`ep_over_cp` lays the expert group over the data x context ranks instead, as Megatron carves EP from
dp x cp: two meshes over the same ranks, the dense one (pp, dp, cp, tp) with dp the ranks reading
different data, and the expert one (pp, edp, ep_inter, ep_intra, tp) with edp = dp x cp / ep, the same
rank order (cp faster than dp), so an expert group is ep consecutive cp ranks (spanning dp ranks when ep
> cp) and the cp ranks share the experts instead of each holding them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fmoe._compat import flatten_mesh, group_options
from fmoe.parallel.agreement import agree
from fmoe.parallel.topology import Topology, check_layout


class ParallelLayout:
    """Process groups by name ("dp", "pp", "tp", "ep", "expert", "expert_intra", "expert_inter", "data").

    `expert` is ep x tp flattened (the group dispatchers exchange tokens over); `expert_intra` and
    `expert_inter` split it into the ranks of this node and the ranks with the same node-local position
    on the other nodes (the two stages of hierarchical dispatch). `data` is dp x ep: the ranks that hold
    the same non-expert weights of one pipeline stage and read different data. `cp`: the ranks that
    split one sequence; `data_cp` (dp x cp x ep) and `dp_cp` (dp x cp) are the groups the dense and the
    expert gradients are summed over (`data` and `dp` without context parallelism). Must be built by
    every rank, after `init_process_group`, with the same arguments.

    `agree_on`: None (default) checks nothing. A mapping (`{}` for the layout alone, or e.g.
    `{"config": cfg, "params": params}`) makes construction first run `fmoe.parallel.agree` over the
    world with `layout=self` and those things, before any group is built: every rank raises the same
    AgreementError naming the ranks that disagree, instead of building mismatched groups. Give
    `params` here only when every rank holds the same shapes (no pipeline split; else agree per stage,
    e.g. `agree(layout.group("expert"), params=p)`).

    `ep_over_cp`: the expert group carved from the dp x cp ranks (Megatron's layout; the module's
    docstring): world = pp x dp x cp x tp, `dp` the ranks reading different data, ep dividing dp x cp;
    `data` is then those dp ranks, `data_cp` dp x cp, and `dp` = `dp_cp` the dp x cp / ep ranks holding
    the same experts.

    `timeout`: how long an op of any of its groups may wait for a peer before the group fails it (gloo
    raises; NCCL's watchdog aborts). None: torch's default for each new group (30 minutes on gloo, 10 on
    NCCL), not the world's. Give the world's (`init_process_group(timeout=)`): groups spanning the whole
    world are the default group itself.
    """

    DIMS = ("pp", "cp", "dp", "ep_inter", "ep_intra", "tp")
    CARVED_DIMS = ("pp", "dp", "cp", "tp")  # ep_over_cp: the dense mesh (cp faster than dp, as Megatron)
    EXPERT_DIMS = ("pp", "edp", "ep_inter", "ep_intra", "tp")  # ep_over_cp: the expert mesh

    def __init__(self, *, tp: int = 1, ep: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1,
                 topology: Topology | None = None, device_type: str = "cpu",
                 agree_on: Mapping[str, Any] | None = None, timeout: timedelta | None = None,
                 ep_over_cp: bool = False):
        ws = dist.get_world_size()
        dp = dp if dp is not None else ws // (tp * pp * cp * (1 if ep_over_cp else ep))
        self.tp, self.ep, self.pp, self.dp, self.cp = tp, ep, pp, dp, cp
        self.ep_over_cp = ep_over_cp
        self.device_type = device_type
        if agree_on is not None:  # before any check or group, so that every rank fails the same way
            if "layout" in agree_on:
                raise ValueError("ParallelLayout: agree_on must not name 'layout' (the layout itself is "
                                 "checked)")
            self.topology = topology or Topology.from_env(ws)
            agree(None, layout=self, **agree_on)
        self.topology = topology or Topology.from_env(ws)
        ep_intra = check_layout(ws, tp=tp, ep=ep, pp=pp, dp=dp, cp=cp,
                                ranks_per_node=self.topology.ranks_per_node, ep_over_cp=ep_over_cp)
        # every group smaller than the world is created with `timeout`; a group of the whole world is the
        # default group itself (torch reuses it only when given no options), which has the world's
        options = None if timeout is None else group_options(device_type, timeout)

        def opts(size: int) -> Any:
            return options if size < ws else None

        def mesh_of(dims: tuple[str, ...], shape: tuple[int, ...]) -> DeviceMesh:
            override = {d: o for d, n in zip(dims, shape, strict=True) if (o := opts(n)) is not None}
            return init_device_mesh(device_type, shape, mesh_dim_names=dims,
                                    backend_override=override or None)

        def flat(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
            sub = mesh[dims]
            return flatten_mesh(sub, name, opts(sub.size()))

        if ep_over_cp:
            self.mesh = mesh_of(self.CARVED_DIMS, (pp, dp, cp, tp))
            shape = (pp, dp * cp // ep, ep // ep_intra, ep_intra, tp)
            # the same ranks in the same order, factored (edp, ep) instead of (dp, cp)
            experts = DeviceMesh(device_type, torch.arange(ws).reshape(shape),
                                 mesh_dim_names=self.EXPERT_DIMS,
                                 backend_override=tuple((None, opts(n)) for n in shape))
            expert_replicas = experts["edp"]
            self._meshes: dict[str, DeviceMesh] = {
                "data": self.mesh["dp"], "data_cp": flat(self.mesh, ("dp", "cp"), "data_cp"),
                "dp": expert_replicas, "dp_cp": expert_replicas}
        else:
            self.mesh = mesh_of(self.DIMS, (pp, cp, dp, ep // ep_intra, ep_intra, tp))
            experts = self.mesh
            self._meshes = {"dp": self.mesh["dp"],
                            "data": flat(self.mesh, ("dp", "ep_inter", "ep_intra"), "data")}
            if cp > 1:  # every rank builds these (a collective), only when they differ from data / dp
                self._meshes["data_cp"] = flat(self.mesh, ("cp", "dp", "ep_inter", "ep_intra"), "data_cp")
                self._meshes["dp_cp"] = flat(self.mesh, ("cp", "dp"), "dp_cp")
            else:
                self._meshes["data_cp"], self._meshes["dp_cp"] = self._meshes["data"], self._meshes["dp"]
        self._meshes.update({
            "pp": self.mesh["pp"], "tp": self.mesh["tp"], "cp": self.mesh["cp"],
            "ep": flat(experts, ("ep_inter", "ep_intra"), "ep"),
            "expert": flat(experts, ("ep_inter", "ep_intra", "tp"), "expert"),
            "expert_intra": flat(experts, ("ep_intra", "tp"), "expert_intra"),
            "expert_inter": experts["ep_inter"],
        })

    def describe(self) -> dict[str, Any]:
        """Return what ranks must agree on (`fmoe.parallel.agree`): sizes, world size, topology, device."""
        return {"tp": self.tp, "ep": self.ep, "pp": self.pp, "dp": self.dp, "cp": self.cp,
                "ep_over_cp": self.ep_over_cp,
                "world_size": dist.get_world_size(), "topology": self.topology,
                "device_type": self.device_type}

    def group(self, name: str) -> dist.ProcessGroup:
        """Return the process group called `name` that contains this rank."""
        if name not in self._meshes:
            raise KeyError(f"ParallelLayout.group: unknown group {name!r}; have {sorted(self._meshes)}")
        return self._meshes[name].get_group()

    def size(self, name: str) -> int:
        """Number of ranks in group `name`."""
        return self._meshes[name].size()

    def local_rank(self, name: str) -> int:
        """This rank's index inside group `name`."""
        return self._meshes[name].get_local_rank()
