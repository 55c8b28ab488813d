"""The process group an Engine runs over: joined by ``initialize``, and left again when
``initialize`` fails after creating it.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) the group comes from its
environment; without it the engine runs a world of one on an in-process store. A
group that exists already (the user's own, or an earlier engine's) is used as it is,
and never left by the engine.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from dcir.diagnostics import DcirError, Diagnostic


class RankFailure(RuntimeError):
    """A collective failed: another rank crashed, diverged or timed out."""


#: How long the other ranks wait for rank 0 to capture and compile the step (tens of
#: seconds for a large model; a collective's ``timeout_s`` would be too short).
CAPTURE_TIMEOUT_S = 900


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
        return cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name, device, created)

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
