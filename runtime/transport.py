"""How the runtime's gathers, reduce-scatters and all-to-alls move their bytes: over the
process group, or, when every rank is on one host and the model is on the CPU, through
shared memory.

Over gloo, a transfer between two ranks on one host goes through the kernel's loopback:
gloo's worker threads copy it into a socket and out again, on the same cores the ranks
compute on. Through shared memory (``native/dcir_runtime.cpp``, "shared-memory
transport") each rank copies its part into an outbox every rank maps, and the others
copy, or sum, straight out of it when they wait: one copy in and one out, on the rank's
own thread. Reductions keep their order (rank by rank, as the gloo path sums), so the
numbers are the same bits either way.

The config's ``transport`` chooses:

* ``"auto"`` (the default): shared memory when it can be set up (a CPU model, more
  than one rank, every rank's outbox mapped by every other), else the process group;
* ``"shared_memory"``: shared memory, or an error that says why not;
* ``"process_group"``: the process group (gloo, or NCCL on GPUs) for everything.

Each rank's outbox is sized from the training program (``outbox_bytes``): the least
ring that holds every gather and reduce-scatter the program has in flight at once,
found by running the runtime's ring allocator over the program's collectives (the
bytes come from the IR: the same on every rank). ``initialize`` opens a 64 KiB outbox;
the first training program, and every plan the optimization cycle switches to,
resize it (``fit``, with every rank, between steps). So plain ZeRO-3, which waits for
each transfer before the next, needs its largest parameter's shard (or a stream's part,
below); a planned program that gathers ahead needs what it gathers ahead. The outbox
counts against the memory budget (``MemoryStats.transport``; among the plans the cycle
weighs, what each needs: ``dcir.search.best_pipeline``'s ``extra``). A collective that
does not fit (more than ``MAX_OUTBOX``, or a program of other shapes that waits later
than the one it was sized for) runs over the process group, which every rank decides
alike.

A transfer of more than ``STREAM_ABOVE`` bytes streams instead: its start moves it
through one region of at most ``STREAM_PART`` bytes, a part at a time, each read by
every rank before the next, and returns with it done. So the largest transfers (an
embedding's gather, a vocabulary's gradient) need a part of the outbox, not their size,
and a transfer of any size can go through shared memory; the price is that the ranks
meet at its start rather than at its wait.

Every rank maps every outbox, so each rank's resident set counts every outbox it has
touched (world times its own), though the host holds each once.
"""

from __future__ import annotations

import logging
import secrets

import torch
import torch.distributed as dist

from dcir import ops as registry
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import DTYPE_BYTES

log = logging.getLogger("dcir")

MIN_OUTBOX = 64 << 10   # before the first program sizes it, and the least it gets
MAX_OUTBOX = 256 << 20  # beyond it, the transfers in flight at once go over the process group
ALIGN = 64              # a region's alignment in the ring (kAlign in native/dcir_runtime.cpp)
STREAM_ABOVE = 8 << 20  # a larger transfer streams through the outbox (kStreamAbove)...
STREAM_PART = 4 << 20   # ... in parts of at most this (kStreamPart)


def set_up(group, mode: str, device: torch.device) -> int:
    """Chooses the transport of ``group`` (``runtime.group.ProcessGroup``) for ``mode``,
    with an outbox of ``MIN_OUTBOX`` until a program sizes it (``fit``); collective:
    every rank calls it. Returns the outbox bytes per rank (0: none)."""
    why = None
    if mode == "process_group":
        why = "the config says process_group"
    elif device.type != "cpu":
        why = f"the model is on {device}"
    elif group.world == 1:
        why = "one rank"
    return _open(group, mode, MIN_OUTBOX, why)


def fit(group, mode: str, current: int, module) -> int:
    """Resizes this rank's outbox (``current`` bytes; 0: none) to what ``module`` needs
    (``outbox_bytes``); collective: every rank calls it, between steps, when the
    training program is installed. Returns the outbox bytes."""
    return resize(group, mode, current, outbox_bytes(module))


def resize(group, mode: str, current: int, need: int) -> int:
    """Resizes this rank's outbox (``current`` bytes; 0: none) to ``need`` bytes, the same
    on every rank; collective: every rank calls it, between steps. Returns the outbox bytes."""
    if current == 0:
        return 0
    if need == current:
        return current
    capacity = _open(group, mode, need, None)
    if capacity == 0 and group.rank == 0:  # "auto": it worked at a smaller size
        log.warning("dcir: the shared-memory outbox could not grow to %.1f MiB for the training program; "
                    "gathers and reduce-scatters go over the process group from now on", need / 2**20)
    return capacity


