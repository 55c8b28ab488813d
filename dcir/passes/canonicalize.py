"""Canonicalize: fold away ops that do nothing, then remove what became dead.

Each rule below is one ``before -> after`` rewrite; results are replaced only by
values of the same type, so types, views and frees stay consistent. After the rules
settle, dead code is removed as by ``dce``.

Before -> after::

    %t = aten.t.default(%w) : f32[8, 16]
    %tt = aten.t.default(%t) : f32[16, 8]
    %v = aten.view.default(%tt) {size = [16, 8]} : f32[16, 8]
    %y = aten.mm.default(%x, %v) : f32[4, 8]
  ->
    %y = aten.mm.default(%x, %w) : f32[4, 8]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir.context import PlanContext
from dcir.ir import Module, Op, Value
from dcir.passes import Pass
from dcir.passes.dce import DeadCodeElimination
from dcir.rewrite import Constraint, Match, P, Rule, X, apply_rules

same_type = Constraint("result has the operand's type", lambda m: m.root.results[0].type == m["x"].type)
identity_dims = Constraint("dims are 0, 1, ..., n-1", lambda m: tuple(m.root.attrs.get("dims", ())) ==
                           tuple(range(len(m.root.attrs.get("dims", ())))))
only_attrs = lambda *keys: Constraint(f"no attributes but {', '.join(keys)}", lambda m: set(m.root.attrs) <= set(keys))


def _view_of_view(m: Match) -> Op:
    """view(view(x, s1), s2) -> view(x, s2): one view, straight from the source."""
    root = m.root
    out = Value(m.func.fresh_name(root.results[0].name), root.results[0].type)
    return Op(root.name, [m["x"]], [out], dict(root.attrs))


RULES = [
    # t(t(x)) -> x
    Rule(P("aten.t.default", P("aten.t.default", X("x"))), lambda m: m["x"], (same_type,), "transpose of transpose"),
    # view(x) to x's own shape -> x   (likewise reshape, _unsafe_view, expand, alias)
    *[Rule(P(name, X("x")), lambda m: m["x"], (same_type, only_attrs(*keys)), f"no-op {name}")
      for name, keys in [("aten.view.default", ("size",)), ("aten.reshape.default", ("shape",)),
                         ("aten._unsafe_view.default", ("size",)), ("aten.expand.default", ("size", "implicit")),
                         ("aten.alias.default", ())]],
    # permute(x, [0, 1, ..., n-1]) -> x
    Rule(P("aten.permute.default", X("x")), lambda m: m["x"], (same_type, identity_dims), "identity permute"),
    # view(view(x)) -> view(x)
    Rule(P("aten.view.default", P("aten.view.default", X("x"))), _view_of_view, (only_attrs("size"),), "view of view"),
]


@dataclass(frozen=True)
class Canonicalize(Pass):
    name = "canonicalize"
    max_iterations: int = 10

    def __post_init__(self):
        if self.max_iterations < 1:
            raise ValueError("max_iterations must be at least 1")

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        apply_rules(module, RULES, stats, self.max_iterations)
        DeadCodeElimination().run(module, stats, ctx)
