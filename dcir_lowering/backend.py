"""DCIR -> PyTorch: each function of a module becomes an FX graph, run eagerly or
handed to Inductor.

The graph calls exactly what the IR says, op by op: ``aten.*`` ops through
``torch.ops.aten``, custom ops (``transformers.grouped_mm_fallback.default``) through
``torch.ops.<namespace>`` (operands and attributes mapped onto the schema as in
``dcir.aten``), ``param.get`` / ``param.set`` read and write the program's state (the
model's own parameter and buffer tensors), ``grad.set`` hands a gradient over, and
``mem.free`` needs nothing in one process (a value's memory goes with its last use).
Editing the text and lowering it again changes the program.

Collectives lower two ways. Given a process group (``group=``, its name), every
``comm.*`` op calls the C++ runtime (``torch.ops.dcir.*``, see ``docs/runtime.md``): a
start returns the result tensors and ``comm.wait`` finishes the transfer; ``mem.free``
releases the buffer's memory then and there; ``param.get`` of a sharded parameter
reads this rank's shard from the runtime's shard store. Without a group, collectives
have a meaning in one process only over a world of one rank (a gather of the one shard
is the tensor, an average over one is itself), which is how a ``zero3{world_size=1}``
module runs in a plain process.

The optimizer step (``@step``, made by the ``offload`` pass, the reloads it starts
in the backward and the copies home it finishes in the forward) lowers to calls on
the optimizer-state store given as ``lower(..., optimizer_state=)`` (an
``OptimizerStateStore``, ``dcir_lowering.state_store``; the Engine's is
``dcir_runtime.offload.StateStore``), which the program's state holds under
``OPTIMIZER_STATE``. ``param.get`` / ``param.set`` of optimizer state,
``mem.reload`` / ``mem.offload`` and their ``mem.wait``, ``mem.free`` of a device
copy and ``optim.step`` become its ``get_state``, ``set_state``, ``reload``,
``offload``, ``wait``, ``free`` and ``step``. The copies of activations
(``mem.offload`` / ``mem.reload`` marked ``act.offload``, from the
``offload_activations`` pass) and their ``mem.wait`` need no store: they run on the
process's copy lanes (``dcir_lowering.copies``), which the store's copies share.

This module is the lowering itself. What the lowered graphs call besides torch's ops
lives in ``dcir_lowering.calls``; the ``Program`` that ``lower`` returns, and the state it
runs on, in ``dcir_lowering.program``; the compute stretches Inductor compiles, and their
timing, in ``dcir_lowering.stretches``.
"""

from __future__ import annotations

import keyword

import torch
import torch.fx as fx

from dcir import aten, custom_ops, fusion, roles
from dcir.activations import OFFLOAD
from dcir.analysis import view_bases
from dcir.buffers import GRAD_ACC_OF, OPTIM_KEY, OPTIM_STATE_OF
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Function, Module, Op, ShardType, Source, Value
from dcir.ops import GATHERS, OPS, REDUCES, SCATTERS, SCHEMA, WAITS, has_trait, views
from dcir.printer import locate
from dcir.shapes import call_arguments, torch_dtype
from dcir.verifier import verify
from dcir_lowering import copies, state_store
from dcir_lowering.calls import (OP_INDEX, _grad_set, _item, _rng_get, _rng_set, _state_add, _state_get, _state_set,
                                 _state_zero, _dequantize, _dequantize_reduce, _quantize, _quantize_rows, _take_shard,
                                 _unbox)
from dcir_lowering.program import Program, constants, device_of, gathered_copies
from dcir_lowering.state_store import OPTIMIZER_STATE, OptimizerStateStore
from dcir_lowering.stretches import compile_compute, reshaping


