"""The memory model: which storage is live at every point of a schedule, and its peak.

The model reads a function's ops in order and follows *storage*, not values: a view
(``aten.t``, ``view``...) and the result of a wait share the storage of what
they come from. For one function:

* an op that allocates (trait ``allocates``) creates storage for each result that is
  not a view, of the result type's size (a pending value is its buffer, a host value
  lives off the device and costs nothing here);
* storage is released by ``mem.free``, or else after the last op that reads it or
  any view of it;
* some storage outlives its last use: what the function returns, what it hands to
  ``grad.set`` (the caller holds gradients until the function returns) and the
  function's arguments (the caller's, unless the function frees them), except the
  saved values a backward takes: they are handed over (a boxed call), and go after
  their last use;
* a compiled stretch (``dcir.fusion.compiled``: ops marked ``lower.fused``) runs as one
  call: storage it reads from before it, and storage a ``mem.free`` within it releases,
  goes when the call returns, after the stretch's last op;
* state (``param.get``: parameter shards, buffers) is not the schedule's: it is held
  whatever the order, so it is not counted.

The bytes live while op ``i`` runs are those live before it plus what it allocates
(its operands are still held); the peak is the largest of these. The runtime
profiler measures the same quantity by following the real storages of a running
step (``dcir_runtime.profiler``); ``tests/test_runtime.py`` holds the two within 10%.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dcir import ops as registry
from dcir import fusion, roles, signature
from dcir.analysis import view_bases
from dcir.buffers import GRAD_ACC_OF, UNSHARD_OF
from dcir.ir import Function, HostType, Module, Op, PendingType, Value


@dataclass
class Timeline:
    """Bytes live in one function, op by op."""

    func: Function
    entry: int                 # bytes live at entry: the arguments
    during: list[int]          # bytes live while op i runs
    after: list[int]           # bytes live after op i (its releases done)
    #: storage -> (bytes, first op it is live at (-1: from entry), last op it is live at)
    storage: dict[Value, tuple[int, int, int]] = field(default_factory=dict)
    caller: int = 0            # bytes the caller holds beside the entry alone (``CALLER_LOSS``)

    @property
    def peak(self) -> int:
        return max([self.entry + self.caller, *self.during])

    @property
    def peak_op(self) -> int | None:
        """Position of the op at which the peak is reached (None: at entry)."""
        if not self.during or self.entry + self.caller >= max(self.during):
            return None
        return max(range(len(self.during)), key=lambda i: (self.during[i], -i))


def device_bytes(v: Value) -> int:
    """Bytes ``v``'s storage occupies on the device (host values: none)."""
    t = v.type.inner if isinstance(v.type, PendingType) else v.type
    return 0 if isinstance(t, HostType) else t.nbytes


def storage_bases(func: Function) -> dict[Value, Value]:
    """For every value that shares another's storage, that value (its base): views, and
    the results of a wait (the buffer its collective or copy filled)."""
    bases = view_bases(func)
    for op in func.ops:
        if registry.has_trait(op, registry.WAITS):
            for v, r in zip(op.operands, op.results):
                bases[r] = bases.get(v, v)
    return bases


