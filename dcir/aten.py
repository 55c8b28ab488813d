"""What DCIR knows about ``aten`` ops: their schemas, and how an op's operands and
attributes map onto a schema's arguments.

The table is read from the installed torch once and cached as JSON per torch version
(importing torch costs seconds; reading the cache costs milliseconds), so ``dcir-opt``
can verify aten ops without importing torch.

Argument mapping (the convention the whole project uses, see docs/language.md):

* tensor arguments (``Tensor``, ``Tensor?``, ``Tensor[]``) are operands, in schema order;
* every other argument is an attribute named like the schema argument (``{dim = 1}``);
  an optional tensor that is absent is written as an attribute with value ``none``,
  and a number given for a tensor (``aten.add.Tensor(%x) {other = 1}``, which torch
  wraps into a tensor) is an attribute too; a complex number is a string in Python's
  complex syntax (``{other = "(1+2j)"}``: the language has no complex literal);
* arguments that keep their schema default may be left out;
* a single ``Tensor[]`` argument takes all operands not taken by the plain tensor
  arguments (``aten.cat.default(%a, %b) {dim = 1}``).
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from dcir import custom_ops
from dcir.op_schema import Arg, Schema, arg_record


_FORMAT = 3  # bump when the cached record changes shape or meaning


def _cache_path(version: str) -> Path:
    root = Path(os.environ.get("DCIR_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dcir")
    return root / f"aten-schemas-v{_FORMAT}-torch-{version}.json"


_LIST_ALIAS = re.compile(r"Tensor\((\w+)\)\[\]")


def _read_from_torch() -> dict[str, list]:
    # only when the table is first read and not cached: dcir-opt on plain text stays torch-free
    import torch  # noqa: F401  (registers the aten schemas)
    from torch._C import _jit_get_all_schemas

    table = {}
    for s in _jit_get_all_schemas():
        if not s.name.startswith("aten::"):
            continue
        key = f"aten.{s.name[len('aten::'):]}.{s.overload_name or 'default'}"
        rets = [arg_record(r) for r in s.returns]
        # Tensor(a)[] (split, unbind): the alias set sits on the list's elements, which
        # torch's Python bindings do not expose; the schema's text shows it.
        m = _LIST_ALIAS.fullmatch(str(s).rsplit(" -> ", 1)[1].strip())
        if m and len(rets) == 1:
            rets[0][4] = m.group(1)
        table[key] = [[arg_record(a) for a in s.arguments], rets]
    return table


@lru_cache(maxsize=1)
def _table() -> dict[str, list]:
    version = metadata.version("torch")
    path = _cache_path(version)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    table = _read_from_torch()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home only costs the next run the torch import
    return table


def schema(op_name: str) -> Schema | None:
    """The schema of ``aten.<name>.<overload>``; ``aten.<name>`` means the default overload.
    An op of another namespace is a custom op, whose schema torch holds (``dcir.custom_ops``)."""
    if not op_name.startswith("aten."):
        return custom_ops.schema(op_name)
    return _aten_schema(op_name)


@lru_cache(maxsize=None)
def _aten_schema(op_name: str) -> Schema | None:
    parts = op_name.split(".")
    if len(parts) == 2:
        op_name += ".default"
    record = _table().get(op_name)
    if record is None:
        return None
    args, rets = record
    return Schema(op_name, tuple(Arg(*a) for a in args), tuple(Arg(*r) for r in rets))


def overloads(base: str) -> list[str]:
    """Known overloads of ``aten.<name>`` (for 'did you mean' notes)."""
    prefix = base + "."
    return sorted(k for k in _table() if k.startswith(prefix))


class MappingError(ValueError):
    """Operands and attributes that do not fit the schema; the message says how."""


def bind(sch: Schema, n_operands: int, attrs: dict, *, check_values: bool = True) -> list[tuple[Arg, object]]:
    """Map an op's operands (by index) and attributes onto ``sch``'s arguments.

    Returns ``(arg, source)`` for each argument the op supplies, where source is
    ``("operand", i)``, ``("operands", start, stop)`` for a tensor list, or
    ``("attr", key)``. Raises ``MappingError`` when they do not fit. With
    ``check_values=False`` only the attribute names matter, not their values.
    """
    names = {a.name for a in sch.args}
    unknown = [k for k in attrs if "." not in k and k not in names]
    if unknown:
        valid = ", ".join(a.name for a in sch.args if not a.is_tensor and not a.is_tensor_list) or "none"
        raise MappingError(f"unknown attribute '{unknown[0]}' for {sch.name}; its attributes are: {valid}")
    lists = [a for a in sch.args if a.is_tensor_list and a.name not in attrs]
    if len(lists) > 1:
        raise MappingError(f"{sch.name} takes several tensor lists; DCIR cannot map operands to it")
    singles = [a for a in sch.args if a.is_tensor and a.name not in attrs]
    bound: list[tuple[Arg, object]] = []
    next_operand = 0
    list_len = max(0, n_operands - len(singles)) if lists else 0
    for a in sch.args:
        if a.name in attrs:
            value = attrs[a.name]
            if not check_values:
                bound.append((a, ("attr", a.name)))
                continue
            if a.is_tensor_list:
                raise MappingError(f"tensor list argument '{a.name}' of {sch.name} is given as operands, not as an attribute")
            if a.is_tensor and (isinstance(value, (bool, int, float)) or is_complex_text(value)):
                bound.append((a, ("attr", a.name)))  # a number where torch takes a tensor: torch wraps it
                continue
            if a.is_tensor and value is not None:
                raise MappingError(f"tensor argument '{a.name}' of {sch.name} must be an operand; as an attribute "
                                   f"it can only be a number (torch wraps it) or, if optional, absent: {{{a.name} = none}}")
            if a.type == "Tensor" and not _takes_undefined(sch):
                raise MappingError(f"'{a.name}' of {sch.name} is a required tensor; it cannot be none")
            expected = _value_fits(a.type, value)
            if expected is not None:
                raise MappingError(f"attribute '{a.name}' of {sch.name} must be {expected} (schema type {a.type})")
            bound.append((a, ("attr", a.name)))
            continue
        if a.is_tensor_list and lists:
            _check_absent(sch, a, attrs.get(f"{a.name}.absent", ()), list_len)
            bound.append((a, ("operands", next_operand, next_operand + list_len)))
            next_operand += list_len
            continue
        if a.is_tensor and next_operand < n_operands:
            bound.append((a, ("operand", next_operand)))
            next_operand += 1
            continue
        if not a.has_default:
            if a.type == "Optional[Tensor]":
                raise MappingError(f"{sch.name} needs its argument '{a.name}' ({a.type}): an operand, "
                                   f"or {{{a.name} = none}} when there is none")
            what = "operand" if a.is_tensor or a.is_tensor_list else "attribute"
            raise MappingError(f"{sch.name} needs its argument '{a.name}' ({a.type}) as an {what}")
    if next_operand < n_operands:
        raise MappingError(f"{sch.name} takes at most {next_operand} tensor operands, got {n_operands}")
    return bound


def _takes_undefined(sch: Schema) -> bool:
    """ATen's derivative kernels (``*_backward``) take an undefined tensor, given as
    None, for an input the forward did not have: AOTAutograd calls
    ``_scaled_dot_product_efficient_attention_backward`` with ``attn_bias=None`` when
    attention had no bias (the CUDA path of every causal ``sdpa``)."""
    return sch.name.split(".")[1].endswith("_backward")


def _check_absent(sch: Schema, a: Arg, absent, present: int) -> None:
    """``{NAME.absent = [k, ...]}``: the positions of a ``Tensor?[]`` list that hold no
    tensor (``x[:, idx]`` indexes with ``[None, idx]``); the operands fill the others in
    order. The positions must be increasing and inside the whole list."""
    if not absent:
        return
    if a.type != "List[Optional[Tensor]]":
        raise MappingError(f"'{a.name}.absent' of {sch.name}: '{a.name}' is a {a.type}, whose entries cannot be absent")
    whole = present + len(absent) if isinstance(absent, tuple) else 0
    if not isinstance(absent, tuple) or not all(_is_int(k) and 0 <= k < whole for k in absent) or \
            list(absent) != sorted(set(absent)):
        raise MappingError(f"'{a.name}.absent' of {sch.name} must list increasing positions in its list of "
                           f"{whole} entries")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_complex_text(v) -> bool:
    """A complex number as the language writes it: a string in Python's complex syntax,
    ``"(1+2j)"`` (there is no complex literal; the schema says the argument is a number)."""
    if not isinstance(v, str) or "j" not in v:
        return False
    try:
        complex(v)
    except ValueError:
        return False
    return True


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) or is_complex_text(v)


# What an attribute value may be for a schema type; unlisted types are not checked.
# int-typed arguments also take an element type (dtype = f32: ScalarType is an int in
# the schema) and a name (memory_format = "contiguous_format": enums are ints too).
_KINDS = {
    "int": ("an integer", lambda v: _is_int(v) or type(v).__name__ == "DType" or isinstance(v, str)),
    "SymInt": ("an integer", _is_int),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "number": ("a number", _is_number),
    "complex": ("a number", _is_number),
    "str": ("a string", lambda v: isinstance(v, str)),
    "Device": ("a device string", lambda v: isinstance(v, str)),
}


_LIST_ITEMS = {"int": _is_int, "SymInt": _is_int, "bool": lambda v: isinstance(v, bool),
               "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "number": _is_number}


def _value_fits(typ: str, value) -> str | None:
    """None when ``value`` fits schema type ``typ``, else what was expected."""
    if typ.startswith("Optional[") and typ.endswith("]"):
        if value is None:
            return None
        typ = typ[len("Optional["):-1]
    if typ.startswith("List[") and typ.endswith("]"):
        inner = typ[len("List["):-1]
        ok = _LIST_ITEMS.get(inner)
        if ok is None or (isinstance(value, tuple) and all(map(ok, value))):
            return None
        if inner in ("int", "SymInt") and _is_int(value):
            return None  # int[2] stride=1 means [1, 1]
        return f"a list of {inner}"
    if typ not in _KINDS:
        return None
    what, ok = _KINDS[typ]
    return None if ok(value) else what
