"""Graph breaks: where Dynamo splits a model's forward, and why.

``dcir.graph_breaks(model, *args, **kwargs)`` runs the forward of a deep copy of the
model once under Dynamo, graph breaks allowed, and returns every break it met: the
reason in one line, the user's file and line (the innermost frame outside torch and
outside DCIR) and that line's source text. The returned list's ``graphs`` is how many
graphs the forward splits into. Logging, ``warnings.warn`` and ``print`` are not breaks
(``benign_breaks``), as under ``compile_to_ir``::

    >>> for b in dcir.graph_breaks(model, x):
    ...     print(b)
    model.py:42: data-dependent branching on a tensor (if x.sum() > 0:)

The caller's model is left as it was (no gradients, no BatchNorm statistics updated):
the copy runs the forward only, never a backward.

The breaks come from Dynamo's own record of each one, made as it decides to break
(``InstructionTranslatorBase.log_graph_break``, which also feeds ``TORCH_LOGS=
graph_breaks``), so a break that makes Dynamo give up on a whole function (a break
inside a loop or a ``with`` block) is listed too; ``torch._dynamo.explain`` reports only
breaks that end a compiled graph. Each graph's own compile reason is read as well, so the
list stays whole where that record is missing.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import io
import logging
import os
import sys
import tokenize
import warnings
from dataclasses import dataclass

import torch

from dcir.diagnostics import Note

#: Dynamo's break types, said in the user's terms; others are shown as Dynamo names them
_PLAIN = {
    "Data-dependent branching": "data-dependent branching on a tensor",
    "Unsupported Tensor.item() call with capture_scalar_outputs=False":
        "Tensor.item() reads a tensor's value into Python",
    "Dynamic shape operator": "an operator whose output shape depends on the data",
    "graph break in loop": "a graph break inside a loop: Dynamo runs the whole function eagerly",
    "Unsupported context manager": "a context manager Dynamo cannot trace",
    "Attempted to call function marked as skipped": "a call Dynamo does not trace",
}


@dataclass(frozen=True)
class GraphBreak:
    """One place where Dynamo splits the graph."""

    reason: str   # one line
    file: str     # the user's file: the innermost frame outside torch and DCIR
    line: int
    source: str   # that line's text, without its comment

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def __str__(self) -> str:
        source = f" ({self.source})" if self.source else ""
        return f"{os.path.basename(self.file)}:{self.line}: {self.reason}{source}"


class GraphBreaks(list):
    """The breaks of one forward, in the order Dynamo met them; ``graphs``: how many
    graphs the forward splits into (0 when it runs no tensor op under Dynamo)."""

    def __init__(self, breaks=(), graphs: int = 0):
        super().__init__(breaks)
        self.graphs = graphs


#: ``logging.Logger`` methods a model may call in forward; transformers adds ``warning_once``,
#: ``warning_advice`` and ``info_once`` to the class (found when a capture starts)
_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "log", "warning_once",
                   "warning_advice", "info_once")


@contextlib.contextmanager
def benign_breaks():
    """Dynamo settings under which logging, ``warnings.warn`` and ``print`` in a model's
    forward do not break its graph: Dynamo ignores them while it traces
    (``torch._dynamo.config.ignore_logging_functions``), so they do not run during
    capture and are not part of the program.

    Why not Dynamo's other knob, ``reorderable_logging_functions`` (run the call after
    the graph, with the values it was given): in torch 2.13 Dynamo emits only the calls
    made in the compiled function's own frame, and silently drops those made in functions
    it inlines, which is every call inside a model's ``forward`` (``OutputGraph.
    compile_subgraph``: "TODO get debug_locals working for nested graph breaks"); and it
    reorders only calls whose arguments are tensors, constants or format strings, so
    ``print(x.shape)`` or ``warnings.warn(msg, UserWarning)`` would break the graph
    anyway. Ignoring is what reordering does to a model's calls, said plainly.

    Nor does the table of function wrappers the ``kernels`` package keeps, which
    transformers writes in every attention forward since 5.25 and which Dynamo refuses to
    write in a checkpointed region (``_PlainKernelFuncs``). The user's own settings are
    kept: these are added to them."""
    config = torch._dynamo.config
    loggers = {getattr(logging.Logger, name) for name in _LOGGER_METHODS if hasattr(logging.Logger, name)}
    ignored = set(config.ignore_logging_functions) | loggers | {print, warnings.warn}
    with config.patch(ignore_logging_functions=ignored), _plain_kernel_funcs():
        yield


#: where the ``kernels`` package (which transformers needs since 5.25) keeps its table of the
#: function wrappers of the model running now: the module and the name
_KERNEL_FUNCS = ("kernels._internals.layer.layer", "_ACTIVE_KERNEL_FUNCS")


class _PlainKernelFuncs:
    """Stands in for ``kernels``' table of a model's function wrappers while DCIR traces.

    A module decorated with ``use_kernelized_func`` (transformers' attention, for the
    rotary embedding) puts its wrappers into the table for the length of its forward
    (``set``, then ``reset``); under Dynamo that is a write to a global object, which
    inside an activation-checkpointed region Dynamo refuses ("HOP: Unsafe side effect":
    eager checkpointing would repeat it when it recomputes), so the step would split into
    graphs. The table changes what runs only for a function ``kernelize`` replaced;
    without one each wrapper runs the plain function, as it does with no table. So the
    stand-in leaves the table unset when no function it is given was replaced (the same
    code runs), and hands a table that holds a replaced one to ``kernels`` (its kernel
    runs; in a checkpointed region Dynamo still refuses the write, and the error names it)."""

    def __init__(self, real):
        self.real = real

    def get(self):
        return self.real.get()

    def set(self, table):
        return (self.real.set(table),) if _replaced(table) else None

    def reset(self, token):
        if token is not None:
            self.real.reset(token[0])


def _replaced(table) -> bool:
    """Whether ``table`` (id of a function -> (its wrapper, the forward the wrapper runs))
    holds a function ``kernelize`` replaced; a table laid out otherwise counts as one."""
    try:
        return any(forward is not type(wrapper).forward for wrapper, forward in table.values())
    except (AttributeError, TypeError, ValueError):
        return True


@functools.cache
def _stand_in(real) -> _PlainKernelFuncs:
    """One stand-in per table, so what Dynamo guards on is the same object at every call."""
    return _PlainKernelFuncs(real)


@contextlib.contextmanager
def _plain_kernel_funcs():
    """``kernels``' table replaced by its stand-in (``_PlainKernelFuncs``), where the
    package is loaded and has the table."""
    module = sys.modules.get(_KERNEL_FUNCS[0])
    real = getattr(module, _KERNEL_FUNCS[1], None)
    if real is None or isinstance(real, _PlainKernelFuncs) or not all(
            callable(getattr(real, name, None)) for name in ("get", "set", "reset")):
        yield
        return
    setattr(module, _KERNEL_FUNCS[1], _stand_in(real))
    try:
        yield
    finally:
        setattr(module, _KERNEL_FUNCS[1], real)


def graph_breaks(model: torch.nn.Module, *args, **kwargs) -> GraphBreaks:
    """Every graph break of ``model(*args, **kwargs)``: see the module docstring."""
    work = copy.deepcopy(model)
    work.train(model.training)
    return breaks_of(work, args, kwargs)


def breaks_of(fn, args: tuple, kwargs: dict) -> GraphBreaks:
    """Run ``fn(*args, **kwargs)`` once under Dynamo, breaks allowed, and list them."""
    found: dict[tuple[str, int], GraphBreak] = {}
    graphs = []

    def count(gm, _example_inputs):
        graphs.append(gm)
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False):
            _add(found, reason.reason, list(reason.user_stack or []))
        return gm.forward

    torch._dynamo.reset()
    try:
        with benign_breaks(), _recording(found), _quiet():
            torch.compile(fn, backend=count, dynamic=False)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    return GraphBreaks(found.values(), len(graphs))


@contextlib.contextmanager
def _recording(found: dict):
    """Dynamo's record of each break as it decides to break, added to ``found``."""
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase  # Dynamo's, ~0.8 s: when listing breaks

    original = getattr(InstructionTranslatorBase, "log_graph_break", None)
    if original is None:  # a torch without it: the graphs' compile reasons alone
        yield
        return

    def log_graph_break(self, code_options, reason, exc, *rest, **kw):
        if not getattr(exc, "logged", False):
            stack = getattr(exc, "real_stack", None) or torch._guards.TracingContext.extract_stack()
            _add(found, getattr(exc, "gb_type", None) or reason, list(stack or []))
        return original(self, code_options, reason, exc, *rest, **kw)

    InstructionTranslatorBase.log_graph_break = log_graph_break
    try:
        yield
    finally:
        InstructionTranslatorBase.log_graph_break = original


