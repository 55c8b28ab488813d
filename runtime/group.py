"""The process group an Engine runs over: joined by ``initialize``, and left again when
``initialize`` fails after creating it.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) the group comes from its
environment; without it the engine runs a world of one on an in-process store. A
group that exists already (the user's own, or an earlier engine's) is used as it is,
and never left by the engine.

With a mesh (the config's ``mesh``, or ``initialize(mesh=DeviceMesh)``) the ranks form
``nodes`` × ``local`` (the IR's names for FSDP2's replicate × shard dimensions), and the
group holds the c10d subgroups a collective over each dimension runs in
(``dcir/mesh.py``): over ``local``, the ranks of this rank's node; over ``nodes``, the
ranks that hold the same shards on the other nodes.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dcir import mesh as meshes
from dcir.diagnostics import DcirError, Diagnostic
from dcir.passes.zero3 import LOCAL, NODES


class RankFailure(RuntimeError):
    """A collective failed: another rank crashed, diverged or timed out."""


#: How long the other ranks wait for rank 0 to capture and compile the step (tens of
#: seconds for a large model; a collective's ``timeout_s`` would be too short).
CAPTURE_TIMEOUT_S = 900


def local_world() -> int:
    """The ranks this rank's node runs: torchrun's ``LOCAL_WORLD_SIZE``; else every rank
    (``WORLD_SIZE``) or, not launched at all, one."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))


