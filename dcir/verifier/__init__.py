"""The verifier: structure, types, and the schedule invariants of docs/language.md.

One checker per invariant, each a small class in its own module with its own golden
file (``tests/golden/verifier/<module>.dcir``):

=================  ==========================================================================
``ssa``            every use is defined, and defined before it is used; names are unique
``declarations``   module attributes; each parameter's and buffer's attributes, type and value
``ranks``          ``ranks``-restricted ops; collectives are issued by every rank, in one order
``ops``            known op, symbol, arity, attributes (a ``schema`` op's: its torch schema)
``shapes``         the op's type rule, declared result types (``shapes=True``: torch's meta kernels)
``sharding``       compute sees only full device values; shards split across ``world_size``
``pending``        a pending value is waited exactly once, by a ``waits`` op, before the return
``memory``         no use after a free, no double free, no free while an async op reads it
``gradients``      a trainable parameter's gradient is reduced once and handed over once a step
``returns``        the returned values match the function's signature
=================  ==========================================================================

One walk (``walk.py``) visits each function once, in execution order, and calls the
checkers' hooks (``checker.py``). The verifier never changes the module it checks.
"""

from __future__ import annotations

import gc

from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Module
from dcir.verifier.walk import walk


def verify(module: Module, *, shapes: bool = False) -> None:
    """Raise ``DcirError`` listing every violation found; return None if the module is valid.

    ``shapes=True`` also runs every aten op through torch's meta kernels and checks its
    declared result types (see ``dcir.shapes``)."""
    diags = diagnostics(module, shapes=shapes)
    if diags:
        raise DcirError(diags)


def diagnostics(module: Module, *, shapes: bool = False) -> list[Diagnostic]:
    """Every violation in ``module``, in the order the walk finds them."""
    # The walk builds a few dicts per op and frees nothing: no point in the cyclic GC.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return walk(module, shapes)
    finally:
        if enabled:
            gc.enable()


__all__ = ["diagnostics", "verify"]