def timeline(func: Function, arg_storage: dict[Value, tuple[object, int]] | None = None,
             kept: set[Value] = frozenset(), module: Module | None = None) -> Timeline:
    """The memory model of ``func`` as scheduled. ``arg_storage`` says, for arguments,
    which storage each is part of and its size (arguments with the same storage key
    share it); by default every argument is its own storage of its type's size.
    ``kept``: saved arguments whose storage the caller holds anyway (``kept_by_caller``).
    ``module``, when given, tells the optimizer-state store's reads apart in the cuts
    of the compiled stretches (``dcir.fusion.stretches``)."""
    bases = storage_bases(func)
    args = _arg_storages(func, arg_storage or {}, bases)
    # a view's base, and through an argument that shares an earlier one's storage, that one
    own = lambda v: bases.get(bases.get(v, v), bases.get(v, v))  # noqa: E731
    n = len(func.ops)
    allocated: dict[Value, int] = {}
    last: dict[Value, int] = {}
    freed_at: dict[Value, int] = {}
    held: set[Value] = {own(v) for v in func.returns}  # live to the end
    allocs = [0] * n
    born: dict[Value, int] = {}
    # the saved values a backward is handed (boxed, dcir_lowering.backend.lower_function)
    # are its own: they go after their last use; the others stay the caller's
    handed = {own(a) for a in signature.args(func, signature.SAVED) if a not in kept} if roles.takes_saved(func) \
        else set()
    for i, op in enumerate(func.ops):
        d = registry.lookup(op.name)
        for v in op.operands:
            last[own(v)] = i
        if d is not None and d.has(registry.FREES):
            for v in op.operands:
                freed_at.setdefault(own(v), i)
        if d is not None and d.has(registry.GRADIENT):
            held.update(own(v) for v in op.operands)
        if d is None or d.has(registry.LOADS_STATE) or not d.has(registry.ALLOCATES):  # state: not the schedule's
            continue
        for r in op.results:
            if own(r) is r:
                allocated[r] = device_bytes(r)
                born[r] = i
                allocs[i] += allocated[r]
                last.setdefault(r, i)
    releases: list[list[Value]] = [[] for _ in range(n)]
    size = {**allocated, **args}
    storage = {}
    returns_at = _compiled_returns(func, module)
    for v in list(allocated) + list(args):
        released = v in freed_at or (v not in held and (v not in args or v in handed))
        end = freed_at.get(v, last.get(v, 0)) if released else n - 1  # an unused handed value: at once
        if released:
            first, returned = returns_at.get(end, (end, end))  # a compiled stretch's: when it returns
            end = returned if born.get(v, -1) < first or v in freed_at else end
            releases[end].append(v)
        storage[v] = (size[v], born.get(v, -1), end)
    live = entry = sum(args.values())
    during, after = [], []
    for i in range(n):
        during.append(live + allocs[i])
        live += allocs[i] - sum(size[v] for v in releases[i])
        after.append(live)
    return Timeline(func, entry, during, after, storage)


def _compiled_returns(func: Function, module: Module | None) -> dict[int, tuple[int, int]]:
    """For each position inside a compiled stretch (``dcir.fusion.compiled``) but its
    last op: (the stretch's first op, its last op). A stretch is one call: what it reads
    from before it is held until the call returns, and so is what a ``mem.free`` within
    it releases (the lowering moves the free to its end, and a value made inside for the
    free is one of the call's results); what it makes and only uses inside, it drops itself."""
    out = {}
    for stretch in fusion.compiled(func, module):
        first, last = min(stretch), max(stretch)
        out.update({i: (first, last) for i in range(first, last)})
    return out


def _arg_storages(func: Function, arg_storage: dict, bases: dict[Value, Value]) -> dict[Value, int]:
    """The storage of ``func``'s arguments and its bytes, one entry per storage (an
    argument that shares an earlier one's storage is made a view of it in ``bases``)."""
    args: dict[Value, int] = {}
    by_key: dict[object, Value] = {}
    for a in func.args:
        key, nbytes = arg_storage.get(a, (a, device_bytes(a)))
        if key in by_key:
            bases[a] = by_key[key]
        else:
            by_key[key] = a
            args[a] = nbytes
    return args


def saved_storage(module: Module) -> dict[Value, tuple[object, int]]:
    """For the saved arguments of the functions that take ``@forward``'s saved values
    (``dcir.roles``: ``@backward``, ``@backward_last``), the storage ``@forward``
    returned them in: two saved values that are views of one tensor are one storage, of
    that tensor's size."""
    fw = roles.saver(module.functions.values())
    out = {}
    for bw in module.functions.values():
        if fw is None or not roles.takes_saved(bw):
            continue
        bases = storage_bases(fw)
        for ret, arg in signature.saved_pairs(fw, bw):
            base = bases.get(ret, ret)
            # module state is not the schedule's memory
            state = isinstance(base.owner, Op) and registry.has_trait(base.owner, registry.LOADS_STATE)
            out[arg] = (base, 0 if state else device_bytes(base))
    return out


def kept_by_caller(module: Module) -> set[Value]:
    """The saved arguments of the backwards whose storage the caller holds whatever the
    backward does: one of ``@forward``'s arguments (the batch) or outputs (the model's
    outputs, which the user's loss holds), or module state."""
    fw = roles.saver(module.functions.values())
    if fw is None:
        return set()
    bases = storage_bases(fw)
    own = lambda v: bases.get(v, v)  # noqa: E731
    theirs = {own(v) for v in (*fw.args, *signature.results(fw, signature.OUTPUT))}
    out = set()
    for bw in module.functions.values():
        if roles.takes_saved(bw):
            out.update(arg for ret, arg in signature.saved_pairs(fw, bw)
                       if own(ret) in theirs or not isinstance(own(ret).owner, Op)
                       or registry.has_trait(own(ret).owner, registry.LOADS_STATE))
    return out