def lower_function(module: Module, name: str, group: str | dict | None = None,
                   shards_in_state: bool = False, store_prefix: str = "", boxed: bool | None = None) -> fx.GraphModule:
    """Function ``name`` of ``module`` as a GraphModule taking ``(state, grads, *args)``,
    or ``(state, grads, args)`` when ``boxed`` (``args`` a list the function empties:
    ``_unbox``; by default a function that takes ``@forward``'s saved values is boxed,
    so each saved activation goes after its last use, as the memory model has it);
    collectives run over the process group named ``group`` when one is given, and
    sharded parameters come from the shard store (under ``store_prefix + FQN``), or
    from ``state`` when ``shards_in_state``."""
    func = module.functions[name]
    g = fx.Graph()
    state = g.placeholder("state")
    grads = g.placeholder("grads")
    if roles.takes_saved(func) if boxed is None else boxed:
        unboxed = g.call_function(_unbox, (g.placeholder("args"),))
        env = {a: g.call_function(_item, (unboxed, k)) for k, a in enumerate(func.args)}
    else:
        env = {a: g.placeholder(_py_name(a.name)) for a in func.args}
    lowering = _Distributed(module, func, group, shards_in_state, store_prefix) if group is not None else None
    offloading = _Offloading(module, func, state)
    for k, op in enumerate(func.ops):
        if offloading.handles(op):
            offloading.lower(op, g, env)
        elif lowering is not None and lowering.handles(op):
            lowering.lower(op, g, env)
        else:
            _lower_op(module, func, op, g, env, state, grads)
        for node in reversed(g.nodes):  # the nodes this op became, for the profiler
            if node.op == "placeholder" or OP_INDEX in node.meta or node.target is _unbox or \
                    (node.target is _item and node.args[0].target is _unbox):  # the arguments, no op's
                break
            node.meta[OP_INDEX] = k
    results = tuple(env[v] for v in func.returns)
    g.output(results)
    return fx.GraphModule(torch.nn.Module(), g, class_name=f"dcir_{_py_name(name)}")


def _py_name(name: str) -> str:
    """A Python identifier for ``name`` (``%0_weight`` is a DCIR name, not a Python one)."""
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "_"
    return "_" + out if out[0].isdigit() or keyword.iskeyword(out) else out


def _gather_one(shard: torch.Tensor, shape: tuple) -> torch.Tensor:
    """all_gather over one rank: the shard is the whole (flattened) tensor."""
    return shard.reshape(shape)


def _scatter_one(full: torch.Tensor) -> torch.Tensor:
    """reduce_scatter over one rank: the average of one is itself, as its flat shard."""
    return full.reshape(-1)


def _loaded(v: Value) -> bool:
    """Whether ``v`` is (a view of) what a ``param.get`` read: the state's own storage."""
    while isinstance(v.owner, Op) and v.owner.name != "param.get":
        src = views(v.owner).get(v.index)
        if src is None:
            return False
        v = v.owner.operands[src]
    return isinstance(v.owner, Op)


def _lower_collective(module: Module, op: Op, g: fx.Graph, env: dict) -> None:
    """Collectives over a world of one rank, where each has a meaning in one process."""
    if (module.world_size or 1) != 1:
        raise _unsupported(module, op, f"{op.name} over {module.world_size} ranks needs the distributed runtime; "
                                       "lower with group= (the Engine does)")
    for v, r in zip(op.operands, op.results):
        if has_trait(op, GATHERS):
            env[r] = g.call_function(_gather_one, (env[v], r.type.inner.shape))
        elif has_trait(op, SCATTERS):
            env[r] = g.call_function(_scatter_one, (env[v],))
        else:  # a wait, or an all_reduce over one rank: the value itself
            env[r] = env[v]
        if has_trait(op, REDUCES) and _loaded(v):  # a result is never the state's storage, which param.zero clears
            env[r] = g.call_function(torch.ops.aten.clone.default, (env[r],))


