"""Custom operators: ``torch.library`` ops outside ``aten``, carried as opaque compute.

An op registered with ``torch.library`` (``torch.library.custom_op``, or
``Library.define`` with an implementation) in any namespace but ``aten`` is written
with its namespace as its family: ``transformers.grouped_mm_fallback.default(%x, %w,
%offs)`` is ``torch.ops.transformers.grouped_mm_fallback.default``. Its operands and
attributes follow its schema exactly as for aten (``dcir.aten.bind``); its result types
are what its fake kernel (``torch.library.register_fake``, or a Meta kernel) computes
on meta tensors, so the verifier checks them without running the op.

Unlike aten, the schema is not in DCIR's cached table: it is read from the running
torch (``torch._C._get_schema``), so the library that registers the op must be imported
in the process. A captured module records which Python modules registered its custom
ops in its attribute ``libraries`` (``defining_module``), and parsing it imports them
(``load_libraries``), so ``dcir-opt file.dcir`` reads a file DCIR wrote as it is;
``dcir-opt --load MODULE`` imports one by hand. An op DCIR cannot carry says why:

* no such operator is registered in this process (import the library that defines it);
* it has no fake kernel (DCIR derives shapes from it: ``torch.library.register_fake``);
* it mutates an argument (``mutates_args`` / ``Tensor(a!)``): refused, because DCIR's
  schedule and memory model read a custom op as pure (a mutation of a gathered
  parameter or a saved activation would be invisible to the sharding passes); write it
  to return the new value instead.

Lookups that succeed are cached; failures are not, so an op registered later (a test
that defines its library after a first lookup) is found then.
"""

from __future__ import annotations

import sys

from dcir.op_schema import Arg, Schema, arg_record

_FOUND: dict[str, object] = {}  # op name -> its Schema, once it is known to be usable
#: the module attribute naming the Python modules that register the module's custom ops
LIBRARIES = "libraries"


def split(op_name: str) -> tuple[str, str, str] | None:
    """``(namespace, name, overload)`` of ``ns.name[.overload]``, or None if it is not that shape."""
    parts = op_name.split(".")
    if len(parts) == 2:
        parts.append("default")
    if len(parts) != 3 or not all(p.isidentifier() for p in parts):
        return None
    return parts[0], parts[1], parts[2]


def lazy_torch():
    """torch, imported on first need: only a module that holds a schema op needs it, and
    dcir-opt on plain text stays torch-free (importing torch takes seconds)."""
    import torch  # lazily, for the reason above
    return torch


def _function_schema(op_name: str):
    """torch's FunctionSchema of the op, or None if no such operator is registered."""
    parts = split(op_name)
    if parts is None:
        return None
    ns, name, overload = parts
    try:
        return lazy_torch()._C._get_schema(f"{ns}::{name}", "" if overload == "default" else overload)
    except RuntimeError:
        return None


def _has_fake_kernel(qualname: str) -> bool:
    torch = lazy_torch()
    from torch._library.simple_registry import singleton  # torch's, so as lazily as lazy_torch

    if singleton.find(qualname).fake_impl.kernel is not None:
        return True
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return any(has(qualname, key) for key in ("Meta", "CompositeExplicitAutograd", "CompositeImplicitAutograd"))


def problem(op_name: str) -> str | None:
    """Why ``op_name`` cannot be carried as a custom op (None if it can)."""
    if op_name in _FOUND:
        return None
    parts = split(op_name)
    if parts is None:
        return f"'{op_name}' is not a custom op name: write namespace.name.overload"
    ns, name, overload = parts
    s = _function_schema(op_name)
    if s is None:
        return (f"no operator {ns}::{name}.{overload} is registered with torch.library in this process; "
                "import the library that defines it (dcir-opt --load MODULE)")
    if not _has_fake_kernel(s.name):
        return (f"custom op {op_name} has no fake kernel, from which DCIR takes its result shapes; register one "
                f"with torch.library.register_fake(\"{ns}::{name}\")")
    mutated = [a.name for a in s.arguments if a.alias_info is not None and a.alias_info.is_write]
    if mutated:
        return (f"custom op {op_name} mutates its argument '{mutated[0]}' (mutates_args); DCIR carries custom ops "
                "as pure compute: return the new value instead")
    return None


def schema(op_name: str):
    """The ``Schema`` of a usable custom op, or None (``problem`` says why)."""
    found = _FOUND.get(op_name)
    if found is not None:
        return found
    if problem(op_name) is not None:
        return None
    s = _function_schema(op_name)
    name = ".".join(split(op_name))
    found = Schema(name, tuple(Arg(*arg_record(a)) for a in s.arguments), tuple(Arg(*arg_record(r)) for r in s.returns))
    _FOUND[op_name] = _FOUND[name] = found
    return found


def resolve(op_name: str):
    """The ``torch._ops.OpOverload`` an op name (aten or custom) stands for."""
    torch = lazy_torch()
    ns, name, overload = split(op_name)
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def load(module_name: str) -> None:
    """Import a module that registers custom ops (``dcir-opt --load``)."""
    if module_name not in sys.modules:
        __import__(module_name)


def defining_module(op_name: str) -> str | None:
    """The Python module, importable by its name, whose code registered custom op
    ``op_name``: the one that defines its ``torch.library.custom_op`` function, else its
    fake kernel; None when torch cannot say, or for a script's own ops (``__main__``)."""
    lazy_torch()
    from torch._library.custom_ops import OPDEFS  # torch's registry of custom_op functions
    from torch._library.simple_registry import singleton  # and of fake kernels

    qualname = "::".join(split(op_name)[:2])
    opdef = OPDEFS.get(qualname)
    fn = getattr(opdef, "_init_fn", None) if opdef is not None else singleton.find(qualname).fake_impl.kernel
    module = getattr(fn, "__module__", None)
    return None if module in (None, "__main__") else module


def is_module_name(name) -> bool:
    """Whether ``name`` names a Python module (dotted identifiers), as ``libraries`` must."""
    return isinstance(name, str) and all(part.isidentifier() for part in name.split("."))


def load_libraries(names: tuple) -> str | None:
    """Import each Python module of a module's ``libraries``; why the first that fails
    cannot be imported, or None."""
    for name in names:
        try:
            load(name)
        except Exception as e:  # noqa: BLE001  (any error of the import: the user's module, reported as such)
            return f"importing {name!r} failed: {type(e).__name__}: {e}"
    return None
