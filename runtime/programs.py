"""The programs an Engine keeps: one per mode and input shapes.

A call whose mode (training or evaluation; with gradients or under ``torch.no_grad()``)
or input shapes no program has seen is captured once and kept, as Dynamo recompiles on
a failed guard, up to ``max_programs`` (an error beyond, which says so). The first
program of a mode comes from rank 0 to every rank (``capture``); a shape met later is
compiled by the rank that meets it (capture reads the parameters' shapes, not their
values, which the engine holds as shards), and must run the
collectives of its mode's first program in the same order: ZeRO's collectives move
parameters and gradients, not batches, so ranks may run different shapes. When they do
not match (a pass planned them from the shapes), the call fails with an error that
says so, instead of a hang.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._pytree import tree_flatten

import dcir
from dcir import ops as registry
from dcir import signature
from dcir.buffers import GRAD_ACC_OF
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import TensorType
from dcir.memory import handed_bytes
from dcir_lowering.program import call_inputs
from dcir_runtime import transport
from dcir_runtime.accounting import fixed_bytes, kept_gradients
from dcir_runtime.capture import capture
from dcir_runtime.execution import Installed
from dcir_runtime.plan import fit_first_step
from dcir_runtime.regions import RegionStep


class Mode(NamedTuple):
    """What a program runs: training or evaluation, with gradients or under ``torch.no_grad()``."""

    training: bool
    grad: bool


class ProgramKey(NamedTuple):
    """What tells programs apart: the mode, the inputs' structure (a pytree spec, as text)
    and each input's ``(shape, dtype)``, or its value when it is not a tensor."""

    training: bool
    grad: bool
    spec: str
    inputs: tuple

    @property
    def mode(self) -> Mode:
        return Mode(self.training, self.grad)

    def shapes(self) -> list[list[int]]:
        """The shapes of the tensor inputs."""
        return [list(s[0]) for s in self.inputs if isinstance(s, tuple) and len(s) == 2]


#: The spec of the key under which a rank keeps rank 0's program of a mode, when its own
#: shapes differ from rank 0's (it compiles its own against it, under its own key)
RANK0_SPEC = "rank 0's shapes"


def key(training: bool, grad: bool, args: tuple, kwargs: dict) -> ProgramKey:
    """The key of a call's program: its mode, and each input's shape and dtype (other
    arguments by value, as Dynamo guards on them)."""
    leaves, spec = tree_flatten((args, kwargs))
    shapes = tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else _constant(t) for t in leaves)
    return ProgramKey(bool(training), bool(grad), str(spec), shapes)


def _constant(v):
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


class Programs:
    def __init__(self):
        self._by_key: dict[ProgramKey, object] = {}
        self._base: dict[Mode, ProgramKey] = {}  # mode -> the key of its first program
        self.regions = None  # the step as graph-break regions (dcir_runtime.regions), when it has breaks

    def __len__(self) -> int:
        return len(self._by_key)

    def installed(self) -> list:
        """Each program kept (each region's, for a step with graph breaks)."""
        if self.regions is not None:
            return [r.installed for r in self.regions.regions]
        return list(self._by_key.values())

    def modules(self) -> list:
        """The module of each program kept."""
        return [installed.module for installed in self.installed()]

    def get(self, k: ProgramKey):
        return self._by_key.get(k)

    def base(self, mode: Mode):
        k = self._base.get(mode)
        return self._by_key[k] if k is not None else None

    def check_room(self, k: ProgramKey, limit: int) -> None:
        if len(self._by_key) >= limit:
            raise DcirError(Diagnostic(
                f"a new input shape ({k.shapes()}) needs a program of its own and the engine keeps {limit} already "
                "(config 'max_programs'); pad or bucket the inputs to fewer shapes, or raise the limit"))

    def add(self, k: ProgramKey, installed, base: bool = False) -> None:
        self._by_key[k] = installed
        if base:
            self._base[k.mode] = k

    def discard_accumulated(self) -> None:
        """Zero every kept program's gradient accumulators (``zero1``'s ``grad_acc``
        buffers): after a checkpoint load the optimizer step goes on from the loaded
        gradients, not from the sums of micro-steps run before the load."""
        for installed in self.installed():
            for name, d in installed.module.decls.items():
                if GRAD_ACC_OF in d.attrs:
                    installed.program.state[name].zero_()

    def replace_base(self, module, program) -> None:
        """A replan of the training program: it replaces its mode's first program, and the
        training programs of other shapes go (they are compiled again, against it)."""
        for mode, k in list(self._base.items()):
            installed = self._by_key[k]
            if installed.module.role("backward") is None:
                continue
            self._by_key = {other: v for other, v in self._by_key.items() if other.mode != mode}
            self._by_key[k] = type(installed)(module, program, installed.outputs)


