"""``torch.compile(model, backend="dcir")``: train through DCIR in one process.

The backend hands Dynamo's graph to AOTAutograd, and each graph it produces (the
forward, then the backward) goes through DCIR: FX -> a verified DCIR function (the
graph's inputs as arguments, parameters included) -> FX again, run eagerly. It is
registered with torch through the ``torch_dynamo_backends`` entry point, so the name
works as soon as DCIR is installed. The DCIR module behind each compiled graph is kept
on the callable as ``.dcir_module`` for inspection.

A graph whose sizes Dynamo made symbolic (a batch of another size under the default
``dynamic=None``, or ``dynamic=True``) is specialized at run time: one static DCIR
program per concrete shape, compiled on first use, at most Dynamo's ``recompile_limit``
of them kept (``PerShape``).

Logging, ``warnings.warn`` and ``print`` in a model's forward split Dynamo's graph before
any backend sees it; run the compiled model under ``benign_breaks()`` to have them
ignored while Dynamo traces, as ``compile_to_ir`` does (docs/frontend.md).

For the whole-step view (parameters as symbols, one module with ``@forward`` and
``@backward``) use ``dcir.compile_to_ir``; this backend is the drop-in path.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.fx as fx
from torch._guards import TracingContext
from torch._subclasses.fake_tensor import unset_fake_temporarily

from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Function, Module, Value
from dcir.verifier import verify
from dcir_lowering.backend import lower_function
from dcir_lowering.frontend import (GraphLowering, _type, _where, benign_breaks,  # noqa: F401  (re-exported)
                                    fold_clones, record_libraries)
from dcir_lowering.program import constants, device_of


def dcir_backend(gm: fx.GraphModule, example_inputs, **_options):
    """The ``"dcir"`` backend for ``torch.compile``."""
    if symbolic_inputs(gm):
        _refuse_higher_order(gm)  # now, as for a static graph, not at the first call
        return PerShape(gm, torch._dynamo.config.recompile_limit)
    return _aot(gm, example_inputs)


def _aot(gm: fx.GraphModule, example_inputs):
    from torch._functorch.aot_autograd import aot_module_simplified  # ~0.9 s to import: at the first graph

    return aot_module_simplified(gm, example_inputs, fw_compiler=functools.partial(_through_dcir, "forward"),
                                 bw_compiler=functools.partial(_through_dcir, "backward"))


def symbolic_inputs(gm: fx.GraphModule) -> bool:
    """Whether Dynamo made a size or a scalar symbolic: a size that changed between calls
    ("automatic dynamic"), or under ``dynamic=True`` every size, int and float attribute
    (a float arrives as a 0-d tensor read with ``.item()``)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("example_value")
            dims = (*val.shape, *val.stride()) if isinstance(val, torch.Tensor) else (val,)
            if _as_scalar(node) or any(isinstance(d, torch.SymInt) for d in dims):
                return True
    return False


def _as_scalar(node: fx.Node) -> bool:
    """A Python float Dynamo passes as a 0-d tensor (its ``pass_arg_as_tensor``)."""
    grapharg = node.meta.get("grapharg")
    return bool(getattr(grapharg, "pass_arg_as_tensor", False))


class PerShape:
    """A Dynamo graph with symbolic sizes, run as one static DCIR program per concrete shape.

    DCIR's IR is statically shaped. At each call the concrete sizes and strides (and the values
    of the graph's symbolic ints and floats) pick a program; the first call with new ones
    specializes the graph to them (those ints and floats become constants, its size
    computations then trace to concrete ints) and compiles it exactly like a static graph: AOTAutograd
    traces it on the call's inputs, the forward and the backward go through DCIR. At most
    ``limit`` programs are kept (Dynamo's ``recompile_limit``, 8 by default); a shape
    beyond them replaces the least recently used one, with a warning the first time,
    so training goes on but may recompile."""

    def __init__(self, gm: fx.GraphModule, limit: int):
        self.gm = gm
        self.limit = limit
        self.scalar_at = [_as_scalar(n) for n in gm.graph.nodes if n.op == "placeholder"]
        self.programs: dict = {}  # key -> AOTAutograd's callable; insertion order = least recently used first
        self.compiles = 0
        self._warned = False

    def key(self, args) -> tuple:
        return tuple(a.item() if scalar else (tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
                     for a, scalar in zip(args, self.scalar_at))

    def __call__(self, *args):
        key = self.key(args)
        program = self.programs.pop(key, None)
        if program is None:
            program = self._compile(args)
        self.programs[key] = program  # most recently used last
        return program(*(a for a in args if not isinstance(a, (int, torch.SymInt))))

    def _compile(self, args):
        if len(self.programs) >= self.limit:
            self.programs.pop(next(iter(self.programs)))
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"DCIR: a graph met more than {self.limit} input shapes (torch._dynamo.config.recompile_limit); "
                    "the least recently used program is dropped and a shape seen again recompiles: pad or bucket "
                    "the inputs to fewer shapes, or raise the limit", stacklevel=2)
        self.compiles += 1
        tensors = [a for a in args if not isinstance(a, (int, torch.SymInt))]
        return _aot(specialize(self.gm, args, self.scalar_at), tensors)