class _Distributed:
    """``comm.*``, ``mem.free`` and sharded ``param.get`` as calls into the C++ runtime."""

    def __init__(self, module: Module, func: Function, group: str | dict, shards_in_state: bool = False,
                 store_prefix: str = ""):
        self.module, self.shards_in_state = module, shards_in_state
        #: mesh dimension (None: every rank) -> the c10d name of the group a collective over it runs in
        self.groups = group if isinstance(group, dict) else {None: group}
        self.store_prefix = store_prefix
        self.ops = torch.ops.dcir
        bases = view_bases(func)  # a view -> the value whose storage it shares
        # storage that is not this function's to release: the program's state (an argument
        # is released when the IR frees it: a gathered parameter @forward hands to @backward)
        self.borrowed = {v for v in func.values() if isinstance(v.owner, Op) and v.owner.name == "param.get"}
        self.storage_base = lambda v: bases.get(v, v)
        # the results of a coalesced reduction are parts of one buffer: freeing one would free
        # them all, so their memory goes with the last of them (as Python drops it)
        pending = {r for op in func.ops if has_trait(op, REDUCES) and len(op.results) > 1 for r in op.results}
        self.parts = {r for op in func.ops if has_trait(op, WAITS) for v, r in zip(op.operands, op.results)
                      if v in pending}

    def handles(self, op: Op) -> bool:
        if op.name == "param.get":  # from the shard store, unless the state has it (an accumulator: always)
            decl = self.module.decls[op.symbol]
            return isinstance(decl.type, ShardType) and not self.shards_in_state and GRAD_ACC_OF not in decl.attrs
        return op.family == "comm" or op.name in ("mem.free", "mem.shard")

    def lower(self, op: Op, g: fx.Graph, env: dict) -> None:
        if "ranks" in op.attrs:
            raise _unsupported(self.module, op,
                               f"{op.name} over a subgroup of ranks is not supported by the runtime yet")
        if "group" in OPS[op.name].attrs and op.attrs.get("group") not in self.groups:  # runs over a group of ranks
            raise _unsupported(self.module, op, f"{op.name} runs over the mesh dimension \"{op.attrs['group']}\", and "
                                                "the process group it is lowered for has no such mesh")
        group = self.groups[op.attrs.get("group")]
        d = self.ops
        tag = ", ".join("%" + v.name for v in op.operands) + (f" (line {op.loc[0]})" if op.loc else "")
        args = [env[v] for v in op.operands]
        if op.name == "param.get":
            env[op.results[0]] = g.call_function(d.get_shard, (self.store_prefix + op.symbol,))
            return
        if op.name == "mem.shard":
            env[op.results[0]] = g.call_function(_take_shard, (args[0], group))
            return
        if op.name == "mem.free":
            for v in op.operands:
                if self.storage_base(v) not in self.borrowed and self.storage_base(v) not in self.parts:
                    g.call_function(d.free, (env[v],))
            return
        if op.name == "comm.wait":
            for v, r in zip(op.operands, op.results):
                env[r] = g.call_function(d.wait, (env[v],))
            return
        reduction = op.attrs.get("op", "sum")
        if op.name == "comm.all_gather":
            outs = [g.call_function(d.all_gather, (args[0], list(op.results[0].type.inner.shape), group, tag))]
        elif op.name == "comm.all_gather_coalesced":
            shapes = [r.type.inner.shape for r in op.results]
            node = g.call_function(d.all_gather_coalesced,
                                   (args, [n for s in shapes for n in s], [len(s) for s in shapes], group, tag))
            outs = [g.call_function(_item, (node, i)) for i in range(len(op.results))]
        elif op.name == "comm.reduce_scatter":
            outs = [g.call_function(d.reduce_scatter, (args[0], reduction, group, tag))]
        elif op.name == "comm.reduce_scatter_coalesced":
            node = g.call_function(d.reduce_scatter_coalesced, (args, reduction, group, tag))
            outs = [g.call_function(_item, (node, i)) for i in range(len(op.results))]
        elif op.name == "comm.all_to_all":
            outs = [g.call_function(d.all_to_all, (args[0], group, tag))]
        elif op.name == "comm.all_reduce":
            outs = [g.call_function(d.all_reduce, (args[0], reduction, group, tag))]
        elif op.name == "comm.all_reduce_coalesced":
            node = g.call_function(d.all_reduce_coalesced, (args, reduction, group, tag))
            outs = [g.call_function(_item, (node, i)) for i in range(len(op.results))]
        else:
            raise _unsupported(self.module, op, f"{op.name} is not supported by the runtime yet")
        for r, node in zip(op.results, outs):
            env[r] = node


