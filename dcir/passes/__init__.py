"""Passes, the pass registry, pipeline syntax and the pass manager.

A pass is a frozen dataclass in its own file ``dcir/passes/<name>.py``; its options
are its fields and its docstring is its ``--help`` text. The registry is built from
the files of this package: a pass's ``name``, its file and its golden test
``tests/golden/passes/<name>.dcir`` are one name (a test checks they agree).

Pipelines are written ``dce,canonicalize{max_iterations=4}``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import ClassVar, TextIO

from lark import Lark, UnexpectedInput

from dcir.context import PlanContext
from dcir.diagnostics import DcirError, Diagnostic
from dcir.fusion import FusionMode
from dcir.ir import Module, Source
from dcir.memory import parse_bytes
from dcir.printer import print_module
from dcir.verifier import diagnostics


@dataclass(frozen=True)
class Pass:
    """Base class: subclasses set ``name`` and implement ``run``."""

    name: ClassVar[str] = ""
    #: whether this pass chooses which stretches of compute run compiled: the passes
    #: before it in a pipeline then plan jointly with it, pricing each stretch as it will
    #: run (``FusionMode.CHOOSING``; ``fuse``)
    chooses_fusion: ClassVar[bool] = False

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        """Rewrite ``module`` in place, planning for ``ctx`` (the machine, how stretches
        of compute are priced); count what happened in ``stats``."""
        raise NotImplementedError

    def spec(self) -> str:
        """This pass as pipeline text, options included where they differ from the defaults."""
        opts = [f"{f.name}={_format_option(getattr(self, f.name))}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default]
        return self.name + ("{" + ",".join(opts) + "}" if opts else "")


def _format_option(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


@lru_cache(maxsize=1)
def registry() -> dict[str, type[Pass]]:
    """Every pass in this package, by name."""
    out = {}
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, Pass) and obj is not Pass and obj.__module__ == mod.__name__:
                out[obj.name] = obj
    return dict(sorted(out.items()))


# ---- pipeline text -------------------------------------------------------------------

@lru_cache(maxsize=1)
def _pipeline_parser() -> Lark:
    # cache=True: strict mode proves terminals disjoint at build time, which costs most of a
    # second; the cached tables skip that on every later start.
    return Lark(Path(__file__).parent.parent.joinpath("pipeline.lark").read_text(), parser="lalr",
                strict=True, propagate_positions=True, cache=True)


def parse_pipeline(text: str) -> list[Pass]:
    """``"dce,canonicalize{max_iterations=4}"`` -> pass instances. Raises ``DcirError``."""
    source = Source("<pipeline>", text)
    try:
        tree = _pipeline_parser().parse(text)
    except UnexpectedInput as e:
        return _fail(source, (e.line, e.column), 1, "malformed pass pipeline; write it like dce,canonicalize{max_iterations=4}")
    passes = []
    known = registry()
    for spec in tree.children:
        if spec is None:
            continue
        name_tok, options = spec.children
        cls = known.get(str(name_tok))
        if cls is None:
            _fail(source, (name_tok.line, name_tok.column), len(name_tok),
                  f"unknown pass '{name_tok}'; passes are: {', '.join(known)}")
        kwargs = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for opt in (options.children if options else ()):
            if opt is None:
                continue
            key, raw = opt.children
            f = fields.get(str(key))
            if f is not None and f.name in kwargs:
                _fail(source, (key.line, key.column), len(key), f"option '{key}' of pass '{cls.name}' is given twice")
            if f is None:
                have = ", ".join(fields) or "none"
                _fail(source, (key.line, key.column), len(key), f"unknown option '{key}' for pass '{cls.name}'; its options are: {have}")
            try:
                kwargs[f.name] = _convert(str(raw), f.type)
            except ValueError as err:
                _fail(source, (raw.line, raw.column), len(raw), f"option '{key}' of pass '{cls.name}': {err}")
        try:
            passes.append(cls(**kwargs))
        except ValueError as err:  # a pass's __post_init__ rejects a combination of values
            _fail(source, (name_tok.line, name_tok.column), len(name_tok), f"pass '{cls.name}': {err}")
    return passes


def _convert(raw: str, typ) -> object:
    typ = typ if isinstance(typ, str) else typ.__name__
    typ = typ.removesuffix(" | None")
    if typ == "Bytes":
        return parse_bytes(raw)
    if raw.startswith('"'):
        raw = json.loads(raw)
    if typ == "bool":
        if raw not in ("true", "false"):
            raise ValueError(f"expected true or false, got '{raw}'")
        return raw == "true"
    if typ == "int":
        if not re.fullmatch(r"[-+]?[0-9]+", raw):
            raise ValueError(f"expected an integer, got '{raw}'")
        return int(raw)
    if typ == "float":
        if not re.fullmatch(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?", raw):
            raise ValueError(f"expected a number, got '{raw}'")
        return float(raw)
    return raw


def _fail(source: Source, loc, length: int, message: str):
    raise DcirError(Diagnostic(message, source, loc, length))


# ---- the pass manager ------------------------------------------------------------------

@dataclass
class PassManager:
    """Runs passes in order, verifying after each; optionally prints IR, timings, statistics."""

    passes: list[Pass]
    verify_each: bool = True
    verify_shapes: bool = False  # also check aten result types with torch's meta kernels
    print_ir_after_all: TextIO | None = None
    reproducer: Path | None = None  # where a failing pass's input is written
    timings: list[tuple[str, float]] = field(default_factory=list)
    stats: dict[str, Counter] = field(default_factory=dict)
    context: PlanContext = PlanContext()  # what the passes plan for (default: the module's machine)

    def run(self, module: Module) -> Module:
        """Run the passes in order, each given ``context``. The passes before one that
        chooses the stretches of compute (``Pass.chooses_fusion``) plan jointly with it:
        they price each stretch as it will run (``FusionMode.CHOOSING``)."""
        joint = max((k for k, p in enumerate(self.passes) if p.chooses_fusion), default=-1)
        choosing = dataclasses.replace(self.context, fusion=FusionMode.CHOOSING)
        for k, p in enumerate(self.passes):
            before = print_module(module) if self.reproducer is not None else None
            counter = Counter()
            start = time.perf_counter()
            try:
                p.run(module, counter, choosing if k < joint else self.context)
            except DcirError as e:
                self._write_reproducer(before, p)
                raise DcirError(e.diagnostics + self._repro_note(p)) from None
            self.timings.append((p.spec(), time.perf_counter() - start))
            self.stats[p.spec()] = counter
            if self.verify_each:
                start = time.perf_counter()
                module.source = None  # the text it was parsed from no longer describes it
                diags = diagnostics(module, shapes=self.verify_shapes)
                self.timings.append(("(verify)", time.perf_counter() - start))
                if diags:
                    self._write_reproducer(before, p)
                    head = Diagnostic(f"pass '{p.spec()}' produced invalid IR:", None, None)
                    raise DcirError([head, *diags, *self._repro_note(p)])
            if self.print_ir_after_all is not None:
                self.print_ir_after_all.write(f"// -----// IR Dump After {p.spec()} //----- //\n")
                self.print_ir_after_all.write(print_module(module))
        return module

    def _write_reproducer(self, text: str | None, p: Pass) -> None:
        if text is None or self.reproducer is None:
            return
        header = f"// RUN: dcir-opt %s --passes '{p.spec()}'\n// Input to the pass '{p.spec()}', which failed on it.\n"
        self.reproducer.write_text(header + text)

    def _repro_note(self, p: Pass) -> list[Diagnostic]:
        if self.reproducer is None:
            return []
        return [Diagnostic(f"reproducer written to {self.reproducer} (run it with: dcir-opt {self.reproducer} "
                           f"--passes '{p.spec()}')", None, None, severity="note")]


def run_passes(module: Module, pipeline: str | list[Pass], *, verify: bool = True,
               context: PlanContext = PlanContext()) -> Module:
    """Run a pipeline (text or pass instances) on ``module`` in place, planning for
    ``context`` (a machine: ``PlanContext(dcir.hardware.load("h100-ib400"))``), and return it."""
    passes = parse_pipeline(pipeline) if isinstance(pipeline, str) else list(pipeline)
    return PassManager(passes, verify_each=verify, context=context).run(module)


def describe(cls: type[Pass]) -> str:
    """A pass's help text: its docstring, then its options with defaults."""
    doc = (sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip()
    fields = dataclasses.fields(cls)
    opts = "\n".join(f"  {f.name} = {_format_option(f.default)}  ({f.type if isinstance(f.type, str) else f.type.__name__})"
                     for f in fields)
    return f"{cls.name}\n\n{doc}\n" + (f"\nOptions:\n{opts}\n" if fields else "\nOptions: none\n")
