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
``offload``, ``wait``, ``free`` and ``step``.
"""

from __future__ import annotations

import functools
import keyword
import re
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.fx as fx

from dcir import aten, custom_ops, fusion, roles, signature
from dcir.diagnostics import DcirError, Diagnostic
from dcir.analysis import view_bases
from dcir.ir import Function, Module, Op, ShardType
from dcir.ops import SCHEMA, has_trait
from dcir.printer import locate
from dcir.roles import BACKWARD, BACKWARD_LAST, EVAL, FORWARD, STEP, UNSHARD
from dcir.shapes import call_arguments, torch_dtype
from dcir.verifier import verify
from dcir_lowering import state_store
from dcir_lowering.state_store import OPTIMIZER_STATE, OptimizerStateStore


#: ``node.meta`` key: position in its function of the op an FX node comes from
OP_INDEX = "dcir_op"


def _state_get(state: dict, name: str) -> torch.Tensor:
    return state[name]


def _state_set(state: dict, name: str, value: torch.Tensor) -> None:
    with torch.no_grad():
        state[name].copy_(value)


def _grad_set(grads: dict, name: str, value: torch.Tensor) -> None:
    grads[name] = value


def _unbox(box: list) -> tuple:
    """A boxed function's arguments, taken out of the caller's list, which is emptied:
    the function then holds the only reference to each, and its graph lets it go after
    its last use (a backward's saved activations, as AOTAutograd's boxed calls do)."""
    args = tuple(box)
    box.clear()
    return args


def _rng_get(where: torch.Tensor) -> torch.Tensor:
    """``rng.get``: the state of the default generator of ``where``'s device."""
    if where.device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(where.device).get_rng_state(where.device)


def _rng_set(state: torch.Tensor, where: torch.Tensor) -> None:
    """``rng.set``: the default generator of ``where``'s device starts again from ``state``."""
    if where.device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(where.device).set_rng_state(state, where.device)