class _Offloading:
    """Optimizer state and host copies as calls on the optimizer-state store, which
    the program's state holds under ``OPTIMIZER_STATE``."""

    def __init__(self, module: Module, func: Function, state: fx.Node):
        self.module, self.state = module, state
        self.symbols = {name for name, d in module.decls.items() if OPTIM_STATE_OF in d.attrs}
        self.keys: dict[str, list[str]] = {}
        for d in module.decls.values():
            if OPTIM_STATE_OF in d.attrs:
                self.keys.setdefault(d.attrs[OPTIM_STATE_OF].name, []).append(d.attrs[OPTIM_KEY])
        copies = {v for op in func.ops if op.name in ("mem.reload", "mem.offload") and OFFLOAD not in op.attrs
                  for v in op.results}
        self.waits = {op for op in func.ops if op.name == "mem.wait" and copies.issuperset(op.operands)}
        reloaded = {r for op in self.waits for v, r in zip(op.operands, op.results) if v.owner.name == "mem.reload"}
        # device copies of state handed over between functions, which the store counts:
        # @step's arguments (reloaded in the last backward), @forward's (updated in @step)
        args = set(func.args)
        reloaded.update(v for op in func.ops if op.name in ("optim.step", "mem.offload")
                        for v in op.operands if v in args)
        bases = view_bases(func)  # a view -> the value whose storage it shares
        self.reloaded = lambda v: bases.get(v, v) in reloaded  # noqa: E731
        # a run of updates with only reads of state between them becomes one call into the
        # optimizer (each call costs a pass over every parameter); the run's last update
        # makes it, the others wait for it
        self.batches: dict[Op, list[Op]] = {}
        run: list[Op] = []
        for op in [*func.ops, None]:
            if op is not None and op.name == "optim.step":
                run.append(op)
            elif op is None or not (op.name == "param.get" and op.symbol in self.symbols):
                if run:
                    self.batches[run[-1]] = run
                run = []

    @staticmethod
    def starts(module: Module, op: Op) -> bool:
        """Whether ``op`` calls the store (the waits and frees of what it makes follow)."""
        if op.name in ("param.get", "param.set"):
            decl = module.decls.get(op.symbol)
            return decl is not None and OPTIM_STATE_OF in decl.attrs
        return op.name == "optim.step" or op.name in ("mem.reload", "mem.offload") and OFFLOAD not in op.attrs

    def handles(self, op: Op) -> bool:
        if op.name == "mem.free":
            return bool(op.operands) and all(self.reloaded(v) for v in op.operands)
        return self.starts(self.module, op) or op in self.waits

    def lower(self, op: Op, g: fx.Graph, env: dict) -> None:
        call = lambda target, *args: g.call_function(target, (self.state, *args))  # noqa: E731
        if op.name == "param.get":
            env[op.results[0]] = call(state_store.get_state, op.symbol)
        elif op.name == "param.set":
            call(state_store.set_state, op.symbol, env[op.operands[0]])
        elif op.name == "mem.reload":
            env[op.results[0]] = call(state_store.reload, env[op.operands[0]])
        elif op.name == "mem.offload":
            env[op.results[0]] = call(state_store.offload, env[op.operands[0]])
        elif op.name == "mem.wait":
            for v, r in zip(op.operands, op.results):
                env[r] = call(state_store.wait, env[v])
        elif op.name == "mem.free":
            for v in op.operands:
                call(state_store.free, env[v])
        elif op in self.batches:  # optim.step, the last of its run: the whole run at once
            run = self.batches[op]
            items = tuple((s.symbol, tuple(self.keys.get(s.symbol, ()))) for s in run)
            node = call(state_store.step, items, *[env[v] for s in run for v in s.operands])
            i = 0
            for s in run:
                for r in s.results:
                    env[r] = g.call_function(_item, (node, i))
                    i += 1