def handed_bytes(module: Module) -> int:
    """Device bytes of ``@forward``'s outputs that are not also saved for a backward, each
    storage once: what a caller that keeps the model's outputs (a loss computed outside
    keeps the logits) holds beside the backward, outside the programs' memory."""
    fw = roles.saver(module.functions.values())
    if fw is None:
        return 0
    bases = storage_bases(fw)
    own = lambda v: bases.get(v, v)  # noqa: E731
    saved = {own(v) for v in signature.results(fw, signature.SAVED)}
    handed = {own(v) for v in signature.results(fw, signature.OUTPUT)} - saved
    return sum(device_bytes(v) for v in handed if isinstance(v.owner, Op)
               and not registry.has_trait(v.owner, registry.LOADS_STATE))


def resident_buffers(module: Module) -> list[str]:
    """The buffers the schedule holds between calls: gathered copies of parameters, and
    gradient accumulators (``zero1``)."""
    return [name for name, d in module.decls.items() if UNSHARD_OF in d.attrs or GRAD_ACC_OF in d.attrs]


def resident(module: Module) -> int:
    """Bytes of ``resident_buffers``."""
    return sum(module.decls[name].full_type.nbytes for name in resident_buffers(module))


#: A module attribute: the bytes a loss computed outside the program holds when the
#: backward starts, beyond the gradients it hands over (``caller.loss_bytes = 67108864``):
#: cross-entropy's saved log-softmax and the log-softmax's gradient are live when the
#: logits' gradient reaches the backward. The runtime measures what the caller hands over
#: from the first backward on and writes it here (``dcir_runtime.accounting.HandedOut``);
#: the memory model adds it to the entry of each function that takes saved values.
CALLER_LOSS = "caller.loss_bytes"


def beside_caller(module: Module, running: Module) -> Module:
    """``module`` (what a plan starts from) told what ``running``'s caller holds beside
    the backward's entry (``CALLER_LOSS``); returned."""
    if CALLER_LOSS in running.attrs:
        module.attrs[CALLER_LOSS] = running.attrs[CALLER_LOSS]
    return module


def timelines(module: Module) -> dict[str, Timeline]:
    """The memory model of every function of ``module``, saved values shared as
    ``@forward`` made them, gathered copies of parameters held throughout."""
    saved, kept = saved_storage(module), kept_by_caller(module)
    held = resident(module)
    return {name: _holding(timeline(f, saved, kept, module) if roles.takes_saved(f) else timeline(f, module=module),
                           held, module)
            for name, f in module.functions.items()}


def timeline_of(module: Module, name: str) -> Timeline:
    """``timelines(module)[name]``, without modelling the other functions (a pass that
    prices candidates for one function asks this for each)."""
    f = module.functions[name]
    t = timeline(f, saved_storage(module), kept_by_caller(module), module) if roles.takes_saved(f) \
        else timeline(f, module=module)
    return _holding(t, resident(module), module)


def _holding(t: Timeline, held: int, module: Module) -> Timeline:
    """``t`` with ``held`` more bytes live throughout (the gathered copies the schedule keeps),
    and, for a function that takes saved values, what ``module``'s caller holds beside its
    entry (``CALLER_LOSS``)."""
    if held:
        t.entry += held
        t.during = [x + held for x in t.during]
        t.after = [x + held for x in t.after]
    t.caller = int(module.attrs.get(CALLER_LOSS, 0)) if roles.takes_saved(t.func) else 0
    return t


def peaks(module: Module) -> dict[str, int]:
    """Predicted peak bytes of every function of ``module``."""
    return {name: t.peak for name, t in timelines(module).items()}


def step_peak(module: Module) -> int:
    """The peak of ``module``'s own memory over a step: the largest of its functions'
    peaks, each counting the activations the backward is handed, temporaries, gathered
    parameters and the buffers the program keeps."""
    return max(peaks(module).values(), default=0)


#: A pass option that is a size in bytes (written ``2GiB``, ``512MB`` or a number).
Bytes = int

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"2GiB"``, ``"512 MB"``, ``"1.5gib"`` or a number of bytes -> bytes, at least one."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    elif re.fullmatch(r"\s*\d+\s*", str(text)):
        n = int(text)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", str(text), re.IGNORECASE)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{text!r} is not a size; write it like \"2GiB\", \"512MB\" or a number of bytes")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{text!r} is no memory at all: a size is at least 1 byte")
    return n


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.50 KiB"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