def specialize(gm: fx.GraphModule, args, scalar_at: list[bool]) -> fx.GraphModule:
    """``gm`` with its int placeholders replaced by the call's values, and the ``.item()``
    of its float ones too: a graph of tensor inputs only, whose size computations trace
    to concrete ints."""
    graph = fx.Graph()
    env: dict = {}
    scalars: dict = {}
    placeholders = iter(zip(args, scalar_at))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value, scalar = next(placeholders)
            if isinstance(value, (int, torch.SymInt)):
                env[node] = int(value)
                continue
            if scalar:
                scalars[node] = value.item()
        elif node.op == "call_method" and node.target == "item" and node.args[0] in scalars:
            env[node] = scalars[node.args[0]]
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    specialized = fx.GraphModule(gm, graph)
    specialized.meta.update(gm.meta)
    return specialized


#: higher-order ops DCIR takes: activation checkpointing's region (Dynamo's graph; AOTAutograd
#: partitions it) and its replay of random ops (AOTAutograd's graphs; ``dcir.activations``)
_TAKEN = ("tag_activation_checkpoint", "run_and_save_rng_state", "run_with_rng_state")


def _refuse_higher_order(gm: fx.GraphModule) -> None:
    """A higher-order op (``torch.cond``, ``torch.while_loop``...) calls subgraphs, which
    DCIR's functions cannot hold yet: an error at the user's line, not a crash on the
    subgraph read as a constant. Activation checkpointing's are taken (``_TAKEN``)."""
    for node in gm.graph.nodes:
        if (node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)
                and node.target.name() not in _TAKEN):
            raise DcirError(Diagnostic(
                f"cannot lower to DCIR: torch.{node.target.name()} is a higher-order op (it calls subgraphs), which "
                f"DCIR cannot express{_where(node.meta.get('stack_trace', ''))}; rewrite it with torch.where"))


def graph_to_module(gm: fx.GraphModule, name: str) -> tuple[Module, list[int]]:
    """One AOT graph as a module with one function; also where its outputs are None
    (gradients of inputs that need none), which DCIR does not return."""
    _refuse_higher_order(gm)
    module = Module(name)
    env: dict = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = Value(node.name, _type(node.meta["val"]))
    func = Function(name, list(env.values()))  # takes the arguments: sets their owner and index
    GraphLowering(module).lower_ops(gm, func, env, backward=name == "backward")
    outputs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    none_at = [i for i, o in enumerate(outputs) if o is None]
    func.returns = [env[o] for o in outputs if o is not None]
    func.result_types = [v.type for v in func.returns]
    module.functions[name] = func
    record_libraries(module)
    return module, none_at


def _fold_forward_clones(gm: fx.GraphModule) -> None:
    """The capture's clone folding (``frontend.fold_clones``) on a forward AOTAutograd
    hands over, which outputs leave the graph read from its metadata (Dynamo's tracing
    context); without it nothing is folded."""
    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    if meta is not None:
        fold_clones(gm, sum(1 for info in meta.input_info if info.mutates_data) + len(meta.output_info))


def _through_dcir(name: str, gm: fx.GraphModule, example_inputs):
    if name == "forward":
        _fold_forward_clones(gm)
    # AOTAutograd calls its compilers inside its FakeTensorMode, where torch.tensor() makes a
    # fake tensor and a real one cannot be read: a graph's constants (a KV cache's empty start,
    # T5's torch.tensor(0) in forward) are spelled out and rebuilt here, so they must be real
    with unset_fake_temporarily():
        module, none_at = graph_to_module(gm, name)
        verify(module)
        lowered = lower_function(module, name, boxed=True)
        state = constants(module, device_of(example_inputs))  # the inputs' device (the model's)

    def run(args):  # boxed: the graph empties ``args`` and lets each input go after its last use
        outputs = list(lowered(state, {}, args))
        for i in none_at:
            outputs.insert(i, None)
        return outputs

    run._boxed_call = True
    run.dcir_module = module
    return run