def _lower_op(module: Module, func: Function, op: Op, g: fx.Graph, env: dict, state, grads) -> None:
    if op.family == "comm":
        _lower_collective(module, op, g, env)
    elif op.name == "param.get":
        env[op.results[0]] = g.call_function(_state_get, (state, op.symbol))
    elif op.name == "param.set":
        g.call_function(_state_set, (state, op.symbol, env[op.operands[0]]))
    elif op.name == "param.add":
        g.call_function(_state_add, (state, op.symbol, env[op.operands[0]]))
    elif op.name == "param.zero":
        g.call_function(_state_zero, (state, op.symbol))
    elif op.name == "grad.set":
        g.call_function(_grad_set, (grads, op.symbol, env[op.operands[0]]))
    elif op.name == "mem.free":
        pass  # one process: memory is released with the value's last use
    elif op.name in ("mem.offload", "mem.reload"):  # an activation's (act.offload): on the copy lanes
        env[op.results[0]] = g.call_function(getattr(copies, op.name[4:]), (env[op.operands[0]],))
    elif op.name == "mem.wait":
        for v, r in zip(op.operands, op.results):
            env[r] = g.call_function(copies.wait, (env[v],))
    elif op.name == "rng.get":
        env[op.results[0]] = g.call_function(_rng_get, (env[op.operands[0]],))
    elif op.name == "rng.set":
        g.call_function(_rng_set, tuple(env[v] for v in op.operands))
    elif op.name == "mem.quantize":
        rows = (op.attrs["parts"],) if "parts" in op.attrs else ()  # a reduction's: one row per rank
        node = g.call_function(_quantize_rows if rows else _quantize, (env[op.operands[0]], op.attrs["block"], *rows))
        env[op.results[0]], env[op.results[1]] = (g.call_function(_item, (node, k)) for k in (0, 1))
    elif op.name == "mem.dequantize":
        env[op.results[0]] = g.call_function(_dequantize, (env[op.operands[0]], env[op.operands[1]], op.attrs["block"],
                                                           op.attrs["parts"], torch_dtype(op.attrs["dtype"].name)))
    elif op.name == "mem.dequantize_reduce":
        env[op.results[0]] = g.call_function(_dequantize_reduce, (env[op.operands[0]], env[op.operands[1]],
                                                                  op.attrs["block"], op.attrs["op"],
                                                                  torch_dtype(op.attrs["dtype"].name)))
    elif op.name == "mem.shard":  # one process: a world of one rank, whose shard is the whole tensor
        if module.group_size(op.attrs.get("group")) != 1:
            raise _unsupported(module, op, f"{op.name} over more than one rank needs a process group: lower with "
                                           "group= (the Engine does)")
        env[op.results[0]] = g.call_function(_take_shard, (env[op.operands[0]], None))
    elif op.name == "mem.cast":
        env[op.results[0]] = g.call_function(torch.ops.aten._to_copy.default, (env[op.operands[0]],),
                                             {"dtype": torch_dtype(op.attrs["dtype"].name)})
    elif has_trait(op, SCHEMA):  # aten and custom ops: torch.ops.<namespace>.<name>.<overload>
        _lower_aten(op, g, env)
    else:
        raise _unsupported(module, op, f"{op.name} is not lowered in @{func.name}")