def lower_function(module: Module, name: str, group: str | None = None,
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


def _lower_collective(module: Module, op: Op, g: fx.Graph, env: dict) -> None:
    """Collectives over a world of one rank, where each has a meaning in one process."""
    if (module.world_size or 1) != 1:
        raise _unsupported(module, op, f"{op.name} over {module.world_size} ranks needs the distributed runtime; "
                                       "lower with group= (the Engine does)")
    for v, r in zip(op.operands, op.results):
        if op.name == "comm.wait":
            env[r] = env[v]
        elif op.name.startswith("comm.all_gather"):
            env[r] = g.call_function(_gather_one, (env[v], r.type.inner.shape))
        elif op.name.startswith("comm.reduce_scatter"):
            env[r] = g.call_function(_scatter_one, (env[v],))
        else:  # all_reduce over one rank
            env[r] = env[v]


class _Distributed:
    """``comm.*``, ``mem.free`` and sharded ``param.get`` as calls into the C++ runtime."""

    def __init__(self, module: Module, func: Function, group: str, shards_in_state: bool = False,
                 store_prefix: str = ""):
        self.module, self.group, self.shards_in_state = module, group, shards_in_state
        self.store_prefix = store_prefix
        self.ops = torch.ops.dcir
        bases = view_bases(func)  # a view -> the value whose storage it shares
        # storage that is not this function's to release: the program's state (an argument
        # is released when the IR frees it: a gathered parameter @forward hands to @backward)
        self.borrowed = {v for v in func.values() if isinstance(v.owner, Op) and v.owner.name == "param.get"}
        self.storage_base = lambda v: bases.get(v, v)

    def handles(self, op: Op) -> bool:
        if op.name == "param.get":  # from the shard store, unless the state has it
            return isinstance(self.module.decls[op.symbol].type, ShardType) and not self.shards_in_state
        return op.family == "comm" or op.name == "mem.free"

    def lower(self, op: Op, g: fx.Graph, env: dict) -> None:
        if "ranks" in op.attrs:
            raise _unsupported(self.module, op, f"{op.name} over a subgroup of ranks is not supported by the runtime yet")
        d = self.ops
        tag = ", ".join("%" + v.name for v in op.operands) + (f" (line {op.loc[0]})" if op.loc else "")
        args = [env[v] for v in op.operands]
        if op.name == "param.get":
            env[op.results[0]] = g.call_function(d.get_shard, (self.store_prefix + op.symbol,))
            return
        if op.name == "mem.free":
            for v in op.operands:
                if self.storage_base(v) not in self.borrowed:
                    g.call_function(d.free, (env[v],))
            return
        if op.name == "comm.wait":
            for v, r in zip(op.operands, op.results):
                env[r] = g.call_function(d.wait, (env[v],))
            return
        reduction = op.attrs.get("op", "sum")
        if op.name == "comm.all_gather":
            outs = [g.call_function(d.all_gather, (args[0], list(op.results[0].type.inner.shape), self.group, tag))]
        elif op.name == "comm.all_gather_coalesced":
            shapes = [r.type.inner.shape for r in op.results]
            node = g.call_function(d.all_gather_coalesced,
                                   (args, [n for s in shapes for n in s], [len(s) for s in shapes], self.group, tag))
            outs = [g.call_function(_item, (node, i)) for i in range(len(op.results))]
        elif op.name == "comm.reduce_scatter":
            outs = [g.call_function(d.reduce_scatter, (args[0], reduction, self.group, tag))]
        elif op.name == "comm.reduce_scatter_coalesced":
            node = g.call_function(d.reduce_scatter_coalesced, (args, reduction, self.group, tag))
            outs = [g.call_function(_item, (node, i)) for i in range(len(op.results))]
        elif op.name == "comm.all_reduce":
            outs = [g.call_function(d.all_reduce, (args[0], reduction, self.group, tag))]
        elif op.name == "comm.all_reduce_coalesced":
            node = g.call_function(d.all_reduce_coalesced, (args, reduction, self.group, tag))
            outs = [g.call_function(_item, (node, i)) for i in range(len(op.results))]
        else:
            raise _unsupported(self.module, op, f"{op.name} is not supported by the runtime yet")
        for r, node in zip(op.results, outs):
            env[r] = node


# ---- what a lowered graph's nodes do, for the profiler (``dcir_runtime.profiler``) ----------

def reads_state(node: fx.Node) -> bool:
    """Whether a node of a lowered function reads the program's state (parameter
    shards, buffers, optimizer state), or picks a result of such a read. An update
    (``optim.step``) returns the state it was given, updated in place."""
    if node.op != "call_function":
        return False
    if node.target is _item and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    if node.target in (state_store.get_state, state_store.step):
        return True
    qualified = getattr(node.target, "_qualified_op_name", "")
    return qualified == "dcir::get_shard" or node.target is _state_get


class _Offloading:
    """Optimizer state and host copies as calls on the optimizer-state store, which
    the program's state holds under ``OPTIMIZER_STATE``."""

    def __init__(self, module: Module, func: Function, state: fx.Node):
        from dcir.memory import OPTIM_KEY, OPTIM_STATE_OF
        self.module, self.state = module, state
        self.symbols = {name for name, d in module.decls.items() if OPTIM_STATE_OF in d.attrs}
        self.keys: dict[str, list[str]] = {}
        for d in module.decls.values():
            if OPTIM_STATE_OF in d.attrs:
                self.keys.setdefault(d.attrs[OPTIM_STATE_OF].name, []).append(d.attrs[OPTIM_KEY])
        copies = {v for op in func.ops if op.name in ("mem.reload", "mem.offload") for v in op.results}
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
        from dcir.memory import OPTIM_STATE_OF
        if op.name in ("param.get", "param.set"):
            decl = module.decls.get(op.symbol)
            return decl is not None and OPTIM_STATE_OF in decl.attrs
        return op.name in ("mem.reload", "mem.offload", "optim.step")

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
    elif op.name == "grad.set":
        g.call_function(_grad_set, (grads, op.symbol, env[op.operands[0]]))
    elif op.name == "mem.free":
        pass  # one process: memory is released with the value's last use
    elif op.name == "rng.get":
        env[op.results[0]] = g.call_function(_rng_get, (env[op.operands[0]],))
    elif op.name == "rng.set":
        g.call_function(_rng_set, tuple(env[v] for v in op.operands))
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


def _item(values, i):
    return values[i]


def _target(name: str):
    return custom_ops.resolve(name)


def _unsupported(module: Module, op: Op, message: str) -> DcirError:
    if module.source is None:
        from dcir.ir import Source
        module.source = Source("<generated>", locate(module))
    return DcirError(Diagnostic(message, module.source, op.loc, len(op.name)))


@dataclass
class Program:
    """A lowered program over live state (the model's tensors, by FQN): each function
    with a role (``dcir/roles.py``) lowered to a GraphModule taking ``(state, grads,
    *args)`` (``graphs``), and what runs it (``runs``: the same, or compiled).

    ``forward(*args, **kwargs)`` returns ``(outputs, saved)``, split as ``@forward``'s
    signature declares (``dcir/signature.py``); ``backward(saved, grads)`` returns the
    gradients by FQN; ``train_step(*args, **kwargs)`` does both, with the gradient of
    every output all ones (for a loss: ``loss.backward()``), and accumulates into the
    parameters' ``.grad``. Arguments are matched to the ``{input = ...}`` arguments by
    their names (``args[0]`` or a keyword such as ``labels``). ``device``: where the
    program's own tensors (``constants``, ``gathered_copies``, tangents) live.
    """

    module: Module
    state: dict
    graphs: dict[str, fx.GraphModule]
    runs: dict[str, object]
    device: torch.device

    def function(self, role: str):
        return self.module.role(role)

    @property
    def forward_gm(self):
        return self.graphs.get(FORWARD)

    @property
    def step_gm(self):
        return self.graphs.get(STEP)

    def backward_for(self, last: bool) -> tuple[str, fx.GraphModule, object]:
        """(role, graph, callable) of the backward to run: ``@backward_last`` in the last
        micro-step of an optimizer step when the module has one, else ``@backward``."""
        role = BACKWARD_LAST if last and BACKWARD_LAST in self.graphs else BACKWARD
        return role, self.graphs[role], self.runs[role]

    def unshard(self) -> None:
        """Gather the copies ``@unshard`` fills: once per optimizer step, before its
        first micro-step (the parameters change only at the step)."""
        if UNSHARD in self.graphs:
            self.graphs[UNSHARD](self.state, {})

    @functools.cached_property
    def differentiable(self) -> frozenset[int]:
        """The outputs the backward takes a gradient of (``{grad = K}``)."""
        return frozenset(k for _, k in signature.grads(self.function(self.backward_for(False)[0])))

    def split(self, role: str, out) -> tuple[list, tuple]:
        """A run's results of the function of ``role``: (its outputs, the rest)."""
        kinds = [signature.kind(d) for d in self.function(role).result_attrs]
        out = list(out or ())
        return ([v for v, k in zip(out, kinds) if k == signature.OUTPUT],
                tuple(v for v, k in zip(out, kinds) if k != signature.OUTPUT))

    def forward(self, *args, **kwargs):
        role = FORWARD if FORWARD in self.runs else EVAL
        return self.split(role, self.runs[role](self.state, {}, *self.inputs(role, args, kwargs)))

    def inputs(self, role: str, args: tuple, kwargs: dict) -> list:
        """The call's ``args`` and ``kwargs`` in the order of the ``{input}`` arguments of
        the function of ``role`` (``call_inputs``)."""
        return call_inputs(self.function(role), args, kwargs)

    def tangents(self, given: dict | None = None, last: bool = True) -> list:
        """The backward's ``{grad = K}`` arguments: ``given[K]`` (the gradient of output K),
        zeros where it has none (the loss did not use that output); without ``given``,
        ones (the gradient of the outputs' sum)."""
        bw = self.function(self.backward_for(last)[0])
        device = self.device
        out = []
        for arg, k in signature.grads(bw):
            dtype = torch_dtype(arg.type.dtype)
            g = given.get(k) if given is not None else torch.ones(arg.type.shape, dtype=dtype, device=device)
            out.append(torch.zeros(arg.type.shape, dtype=dtype, device=device) if g is None else g.to(dtype))
        return out

    def backward(self, saved, grads: list, last: bool = True) -> dict:
        """Gradients by FQN; ``last``: this is the last micro-step of an optimizer step."""
        out: dict = {}
        self.backward_for(last)[2](self.state, out, [*saved, *grads])
        return out

    @torch.no_grad()
    def train_step(self, *args, **kwargs):
        self.unshard()
        outputs, saved = self.forward(*args, **kwargs)
        for fqn, g in self.backward(saved, self.tangents()).items():
            p = self.state[fqn]
            g = g.detach().reshape(p.shape)  # a one-rank shard is the flattened gradient
            p.grad = g.clone() if p.grad is None else p.grad + g
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def call_inputs(func: Function, args: tuple, kwargs: dict) -> list:
    """A call's ``args`` and ``kwargs`` in the order of ``func``'s ``{input}`` arguments,
    by their names (``args[0]``, ``labels``); a function that declares none takes them
    by position."""
    if not signature.args(func, signature.INPUT):  # a hand-written function: by position
        return list(args) + list(kwargs.values())
    out = []
    for name in signature.input_names(func):
        m = re.fullmatch(r"args\[(\d+)\]", name)
        if m and int(m.group(1)) < len(args):
            out.append(args[int(m.group(1))])
        elif name in kwargs:
            out.append(kwargs[name])
        else:
            raise TypeError(f"the captured step takes an input {name!r} that this call does not give")
    return out


def lower(module: Module, state: dict, *, inductor: bool = False, group: str | None = None,
          store_prefix: str = "", optimizer_state: OptimizerStateStore | None = None,
          device: torch.device | str | None = None) -> Program:
    """Lower ``module`` (verified first) to a ``Program`` over ``state`` (FQN -> tensor).
    Buffers with a ``value`` attribute that ``state`` lacks are made from it. With
    ``group`` (a process group's name), collectives run over it through the C++
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
            raise _unsupported(module, needs, f"{needs.name} runs on an optimizer-state store, and none was given: "
                                              "lower(..., optimizer_state=store) with a dcir_runtime.offload.StateStore "
                                              "(the Engine makes one when its config has 'offload')")
    from dcir.memory import OPTIM_STATE_OF
    missing = [name for name, d in module.decls.items()  # optimizer state: @step's store has it
               if name not in state and OPTIM_STATE_OF not in d.attrs
               and not (group is not None and isinstance(d.type, ShardType))]
    if missing:
        raise DcirError(Diagnostic(f"no tensor for {', '.join('@' + m for m in missing)} in the program's state"))
    in_state = any(isinstance(d.type, ShardType) and name in state for name, d in module.decls.items())
    graphs = {f.role: lower_function(module, f.name, group, in_state, store_prefix)
              for f in module.functions.values() if f.role is not None}

    def compiled(role: str, gm):
        if role not in fusion.ROLES:
            return gm
        if inductor:
            return compile_compute(gm)
        func = module.role(role)
        marked = {i for i, op in enumerate(func.ops) if fusion.FUSE in op.attrs}
        return compile_compute(gm, marked) if marked else gm

    return Program(module, state, graphs, {role: compiled(role, gm) for role, gm in graphs.items()}, device)


_STATE_CALLS = (_state_get, _state_set, _grad_set, *state_store.CALLS, _rng_get, _rng_set, _unbox)


def _runs_in_runtime(node: fx.Node, runtime: set) -> bool:
    """State access and the runtime's ops (and the picking of their results)."""
    if node.op != "call_function":
        return False
    t = node.target
    if t in _STATE_CALLS or getattr(t, "_qualified_op_name", "").startswith("dcir::"):
        return True
    if torch.Tag.nondeterministic_seeded in getattr(t, "tags", ()):  # eager's generator (dcir.activations)
        return True
    return t is _item and node.args[0] in runtime


def compile_compute(gm: fx.GraphModule, only: set[int] | None = None) -> fx.GraphModule:
    """Inductor for the compute between collectives, the runtime's ops as they are.

    Inductor sees a collective as a synchronous kernel: it would reuse the storage of
    an input the transfer is still reading, or of a result that ``comm.wait`` returns,
    for its own buffers. So the graph is cut at runtime ops; each stretch of compute
    between them is compiled on its own, and the runtime's ops run between the compiled
    pieces. A copy of the graph is cut (``gm`` stays as it is: the profiler runs it).

    Fewer cuts mean fewer calls into compiled code (each costs some microseconds) and
    more to fuse, so runtime ops that need not split a stretch are moved to its edge
    (``_arrange``), keeping the order of every runtime op that has an effect:

    * to its start: reads of state (``param.get``: a reference to a stored tensor, which
      only ``param.set`` and the optimizer change, and those cut), the picking of a
      result already made, and a ``comm.wait`` on a collective that an earlier wait has
      finished (the wait of one result of a coalesced transfer finishes all of them:
      the others return at once);
    * to its end, or to just before the first compute that reads its result: any other
      ``comm.wait`` (waiting later blocks less; its buffer is allocated already),
      ``mem.free`` (nothing reads a freed value after the free, the verifier proves it,
      so only the release comes later: the stretch's compute keeps its memory that long)
      and ``grad.set`` (a dict entry);
    * never: collective starts (moving one earlier allocates its buffer earlier, later
      starts the transfer later), ``param.set`` (compute after it reads the new value),
      the optimizer-state store's calls (reloads, copies home, the step), ``rng.get``,
      ``rng.set`` and random ops (eager's generator: ``dcir.activations``).

    A stretch with fewer than ``MIN_COMPILED_OPS`` ops Inductor could fuse (views and
    matmuls aside: Inductor calls the same library kernels for those) runs as it is:
    there is nothing to fuse, and the call would cost more than it saves. With ``only``
    (positions of IR ops: those the ``fuse`` pass marked), only a stretch that runs one
    of them is compiled (``dcir.fusion`` cuts the IR as this function cuts the graph)."""
    from torch.fx.passes.split_module import split_module

    arranged = fx.GraphModule(gm, _arrange(gm.graph))
    runtime: set = set()
    part: dict = {}
    compute_parts: dict[int, int] = {}  # stretch -> its ops Inductor could fuse
    chosen: set[int] = set()  # stretches that run an op of ``only``
    current, last = 0, None
    for n in arranged.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        in_runtime = _runs_in_runtime(n, runtime)
        if in_runtime:
            runtime.add(n)
        if in_runtime != last:
            current, last = current + 1, in_runtime
        part[n] = current
        if not in_runtime:
            compute_parts[current] = compute_parts.get(current, 0) + _fusible(n)
            if only is None or n.meta.get(OP_INDEX) in only:
                chosen.add(current)
    split = split_module(arranged, torch.nn.Module(), lambda n: part[n], keep_original_order=True)
    for name, sub in list(split.named_children()):
        k = int(name.rsplit("_", 1)[1])
        if compute_parts.get(k, 0) >= MIN_COMPILED_OPS and k in chosen:
            setattr(split, name, _Compiled(sub))
    return split


#: the fewest ops Inductor could fuse (``_fusible``) a stretch needs to be compiled
MIN_COMPILED_OPS = fusion.MIN_OPS


def _fusible(node: fx.Node) -> int:
    """1 for an op Inductor could fuse with others, 0 for a view, the picking of a
    result, or a library kernel (a matmul: ``dcir.fusion.LIBRARY_KERNELS``)."""
    t = node.target
    return int(t is not _item and not str(t).startswith(fusion.LIBRARY_KERNELS) and not getattr(t, "is_view", False))


def _kind(node: fx.Node, runtime: set) -> str:
    """What ``node`` is to a stretch, in ``dcir.fusion``'s terms (``fusion.arrange`` places
    it); ``runtime``: the runtime's nodes so far."""
    if not _runs_in_runtime(node, runtime):
        return fusion.COMPUTE
    runtime.add(node)
    t, runtime_op = node.target, _runtime_op(node)
    if t is _state_get or runtime_op == "get_shard":
        return fusion.READ
    if t is _item:
        return fusion.PICK
    if t is _grad_set:
        return fusion.HAND_OVER
    return {"free": fusion.FREE, "wait": fusion.WAIT}.get(runtime_op, fusion.OTHER)


def _runtime_op(node: fx.Node) -> str:
    """The name of the runtime's op (``torch.ops.dcir.*``) a node calls, or ``""``."""
    name = getattr(node.target, "_qualified_op_name", "")
    return name[len("dcir::"):] if name.startswith("dcir::") else ""


def _collective(wait: fx.Node) -> fx.Node:
    """The collective a ``comm.wait`` node finishes (a coalesced one's results are picked)."""
    pending = wait.args[0]
    return pending.args[0] if pending.target is _item else pending


def _arrange(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with the runtime ops that may cross compute moved to the edges
    of their stretch (``compile_compute``), where ``dcir.fusion.arrange`` puts them."""
    args = [n for n in graph.nodes if n.op == "placeholder"]
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    runtime: set = set()
    kinds = [_kind(n, runtime) for n in nodes]
    order, _ = fusion.arrange(nodes, kinds, lambda n: n.all_input_nodes,
                              lambda n: [_collective(n)], placed=args)
    out = fx.Graph()
    env: dict = {}
    for n in [*args, *order, *[m for m in graph.nodes if m.op == "output"]]:
        env[n] = out.node_copy(n, lambda a: env[a])
    return out


#: the runs of a compiled stretch after compiling it that are not timed (``_Compiled``)
WARM_RUNS = 4

#: the views a compiled stretch reshapes instead (``_Compiled``)
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


class _Compiled(torch.nn.Module):
    """A stretch compiled by Inductor at its first call (``compile_fx`` with the call's
    tensors as the example: a program's shapes are fixed, and Inductor's code checks
    each input's size and strides), its tensor results made contiguous.

    Straight to Inductor, not ``torch.compile``: Dynamo would check its guards on every
    call (about 15 us on this CPU, hundreds of stretches a step) for a graph that has no
    Python to trace. Inductor may lay a result out differently from eager (a pointwise
    result keeps its input's permuted strides); a later stretch that ``aten.view``s it,
    as the IR says, then fails. Every view of a contiguous tensor is valid, and the
    captured graphs are functional, so a copy changes no value (``contiguous`` copies
    only what is not). For the same reason the stretch's own ``aten.view``s are
    reshapes: Inductor traces with meta strides, which can differ from eager's (a
    ``cat`` with an empty operand keeps the other's permuted strides on meta, a
    contiguous result in eager), and a view the eager strides allow would fail there.

    Each call is timed (``times``: the profiler prices the stretch's ops from them). The
    first run of a compiled kernel loads it, which took up to 10 times its later runs
    here, and the next few are slow too (their buffers are fresh: a tiny Llama's
    stretches, run once a step, took 1.8, 1.55 and 1.28 times a later run in their 2nd,
    3rd and 4th runs, 1.05 in their 5th), so after compiling, the stretch runs
    ``WARM_RUNS`` times untimed; their results are dropped (the stretch has no effect
    but its results: state is written by ``param.set``, which cuts stretches; a stretch
    with random ops draws its seeds from torch's generator that many times more then).
    The optimization cycle profiles a compiled plan after one step, so the first timed
    run is what prices it."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        for n in gm.graph.nodes:  # the same values; see the class's docstring
            if n.target in _VIEWS:
                n.target = torch.ops.aten.reshape.default
        gm.recompile()
        self.gm, self.compiled = gm, None
        # the IR ops it runs (its placeholders carry the meta of the ops that made its inputs)
        self.ops = sorted({n.meta[OP_INDEX] for n in gm.graph.nodes if n.op == "call_function" and OP_INDEX in n.meta})
        self.times: deque = deque(maxlen=5)  # seconds of its last calls, compiling aside (``stretch_times``)

    def forward(self, *args):
        if self.compiled is None:
            from torch._inductor.compile_fx import compile_fx
            with torch.no_grad():
                self.compiled = compile_fx(self.gm, list(args))
            for _ in range(WARM_RUNS):  # untimed: the first runs are slow (the class's docstring)
                self.compiled(*args)
        begin = time.perf_counter()
        out = self.compiled(*args)
        if isinstance(out, torch.Tensor):
            out = out.contiguous()
        elif isinstance(out, (tuple, list)):
            out = type(out)(x.contiguous() if isinstance(x, torch.Tensor) else x for x in out)
        self.times.append(time.perf_counter() - begin)
        return out


def stretch_times(runner) -> list[tuple[list[int], float]]:
    """The compiled stretches of a function's runner (``Program.runs``) that have run:
    (the IR ops each runs, the median seconds of its last calls). The profiler prices
    the ops of a program lowered with ``inductor`` from them (``dcir_runtime.profiler``)."""
    children = runner.children() if isinstance(runner, torch.nn.Module) else ()
    return [(c.ops, statistics.median(c.times)) for c in children if isinstance(c, _Compiled) and c.times]


def device_of(tensors) -> torch.device:
    """Where a program over ``tensors`` runs: the first tensor's device; with none,
    torch's default device (``torch.set_default_device``)."""
    first = next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)
    return first if first is not None else torch.get_default_device()


def constants(module: Module, device: torch.device | str) -> dict:
    """The buffers whose text spells out their value (``{value = [...]}``), as tensors on ``device``."""
    out = {}
    for name, decl in module.decls.items():
        if "value" in decl.attrs:
            t = decl.type
            values = [complex(v) if isinstance(v, str) else v for v in decl.attrs["value"]]  # complex: "(1+2j)"
            out[name] = torch.tensor(values, dtype=torch_dtype(t.dtype), device=device).reshape(t.shape)
    return out


def gathered_copies(module: Module, device: torch.device | str) -> dict:
    """Storage for the buffers the schedule keeps: gathered copies of parameters (filled
    by ``@unshard``) and gradient accumulators (``zero1``, zero at the start)."""
    from dcir.memory import GRAD_ACC_OF, UNSHARD_OF
    out = {}
    for name, d in module.decls.items():
        if UNSHARD_OF in d.attrs or GRAD_ACC_OF in d.attrs:
            out[name] = torch.zeros(d.type.shape, dtype=torch_dtype(d.type.dtype), device=device)
    return out


def state_of(model: torch.nn.Module) -> dict:
    """A model's parameters and buffers by FQN: the state a Program runs on."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}
