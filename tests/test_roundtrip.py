"""Round trip is a property: for generated modules, print -> parse -> print gives the
same bytes and an equal module, and the fast parser agrees with the full grammar even
when ops are spread over several lines."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcir
from dcir.ir import (DTYPE_BYTES, NONE, UNIT, Decl, DType, Function, HostType, Module, Op, PendingType, ShardType,
                     SymbolRef, TensorType, Value)

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}(\.[a-z0-9_]{1,4}){0,2}", fullmatch=True)
odd_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=8)
dtypes = st.sampled_from(sorted(DTYPE_BYTES))
tensors = st.builds(TensorType, dtypes, st.lists(st.integers(0, 64), max_size=4).map(tuple))
shards = st.builds(ShardType, tensors, st.integers(1, 8))
types = st.one_of(tensors, shards, st.builds(PendingType, st.one_of(tensors, shards)),
                  st.builds(HostType, st.one_of(tensors, shards)), st.just(NONE))
scalars = st.one_of(st.integers(-2**63, 2**63), st.floats(allow_nan=False), st.text(max_size=10), st.booleans(),
                    st.none(), st.builds(SymbolRef, st.one_of(names, odd_names)), st.builds(DType, dtypes))
attr_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=6)
attr_keys = st.one_of(names, st.text(min_size=1, max_size=6))
attrs = st.dictionaries(attr_keys, st.one_of(attr_values, st.just(UNIT)), max_size=3)
op_names = st.one_of(st.sampled_from(["aten.relu.default", "comm.wait", "mem.free", "param.get", "grad.set"]),
                     st.from_regex(r"[a-z]{1,5}\.[a-z_]{1,8}(\.[A-Za-z]{1,6})?", fullmatch=True))


@st.composite
def functions(draw, fname):
    args = [Value(f"arg{i}", draw(types)) for i in range(draw(st.integers(0, 3)))]
    values = list(args)
    ops = []
    for i in range(draw(st.integers(0, 6))):
        operands = draw(st.lists(st.sampled_from(values), max_size=3)) if values else []
        results = [Value(draw(names.map(lambda n, i=i, k=k: f"{n}_{i}_{k}")), draw(types))
                   for k in range(draw(st.integers(0, 2)))]
        sym = draw(st.one_of(st.none(), names, odd_names))
        parens = bool(operands) or draw(st.booleans())
        ops.append(Op(draw(op_names), operands, results, draw(attrs), sym, parens=parens))
        values.extend(results)
    returns = draw(st.lists(st.sampled_from(values), max_size=2)) if values else []
    return Function(fname, args, [draw(types) for _ in returns], ops, returns, draw(attrs))


@st.composite
def modules(draw):
    m = Module(draw(st.one_of(names, odd_names)), attrs=draw(attrs))
    for name in draw(st.lists(st.one_of(names, odd_names), max_size=3, unique=True)):
        m.decls[name] = Decl(draw(st.sampled_from(["param", "buffer"])), name, draw(types), draw(attrs))
    for fname in draw(st.lists(st.one_of(names, odd_names), max_size=3, unique=True)):
        m.functions[fname] = draw(functions(fname))
    return m


def _spread(text: str) -> str:
    """The same module with its attribute and operand lists broken over lines (lines
    holding a string are left alone: a string cannot span lines)."""
    return "\n".join(line if '"' in line else re.sub(r", (?=(%|[A-Za-z_]))", ",\n        ", line)
                     for line in text.split("\n"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(modules())
def test_print_parse_print(m: Module):
    text = dcir.print(m)
    again = dcir.parse(text)
    assert again == m
    assert dcir.print(again) == text
    assert dcir.parse(text, fast=False) == m


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(modules())
def test_layout_does_not_matter(m: Module):
    text = _spread(dcir.print(m))
    assert dcir.parse(text) == m
    assert dcir.parse(text, fast=False) == m
