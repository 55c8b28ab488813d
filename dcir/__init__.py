"""DCIR: a compiler for distributed training, built around its own IR.

The public API is small:

* ``dcir.parse(text, name)`` -> ``Module``; ``dcir.print(module)`` -> text;
* ``dcir.verify(module)`` raises ``DcirError`` with located diagnostics;
* ``dcir.run_passes(module, "dce,canonicalize")`` runs a pass pipeline in place.

Everything else is reached through these or through ``dcir-opt``.
"""

from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Module
from dcir.parser import parse
from dcir.passes import run_passes
from dcir.printer import print_module as print  # noqa: A001  (dcir.print(module), like MLIR's print)
from dcir.verifier import verify

__all__ = ["DcirError", "Diagnostic", "Module", "parse", "print", "run_passes", "verify"]