@dataclass(frozen=True)
class ProcessGroup:
    rank: int
    world: int
    #: the c10d name of the group, which the C++ runtime resolves for every collective
    name: str
    #: where the model lives (NCCL for a GPU model, gloo for a CPU one)
    device: torch.device
    #: whether this engine created the group, and so must leave it when it fails
    created: bool
    #: the mesh the ranks form, as the IR names it ({"nodes": R, "local": S}); {}: none
    mesh: dict = field(default_factory=dict)
    #: mesh dimension -> this rank's c10d subgroup over it
    subgroups: dict = field(default_factory=dict)
    #: whether parameters are sharded over a node's ranks (HSDP), not over every rank
    shards_in_node: bool = False

    @classmethod
    def join(cls, timeout_s: float, device: torch.device, mesh: dict | None = None,
             device_mesh=None) -> "ProcessGroup":
        """The job's group (made here unless it exists); with ``mesh`` (the config's
        ``topology``: ``{"replicate": R, "shard": S, "hsdp": ...}``), its subgroups, from
        ``device_mesh`` when given."""
        created = not dist.is_initialized()
        if created:
            timeout = datetime.timedelta(seconds=timeout_s)
            backend = "nccl" if device.type == "cuda" else "gloo"
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                dist.init_process_group(backend, timeout=timeout)
            else:  # not launched by torchrun: a world of one
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        group = cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name, device, created)
        return group if mesh is None else group._with_mesh(mesh, device_mesh)

    def _with_mesh(self, mesh: dict, device_mesh) -> "ProcessGroup":
        local = mesh["shard"]
        nodes = mesh["replicate"] or max(1, self.world // local)
        if nodes * local != self.world:
            self.leave_after_failure()
            what = (f"the mesh replicate={nodes} × shard={local} has {nodes * local} ranks" if mesh["replicate"] else
                    f"zero_hpz_partition_size {local} does not divide the ranks into nodes")
            raise DcirError(Diagnostic(f"{what}, but this job runs {self.world}"))
        if device_mesh is None:
            device_mesh = init_device_mesh(self.device.type, (nodes, local), mesh_dim_names=("replicate", "shard"))
        subgroups = {NODES: device_mesh.get_group(0), LOCAL: device_mesh.get_group(1)}
        return ProcessGroup(self.rank, self.world, self.name, self.device, self.created, {NODES: nodes, LOCAL: local},
                            subgroups, mesh["hsdp"])

    @property
    def names(self) -> dict:
        """Mesh dimension (None: every rank) -> the c10d name of the group a collective over it runs in."""
        return {None: self.name, **{dim: g.group_name for dim, g in self.subgroups.items()}}

    def traffic(self) -> dict:
        """What the C++ runtime's collectives carried over each group this rank is in, by
        mesh dimension ("world": every rank): ``{"collectives": N, "bytes": B}``, B the
        payload this rank handed to the group, since the process started."""
        return {dim or "world": dict(zip(("collectives", "bytes"), torch.ops.dcir.group_stats(name)))
                for dim, name in self.names.items()}

    @property
    def shard_name(self) -> str:
        """The c10d name of the group each parameter is split over (under HSDP, this rank's node)."""
        return self.names[LOCAL if self.shards_in_node else None]

    @property
    def shard_rank(self) -> int:
        """Which shard of each parameter this rank holds (its place within its node under HSDP)."""
        return self.shard_of(self.rank)

    @property
    def shard_world(self) -> int:
        """Into how many shards each parameter is split."""
        return self.mesh[LOCAL] if self.shards_in_node else self.world

    def shard_of(self, rank: int) -> int:
        """Which shard ``rank`` holds."""
        return meshes.coordinate(self.mesh, LOCAL, rank) if self.shards_in_node else rank

    def leave_after_failure(self) -> None:
        """Destroy the group this engine created, after ``initialize`` failed. Without
        this, the group is torn down at interpreter exit while a peer's last broadcast
        may still be in flight, and gloo can abort the process instead of letting the
        error end it. Every rank fails the same way (the checks are deterministic), so
        the barrier lets the peers finish first; a peer that did not fail gives up
        after the group's timeout, and the group is destroyed anyway."""
        if not self.created or not dist.is_initialized():
            return
        try:
            if self.world > 1:
                dist.barrier()
        except RuntimeError:  # a peer that went on: nothing to wait for
            pass
        dist.destroy_process_group()

    def collective_device(self) -> torch.device:
        """Where a small tensor for a torch.distributed collective lives: NCCL reduces
        only GPU tensors, gloo CPU ones."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def most(self, value: float, what: str) -> float:
        """The largest of every rank's ``value`` (float64), on every rank; ``what`` it
        agrees on names it in the RankFailure of a peer that crashed or stalled."""
        if self.world == 1:
            return value
        agreed = torch.tensor([float(value)], dtype=torch.float64, device=self.collective_device())
        self._collective(lambda: dist.all_reduce(agreed, op=dist.ReduceOp.MAX), what)
        return agreed.item()

    def gather_ints(self, value: int, what: str) -> list[int]:
        """Every rank's ``value`` (an int64), by rank, on every rank; ``what`` names the
        exchange in the RankFailure of a peer that crashed or stalled."""
        if self.world == 1:
            return [value]
        mine = torch.tensor([value], dtype=torch.int64, device=self.collective_device())
        seen = [torch.empty_like(mine) for _ in range(self.world)]
        self._collective(lambda: dist.all_gather(seen, mine), what)
        return [int(t.item()) for t in seen]

    def gather_texts(self, text: str, what: str) -> list[str]:
        """Every rank's ``text``, by rank, on every rank (``gather_ints``'s failure)."""
        if self.world == 1:
            return [text]
        seen: list = [None] * self.world
        self._collective(lambda: dist.all_gather_object(seen, text), what)
        return seen

    def _collective(self, run: Callable[[], object], what: str) -> None:
        try:
            run()
        except RuntimeError as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RankFailure(f"rank {self.rank} of {self.world}: agreeing on {what} failed: {reason} (a rank that "
                              "crashed or stalled leaves the others waiting here)") from None

    @torch.no_grad()
    def from_rank0(self, key: str, make: Callable[[], str], what: str = "compile the step") -> str:
        """Rank 0 runs ``make`` (returns module text, may raise DcirError); every rank
        gets its text, or rank 0's error, through the rendezvous store under ``key``."""
        key = f"dcir/{key}"
        store = dist.distributed_c10d._get_default_store()
        if self.rank == 0:
            try:
                status, text = "ok", make()
            except DcirError as e:
                status, text = "error", e.render()
            if self.world > 1:
                store.set(key, f"{status}\n{text}")
        else:
            store.wait([key], datetime.timedelta(seconds=CAPTURE_TIMEOUT_S))
            status, text = store.get(key).decode().split("\n", 1)
        if status == "error":
            raise DcirError(Diagnostic(f"rank 0 could not {what}:\n{text}"))
        return text
