"""The process group an Engine runs over: joined by ``initialize``, and left again when
``initialize`` fails after creating it.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) the group comes from its
environment; without it the engine runs a world of one on an in-process store. A
group that exists already (the user's own, or an earlier engine's) is used as it is,
and never left by the engine.

Over gloo, the runtime's collectives run over a group of their own with one worker
thread (``collective_group``), so transfers finish in the order they were issued.
That is how NCCL runs a stream's collectives and how the simulator's collective lane
prices them. Gloo's default group has two threads: the transfer issued next shares the
link with the one before, and a prefetched 32 MiB gather took 51-53 ms instead of
41-42 behind six small ones (docs/simulator.md).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from dcir.diagnostics import DcirError, Diagnostic

#: How long the other ranks wait for rank 0 to capture and compile the step (tens of
#: seconds for a large model; a collective's ``timeout_s`` would be too short).
CAPTURE_TIMEOUT_S = 900


#: the backend and description of the runtime's own gloo group
FIFO_GLOO = "dcir_gloo_fifo"
FIFO_DESC = "dcir collectives (gloo, one worker thread)"
#: the name of that group per timeout; names only, since a reference would keep a
#: destroyed group alive until the interpreter exits, where gloo can abort the process
_FIFO_NAMES: dict[float, str] = {}


def _one_thread_gloo(store, rank: int, size: int, timeout: datetime.timedelta):
    # torch.distributed offers gloo's thread count only through these options
    opts = dist.ProcessGroupGloo._Options()
    opts._threads, opts._timeout = 1, timeout
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _is_fifo_group(name: str) -> bool:
    """Whether ``name`` is registered (the current init's) and is DCIR's FIFO group."""
    try:
        group = torch._C._distributed_c10d._resolve_process_group(name)
    except RuntimeError:  # destroyed with the groups of an earlier init
        return False
    return group.group_desc == FIFO_DESC and group.size() == dist.get_world_size()


def collective_group(timeout_s: float) -> str:
    """The c10d name of the group the runtime's collectives run over: over gloo, every
    rank's one-thread group (created here on first use, on every rank, and kept until
    ``destroy_process_group``); otherwise the default group."""
    if dist.get_backend() != "gloo" or dist.get_world_size() == 1:
        return dist.group.WORLD.group_name
    name = _FIFO_NAMES.get(timeout_s)
    if name is None or not _is_fifo_group(name):
        if FIFO_GLOO not in dist.Backend.backend_list:
            dist.Backend.register_backend(FIFO_GLOO, _one_thread_gloo, devices=["cpu"])
        name = _FIFO_NAMES[timeout_s] = dist.new_group(
            backend=FIFO_GLOO, timeout=datetime.timedelta(seconds=timeout_s), group_desc=FIFO_DESC).group_name
    return name


@dataclass(frozen=True)
class ProcessGroup:
    rank: int
    world: int
    #: the c10d name of the group the C++ runtime resolves for every collective
    #: (``collective_group``); the engine's own agreements run over the default group
    name: str
    #: where the model lives (NCCL for a GPU model, gloo for a CPU one)
    device: torch.device
    #: whether this engine created the group, and so must leave it when it fails
    created: bool

    @classmethod
    def join(cls, timeout_s: float, device: torch.device) -> "ProcessGroup":
        created = not dist.is_initialized()
        if created:
            timeout = datetime.timedelta(seconds=timeout_s)
            backend = "nccl" if device.type == "cuda" else "gloo"
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                dist.init_process_group(backend, timeout=timeout)
            else:  # not launched by torchrun: a world of one
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return cls(dist.get_rank(), dist.get_world_size(), collective_group(timeout_s), device, created)

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

    def most(self, value: float) -> float:
        """The largest of every rank's ``value`` (float64), on every rank."""
        if self.world == 1:
            return value
        agreed = torch.tensor([float(value)], dtype=torch.float64, device=self.collective_device())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return agreed.item()

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
