"""``Module`` -> text. Deterministic: the same module prints to the same bytes.

Layout: two-space indentation, one declaration or op per line, attributes in the
order they were given, floats in Python's shortest round-trip form.
"""

from __future__ import annotations

import gc
import json
import math
import re
from functools import lru_cache
from itertools import zip_longest
from typing import TYPE_CHECKING

from dcir.attrs import UNIT, DType, SymbolRef

if TYPE_CHECKING:  # dcir.ir prints with this module (Module.__str__)
    from dcir.ir import Function, Module, Op

_BARE_SYMBOL = re.compile(r"[A-Za-z_$][\w.$-]*\Z")
_BARE_KEY = re.compile(r"[A-Za-z_][\w.]*\Z")
_KEYWORDS = {"true", "false", "none", "param", "buffer", "func", "module", "return", "attributes", "role",
             "shard", "pending", "host", "bool", "u8", "i8", "i16", "i32", "i64", "f16", "bf16", "f32", "f64",
             "c64", "c128"}


def symbol(name: str) -> str:
    return "@" + (name if _BARE_SYMBOL.match(name) else json.dumps(name))


def _float(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    text = repr(v)
    return text if ("." in text or "e" in text or "n" in text) else text + ".0"


def attr_value(v: object) -> str:
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return "none"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _float(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, SymbolRef):
        return symbol(v.name)
    if isinstance(v, DType):
        return v.name
    if isinstance(v, tuple):
        return "[" + ", ".join(attr_value(x) for x in v) + "]"
    raise TypeError(f"cannot print attribute value {v!r} of type {type(v).__name__}")


def attr_dict(attrs: dict) -> str:
    parts = []
    for k, v in attrs.items():
        key = k if _BARE_KEY.match(k) and k not in _KEYWORDS else json.dumps(k)
        parts.append(key if v is UNIT else f"{key} = {attr_value(v)}")
    return "{" + ", ".join(parts) + "}"


@lru_cache(maxsize=65536)
def type_text(t) -> str:
    return str(t)


def print_op(op: Op) -> str:
    parts = []
    if op.results:
        parts.append(", ".join("%" + r.name for r in op.results) + " = ")
    parts.append(op.name)
    if op.symbol is not None:
        parts.append(" " + symbol(op.symbol))
    if op.parens or op.operands:
        parts.append("(" + ", ".join("%" + v.name for v in op.operands) + ")")
    if op.attrs:
        parts.append(" " + attr_dict(op.attrs))
    if op.results:
        parts.append(" : " + ", ".join(type_text(r.type) for r in op.results))
    return "".join(parts)


def _typed(text: str, attrs: dict) -> str:
    """An argument or result of a signature, with its attributes (``{saved}``) if any."""
    return text + " " + attr_dict(attrs) if attrs else text  # None: a result without its attributes


def _print_function(f: Function, out: list[str]) -> None:
    args = ", ".join(_typed(f"%{a.name}: {a.type}", d) for a, d in zip_longest(f.args, f.arg_attrs[:len(f.args)]))
    head = f"  func {symbol(f.name)}({args})"
    if f.result_types:
        results = zip_longest(f.result_types, f.result_attrs[:len(f.result_types)])
        head += " -> (" + ", ".join(_typed(str(t), d) for t, d in results) + ")"
    if f.role is not None:
        head += f" role {f.role}"
    if f.attrs:
        head += " attributes " + attr_dict(f.attrs)
    out.append(head + " {")
    out.extend("    " + print_op(op) for op in f.ops)
    out.append("    return" + ("" if not f.returns else " " + ", ".join("%" + v.name for v in f.returns)))
    out.append("  }")


def print_module(m: Module) -> str:
    """The module as DCIR text, ending with a newline."""
    # Printing makes strings and short-lived lists and no cycles; a collection started
    # here would only rescan the module's objects (their use-lists too): about a fifth
    # of the time on a 100k-op module.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _print_module(m)
    finally:
        if enabled:
            gc.enable()


def _print_module(m: Module) -> str:
    out = ["module " + symbol(m.name) + (" attributes " + attr_dict(m.attrs) if m.attrs else "") + " {"]
    for d in m.decls.values():
        out.append(f"  {d.kind} {symbol(d.name)} : {d.type}" + (" " + attr_dict(d.attrs) if d.attrs else ""))
    for i, f in enumerate(m.functions.values()):
        if i or m.decls:
            out.append("")
        _print_function(f, out)
    out.append("}")
    return "\n".join(out) + "\n"


def positions(m: Module) -> tuple[str, dict[int, tuple[int, int]]]:
    """Print ``m`` and say where each function, op, return and declaration lies in that
    text, keyed by ``id()`` (a function's return under ``("return", id(f))``). Leaves
    ``m`` untouched: the verifier locates diagnostics on in-memory modules with it."""
    text = print_module(m)
    lines = text.split("\n")
    where: dict = {}
    lineno = 1
    for f in m.functions.values():
        while not lines[lineno - 1].startswith("  func "):
            lineno += 1
        where[id(f)] = (lineno, 3)
        for op in f.ops:
            lineno += 1
            where[id(op)] = (lineno, 5)
        lineno += 1
        where[("return", id(f))] = (lineno, 5)
        lineno += 1
    by_symbol = {symbol(d.name): d for d in m.decls.values()}
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if stripped.startswith(("param ", "buffer ")) and stripped.split()[1] in by_symbol:
            where[id(by_symbol[stripped.split()[1]])] = (i + 1, 3)
    return text, where


def locate(m: Module) -> str:
    """Print ``m`` and record each op's position in that text on the op (for
    diagnostics raised while lowering a module built in memory). Returns the text."""
    text, where = positions(m)
    for f in m.functions.values():
        f.loc = where[id(f)]
        f.return_loc = where[("return", id(f))]
        for op in f.ops:
            op.loc = where[id(op)]
    for d in m.decls.values():
        d.loc = where.get(id(d), d.loc)
    return text
