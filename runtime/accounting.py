"""What a rank holds, as the runtime accounts it: ``Engine.memory()``.

The C++ runtime counts the shard store and the gathered buffers (``native.runtime_stats``);
this adds what Python holds: gradient shards, optimizer state on the device and in host
memory, buffers, the program's replicas and accumulators. See docs/runtime.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields

import torch
from torch.utils._pytree import tree_leaves

from dcir import sim
from dcir.buffers import GRAD_ACC_OF, UNSHARD_OF
from dcir.ir import Module
from dcir.memory import CALLER_LOSS, step_peak
from dcir_lowering import copies
from dcir_runtime.native import runtime_stats
from dcir_runtime.offload import StateStore


@dataclass(frozen=True)
class MemoryStats(Mapping):
    """Bytes (and counters) of one rank, by name: ``m.parameters``. It also reads as
    the mapping ``Engine.memory()`` always returned (``m["parameters"]``, ``dict(m)``),
    so code written against that keeps working."""

    parameters: int              # this engine's parameter shards
    gradients: int               # gradient shards
    optimizer_state: int         # optimizer state on the device now
    optimizer_state_peak: int    # ... at its peak (what ``offload`` bounds)
    optimizer_state_host: int    # ... in host memory (``offload``)
    buffers: int                 # the model's buffers, replicated on every rank
    replicas: int                # whole parameters the program keeps (zero1/zero2, unshard)
    gradient_accumulators: int   # full gradients summed across micro-steps (zero1)
    gathered_now: int            # gathered parameters alive now (the runtime's, for the process)
    gathered_peak: int           # ... at their peak
    full_parameters: int         # the whole model's parameter bytes, for comparison
    collectives: int             # collectives started
    sent: int                    # bytes handed to them
    wait_s: float                # host seconds blocked in comm.wait of a collective
    copy_wait_s: float           # ... of a host copy (offload, offload_activations; the process's copy lanes)
    transport: int = 0           # this rank's shared-memory outbox (dcir_runtime.transport), sized
    #                              from the program: counted with what the schedule holds
    activations_host_peak: int = 0  # saved activations in host memory at their peak (offload_activations;
    #                              the process's)
    step_peak: int = 0           # the memory model's peak of what the running program holds in a step:
    #                              saved activations, temporaries, gathered parameters, replicas,
    #                              accumulators, the backward's gradient shards from their reduction on
    #                              (dcir.memory; the profiler measures it within 10%)
    gradients_kept: int = 0      # gradient shards held beside the whole step, not only from the backward
    #                              that reduces them: micro-steps accumulate into them, or graph-break
    #                              regions' backwards run beside each other's (fixed_bytes counts them)
    outputs_held: int = 0        # the most bytes of a forward's outputs its caller still held when the
    #                              backward started (the logits a loss computed outside keeps), beside
    #                              the whole backward (HandedOut; fixed_bytes counts them)

    def __getitem__(self, key: str):
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


#: What a loss computed outside holds when the backward starts, per byte of the gradients
#: it hands over: cross-entropy, the loss of a causal language model, keeps its
#: log-softmax (saved for its backward) and makes the log-softmax's gradient before the
#: logits' one, each the logits' size (the memory model counts the logits' gradient, the
#: backward's argument). On the long-sequence Llama with the loss outside, uncounted, the
#: allocator's peak ran 10% over a budget the cycle's plan was priced within; counted,
#: every step was within it (docs/benchmarks.md).
LOSS_COPIES = 2


class HandedOut:
    """The outputs of an engine's last training forward, held weakly, and ``peak``: the
    most bytes of them the caller still held when a backward started. The program's
    memory model ends with its outputs at the forward's end; what the caller keeps of
    them (the logits, where the loss is computed outside: the loss's own backward has
    run and let go of what it saved, but ``out.logits`` lives on) is held beside the
    whole backward, outside any program. An output that is also a saved activation is
    the program's already. ``loss_bytes``: the most a loss computed outside held beside a
    backward's entry (``LOSS_COPIES`` times the gradients it handed over; the memory
    model's ``CALLER_LOSS``)."""

    def __init__(self):
        self.refs: list[tuple[weakref.ref, int, int]] = []  # (tensor, its storage's address, its bytes)
        self.peak = self.loss_bytes = 0

    def hand(self, out):
        """``out`` (the model's outputs, or the tensors the caller's structure is rebuilt
        from: a cache object's too), noted: each storage once."""
        seen, self.refs = set(), []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    self.refs.append((weakref.ref(t), storage.data_ptr(), storage.nbytes()))
        return out

    def backward_starts(self, saved: tuple, grads: tuple = ()) -> None:
        """The backward of the noted forward starts, with its ``saved`` activations and the
        ``grads`` of its outputs the caller handed over (None where it handed none)."""
        handed = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads
                  if isinstance(g, torch.Tensor)}
        self.loss_bytes = max(self.loss_bytes, LOSS_COPIES * sum(handed.values()))
        if self.refs:
            theirs = {t.untyped_storage().data_ptr() for t in saved if isinstance(t, torch.Tensor)}
            held = sum(n for ref, ptr, n in self.refs if ref() is not None and ptr not in theirs)
            self.peak, self.refs = max(self.peak, held), []


