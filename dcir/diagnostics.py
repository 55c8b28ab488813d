"""One diagnostic type for parse, verify and pass errors.

A diagnostic renders like a compiler's::

    model.dcir:12:20: error: use of %x after it was freed
        %y = aten.relu.default(%x) : f32[4]
                               ^~
    model.dcir:10:5: note: freed here
        mem.free(%x)
        ^~~~~~~~

Locations are 1-based ``(line, column)`` pairs into a ``Source``. Errors found on a
module that was built in memory (no source) are located in its printed text, so a
user always gets a line to look at.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcir.ir import Source


@dataclass(frozen=True)
class Note:
    loc: tuple[int, int] | None
    message: str
    length: int = 1


@dataclass(frozen=True)
class Diagnostic:
    """A message at a place in a source text, with optional notes at other places."""

    message: str
    source: Source | None = None
    loc: tuple[int, int] | None = None
    length: int = 1  # how many characters the underline covers
    notes: tuple[Note, ...] = field(default_factory=tuple)
    severity: str = "error"

    def render(self) -> str:
        parts = [_render_one(self.source, self.loc, self.length, self.severity, self.message)]
        parts += [_render_one(self.source, n.loc, n.length, "note", n.message) for n in self.notes]
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.render()


def _render_one(source: Source | None, loc: tuple[int, int] | None, length: int, severity: str, message: str) -> str:
    if source is None:
        return f"{severity}: {message}"
    name = source.name
    if loc is None:
        return f"{name}: {severity}: {message}"
    line, col = loc
    head = f"{name}:{line}:{col}: {severity}: {message}"
    text = source.line(line) if source else ""
    if not text:
        return head
    caret = " " * (col - 1) + "^" + "~" * max(0, length - 1)
    return f"{head}\n{text}\n{caret}"


class DcirError(Exception):
    """Bad input: raised by the parser, the verifier and passes; carries diagnostics."""

    def __init__(self, diagnostics: list[Diagnostic] | Diagnostic):
        self.diagnostics = [diagnostics] if isinstance(diagnostics, Diagnostic) else list(diagnostics)
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)