def fits(module: dcir.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``module``'s inputs have the shapes of this call's."""
    func = module.role("forward") or module.role("eval")
    try:
        given = call_inputs(func, args, kwargs)
    except TypeError:
        return False
    declared = signature.args(func, signature.INPUT)
    return all(not isinstance(a.type, TensorType) or (isinstance(x, torch.Tensor) and tuple(x.shape) == a.type.shape)
               for a, x in zip(declared, given))


def collectives(module: dcir.Module) -> list[tuple]:
    """The collectives each function runs, in order: what ranks must agree on."""
    out = []
    for f in module.functions.values():
        for op in f.ops:
            if registry.has_trait(op, registry.COLLECTIVE):
                out.append((f.role, op.name, tuple(str(v.type) for v in op.operands), tuple(sorted(op.attrs))))
    return out


def check_collectives(base: dcir.Module, new: dcir.Module) -> None:
    """``new`` (a shape this rank compiled alone) runs ``base``'s collectives, in order."""
    a, b = collectives(base), collectives(new)
    if a == b:
        return
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    raise DcirError(Diagnostic(
        f"the program for this rank's input shapes runs other collectives than the other ranks' ({len(b)} against "
        f"{len(a)}, first difference at collective {at}); running it would deadlock: give every rank the same "
        "shapes, or drop the shape-dependent passes (prefetch, bucket) from the config"))


def _fixed_at_first_step(engine, captured: dcir.Module) -> int:
    """What ``engine``'s rank will hold whatever the schedule once its first step has run
    (``fixed_bytes``): before that step, with the optimizer state it will make counted
    already (a tensor like each trainable shard per per-element state key, at most the
    offload budget of it on the device), and ``captured``'s outputs as if the caller kept
    them all beside the backward (``handed_bytes``; what it keeps is measured from the
    first backward on, ``accounting.HandedOut``), and the gradient shards that will outlive
    a backward under it (``kept_gradients``: none are kept before a program runs)."""
    m = engine.memory()
    outputs = max(handed_bytes(captured) - m.outputs_held, 0)
    trainable = {n: s.numel() * s.element_size() for n, s in engine.sharded.trainable().items()}
    kept = kept_gradients(captured, engine.config.gradient_accumulation_steps, False, trainable)
    fixed = fixed_bytes(m) + outputs + max(sum(trainable[n] for n in kept) - m.gradients_kept, 0)
    if m.optimizer_state_peak:
        return fixed
    state = len(engine.optimizer_state_keys()) * sum(trainable.values())
    if engine.config.offload is not None:
        state = min(state, engine.config.offload["budget"])
    return fixed + state


def capture_program(engine, args: tuple, kwargs: dict, k: ProgramKey, training: bool):
    """Capture ``engine``'s program of key ``k``: through rank 0 the first of its mode
    (every rank calls it then); on this rank alone a shape this rank meets later, checked
    to run the collectives the mode's first program runs."""
    engine.programs.check_room(k, engine.config.max_programs)
    if engine.programs.regions is not None:  # Dynamo compiles the regions of a new shape or mode
        engine.programs.add(k, engine.programs.regions)
        return engine.programs.regions
    mode = k.mode
    base = engine.programs.base(mode)
    captured = capture(engine.model, args, kwargs, loss_fn=engine.loss_fn, config=engine.config,
                       group=engine.process_group, key=f"{engine.store_prefix}program/{mode.training:d}{mode.grad:d}",
                       local=base is not None, training=training, passes=engine.planner.passes,
                       state_keys=engine.optimizer_state_keys, cache=engine.planner.cache, call=k)
    if captured is None:  # graph breaks: the step runs as regions, on every rank
        engine.programs.regions = RegionStep(engine)
        engine.programs.add(k, engine.programs.regions)
        return engine.programs.regions
    first = training and base is None and engine.program is None  # the training program the cycle plans
    plan = engine.planner.resume(captured) if first else None  # the plan a cached cycle took for it
    if first and plan is None:  # within the memory budget from the first step on
        plan = fit_first_step(engine.planner, captured.module, lambda: _fixed_at_first_step(engine, captured.module),
                              transport.outbox_bytes if engine.transport_bytes else None)
    running = plan or captured.module
    installed = Installed(running, engine.lower(running), captured.outputs)
    matches = fits(installed.module, args, kwargs)
    if base is not None:
        check_collectives(base.module, installed.module)
        engine.programs.add(k, installed)
        return installed
    engine.programs.add(k if matches else k._replace(spec=RANK0_SPEC, inputs=()), installed, base=True)
    if first:
        engine.execution.install(running, installed.program)
        # every rank installs it here: the shared-memory outbox is resized for it, together
        engine.transport_bytes = transport.fit(engine.process_group, engine.config.transport, engine.transport_bytes,
                                               running)
    if not matches:  # rank 0's shapes; this rank's own are compiled here, against them
        return capture_program(engine, args, kwargs, k, training)
    return installed
