"""Graph-break regions: one graph Dynamo hands a backend -> one DCIR module.

A model whose step Dynamo cannot trace as one graph (a ``.item()`` branch, a call it
cannot trace, a ``print`` of a value) runs as several graphs with Python between them.
Each graph is a *region*; ``capture_region`` turns one into a module of its own, as
``dcir_lowering.frontend.capture`` turns a whole step: the model's parameters and
buffers the region reads are symbols (``param.get``), its other inputs (the model's
inputs, or values the Python before it computed) ``{input}`` arguments in Dynamo's
order, its outputs ``{output}`` results; ``@backward`` takes their gradients and returns
the gradient of each input that needs one (``{input_grad = K}``), which autograd hands to
the region before it.

The region is traced on fake tensors (AOTAutograd, in a ``FakeTensorMode`` of its own),
so its parameters' values are never read: the Engine's are shards, and the module's
own tensors are empty. The Python between regions runs on the real values the regions
compute (``.item()`` reads a real tensor), which is why regions are captured when the
step first reaches them, not before.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode

from dcir import signature
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Module
from dcir_lowering.frontend import _Captured, _Lowering, fold_clones


def capture_region(gm: fx.GraphModule, example_inputs: list, model: torch.nn.Module, name: str,
                   training: bool) -> tuple[Module, list[int]]:
    """The module of one region: ``gm`` (Dynamo's graph) on ``example_inputs`` (its real
    inputs, ``model``'s parameters and buffers among them), with a backward when
    ``training`` and an output needs a gradient, else ``@eval`` alone; and which of the
    inputs are its ``{input}`` arguments, in their order."""
    captured = _trace_region(gm, example_inputs, training)
    if captured.aliased():  # an output that views an input or another output: AOTAutograd rebuilds
        gm = _cloning_outputs(gm)  # such outputs outside the graph, so the region returns copies
        captured = _trace_region(gm, example_inputs, training)
    if captured.mutated_outputs():
        raise DcirError(Diagnostic(f"the graph-break {name} changes one of its inputs in place; DCIR runs a region "
                                   "as a function of its inputs: write the result to a new tensor"))
    fold_clones(captured.forward, len(captured.meta.output_info))
    lowering = _Lowering(model, captured, name)
    module = lowering.module()
    for f in module.functions.values():  # a region takes its inputs by position, in Dynamo's order
        f.arg_attrs = [signature.mark(signature.INPUT) if signature.INPUT in d else d for d in f.arg_attrs]
    return module, list(lowering.user_inputs)


def _trace_region(gm: fx.GraphModule, example_inputs: list, training: bool) -> _Captured:
    """AOTAutograd's forward and (``training``) backward graphs of ``gm``, traced on fake
    copies of ``example_inputs``; ``inputs`` stay the real ones (a parameter is known by
    its identity)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [_fake(mode, t) for t in example_inputs]
    captured = _Captured()
    # the backward graph now, not at a first backward (inside Dynamo's compile, none can run)
    with tracing(TracingContext(mode)), torch.set_grad_enabled(training), \
            torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        captured.backend(gm, fakes)
    captured.inputs = list(example_inputs)
    return captured


def _fake(mode: FakeTensorMode, t):
    """A fake tensor shaped as ``t``, on its device, requiring grad as it does; not a tensor: ``t``."""
    if not isinstance(t, torch.Tensor):
        return t
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return fake.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else fake


def _cloning_outputs(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each tensor output replaced by a copy of it."""
    g = gm.graph
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(out):
        copies = [g.call_function(torch.clone, (n,)) if isinstance(n, fx.Node) else n for n in out.args[0]]
    for copy, n in zip(copies, out.args[0]):
        if isinstance(n, fx.Node):
            copy.meta = dict(n.meta)
    out.args = (tuple(copies),)
    gm.recompile()
    return gm
