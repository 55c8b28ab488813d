"""Declarations: the module's attributes, and each parameter's and buffer's
attributes, type and (for a buffer) value."""

from __future__ import annotations

import math

from dcir.aten import is_complex_text
from dcir.custom_ops import LIBRARIES, is_module_name
from dcir.ir import UNIT, HostType, ShardType, TensorType
from dcir.verifier.checker import Checker


class Declarations(Checker):
    def module(self) -> None:
        for key, value in self.m.attrs.items():
            if "." in key:
                continue
            if key == LIBRARIES:
                if not (isinstance(value, tuple) and value and all(map(is_module_name, value))):
                    self.report.error(f"module attribute {LIBRARIES} must be a list of Python module names, e.g. "
                                      '["transformers.integrations.moe"]', self.report.loc(self.m), 6)
            elif key != "world_size":
                self.report.error(f"unknown module attribute '{key}'; modules take: world_size, {LIBRARIES} (and "
                                  "dotted names)", self.report.loc(self.m), 6)
            elif not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                self.report.error("module attribute world_size must be a positive integer", self.report.loc(self.m), 6)
        self._mesh()
        for decl in self.m.decls.values():
            self._attrs(decl)
            self._type(decl)

    def _mesh(self) -> None:
        """``mesh.<dim> = <size>``: positive sizes whose product is the world size."""
        dims = {k: v for k, v in self.m.attrs.items() if k.startswith("mesh.")}
        if not dims:
            return
        bad = [k for k, v in dims.items() if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1)]
        if bad:
            self.report.error(f"module attribute {bad[0]} must be a positive integer (a mesh dimension's size)",
                              self.report.loc(self.m), 6)
        elif math.prod(dims.values()) != self.m.world_size:
            self.report.error(f"the mesh {' × '.join(f'{k[5:]}={v}' for k, v in dims.items())} has "
                              f"{math.prod(dims.values())} ranks, but the module runs on world_size = "
                              f"{self.m.world_size}", self.report.loc(self.m), 6)

    def _attrs(self, d) -> None:
        for key, value in d.attrs.items():
            if "." in key:
                continue
            if key == "value" and d.kind == "buffer":
                self._value(d, value)
            elif key != "trainable" or d.kind != "param":
                allowed = "trainable (and dotted names)" if d.kind == "param" else "value (and dotted names)"
                self.report.error(f"unknown attribute '{key}' on {d.kind} @{d.name}; a {d.kind} takes {allowed}",
                                  self.report.loc(d), len(d.kind))
            elif value is not UNIT:
                self.report.error("'trainable' is a unit attribute: write {trainable}", self.report.loc(d), len(d.kind))

    def _type(self, d) -> None:
        held = d.type.inner if isinstance(d.type, HostType) and d.kind == "buffer" else d.type
        if not isinstance(held, (TensorType, ShardType)):
            kinds = "a tensor, a shard or (in host memory) host<...>" if d.kind == "buffer" else "a tensor or a shard"
            self.report.error(f"{d.kind} @{d.name} must hold {kinds}, not {d.type}", self.report.loc(d), len(d.kind))

    def _value(self, d, value) -> None:
        """A buffer's ``value``: its elements, flattened, as numbers (booleans for bool)."""
        numel = d.type.numel if isinstance(d.type, TensorType) else None
        dtype = getattr(d.type, "dtype", None)
        kinds = (bool,) if dtype == "bool" else (int, float)
        fits = is_complex_text if dtype in ("c64", "c128") else (  # complex elements: "(1+2j)"
            lambda v: isinstance(v, kinds) and (kinds == (bool,) or not isinstance(v, bool)))
        ok = isinstance(value, tuple) and len(value) == numel and all(fits(v) for v in value)
        if not ok:
            self.report.error(f"value of buffer @{d.name} must list its {numel} elements, flattened, as "
                              f"{'true/false' if kinds == (bool,) else 'numbers'}"
                              + (' (complex ones as strings: "(1+2j)")' if dtype in ("c64", "c128") else ""),
                              self.report.loc(d), len(d.kind))
