"""``dcir-opt``: parse, verify, run passes, print.

Exit status: 0 on success, 1 for bad input (a located diagnostic is printed, never a
traceback), 2 for bad usage (unknown option, unknown pass, unreadable file), 3 for an
internal error (a bug in DCIR).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import textwrap
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from dcir import custom_ops, trace
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Source
from dcir.machine import HardwareError, Machine, load
from dcir.memory import parse_bytes
from dcir.memplot import plot
from dcir.parser import parse
from dcir.passes import PassManager, describe, parse_pipeline, registry
from dcir.printer import print_module
from dcir.sim import simulate_module
from dcir.verifier import diagnostics

SPLIT_MARKER = re.compile(r"^// -----\s*$", re.M)
_EXPECTED = re.compile(r"//\s*expected-(error|note)\s*(@[+-]?\d+|@above|@below)?\s*\{\{(.*?)\}\}")


def _passes_epilog() -> str:
    """Each pass with the first sentence of its module's docstring, in a column wide
    enough for the longest name, wrapped under itself."""
    passes = registry()
    width = max(map(len, passes)) + 1
    rows = []
    for name, cls in passes.items():
        first = " ".join((sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n", 1)[0].split())
        sentence = first.split(". ", 1)[0].rstrip(".") + "."
        rows.append(textwrap.fill(sentence, 100, initial_indent=f"  {name:<{width}}", subsequent_indent=" " * (width + 2)))
    return "passes (options in braces: canonicalize{max_iterations=4}; --help-pass NAME for details):\n" + "\n".join(rows) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dcir-opt",
        description="Parse a DCIR module, verify it, run passes on it and print the result. "
                    "With no --passes it parses, verifies and reprints.",
        epilog=_passes_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", default="-", help="a .dcir file, or - for standard input (default)")
    p.add_argument("--passes", default="", metavar="PIPELINE", help="comma-separated passes, e.g. dce,canonicalize")
    p.add_argument("-o", "--output", default="-", metavar="OUT", help="where to write the result (default: stdout)")
    p.add_argument("--print-ir-after-all", action="store_true", help="print the module to stderr after every pass")
    p.add_argument("--time-passes", action="store_true", help="report the time of parsing, each pass, verifying and printing")
    p.add_argument("--pass-statistics", action="store_true", help="report which rewrite rules fired, how often")
    p.add_argument("--verify-diagnostics", action="store_true",
                   help="check that the diagnostics match the '// expected-error {{...}}' comments in the input")
    p.add_argument("--disable-verify", action="store_true", help="do not verify the input or the output of each pass")
    p.add_argument("--verify-shapes", action="store_true",
                   help="also check every aten op's result types with torch's meta kernels (imports torch)")
    p.add_argument("--split-input-file", action="store_true",
                   help="treat each '// -----' separated chunk as its own module")
    p.add_argument("--reproducer", metavar="PATH", type=Path,
                   help="if a pass fails, write its input there as a runnable .dcir test")
    p.add_argument("--simulate", metavar="HW",
                   help="print the predicted step time, exposed communication and peak memory per rank on the "
                        "machine HW (a dcir/machines name such as h100-ib400, or a .toml file) instead of the module")
    p.add_argument("--micro-steps", type=int, default=1, metavar="N",
                   help="micro-steps per optimizer step for --simulate (gradient accumulation; default 1)")
    p.add_argument("--emit-trace", metavar="OUT", type=Path,
                   help="write the predicted schedule as a Chrome trace (Perfetto) to OUT, on --simulate's machine")
    p.add_argument("--memory-plot", metavar="OUT", type=Path,
                   help="draw live bytes over the ops of every function to OUT (PNG; needs matplotlib)")
    p.add_argument("--budget", metavar="SIZE",
                   help="the memory budget line of --memory-plot and the budget counter of --emit-trace, e.g. 2GiB")
    p.add_argument("--help-pass", metavar="NAME", help="describe one pass and its options, then exit")
    p.add_argument("--load", action="append", default=[], metavar="MODULE",
                   help="import the Python module MODULE first, which registers the custom ops (torch.library) the "
                        "input uses, e.g. --load transformers.integrations.moe (repeatable); a module DCIR captured "
                        "names its own in its attribute 'libraries', which parsing imports")
    return p


class _Usage(Exception):
    pass


def main(argv: list[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    args = build_parser().parse_args(argv)

    if args.help_pass:
        cls = registry().get(args.help_pass)
        if cls is None:
            stderr.write(f"dcir-opt: unknown pass '{args.help_pass}'; passes are: {', '.join(registry())}\n")
            return 2
        stdout.write(describe(cls))
        return 0
    try:
        passes = parse_pipeline(args.passes)
    except DcirError as e:
        stderr.write(e.render() + "\n")
        return 2
    try:
        _load(args.load)
        name, text = _read(args.input, stdin)
        args.machine = _machine(args)
    except _Usage as e:
        stderr.write(f"dcir-opt: {e}\n")
        return 2

    chunks = _chunks(text, args.split_input_file)
    outputs, failed = [], False
    timings: list[tuple[str, float]] = []
    for chunk, offset in chunks:
        out, diags = _process(name, chunk, offset, passes, args, stderr, timings)
        if args.verify_diagnostics:
            mismatches = _check_expected(Source(name, chunk, offset), diags)
            for d in mismatches:
                stderr.write(d.render() + "\n")
            failed |= bool(mismatches)
            continue
        if diags:
            stderr.write("\n".join(d.render() for d in diags) + "\n")
            failed = True
            continue
        if args.simulate:
            stdout.write(out.report())
            continue
        outputs.append(out.text)
    if args.time_passes:
        _report_times(timings, stderr)
    if not args.verify_diagnostics and outputs:
        result = "// -----\n".join(outputs)
        if args.output == "-":
            stdout.write(result)
        else:
            Path(args.output).write_text(result)
    return 1 if failed else 0


def _load(modules: list[str]) -> None:
    """Import the modules of ``--load`` (libraries that register custom ops)."""
    for module in modules:
        try:
            custom_ops.load(module)
        except ImportError as e:
            raise _Usage(f"--load {module}: {e}") from None


def _machine(args):
    """The machine of --simulate (for --emit-trace: the default one when none is named)."""
    if args.budget is not None:
        try:
            args.budget = parse_bytes(args.budget)
        except ValueError as e:
            raise _Usage(f"--budget: {e}") from None
    if args.micro_steps < 1:
        raise _Usage("--micro-steps must be at least 1")
    if args.memory_plot:
        if importlib.util.find_spec("matplotlib") is None:
            raise _Usage("--memory-plot needs matplotlib, an optional dependency: pip install 'dcir[plot]'")
    if not args.simulate:
        return Machine()
    try:
        return load(args.simulate)
    except HardwareError as e:
        raise _Usage(str(e)) from None


class _Result:
    """A processed module: its text, and what --simulate, --emit-trace and --memory-plot make of it."""

    def __init__(self, text: str, module, args):
        self.text, self.module, self.args = text, module, args
        if args.emit_trace:
            machine = _on_program_ranks(module, args.machine) if args.simulate else None
            trace.write(args.emit_trace, trace.predicted(module, machine, budget=args.budget))
        if args.memory_plot:
            plot(module, args.memory_plot, args.budget, title=Path(module.source.name).name if module.source else "")

    def report(self) -> str:
        m = _on_program_ranks(self.module, self.args.machine)
        note = ""
        if m.world_size != self.args.machine.world_size and self.args.machine.world_size:
            note = (f"note: the program is sharded over {m.world_size} ranks (its world_size), {m.name} describes "
                    f"{self.args.machine.world_size}: predicted on {m.world_size} of them; compile the model for "
                    f"{self.args.machine.world_size} ranks to predict them all (benchmarks/predict_at_scale.py)\n")
        return note + simulate_module(self.module, m, self.args.micro_steps).report()


def _on_program_ranks(module, machine):
    """``machine`` with the ranks ``module`` is sharded over: a program runs on as many."""
    if module.world_size and machine.world_size != module.world_size:
        return replace(machine, world_size=module.world_size)
    return machine


def _read(path: str, stdin: TextIO) -> tuple[str, str]:
    if path == "-":
        return "<stdin>", stdin.read()
    try:
        return path, Path(path).read_text()
    except OSError as e:
        raise _Usage(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise _Usage(f"cannot read {path}: not UTF-8 text") from None


def _chunks(text: str, split: bool) -> list[tuple[str, int]]:
    if not split:
        return [(text, 0)]
    out, start = [], 0
    for m in SPLIT_MARKER.finditer(text):
        out.append((text[start:m.start()], text.count("\n", 0, start)))
        start = min(m.end() + 1, len(text))
    out.append((text[start:], text.count("\n", 0, start)))
    return out


def _process(name, text, offset, passes, args, stderr, timings) -> tuple[str, list[Diagnostic]]:
    try:
        start = time.perf_counter()
        module = parse(text, name, line_offset=offset)
        timings.append(("parse", time.perf_counter() - start))
        if not args.disable_verify:
            start = time.perf_counter()
            diags = diagnostics(module, shapes=args.verify_shapes)
            timings.append(("verify", time.perf_counter() - start))
            if diags:
                return "", diags
        pm = PassManager(passes, verify_each=not args.disable_verify, verify_shapes=args.verify_shapes,
                         print_ir_after_all=stderr if args.print_ir_after_all else None, reproducer=args.reproducer)
        pm.run(module)
        timings.extend(pm.timings)
        if args.pass_statistics:
            _report_stats(pm.stats, stderr)
        start = time.perf_counter()
        out = print_module(module)
        timings.append(("print", time.perf_counter() - start))
        return _Result(out, module, args), []
    except DcirError as e:
        return "", e.diagnostics


def _report_times(timings, out: TextIO) -> None:
    totals: dict[str, float] = {}
    for name, secs in timings:
        totals[name] = totals.get(name, 0.0) + secs
    whole = sum(totals.values()) or 1e-9
    out.write("===-- pass execution timing report --===\n  wall (s)   share  name\n")
    for name, secs in totals.items():
        out.write(f"  {secs:8.4f}  {100 * secs / whole:5.1f}%  {name}\n")
    out.write(f"  {whole:8.4f}  100.0%  total\n")


def _report_stats(stats, out: TextIO) -> None:
    out.write("===-- pass statistics --===\n")
    for name, counter in stats.items():
        out.write(f"{name}\n")
        for key, n in sorted(counter.items()):
            out.write(f"  {n:6d}  {key}\n")


def _check_expected(source: Source, produced: list[Diagnostic]) -> list[Diagnostic]:
    """Match produced diagnostics against ``// expected-...`` comments. Returns the mismatches."""
    expected = []  # [line, severity, text, matched]
    for i, line in enumerate(source.text.split("\n")):
        lineno = i + 1 + source.line_offset
        for m in _EXPECTED.finditer(line):
            where = m.group(2)
            target = lineno
            if where in ("@above", "@below"):
                target += -1 if where == "@above" else 1
            elif where:
                target += int(where[1:])
            expected.append([target, m.group(1), m.group(3), False, (lineno, m.start() + 1)])
    problems = []
    flat = []
    for d in produced:
        flat.append((d.loc, d.severity, d.message, d))
        flat.extend((n.loc, "note", n.message, d) for n in d.notes)
    for loc, severity, message, d in flat:
        hit = next((e for e in expected if not e[3] and e[1] == severity and loc is not None and e[0] == loc[0]
                    and e[2] in message), None)
        if hit is None:
            where = f"line {loc[0]}" if loc else "no location"
            problems.append(Diagnostic(f"unexpected {severity} ({where}): {message}", source, loc))
            continue
        hit[3] = True
    for e in expected:
        if not e[3]:
            problems.append(Diagnostic(f"expected {e[1]} on line {e[0]} was not produced: {e[2]}", source, e[4]))
    return problems


def opt_main() -> None:
    """Console entry point. A Python exception that escapes is a bug in DCIR, not the
    input's fault: it is reported as such (exit 3), with the traceback for the report."""
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    except Exception:
        sys.stderr.write("dcir-opt: internal error, a bug in DCIR (please report it with the input):\n")
        traceback.print_exc()
        code = 3
    sys.exit(code)


if __name__ == "__main__":
    opt_main()