class StepPeak:
    """``step_peak`` of the program an engine runs, computed once per program and what its
    caller holds (``CALLER_LOSS``)."""

    def __init__(self):
        self.module: Module | None = None
        self.caller = self.peak = 0

    def __call__(self, module: Module | None) -> int:
        caller = module.attrs.get(CALLER_LOSS, 0) if module is not None else 0
        if module is not self.module or caller != self.caller:
            self.module, self.caller, self.peak = module, caller, step_peak(module) if module is not None else 0
        return self.peak


def note_caller(module: Module | None, loss_bytes: int) -> None:
    """``module`` (the program an engine runs: the cycle plans from it too) told what a loss
    computed outside holds beside its backward's entry (``HandedOut.loss_bytes``)."""
    if module is not None and loss_bytes > module.attrs.get(CALLER_LOSS, 0):
        module.attrs[CALLER_LOSS] = loss_bytes


def measure(shards: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, store: StateStore | None,
            model: torch.nn.Module, module: Module | None, full_bytes: int, transport: int = 0,
            modelled_peak: int = 0, kept: Collection[str] = (), outputs_held: int = 0) -> MemoryStats:
    """The accounting of one engine: its ``shards`` and their ``optimizer`` (with its
    offload ``store``, if any), the ``model``'s buffers, the buffers the running
    ``module`` keeps (None before capture), the ``transport``'s outbox bytes, the
    running program's ``modelled_peak`` (``step_peak``), the shards whose gradients
    outlive the backward that reduces them (``kept``, by name: ``kept_gradients``), and
    the ``outputs_held`` by the caller beside a backward (``HandedOut``)."""
    stats = runtime_stats()
    tensors = [t for st in optimizer.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0]
    host = _bytes(t for t in tensors if store is not None and store.is_host(t))
    state = _bytes(tensors) - host
    held = {UNSHARD_OF: 0, GRAD_ACC_OF: 0}  # the program's own buffers
    for d in (module.decls.values() if module is not None else ()):
        for kind in held:
            if kind in d.attrs:
                held[kind] += d.full_type.nbytes
    return MemoryStats(
        parameters=_bytes(shards.values()), gradients=_bytes(s.grad for s in shards.values() if s.grad is not None),
        optimizer_state=state, optimizer_state_peak=max(state, store.peak if store is not None else 0),
        optimizer_state_host=host, buffers=_bytes(model.buffers()),
        replicas=held[UNSHARD_OF], gradient_accumulators=held[GRAD_ACC_OF],
        gathered_now=stats.gathered_now, gathered_peak=stats.gathered_peak, full_parameters=full_bytes,
        collectives=stats.collectives, sent=stats.sent, wait_s=stats.wait_ns / 1e9,
        copy_wait_s=copies.wait_s(), transport=transport,
        activations_host_peak=copies.activation_stats().host_peak, step_peak=modelled_peak,
        gradients_kept=_bytes(s for name, s in shards.items() if s.requires_grad and name in kept),
        outputs_held=outputs_held)


def kept_gradients(module: Module | None, micro_steps: int, regions: bool, trainable: Collection[str]) -> set[str]:
    """The ``trainable`` parameters whose gradient shards outlive a backward while a rank
    runs ``module`` (None: no program yet) in ``micro_steps`` per optimizer step: every one
    under graph-break ``regions`` (their backwards run beside each other's), else those
    micro-steps accumulate into, as the simulator prices them (``dcir.sim.kept_gradients``)."""
    if regions:
        return set(trainable)
    return sim.kept_gradients(module, micro_steps) if module is not None else set()


def fixed_bytes(m: MemoryStats) -> int:
    """What a rank holds whatever the schedule: parameter shards, optimizer state, buffers,
    the gradient shards where they are held beside the whole step (``gradients_kept``),
    and the outputs the caller keeps beside a backward (``outputs_held``).
    Otherwise a step's gradient shards are the schedule's: they are released after each
    optimizer step, and the memory model counts each one from the reduction that makes it
    (``grad.set``) to the backward's end. That end holds all of them, as the optimizer
    step does, so counting them here too would count them twice, and before the
    backward they do not exist (measured: 18 MiB of a 139 MiB step, docs/benchmarks.md)."""
    return m.parameters + m.gradients_kept + m.optimizer_state_peak + m.buffers + m.outputs_held


def scheduled_bytes(m: MemoryStats) -> int:
    """What the schedule holds at its peak: the larger of the memory model's peak of the
    step (activations, temporaries, gathered parameters, replicas, accumulators) and what
    the runtime measured of the last three, plus the shared-memory outbox sized for it.
    The memory model counts all of these, so a pass's budget leaves them out of the fixed
    part."""
    measured = m.replicas + m.gradient_accumulators + m.gathered_peak
    return max(measured, m.step_peak) + m.transport
