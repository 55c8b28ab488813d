"""Memory: nothing reads a value, or any view of its storage, after a ``frees`` op
released it; nothing is freed twice; nothing is freed while an ``async`` op that reads
it (a collective, an offload) is in flight, i.e. before that op's pending result is
waited (which the async checker, ``Pending``, knows); and no symbol is written (a
``param.add``, ``param.zero``) while such an op reads what a ``param.get`` loaded from
it: the loaded value is the state's own storage."""

from __future__ import annotations

from dcir import ops as registry
from dcir.verifier.checker import Checker
from dcir.verifier.pending import Pending


class Memory(Checker):
    def __init__(self, report, module, pending: Pending):
        super().__init__(report, module)
        self.pending = pending

    def function(self, f) -> None:
        self.storage = {}  # a view -> the value that owns its storage
        self.freed = {}  # storage owner -> the op that released it
        self.inflight = {}  # storage -> [(async op reading it, its pending result)]
        self.loaded = {}  # symbol -> the values param.get read from it

    def operand(self, op, d, k: int, v) -> bool:
        owner = self.storage.get(v, v)
        if owner not in self.freed:
            return True
        what = "" if owner is v else f" (it is a view of %{owner.name})"
        self.report.operand_error(op, k, f"use of %{v.name} after its storage was freed{what}",
                                  (self.report.op_note(self.freed[owner], "freed here"),))
        return False

    def effects(self, op, d, ok: bool) -> None:
        if not ok:
            return
        if registry.FREES in d.traits:
            self._free(op)
        if registry.WRITES_STATE in d.traits and op.symbol is not None:
            self._write(op)
        if registry.LOADS_STATE in d.traits:
            self.loaded.setdefault(op.symbol, []).extend(op.results)
        if registry.ASYNC in d.traits and op.results:
            per_operand = len(op.results) == len(op.operands)
            for k, v in enumerate(op.operands):
                self.inflight.setdefault(self.storage.get(v, v), []).append((op, op.results[k if per_operand else 0]))
        if registry.COMPUTE in d.traits:
            for res, src in registry.views(op).items():
                base = op.operands[src]
                self.storage[op.results[res]] = self.storage.get(base, base)

    def _free(self, op) -> None:
        for k, v in enumerate(op.operands):
            owner = self.storage.get(v, v)
            if owner in self.freed:
                if self.freed[owner] is op:
                    what = "" if owner is v else f" (the storage of %{owner.name})"
                    self.report.operand_error(op, k, f"%{v.name}{what} is freed twice by the same mem.free")
                continue  # a free in an earlier op is reported as a use after free
            self.freed[owner] = op
            for reader, pending in self.inflight.get(owner, ()):
                if pending not in self.pending.waited:
                    self.report.operand_error(op, k, f"%{v.name} is freed while {reader.name} still reads it; free "
                                                     f"it after comm.wait(%{pending.name})",
                                              (self.report.op_note(reader, "the async op starts here"),))
                    break

    def _write(self, op) -> None:
        for v in self.loaded.get(op.symbol, ()):
            for reader, pending in self.inflight.get(v, ()):
                if pending not in self.pending.waited:
                    self.report.op_error(op, f"{op.name} writes @{op.symbol} while {reader.name} still reads "
                                             f"%{v.name}, its storage; write it after comm.wait(%{pending.name})",
                                         (self.report.op_note(reader, "the async op starts here"),))
                    return

    def returned(self, f, k: int, v) -> bool:
        owner = self.storage.get(v, v)
        if owner not in self.freed:
            return True
        self.report.return_error(f, f"return of %{v.name} after its storage was freed",
                                 (self.report.op_note(self.freed[owner], "freed here"),))
        return False
