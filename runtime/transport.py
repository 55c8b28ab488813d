"""How the runtime's gathers and reduce-scatters move their bytes: over the process group,
or, when every rank is on one host and the model is on the CPU, through shared memory.

Over gloo, a transfer between two ranks on one host goes through the kernel's loopback:
gloo's worker threads copy it into a socket and out again, on the same cores the ranks
compute on. Through shared memory (``native/dcir_runtime.cpp``, "shared-memory
transport") each rank copies its part into an outbox every rank maps, and the others
copy, or sum, straight out of it when they wait: one copy in and one out, on the rank's
own thread. Reductions keep their order (rank by rank, as the gloo path sums), so the
numbers are the same bits either way.

The config's ``transport`` chooses:

* ``"process_group"`` (the default): the process group (gloo, or NCCL on GPUs) for everything;
* ``"shared_memory"``: shared memory, or an error that says why not;
* ``"auto"``: shared memory when it can be set up (a CPU model, more than one rank,
  every rank's outbox mapped by every other), else the process group.

Each rank's outbox holds twice its parameter shards' bytes (at least 16 MiB, at most
256 MiB): room for a step's gathers in flight. A collective that does not fit runs over
the process group, which every rank decides alike. Every rank maps every outbox, so it
costs memory: twice the shards per rank on the host, and each rank's resident set
counts every outbox it touched (``tests/test_start.py``'s memory cap goes over with it;
a quarter of the shards kept under the cap but sent too much over gloo to be worth it).
That is why it is not the default yet; sizing the outbox from the planned schedule's
bytes in flight is the way to make it one.
"""

from __future__ import annotations

import secrets

import torch
import torch.distributed as dist

from dcir.diagnostics import DcirError, Diagnostic

MIN_OUTBOX = 16 << 20
MAX_OUTBOX = 256 << 20


def outbox_bytes(shard_bytes: int) -> int:
    """The outbox a rank gets for ``shard_bytes`` of parameter shards (module docstring)."""
    return max(MIN_OUTBOX, min(MAX_OUTBOX, 2 * shard_bytes))


def set_up(group, mode: str, device: torch.device, shards: dict[str, torch.Tensor]) -> int:
    """Chooses the transport of ``group`` (``runtime.group.ProcessGroup``) for ``mode``,
    with an outbox sized for this rank's parameter ``shards``; collective: every rank
    calls it. Returns the outbox bytes per rank (0: none)."""
    ops = torch.ops.dcir
    why = None
    if mode == "process_group":
        why = "the config says process_group"
    elif device.type != "cpu":
        why = f"the model is on {device}"
    elif group.world == 1:
        why = "one rank"
    capacity = 0
    if why is None:
        capacity = outbox_bytes(sum(s.numel() * s.element_size() for s in shards.values()))
        token = [f"/dcir-{secrets.token_hex(6)}" if group.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        ok = _everyone(ops.shm_create(group.name, token[0], group.rank, group.world, capacity))
        ok = ok and _everyone(ops.shm_attach(group.name, token[0]))
        if not ok:
            why = (f"a rank could not map every rank's outbox of {capacity >> 20} MiB (ranks on different hosts, "
                   "or too little space in /dev/shm)")
    ops.shm_commit(group.name, why is None)
    if why is not None and mode == "shared_memory":
        raise DcirError(Diagnostic(f"transport \"shared_memory\" is not possible here: {why}"))
    return 0 if why else capacity


def _everyone(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a barrier, too)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
