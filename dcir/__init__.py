"""DCIR: a compiler for distributed training, built around its own IR.

The public API is small:

* ``dcir.parse(text, name)`` -> ``Module``; ``dcir.print(module)`` -> text;
* ``dcir.verify(module)`` raises ``DcirError`` with located diagnostics;
* ``dcir.run_passes(module, "dce,canonicalize")`` runs a pass pipeline in place;
* ``dcir.compile_to_ir(model, example_inputs)`` captures a PyTorch model's training
  step (forward and backward) as a module (``dcir_lowering.frontend``);
* ``dcir.graph_breaks(model, *args, **kwargs)`` lists where Dynamo splits the model's
  forward, and why, as ``GraphBreak``s (``dcir_lowering.breaks``);
* ``dcir.initialize(model, optimizer=..., config=...)`` -> the training ``Engine``
  that runs the sharded program across processes (``dcir_runtime``);
* ``dcir.lower(module, state)`` makes a module runnable again, over the model's own
  tensors (``dcir_lowering.backend``; ``dcir_lowering.program.state_of(model)`` gives them).

Everything else is reached through these or through ``dcir-opt``.
"""

from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Module
from dcir.parser import parse
from dcir.passes import run_passes
from dcir.printer import print_module as print  # noqa: A001  (dcir.print(module), like MLIR's print)
from dcir.verifier import verify

__all__ = ["DcirError", "Diagnostic", "GraphBreak", "Module", "compile_to_ir", "graph_breaks", "initialize", "lower",
           "parse", "print", "run_passes", "verify"]


def __getattr__(name: str):
    # Capture needs torch, whose import costs seconds; dcir-opt never pays for it.
    if name == "compile_to_ir":
        from dcir_lowering.frontend import compile_to_ir
        return compile_to_ir
    if name in ("graph_breaks", "GraphBreak"):
        from dcir_lowering import breaks
        return getattr(breaks, name)
    if name == "initialize":
        from dcir_runtime import initialize
        return initialize
    if name == "lower":
        from dcir_lowering.backend import lower
        return lower
    raise AttributeError(f"module 'dcir' has no attribute {name!r}")