def _lower_aten(op: Op, g: fx.Graph, env: dict) -> None:
    sch = aten.schema(op.name)
    args, kwargs = call_arguments(op.name, [env[v] for v in op.operands], op.attrs)
    node = g.call_function(_target(op.name), tuple(args), kwargs)
    if len(op.results) == 1 and not sch.variadic_results and len(sch.returns) == 1:
        env[op.results[0]] = node
        return
    for i, r in enumerate(op.results):
        env[r] = g.call_function(_item, (node, i))


def _target(name: str):
    return custom_ops.resolve(name)


def _unsupported(module: Module, op: Op, message: str) -> DcirError:
    if module.source is None:
        module.source = Source("<generated>", locate(module))
    return DcirError(Diagnostic(message, module.source, op.loc, len(op.name)))


def lower(module: Module, state: dict, *, inductor: bool = False, group: str | dict | None = None,
          store_prefix: str = "", optimizer_state: OptimizerStateStore | None = None,
          device: torch.device | str | None = None) -> Program:
    """Lower ``module`` (verified first) to a ``Program`` over ``state`` (FQN -> tensor).
    Buffers with a ``value`` attribute that ``state`` lacks are made from it. With
    ``group`` (a process group's name, or a dict from each mesh dimension, None for every
    rank, to the name of this rank's group over it), collectives run over it through the C++
    runtime, and sharded parameters are read from the runtime's shard store, under
    ``store_prefix + FQN`` (from ``state`` when it has them). ``inductor`` compiles the compute (between the
    collectives, see ``compile_compute``); without it, the stretches whose ops the ``fuse``
    pass marked (``dcir.fusion``) are compiled, the rest runs op by op. ``optimizer_state`` is the store that
    optimizer state, ``optim.step`` and host copies run on (an ``OptimizerStateStore``,
    such as ``dcir_runtime.offload.StateStore``); a module with any of them needs one. The
    tensors the program makes (``constants``, ``gathered_copies``) go on ``device``:
    the Engine's; by default ``state``'s (``device_of``)."""
    verify(module)
    device = device_of(state.values()) if device is None else torch.device(device)
    state = {**constants(module, device), **gathered_copies(module, device), **state}
    if optimizer_state is not None:
        state[OPTIMIZER_STATE] = optimizer_state
    else:
        needs = next((op for f in module.functions.values() for op in f.ops if _Offloading.starts(module, op)), None)
        if needs is not None:
            raise _unsupported(
                module, needs, f"{needs.name} runs on an optimizer-state store, and none was given: "
                "lower(..., optimizer_state=store) with a dcir_runtime.offload.StateStore "
                "(the Engine makes one when its config has 'offload')")
    missing = [name for name, d in module.decls.items()  # optimizer state: @step's store has it
               if name not in state and OPTIM_STATE_OF not in d.attrs
               and not (group is not None and isinstance(d.type, ShardType))]
    if missing:
        raise DcirError(Diagnostic(f"no tensor for {', '.join('@' + m for m in missing)} in the program's state"))
    in_state = any(isinstance(d.type, ShardType) and name in state and GRAD_ACC_OF not in d.attrs
                   for name, d in module.decls.items())
    graphs = {f.role: lower_function(module, f.name, group, in_state, store_prefix)
              for f in module.functions.values() if f.role is not None}

    compiles = inductor or any(fusion.marked(f) for f in module.functions.values())

    def compiled(role: str, gm):
        if role not in fusion.ROLES or not compiles:
            return gm
        if inductor:
            return compile_compute(gm)
        func = module.role(role)
        marked = {i for i, op in enumerate(func.ops) if fusion.FUSE in op.attrs}
        # a function with nothing compiled may read what another's compiled stretch laid out
        return compile_compute(gm, marked) if marked else reshaping(gm)

    return Program(module, state, graphs, {role: compiled(role, gm) for role, gm in graphs.items()}, device)
