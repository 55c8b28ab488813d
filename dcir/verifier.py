"""The verifier: structure, types, and the schedule invariants of docs/language.md.

One linear walk per function, in execution order. Each rule has its own message (and
its own golden test in tests/golden/verifier/). Rules:

* ops: known op, arity, attributes, symbol, type rule (result types as the op's
  registry entry computes them);
* SSA: every use is defined, and defined before it is used; names are unique;
* async: a pending value is consumed only by ``comm.wait``, exactly once, and every
  pending value is waited before its function returns;
* memory: nothing reads a value, or any view of its storage, after ``mem.free``;
  nothing is freed twice; nothing is freed while an async op that reads it (a
  collective, an offload) is still in flight, i.e. before that op's ``comm.wait``;
* sharding: compute (``aten.*``) sees only full device values, never a shard, a
  pending or a host value; shards split the tensor across ``world_size`` ranks;
* gradients: in a module with a ``@backward`` function, every trainable parameter's
  gradient is handed to the optimizer (``grad.set``) exactly once, and, when the
  module runs on more than one rank, reduced across ranks exactly once on its way;
* ranks: an op with a ``ranks`` attribute runs only on those ranks. Collectives never
  do, and no collective or unrestricted op may read a value that only some ranks
  have, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import difflib
import gc
from functools import lru_cache

from dcir import aten, dtypes, ops as registry
from dcir.diagnostics import DcirError, Diagnostic, Note
from dcir.ir import UNIT, attr_key, HostType, Module, Op, PendingType, ShardType, TensorType, Value
from dcir.ops import COMMON_ATTRS, OpDef, TypeRuleError
from dcir.printer import locate


def verify(module: Module, *, shapes: bool = False) -> None:
    """Raise ``DcirError`` listing every violation found; return None if the module is valid.

    ``shapes=True`` also runs every aten op through torch's meta kernels and checks its
    declared result types (see ``dcir.shapes``)."""
    diags = diagnostics(module, shapes=shapes)
    if diags:
        raise DcirError(diags)


def diagnostics(module: Module, *, shapes: bool = False) -> list[Diagnostic]:
    # The walk builds a few dicts per op and frees nothing: no point in the cyclic GC.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _Verifier(module, shapes).run()
    finally:
        if enabled:
            gc.enable()


@lru_cache(maxsize=65536)
def _aten_binding_problem(name: str, n_operands: int, key: tuple, items: tuple) -> str | None:
    """Why an aten op's operands and attributes do not fit its schema (None if they do);
    memoized on the attribute *key*, which tells 1, 1.0 and true apart."""
    try:
        aten.bind(aten.schema(name), n_operands, dict(items))
    except aten.MappingError as e:
        return str(e)
    return None


def _ranks(op: Op) -> tuple | None:
    """The ranks an op is restricted to, if its ``ranks`` attribute is well formed."""
    ranks = op.attrs.get("ranks")
    return ranks if isinstance(ranks, tuple) and ranks and all(isinstance(r, int) for r in ranks) else None


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


class _Verifier:
    def __init__(self, module: Module, shapes: bool = False):
        self.m = module
        self.shapes = shapes
        self.diags: list[Diagnostic] = []
        self.grad_sets: dict[str, dict[str, list[Op]]] = {}  # function -> parameter -> grad.set ops

    # ---- locations ----
    def _src(self):
        if self.m.source is None:
            from dcir.ir import Source
            self.m.source = Source("<generated>", locate(self.m))
        return self.m.source

    def _op_span(self, op: Op) -> tuple[tuple[int, int] | None, int]:
        src = self._src()
        if op.loc is None:
            return None, 1
        line = src.line(op.loc[0])
        start = line.find(op.name, op.loc[1] - 1)
        if start < 0:
            return op.loc, 1
        return (op.loc[0], start + 1), len(op.name)

    def _operand_span(self, op: Op, index: int) -> tuple[tuple[int, int] | None, int]:
        src = self._src()
        (loc, length) = self._op_span(op)
        if loc is None or index >= len(op.operands):
            return loc, length
        line = src.line(loc[0])
        pos = loc[1] - 1 + len(op.name)
        for i, v in enumerate(op.operands):
            token = "%" + v.name
            found = line.find(token, pos)
            while found >= 0 and found + len(token) < len(line) and (line[found + len(token)].isalnum() or line[found + len(token)] in "_.$-"):
                found = line.find(token, found + 1)
            if found < 0:
                return loc, length
            if i == index:
                return (loc[0], found + 1), len(token)
            pos = found + len(token)
        return loc, length

    def _def_note(self, v: Value, text: str = "defined here") -> Note:
        owner = v.owner
        if isinstance(owner, Op):
            loc, length = self._op_span(owner)
            src = self._src()
            if owner.loc is not None:
                line = src.line(owner.loc[0])
                found = line.find("%" + v.name, owner.loc[1] - 1)
                if found >= 0:
                    return Note((owner.loc[0], found + 1), text, len(v.name) + 1)
            return Note(loc, text, length)
        if owner is not None and owner.loc is not None:  # a function argument
            line = self._src().line(owner.loc[0])
            found = line.find("%" + v.name + ":")
            return Note((owner.loc[0], found + 1) if found >= 0 else owner.loc, text, len(v.name) + 1)
        return Note(None, text)

    def _op_note(self, op: Op, text: str) -> Note:
        loc, length = self._op_span(op)
        return Note(loc, text, length)

    def error(self, message: str, loc, length: int = 1, notes: tuple[Note, ...] = ()) -> None:
        self.diags.append(Diagnostic(message, self._src(), loc, length, tuple(notes)))

    def op_error(self, op: Op, message: str, notes=()) -> None:
        loc, length = self._op_span(op)
        self.error(message, loc, length, notes)

    def operand_error(self, op: Op, index: int, message: str, notes=()) -> None:
        loc, length = self._operand_span(op, index)
        self.error(message, loc, length, notes)

    # ---- module ----
    def run(self) -> list[Diagnostic]:
        self._check_module_attrs()
        for decl in self.m.decls.values():
            self._check_decl(decl)
        for func in self.m.functions.values():
            self._check_function(func)
        self._check_gradients()
        dtypes.check(self.m, self.op_error)
        return self.diags

    def _check_module_attrs(self) -> None:
        for key, value in self.m.attrs.items():
            if "." in key:
                continue
            if key != "world_size":
                self.error(f"unknown module attribute '{key}'; modules take: world_size (and dotted names)",
                           self.m.loc, 6)
            elif not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                self.error("module attribute world_size must be a positive integer", self.m.loc, 6)

    def _check_decl(self, d) -> None:
        length = len(d.kind)
        for key, value in d.attrs.items():
            if "." in key:
                continue
            if key == "value" and d.kind == "buffer":
                self._check_value(d, value)
                continue
            if key != "trainable" or d.kind != "param":
                allowed = "trainable (and dotted names)" if d.kind == "param" else "value (and dotted names)"
                self.error(f"unknown attribute '{key}' on {d.kind} @{d.name}; a {d.kind} takes {allowed}", d.loc, length)
            elif value is not UNIT:
                self.error("'trainable' is a unit attribute: write {trainable}", d.loc, length)
        held = d.type.inner if isinstance(d.type, HostType) and d.kind == "buffer" else d.type
        if not isinstance(held, (TensorType, ShardType)):
            kinds = "a tensor, a shard or (in host memory) host<...>" if d.kind == "buffer" else "a tensor or a shard"
            self.error(f"{d.kind} @{d.name} must hold {kinds}, not {d.type}", d.loc, length)
        ws = self.m.world_size
        if isinstance(held, ShardType) and ws is not None and held.parts != ws:
            self.error(f"@{d.name} is split into {held.parts} shards, but the module runs on world_size = {ws} ranks",
                       d.loc, length)

    def _check_value(self, d, value) -> None:
        """A buffer's ``value``: its elements, flattened, as numbers (booleans for bool)."""
        numel = d.type.numel if isinstance(d.type, TensorType) else None
        kinds = (bool,) if getattr(d.type, "dtype", None) == "bool" else (int, float)
        ok = (isinstance(value, tuple) and len(value) == numel
              and all(isinstance(v, kinds) and (kinds == (bool,) or not isinstance(v, bool)) for v in value))
        if not ok:
            self.error(f"value of buffer @{d.name} must list its {numel} elements, flattened, as "
                       f"{'true/false' if kinds == (bool,) else 'numbers'}", d.loc, len(d.kind))

    # ---- functions ----
    def _check_function(self, f) -> None:
        position: dict[Value, int] = {}
        names: dict[str, Value] = {}
        for a in f.args:
            position[a] = -1
            if a.name in names:
                self.error(f"redefinition of %{a.name}", f.loc, 4, (self._def_note(names[a.name], "previous definition here"),))
            names[a.name] = a
        for i, op in enumerate(f.ops):
            for r in op.results:
                position.setdefault(r, i)
        storage: dict[Value, Value] = {}  # a view -> the value that owns its storage
        freed: dict[Value, Op] = {}  # storage owner -> the mem.free that released it
        waited: dict[Value, Op] = {}  # pending value -> its wait
        pendings: list[Value] = []
        restricted: dict[Value, tuple] = {}  # value -> ranks that have it
        reductions: dict[Value, int] = {}  # how many cross-rank reductions a value went through
        inflight: dict[Value, list[tuple[Op, Value]]] = {}  # storage -> async ops reading it, with a pending result

        for i, op in enumerate(f.ops):
            d = registry.lookup(op.name)
            if d is None:
                self._unknown_op(op)
            ok = self._check_operands(op, i, d, position, storage, freed, waited, restricted)
            if d is not None:
                ok = self._check_shape_of(op, d) and ok
                ok = ok and self._check_types(op, d)
            for r in op.results:
                first = names.get(r.name)
                if first is not None and first is not r:
                    self.error(f"redefinition of %{r.name}", *self._result_span(op, r),
                               (self._def_note(first, "previous definition here"),))
                else:
                    names[r.name] = r
            if d is not None and d.has(registry.WAITS):  # even a malformed wait shows what it meant to join
                for v in op.operands:
                    if isinstance(v.type, PendingType):
                        waited.setdefault(v, op)
            if d is not None and d.has(registry.GRADIENT) and op.symbol in self.m.decls:
                self.grad_sets.setdefault(f.name, {}).setdefault(op.symbol, []).append(op)
            if d is None or not ok:
                continue  # its effects are unknown; tracking them would only add follow-on errors
            self._track(op, d, storage, freed, waited, pendings, restricted, reductions, inflight)

        self._check_return(f, position, storage, freed, waited)
        for p in pendings:
            if p not in waited:
                loc, length = self._result_span(p.owner, p)
                self.error(f"pending value %{p.name} is never waited; add comm.wait before the function returns", loc, length)

    def _result_span(self, op: Op, r: Value):
        note = self._def_note(r)
        return note.loc, note.length

    def _unknown_op(self, op: Op) -> None:
        family = op.family
        if family == "aten":
            parts = op.name.split(".")
            base = ".".join(parts[:2])
            known = aten.overloads(base)
            if known:
                hint = "; its overloads are: " + ", ".join(k.rsplit(".", 1)[1] for k in known[:12])
            else:
                close = difflib.get_close_matches(base[5:], {k.split(".")[1] for k in aten._table()}, n=3)
                hint = ("; did you mean " + ", ".join(f"aten.{c}" for c in close) + "?") if close else ""
            self.op_error(op, f"unknown aten op '{op.name}'" + hint)
            return
        if family in registry.FAMILIES:
            members = sorted(n for n in registry.OPS if n.startswith(family + "."))
            self.op_error(op, f"unknown op '{op.name}'; {family} ops are: {', '.join(members)}")
            return
        self.op_error(op, f"unknown op '{op.name}'; op families are: {', '.join(registry.FAMILIES)}")

    def _check_shape_of(self, op: Op, d: OpDef) -> bool:
        """Symbol, arity and attributes. False when the type rule cannot run."""
        ok = True
        if d.symbol and op.symbol is None:
            self.op_error(op, f"{op.name} needs a symbol: {d.example}")
            ok = False
        elif not d.symbol and op.symbol is not None:
            self.op_error(op, f"{op.name} takes no symbol")
            ok = False
        elif d.symbol and op.symbol not in self.m.decls:
            close = difflib.get_close_matches(op.symbol, list(self.m.decls), n=1)
            self.op_error(op, f"unknown symbol @{op.symbol}" + (f"; did you mean @{close[0]}?" if close else ""))
            ok = False
        lo, hi = d.operands
        n = len(op.operands)
        if n < lo or (hi is not None and n > hi):
            want = f"{lo}" if lo == hi else (f"at least {lo}" if hi is None else f"{lo} to {hi}")
            self.op_error(op, f"{op.name} takes {want} operand{'' if (hi or lo) == 1 else 's'}, got {n}")
            ok = False
        if d.results == "per_operand":
            if len(op.results) != n:
                self.op_error(op, f"{op.name} defines one result per operand: {n} operand{'s' if n != 1 else ''}, "
                                  f"{_plural(len(op.results), 'result')}")
                ok = False
        elif d.name != "aten.*":
            rlo, rhi = d.results
            if not rlo <= len(op.results) <= rhi:
                self.op_error(op, f"{op.name} defines {_plural(rlo, 'result')}, not {len(op.results)}")
                ok = False
        return self._check_attrs(op, d) and ok

    def _check_attrs(self, op: Op, d: OpDef) -> bool:
        ok = True
        for key, spec in COMMON_ATTRS.items():
            if key in op.attrs and spec.check(op.attrs[key]) is not None:
                self.op_error(op, f"attribute '{key}' of {op.name} must be {spec.check(op.attrs[key])}")
                ok = False
        ranks = op.attrs.get("ranks")
        if isinstance(ranks, tuple) and ok:
            ws = self.m.world_size
            bad = [r for r in ranks if r < 0 or (ws is not None and r >= ws)]
            if not ranks or bad or len(set(ranks)) != len(ranks):
                limit = f"0 to {ws - 1}" if ws is not None else "0 or more"
                self.op_error(op, f"'ranks' of {op.name} must list distinct ranks, each {limit}; got {list(ranks)}")
                ok = False
        if d.name == "aten.*":
            items = tuple((k, v) for k, v in op.attrs.items() if k not in COMMON_ATTRS)
            problem = _aten_binding_problem(op.name, len(op.operands), tuple((k, attr_key(v)) for k, v in items), items)
            if problem is not None:
                self.op_error(op, problem)
                return False
            return ok
        for key, value in op.attrs.items():
            if "." in key or key in COMMON_ATTRS:
                continue
            spec = d.attrs.get(key)
            if spec is None:
                valid = ", ".join(sorted(d.attrs)) or "none"
                self.op_error(op, f"unknown attribute '{key}' for {op.name}; its attributes are: {valid}")
                ok = False
                continue
            expected = spec.check(value)
            if expected is not None:
                self.op_error(op, f"attribute '{key}' of {op.name} must be {expected}")
                ok = False
        for key, spec in d.attrs.items():
            if spec.required and key not in op.attrs:
                self.op_error(op, f"{op.name} needs the attribute '{key}': {d.example}")
                ok = False
        return ok

    def _check_operands(self, op, i, d, position, storage, freed, waited, restricted) -> bool:
        ok = True
        waits = d is not None and d.has(registry.WAITS)
        compute = d is not None and d.has(registry.COMPUTE)
        op_ranks = _ranks(op)
        for k, v in enumerate(op.operands):
            if v.owner is None:
                self.operand_error(op, k, f"use of undefined value %{v.name}")
                ok = False
                continue
            if position.get(v, -1) >= i:
                self.operand_error(op, k, f"use of %{v.name} before its definition", (self._def_note(v),))
                ok = False
                continue
            t = v.type
            if isinstance(t, PendingType) and not waits:
                self.operand_error(op, k, f"pending value %{v.name} is used by {op.name}; only comm.wait can consume a "
                                          "pending value", (self._def_note(v),))
                ok = False
            elif waits and isinstance(t, PendingType) and v in waited:
                self.operand_error(op, k, f"pending value %{v.name} is waited twice",
                                   (self._op_note(waited[v], "first waited here"),))
                ok = False
            owner = storage.get(v, v)
            if owner in freed:
                what = "" if owner is v else f" (it is a view of %{owner.name})"
                self.operand_error(op, k, f"use of %{v.name} after its storage was freed{what}",
                                   (self._op_note(freed[owner], "freed here"),))
                ok = False
            if compute and isinstance(t, ShardType):
                self.operand_error(op, k, f"{op.name} computes on %{v.name}, a shard; compute needs the full value "
                                          "(comm.all_gather it, then comm.wait)", (self._def_note(v),))
                ok = False
            elif compute and isinstance(t, HostType):
                self.operand_error(op, k, f"{op.name} computes on %{v.name}, which is in host memory; "
                                          "mem.reload it first", (self._def_note(v),))
                ok = False
            have = restricted.get(v)
            if have is not None:
                if d is not None and d.has(registry.COLLECTIVE):
                    self.operand_error(op, k, f"collective {op.name} reads %{v.name}, which only ranks {list(have)} "
                                              "compute; every rank must contribute the same collective",
                                       (self._def_note(v),))
                    ok = False
                elif op_ranks is None or not set(op_ranks) <= set(have):
                    who = "every rank" if op_ranks is None else f"ranks {list(op_ranks)}"
                    self.operand_error(op, k, f"%{v.name} exists only on ranks {list(have)}, but {op.name} runs on {who}",
                                       (self._def_note(v),))
                    ok = False
        if op_ranks is not None and d is not None and d.has(registry.COLLECTIVE):
            self.op_error(op, f"collective {op.name} is restricted to ranks {list(op_ranks)}; every rank must issue "
                              "the same collectives in the same order")
            ok = False
        return ok

    def _check_types(self, op: Op, d: OpDef) -> bool:
        """Run the op's type rule. False when it rejects the operands."""
        types = [v.type for v in op.operands]
        try:
            expected = d.type_rule(op, types, self.m)
        except TypeRuleError as e:
            if e.operand is not None and e.operand < len(op.operands):
                self.operand_error(op, e.operand, str(e))
            else:
                self.op_error(op, str(e))
            return False
        if self.shapes and d.name == "aten.*":
            return self._check_aten_shapes(op, types)
        for k, (want, r) in enumerate(zip(expected, op.results)):
            if r.type != want:
                loc, length = self._result_span(op, r)
                self.error(f"%{r.name} should have type {want}, but is declared {r.type}", loc, length)
        ws = self.m.world_size
        for r in op.results:
            inner = r.type
            while isinstance(inner, (PendingType, HostType)):
                inner = inner.inner
            if isinstance(inner, ShardType) and ws is not None and inner.parts != ws:
                loc, length = self._result_span(op, r)
                self.error(f"%{r.name} is split into {inner.parts} shards, but the module runs on world_size = {ws} ranks",
                           loc, length)
        return True

    def _check_aten_shapes(self, op: Op, types) -> bool:
        from dcir import shapes
        try:
            inferred = shapes.infer(op.name, types, op.attrs)
        except shapes.ShapeError as e:
            self.op_error(op, f"torch rejects {op.name} on these operands: {e}")
            return False
        for want, r in zip(inferred, op.results):
            if r.type != want:
                loc, length = self._result_span(op, r)
                self.error(f"%{r.name} should have type {want} (torch's meta kernel for {op.name} says so), "
                           f"but is declared {r.type}", loc, length)
        return True

    def _track(self, op, d, storage, freed, waited, pendings, restricted, reductions, inflight) -> None:
        traits = d.traits
        if registry.FREES in traits:
            self._track_free(op, storage, freed, waited, inflight)
        if registry.ASYNC in traits and op.results:
            per_operand = len(op.results) == len(op.operands)
            for k, v in enumerate(op.operands):
                owner = storage.get(v, v)
                inflight.setdefault(owner, []).append((op, op.results[k if per_operand else 0]))
        for r in op.results:  # any op's, not only an async one's: comm.wait of pending<pending<T>>
            if isinstance(r.type, PendingType):
                pendings.append(r)
        if registry.COMPUTE in traits:
            for res, src in registry.views(op).items():
                base = op.operands[src]
                storage[op.results[res]] = storage.get(base, base)
        if "ranks" in op.attrs:
            ranks = _ranks(op)
            if ranks is not None:
                for r in op.results:
                    restricted[r] = ranks
        # gradient reductions: a reduce collective adds one; everything else keeps the most of its inputs
        if reductions or registry.REDUCES in traits:
            count = max((reductions.get(v, 0) for v in op.operands), default=0)
            if registry.REDUCES in traits:
                count += 1
            if registry.WAITS in traits:
                for v, r in zip(op.operands, op.results):
                    reductions[r] = reductions.get(v, 0)
            elif count:
                for r in op.results:
                    reductions[r] = count
        if registry.GRADIENT in traits:
            self._check_gradient(op, reductions.get(op.operands[0], 0))

    def _track_free(self, op, storage, freed, waited, inflight) -> None:
        for k, v in enumerate(op.operands):
            owner = storage.get(v, v)
            if owner in freed:
                if freed[owner] is op:
                    what = "" if owner is v else f" (the storage of %{owner.name})"
                    self.operand_error(op, k, f"%{v.name}{what} is freed twice by the same mem.free")
                continue  # a free in an earlier op is reported as a use after free
            freed[owner] = op
            for reader, pending in inflight.get(owner, ()):
                if pending not in waited:
                    self.operand_error(op, k, f"%{v.name} is freed while {reader.name} still reads it; free it "
                                              f"after comm.wait(%{pending.name})",
                                       (self._op_note(reader, "the async op starts here"),))
                    break

    def _check_gradient(self, op: Op, reduced: int) -> None:
        decl = self.m.decls[op.symbol]
        if not decl.trainable:
            what = "a buffer" if decl.kind == "buffer" else "a frozen parameter (no 'trainable')"
            self.op_error(op, f"grad.set of @{decl.name}, which is {what}; only trainable parameters have gradients")
            return
        ws = self.m.world_size or 1
        if reduced > 1:
            self.op_error(op, f"the gradient of @{decl.name} is reduced across ranks {reduced} times; it must be reduced "
                              "exactly once")
        elif reduced == 0 and ws > 1:
            self.op_error(op, f"the gradient of @{decl.name} is not reduced across ranks (world_size = {ws}); "
                              "reduce_scatter or all_reduce it before grad.set")

    def _check_return(self, f, position, storage, freed, waited) -> None:
        loc = f.return_loc
        for k, v in enumerate(f.returns):
            if v.owner is None:
                self.error(f"return of undefined value %{v.name}", loc, 6)
            elif isinstance(v.type, PendingType):
                self.error(f"return of pending value %{v.name}; comm.wait it first", loc, 6, (self._def_note(v),))
            elif storage.get(v, v) in freed:
                self.error(f"return of %{v.name} after its storage was freed", loc, 6,
                           (self._op_note(freed[storage.get(v, v)], "freed here"),))
        if len(f.returns) != len(f.result_types):
            self.error(f"@{f.name} returns {_plural(len(f.returns), 'value')}, but its signature declares "
                       f"{len(f.result_types)}", loc, 6)
            return
        for k, (v, t) in enumerate(zip(f.returns, f.result_types)):
            if v.owner is not None and v.type != t:
                self.error(f"return value #{k} %{v.name} has type {v.type}, but @{f.name} declares {t}", loc, 6,
                           (self._def_note(v),))

    def _check_gradients(self) -> None:
        """Each trainable parameter gets one gradient per optimizer step: the backward of
        the last micro-step (``@backward_last`` when there is one, else ``@backward``)
        hands it over exactly once. ``@backward`` and ``@backward_last`` are alternatives
        (each runs alone in its micro-step), so the count is per function."""
        final = "backward_last" if "backward_last" in self.m.functions else "backward"
        training = final in self.m.functions
        backwards = ("backward", "backward_last")
        for decl in self.m.decls.values():
            if not decl.trainable:
                continue
            if training and not self.grad_sets.get(final, {}).get(decl.name):
                self.error(f"trainable parameter @{decl.name} never gets a gradient: @{final} must grad.set it "
                           "exactly once (or drop 'trainable' to freeze it)", decl.loc, len(decl.kind))
            for name in backwards:  # within one backward: once
                sets = self.grad_sets.get(name, {}).get(decl.name, [])
                for extra in sets[1:]:
                    self.op_error(extra, f"the gradient of @{decl.name} is handed to the optimizer twice",
                                  (self._op_note(sets[0], "first grad.set here"),))
            # in any other function: a second hand-over (or, without a backward, a second one)
            first = next((per[decl.name][0] for name, per in self.grad_sets.items()
                          if name in backwards and per.get(decl.name)), None)
            others = [op for name, per in self.grad_sets.items() if name not in backwards
                      for op in per.get(decl.name, [])]
            for extra in others if first is not None else others[1:]:
                self.op_error(extra, f"the gradient of @{decl.name} is handed to the optimizer twice",
                              (self._op_note(first or others[0], "first grad.set here"),))