@contextlib.contextmanager
def _quiet():
    """Dynamo's own warnings about each break (the list says it all) kept off the console."""
    dynamo_log = logging.getLogger("torch._dynamo")
    level = dynamo_log.level
    dynamo_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        dynamo_log.setLevel(level)


def _add(found: dict, reason: str, stack: list) -> None:
    """One break at the innermost user frame of ``stack``; the first reason met at a line wins."""
    frame = _user_frame(stack)
    if frame is None:
        return
    key = (frame.filename, frame.lineno)
    if key not in found:
        found[key] = GraphBreak(_one_line(reason), frame.filename, frame.lineno, _code(frame.line or ""))


def _internal_dirs() -> tuple[str, ...]:
    """The folders of torch and of DCIR's packages (found, not imported: the runtime is a layer above)."""
    return tuple(os.path.join(importlib.util.find_spec(name).submodule_search_locations[0], "")
                 for name in ("torch", "dcir", "dcir_lowering", "dcir_runtime"))


def _user_frame(stack: list):
    """The innermost frame outside torch and DCIR; the innermost frame when all are inside."""
    if not stack:
        return None
    internal = _internal_dirs()
    outside = [f for f in stack if not os.path.abspath(f.filename).startswith(internal)]
    return (outside or stack)[-1]