def _open(group, mode: str, capacity: int, why: str | None) -> int:
    """Every rank's outbox of ``capacity`` bytes, mapped by every rank, replacing the
    one before (unless ``why`` says why not); the process group where that fails."""
    ops = torch.ops.dcir
    if why is None:
        token = [f"/dcir-{secrets.token_hex(6)}" if group.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        ok = _everyone(ops.shm_create(group.name, token[0], group.rank, group.world, capacity))
        ok = ok and _everyone(ops.shm_attach(group.name, token[0]))
        if not ok:
            why = (f"a rank could not map every rank's outbox of {capacity / 2**20:.1f} MiB (ranks on different hosts, "
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


def outbox_bytes(module) -> int:
    """The outbox ``module``'s gathers and reduce-scatters need (module docstring): the
    least capacity at which the runtime's ring places each of them without touching
    one not yet waited, in every function; between ``MIN_OUTBOX`` and ``MAX_OUTBOX``."""
    need = MIN_OUTBOX
    for func in module.functions.values():
        events = _ring_events(func)
        sizes = [b for kind, _, b in events if kind != "wait"]
        if not sizes:
            continue
        # the in-flight peak is the least; wrapping round can waste up to one region more,
        # tried in steps of 1/64 of the peak, then doubling (everything, unwrapped, always fits)
        low, high = max(_in_flight(events), MIN_OUTBOX), sum(sizes)
        step = -(-low // 64 // ALIGN) * ALIGN
        tries = [*range(low, low + max(sizes) + step, step), *(low << k for k in range(1, 8))]
        need = max(need, next((c for c in tries if c < high and _places_all(events, c)), high))
    return min(need, MAX_OUTBOX)


def _ring_events(func) -> list[tuple[str, int, int]]:
    """The function's transfers over shared memory, in order: ("start", op, region bytes)
    and ("wait", op, 0), the first wait on a result of the op (it finishes them all); a
    stream, which its start finishes: ("stream", op, its part's bytes)."""
    events, started, waited = [], {}, set()
    for k, op in enumerate(func.ops):
        if registry.has_trait(op, registry.WAITS):
            start = started.get(id(op.operands[0].owner))
            if start is not None and start not in waited:
                waited.add(start)
                events.append(("wait", start, 0))
            continue
        units, width = _region(op)
        if units * width > STREAM_ABOVE:
            events.append(("stream", k, _aligned(min(units, max(1, STREAM_PART // width)) * width)))
        elif units * width:
            started[id(op)] = k
            events.append(("start", k, _aligned(units * width)))
    return events


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _region(op) -> tuple[int, int]:
    """What ``op`` puts in this rank's outbox (``native/dcir_runtime.cpp``), as (units,
    bytes each), the units a stream's parts are cut in: a gather, its shards' bytes
    (whatever their dtypes); a reduce-scatter or an all-to-all, per element of the chunk
    a rank keeps, that element of every other rank's chunk. (0, 0): not over shared
    memory (an all-reduce, another group)."""
    if "group" in op.attrs:
        return 0, 0
    if registry.has_trait(op, registry.GATHERS):
        return sum(v.type.nbytes for v in op.operands), 1
    if registry.has_trait(op, registry.EXCHANGES):  # every row but its own
        t = op.operands[0].type
        return t.numel // t.shape[0], (t.shape[0] - 1) * DTYPE_BYTES[t.dtype]
    if registry.has_trait(op, registry.SCATTERS):
        shards = [v.type.inner for v in op.results]
        width = max(DTYPE_BYTES[v.type.dtype] for v in op.operands)
        return sum(t.numel for t in shards), (shards[0].parts - 1) * width
    return 0, 0


def _in_flight(events) -> int:
    """The most bytes started and not yet waited at once (a stream's part, while it runs)."""
    held, most, sizes = 0, 0, {}
    for kind, k, nbytes in events:
        if kind == "wait":
            held -= sizes[k]
            continue
        most = max(most, held + nbytes)
        if kind == "start":
            sizes[k] = nbytes
            held += nbytes
    return most


def _places_all(events, capacity: int) -> bool:
    """Whether the runtime's ring (``Shm::reserve``) of ``capacity`` bytes places every
    start: at the head, or at 0 when it does not fit before the end, or at 0 when
    nothing is in flight; never over a region not yet waited. A stream, done at its
    start, leaves the head where it began."""
    head, live = 0, {}  # op -> (offset, bytes), not yet waited
    for kind, k, nbytes in events:
        if kind == "wait":
            live.pop(k, None)
            continue
        if nbytes > capacity:
            return False
        if not live:
            head = 0
        offset = head if head + nbytes <= capacity else 0
        if any(o < offset + nbytes and offset < o + b for o, b in live.values()):
            return False
        if kind == "start":
            live[k] = (offset, nbytes)
            head = offset + nbytes
        else:  # a stream, done at its start: the next op may take its region
            head = offset
    return True
