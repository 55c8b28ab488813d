"""``torch.compile(model, backend="dcir")``: train through DCIR in one process.

The backend hands Dynamo's graph to AOTAutograd, and each graph it produces (the
forward, then the backward) goes through DCIR: FX -> a verified DCIR function (the
graph's inputs as arguments, parameters included) -> FX again, run eagerly. It is
registered with torch through the ``torch_dynamo_backends`` entry point, so the name
works as soon as DCIR is installed. The DCIR module behind each compiled graph is kept
on the callable as ``.dcir_module`` for inspection.

Logging, ``warnings.warn`` and ``print`` in a model's forward split Dynamo's graph before
any backend sees it; run the compiled model under ``benign_breaks()`` to have them
ignored while Dynamo traces, as ``compile_to_ir`` does (docs/frontend.md).

For the whole-step view (parameters as symbols, one module with ``@forward`` and
``@backward``) use ``dcir.compile_to_ir``; this backend is the drop-in path.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Function, Module, Value
from dcir.verifier import verify
from dcir_lowering.backend import constants, lower_function
from dcir_lowering.frontend import GraphLowering, _type, _where, benign_breaks  # noqa: F401  (re-exported)


def dcir_backend(gm: fx.GraphModule, example_inputs, **_options):
    """The ``"dcir"`` backend for ``torch.compile``."""
    from torch._functorch.aot_autograd import aot_module_simplified

    _refuse_dynamic_shapes(gm)
    return aot_module_simplified(gm, example_inputs, fw_compiler=functools.partial(_through_dcir, "forward"),
                                 bw_compiler=functools.partial(_through_dcir, "backward"))


def _refuse_dynamic_shapes(gm: fx.GraphModule) -> None:
    """DCIR's shapes are static. Dynamo makes a size symbolic when it changed between
    calls (a smaller last batch: "automatic dynamic") or under ``dynamic=True``; that is
    an error naming the input, with the fix: ``dynamic=False`` gives one graph per shape."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("example_value")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else (val,)
        if not any(isinstance(d, torch.SymInt) for d in shape):
            continue
        grapharg = node.meta.get("grapharg")
        source = grapharg.source.name if grapharg is not None else node.name
        what = f"the size {val}" if isinstance(val, torch.SymInt) else f"the shape [{', '.join(map(str, shape))}]"
        traces = [u.meta["stack_trace"] for u in node.users if u.meta.get("stack_trace")]
        where = _where(traces[0]) if traces else ""
        raise DcirError(Diagnostic(
            f"cannot lower to DCIR: input {source} has a dynamic shape ({what}){where}; "
            "DCIR's shapes are static: pass dynamic=False to torch.compile for one graph per input shape"))


def _refuse_higher_order(gm: fx.GraphModule) -> None:
    """A higher-order op (``torch.cond``, ``torch.while_loop``...) calls subgraphs, which
    DCIR's functions cannot hold yet: an error at the user's line, not a crash on the
    subgraph read as a constant."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
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
    GraphLowering(module).lower_ops(gm, func, env)
    outputs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    none_at = [i for i, o in enumerate(outputs) if o is None]
    func.returns = [env[o] for o in outputs if o is not None]
    func.result_types = [v.type for v in func.returns]
    module.functions[name] = func
    return module, none_at


def _through_dcir(name: str, gm: fx.GraphModule, example_inputs):
    # AOTAutograd calls its compilers inside its FakeTensorMode, where torch.tensor() makes a
    # fake tensor and a real one cannot be read: a graph's constants (a KV cache's empty start,
    # T5's torch.tensor(0) in forward) are spelled out and rebuilt here, so they must be real
    with unset_fake_temporarily():
        module, none_at = graph_to_module(gm, name)
        verify(module)
        lowered = lower_function(module, name)
        state = constants(module)

    def run(args):
        outputs = list(lowered(state, {}, *args))
        args.clear()  # boxed calling convention: let the inputs go as early as AOTAutograd can
        for i in none_at:
            outputs.insert(i, None)
        return outputs

    run._boxed_call = True
    run.dcir_module = module
    return run
