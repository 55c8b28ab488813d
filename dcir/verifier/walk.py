"""The one walk over a module that drives every checker (see ``checker.py``)."""

from __future__ import annotations

from dcir import ops as registry
from dcir.diagnostics import Diagnostic
from dcir.ir import Module
from dcir.verifier.checker import Checker
from dcir.verifier.declarations import Declarations
from dcir.verifier.dtypes import Dtypes
from dcir.verifier.gradients import Gradients
from dcir.verifier.memory import Memory
from dcir.verifier.ops import Ops
from dcir.verifier.pending import Pending
from dcir.verifier.ranks import Ranks
from dcir.verifier.report import Reporter
from dcir.verifier.returns import Returns
from dcir.verifier.shapes import Shapes
from dcir.verifier.sharding import Sharding
from dcir.verifier.signatures import Signatures
from dcir.verifier.ssa import Ssa


def checkers(report: Reporter, module: Module, shapes: bool) -> tuple[Ssa, list[Checker]]:
    """The SSA checker, and every checker in the order their hooks run. Order matters
    where one invariant needs another's state or verdict: the type rule (``Shapes``)
    runs on ops that ``Ranks`` and ``Ops`` found well formed, shard counts
    (``Sharding``) on results the type rule accepted, and ``Memory`` asks ``Pending``
    which async ops are joined, so ``Pending`` records a wait first."""
    ssa = Ssa(report, module)
    pending = Pending(report, module)
    return ssa, [ssa, Declarations(report, module), Ranks(report, module), Ops(report, module),
                 Shapes(report, module, meta=shapes), Sharding(report, module), pending,
                 Memory(report, module, pending), Gradients(report, module), Returns(report, module),
                 Dtypes(report, module), Signatures(report, module)]


def walk(module: Module, shapes: bool = False) -> list[Diagnostic]:
    report = Reporter(module)
    ssa, all_checkers = checkers(report, module, shapes)
    hooks = _Hooks(all_checkers)
    for hook in hooks.module:
        hook()
    for f in module.functions.values():
        _function(f, ssa, hooks)
    for hook in hooks.end_module:
        hook()
    return report.diags


_UNSEEN = object()


class _Hooks:
    """Each hook as the list of the bound methods that override it: a 100k-op module
    makes millions of hook calls, and most checkers leave most hooks alone."""

    def __init__(self, all_checkers: list[Checker]):
        for name in ("module", "function", "operand", "op", "effects", "returned", "end_function", "end_module"):
            base = getattr(Checker, name)
            setattr(self, name, [getattr(c, name) for c in all_checkers if getattr(type(c), name) is not base])


def _function(f, ssa: Ssa, hooks: _Hooks) -> None:
    for hook in hooks.function:
        hook(f)
    defs: dict = {}  # op name -> its definition: one registry lookup per name, not per op
    defined = ssa.defined
    for i, op in enumerate(f.ops):
        d = defs.get(op.name, _UNSEEN)
        if d is _UNSEEN:
            d = defs[op.name] = registry.lookup(op.name)
        ok = True
        for k, v in enumerate(op.operands):
            if not defined(i, op, k, v):
                ok = False
                continue  # an undefined value has no type or state to check
            for hook in hooks.operand:
                ok = hook(op, d, k, v) and ok
        for hook in hooks.op:
            ok = hook(op, d, ok)
        for hook in hooks.effects:
            hook(op, d, ok)
    for k, v in enumerate(f.returns):
        for hook in hooks.returned:
            if not hook(f, k, v):
                break  # the first violation hides the others
    for hook in hooks.end_function:
        hook(f)
