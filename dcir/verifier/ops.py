"""Ops: every op is known, takes a symbol exactly when its definition says so (and
the symbol is declared), has the declared number of operands and results, and only
the attributes its definition (or, for ``schema`` ops, its torch schema) accepts."""

from __future__ import annotations

import difflib
from functools import lru_cache

from dcir import aten, custom_ops, ops as registry
from dcir.ir import attr_key
from dcir.ops import COMMON_ATTRS
from dcir.verifier.checker import Checker
from dcir.verifier.report import plural


@lru_cache(maxsize=65536)
def _binding_problem(name: str, n_operands: int, key: tuple, items: tuple) -> str | None:
    """Why a schema op's operands and attributes do not fit its schema (None if they
    do); memoized on the attribute *key*, which tells 1, 1.0 and true apart."""
    try:
        aten.bind(aten.schema(name), n_operands, dict(items))
    except aten.MappingError as e:
        return str(e)
    return None


class Ops(Checker):
    def op(self, op, d, ok: bool) -> bool:
        if d is None:
            self._unknown(op)
            return False
        ok = self._symbol(op, d) and ok
        ok = self._arity(op, d) and ok
        common = self._common_attrs(op)
        own = self._schema_attrs(op) if registry.SCHEMA in d.traits else self._attrs(op, d)
        return common and own and ok

    def _unknown(self, op) -> None:
        family = op.family
        if family == "aten":
            base = ".".join(op.name.split(".")[:2])
            known = aten.overloads(base)
            if known:
                hint = "; its overloads are: " + ", ".join(k.rsplit(".", 1)[1] for k in known[:12])
            else:
                close = difflib.get_close_matches(base[5:], {k.split(".")[1] for k in aten._table()}, n=3)
                hint = ("; did you mean " + ", ".join(f"aten.{c}" for c in close) + "?") if close else ""
            self.report.op_error(op, f"unknown aten op '{op.name}'" + hint)
        elif family in registry.FAMILIES:
            members = sorted(n for n in registry.OPS if n.startswith(family + "."))
            self.report.op_error(op, f"unknown op '{op.name}'; {family} ops are: {', '.join(members)}")
        else:  # a torch.library namespace, or a typo of a family
            self.report.op_error(op, f"unknown op '{op.name}'; op families are: {', '.join(registry.FAMILIES)} "
                                     f"and custom ops, but {custom_ops.problem(op.name)}")

    def _symbol(self, op, d) -> bool:
        if d.symbol and op.symbol is None:
            self.report.op_error(op, f"{op.name} needs a symbol: {d.example}")
        elif not d.symbol and op.symbol is not None:
            self.report.op_error(op, f"{op.name} takes no symbol")
        elif d.symbol and op.symbol not in self.m.decls:
            close = difflib.get_close_matches(op.symbol, list(self.m.decls), n=1)
            self.report.op_error(op, f"unknown symbol @{op.symbol}" + (f"; did you mean @{close[0]}?" if close else ""))
        else:
            return True
        return False

    def _arity(self, op, d) -> bool:
        ok = True
        lo, hi = d.operands
        n = len(op.operands)
        if n < lo or (hi is not None and n > hi):
            want = f"{lo}" if lo == hi else (f"at least {lo}" if hi is None else f"{lo} to {hi}")
            self.report.op_error(op, f"{op.name} takes {want} operand{'' if (hi or lo) == 1 else 's'}, got {n}")
            ok = False
        if d.results == "per_operand":
            if len(op.results) != n:
                self.report.op_error(op, f"{op.name} defines one result per operand: {plural(n, 'operand')}, "
                                         f"{plural(len(op.results), 'result')}")
                ok = False
        elif registry.SCHEMA not in d.traits:  # a schema op's results are its type rule's business
            rlo, rhi = d.results
            if not rlo <= len(op.results) <= rhi:
                self.report.op_error(op, f"{op.name} defines {plural(rlo, 'result')}, not {len(op.results)}")
                ok = False
        return ok

    def _common_attrs(self, op) -> bool:
        ok = True
        for key, spec in COMMON_ATTRS.items():
            if key in op.attrs and spec.check(op.attrs[key]) is not None:
                self.report.op_error(op, f"attribute '{key}' of {op.name} must be {spec.check(op.attrs[key])}")
                ok = False
        ranks = op.attrs.get("ranks")
        if isinstance(ranks, tuple) and ok:
            ws = self.m.world_size
            bad = [r for r in ranks if r < 0 or (ws is not None and r >= ws)]
            if not ranks or bad or len(set(ranks)) != len(ranks):
                limit = f"0 to {ws - 1}" if ws is not None else "0 or more"
                self.report.op_error(op, f"'ranks' of {op.name} must list distinct ranks, each {limit}; "
                                         f"got {list(ranks)}")
                ok = False
        return ok

    def _schema_attrs(self, op) -> bool:
        items = tuple((k, v) for k, v in op.attrs.items() if k not in COMMON_ATTRS)
        problem = _binding_problem(op.name, len(op.operands), tuple((k, attr_key(v)) for k, v in items), items)
        if problem is not None:
            self.report.op_error(op, problem)
            return False
        return True

    def _attrs(self, op, d) -> bool:
        ok = True
        for key, value in op.attrs.items():
            if "." in key or key in COMMON_ATTRS:
                continue
            spec = d.attrs.get(key)
            if spec is None:
                valid = ", ".join(sorted(d.attrs)) or "none"
                self.report.op_error(op, f"unknown attribute '{key}' for {op.name}; its attributes are: {valid}")
                ok = False
            elif spec.check(value) is not None:
                self.report.op_error(op, f"attribute '{key}' of {op.name} must be {spec.check(value)}")
                ok = False
        for key, spec in d.attrs.items():
            if spec.required and key not in op.attrs:
                self.report.op_error(op, f"{op.name} needs the attribute '{key}': {d.example}")
                ok = False
        return ok
