"""Where a diagnostic points, and the list the checkers append to.

A parsed module carries its ``Source`` and every op its location. A module built in
memory has neither; then the module is printed (once, at the first diagnostic) and
errors point into that text. The module itself is never touched: locations of a
printed module are kept here, keyed by object identity.
"""

from __future__ import annotations

from dcir.diagnostics import Diagnostic, Note
from dcir.ir import Module, Op, Source, Value
from dcir.printer import positions


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


class Reporter:
    """Collects diagnostics; knows how to underline an op, an operand or a definition."""

    def __init__(self, module: Module):
        self.module = module
        self.diags: list[Diagnostic] = []
        self._source = module.source
        self._where: dict | None = None if module.source is None else {}

    # ---- locations ----
    def source(self) -> Source:
        if self._source is None:
            text, self._where = positions(self.module)
            self._source = Source("<generated>", text)
        return self._source

    def loc(self, thing) -> tuple[int, int] | None:
        """Where a function, op, declaration or the module starts."""
        self.source()
        return thing.loc if self.module.source is not None else self._where.get(id(thing))

    def return_loc(self, func) -> tuple[int, int] | None:
        self.source()
        return func.return_loc if self.module.source is not None else self._where.get(("return", id(func)))

    def op_span(self, op: Op) -> tuple[tuple[int, int] | None, int]:
        loc = self.loc(op)
        if loc is None:
            return None, 1
        start = self.source().line(loc[0]).find(op.name, loc[1] - 1)
        if start < 0:
            return loc, 1
        return (loc[0], start + 1), len(op.name)

    def operand_span(self, op: Op, index: int) -> tuple[tuple[int, int] | None, int]:
        loc, length = self.op_span(op)
        if loc is None or index >= len(op.operands):
            return loc, length
        line = self.source().line(loc[0])
        pos = loc[1] - 1 + len(op.name)
        for i, v in enumerate(op.operands):
            found = _find_name(line, "%" + v.name, pos)
            if found < 0:
                return loc, length
            if i == index:
                return (loc[0], found + 1), len(v.name) + 1
            pos = found + len(v.name) + 1
        return loc, length

    def def_note(self, v: Value, text: str = "defined here") -> Note:
        """A note on the definition of ``v``: its name in an op's results or in the
        arguments of its function."""
        owner = v.owner
        loc = None if owner is None else self.loc(owner)
        if isinstance(owner, Op):
            if loc is not None:
                found = self.source().line(loc[0]).find("%" + v.name, loc[1] - 1)
                if found >= 0:
                    return Note((loc[0], found + 1), text, len(v.name) + 1)
            return self.op_note(owner, text)
        if loc is not None:  # a function argument
            found = self.source().line(loc[0]).find("%" + v.name + ":")
            return Note((loc[0], found + 1) if found >= 0 else loc, text, len(v.name) + 1)
        return Note(None, text)

    def result_span(self, r: Value) -> tuple[tuple[int, int] | None, int]:
        note = self.def_note(r)
        return note.loc, note.length

    def op_note(self, op: Op, text: str) -> Note:
        loc, length = self.op_span(op)
        return Note(loc, text, length)

    # ---- reporting ----
    def error(self, message: str, loc, length: int = 1, notes: tuple[Note, ...] = ()) -> None:
        self.diags.append(Diagnostic(message, self.source(), loc, length, tuple(notes)))

    def op_error(self, op: Op, message: str, notes=()) -> None:
        self.error(message, *self.op_span(op), notes)

    def operand_error(self, op: Op, index: int, message: str, notes=()) -> None:
        self.error(message, *self.operand_span(op, index), notes)

    def result_error(self, r: Value, message: str) -> None:
        self.error(message, *self.result_span(r))

    def return_error(self, func, message: str, notes=()) -> None:
        self.error(message, self.return_loc(func), 6, notes)


def _find_name(line: str, token: str, pos: int) -> int:
    """Where the value name ``token`` stands alone in ``line`` from ``pos`` (not as the
    start of a longer name), or -1."""
    found = line.find(token, pos)
    end = found + len(token)
    while found >= 0 and end < len(line) and (line[end].isalnum() or line[end] in "_.$-"):
        found = line.find(token, found + 1)
        end = found + len(token)
    return found