def _one_line(reason: str) -> str:
    first = str(reason).strip().split("\n", 1)[0].strip()
    return _PLAIN.get(first, first)


def _code(line: str) -> str:
    """A source line without its trailing comment (a ``#`` inside a string stays)."""
    line = line.strip()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line).readline):
            if tok.type == tokenize.COMMENT:
                return line[:tok.start[1]].rstrip()
    except (tokenize.TokenError, SyntaxError):  # an unclosed bracket: the statement goes on below
        pass
    return line


def notes(step, args: tuple, kwargs: dict, limit: int = 10) -> tuple:
    """The breaks of ``step`` as diagnostic notes for capture's whole-graph error: at most
    ``limit``, then how many more. Listing runs the step again; when that fails too, the
    error stands without the list."""
    try:
        found = breaks_of(step, args, kwargs)
    except Exception:  # noqa: BLE001  (the error being raised says what matters; the list only adds to it)
        return ()
    if not found:
        return ()
    head = Note(None, f"{_count(len(found), 'graph break')} in the step, which runs as {_count(found.graphs, 'graph')} "
                      "and Python between them (dcir.graph_breaks lists the breaks):")
    lines = [Note(None, f"{b.where}: {b.reason}" + (f" ({b.source})" if b.source else "")) for b in found[:limit]]
    more = [Note(None, f"and {len(found) - limit} more")] if len(found) > limit else []
    return (head, *lines, *more)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
