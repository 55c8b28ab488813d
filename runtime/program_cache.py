"""The program cache: a restarted job skips capture and planning (config ``program_cache``).

Capture (Dynamo, AOTAutograd, the passes) takes seconds to minutes, and the optimization
cycle spends steps profiling; a job restarted after a fault (``torchrun
--max-restarts``) would pay both again for the program it already had. With a cache
directory, rank 0 keeps each program it compiles there, as text, with the structure of
the model's output, and, after each cycle, the program the cycle left running; a later
job whose key matches reads them instead of capturing and runs that program from its
first step.

The key (``ProgramCache.name``) is everything the program is a function of:

* DCIR's own sources, torch's and Python's versions;
* the world size and the config (less ``timeout_s`` and ``program_cache``);
* the call: training or evaluation, with or without gradients, the inputs' structure,
  shapes and dtypes (``programs.key``);
* the model's structure: each module's class and its attributes (``training``, a
  dropout's ``p``, checkpointing switches, ``transformers``' config, hooks), each
  parameter's and buffer's name, shape, dtype and ``requires_grad``;
* the model's code: the source of every file reached from the model's classes, its
  hooks and the loss function, following the names their functions read from their
  modules' globals, and the version of each installed package reached (``transformers``'
  code is keyed by its version, not read).

Code the walk cannot see (a function reached only through a value computed at run time)
is not in the key: after changing such code, clear the directory. A file that cannot
be read back is warned about and compiled again, never half used.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import os
import platform
import sys
import sysconfig
import types
import warnings
from pathlib import Path

import torch

from dcir.diagnostics import DcirError, Diagnostic

#: bumped when an entry's layout changes: older entries are then misses
FORMAT = 1
#: the most objects the code walk visits: a bound on models that reach a whole library
WALK_LIMIT = 20_000
#: DCIR's own packages (and the kinds of their source files), whose digest is part of every key
SOURCE_PACKAGES, SOURCE_SUFFIXES = ("dcir", "dcir_lowering", "dcir_runtime"), (".py", ".lark")


@dataclasses.dataclass
class Entry:
    """What a job keeps of one program: its text as compiled, the structure of the
    model's output (``Outputs.pack``), and, once the optimization cycle has run, the
    program it left running (the plan it took, or the captured one it kept), with the
    cycle's records and the number of steps (of the job that planned it) whose profiles
    it had seen."""

    program: str
    outputs: str
    plan: str | None = None
    log: list = dataclasses.field(default_factory=list)
    planned_through: int = 0

    def dumps(self) -> str:
        return json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, default=str)

    @classmethod
    def loads(cls, text: str) -> "Entry":
        data = json.loads(text)
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"not an entry of format {FORMAT}")
        return cls(**data)


@functools.cache
def sources_digest() -> str:
    """A digest of DCIR's own sources: a program is a function of the compiler that made it."""
    h = hashlib.sha256()
    for package in SOURCE_PACKAGES:  # wherever they are installed (the repository's folders, site-packages)
        top = Path(importlib.import_module(package).__file__).resolve().parent
        for path in sorted(p for p in top.rglob("*") if p.suffix in SOURCE_SUFFIXES):
            h.update(f"{package}/{path.relative_to(top).as_posix()}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


class ProgramCache:
    """The cache in ``root`` for the engines of a world of ``world`` ranks."""

    def __init__(self, root, world: int):
        self.root, self.world = Path(root).expanduser(), world
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DcirError(Diagnostic(f"config 'program_cache': cannot create {self.root}: {e.strerror}")) from None

    def name(self, model: torch.nn.Module, loss_fn, call, config) -> str:
        """The entry name of ``model``'s program for ``call`` (``programs.ProgramKey``) under ``config``."""
        settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("timeout_s", "program_cache")}
        common = {"format": FORMAT, "dcir": sources_digest(), "torch": torch.__version__,
                  "python": platform.python_version(), "world": self.world, "config": settings}
        h = hashlib.sha256(json.dumps(common, sort_keys=True, default=str).encode())
        h.update(repr(tuple(call)).encode())
        described = Described()
        h.update(described.model(model).encode())
        h.update(described.value(loss_fn).encode())
        h.update(code_digest(described.code).encode())
        return h.hexdigest()[:32]

    def path(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def load(self, name: str) -> Entry | None:
        """The entry ``name``; None when there is none, or (with a warning) when it cannot be read back."""
        path = self.path(name)
        try:
            return Entry.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError) as e:
            warnings.warn(f"dcir: the program cache entry {path} cannot be read back ({e}); compiling again",
                          stacklevel=2)
            return None

    def save(self, name: str, entry: Entry) -> None:
        """Write ``entry`` whole or not at all (a temporary file renamed over it); a cache that
        cannot be written is warned about, and the job goes on without it."""
        path = self.path(name)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(entry.dumps())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            warnings.warn(f"dcir: cannot write the program cache entry {path} ({e.strerror}); going on without it",
                          stacklevel=2)

    def save_plan(self, name: str, plan: str, log: list, planned_through: int) -> None:
        """Add the program the cycle left running (its records, and the steps it has seen) to entry ``name``."""
        entry = self.load(name)
        if entry is not None:
            self.save(name, dataclasses.replace(entry, plan=plan, log=log, planned_through=planned_through))


# ---- the key's description of a model ---------------------------------------------------------

#: what ``torch.nn.Module`` keeps in its instance dict that the description walks itself
#: (parameters, buffers, children) or that says nothing about the step
_MODULE_SLOTS = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_state_dict_hooks",
                 "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
                 "_is_full_backward_hook", "_compiled_call_impl"}
#: the endings of the module attributes that keep hooks by handle id (a process-wide
#: counter): described by the hooks alone
_HOOKS = ("hooks", "hooks_with_kwargs", "hooks_always_called")


class Described:
    """Text that describes values deterministically (no addresses), collecting the code
    it meets (classes, functions) in ``code`` for ``code_digest``."""

    def __init__(self):
        self.code: list = []

    def model(self, model: torch.nn.Module) -> str:
        lines = []
        for name, m in model.named_modules(remove_duplicate=False):
            attrs = {k: self.value(list(v.values()) if k.endswith(_HOOKS) and isinstance(v, dict) else v)
                     for k, v in sorted(vars(m).items()) if k not in _MODULE_SLOTS}
            lines.append(f"{name}: {self.value(type(m))} {attrs}")
        lines += [f"{n} {list(p.shape)} {p.dtype} {p.requires_grad}" for n, p in model.named_parameters()]
        lines += [f"{n} {list(b.shape)} {b.dtype}" for n, b in model.named_buffers()]
        return "\n".join(lines)

    def value(self, v, depth: int = 0) -> str:
        if depth > 8:  # deeper than any setting goes (and a container that holds itself)
            return type(v).__name__
        if v is None or isinstance(v, (bool, int, float, str, bytes, torch.dtype, torch.device)):
            return repr(v)
        if isinstance(v, torch.Tensor):
            return f"tensor({list(v.shape)}, {v.dtype})"
        if isinstance(v, (list, tuple, set, frozenset)):
            items = [self.value(x, depth + 1) for x in v]
            return f"{type(v).__name__}({sorted(items) if isinstance(v, (set, frozenset)) else items})"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{self.value(k, depth + 1)}: {self.value(x, depth + 1)}"
                                   for k, x in v.items()) + "}"
        if isinstance(v, functools.partial):
            return f"partial({self.value(v.func, depth + 1)}, {self.value(v.args, depth + 1)}, " \
                   f"{self.value(v.keywords, depth + 1)})"
        if isinstance(v, (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
            self.code.append(getattr(v, "__func__", v))
            return f"{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', type(v).__name__)}"
        if isinstance(v, torch.nn.Module):
            return f"module {self.value(type(v))}"  # described on its own line when it is the model's
        self.code.append(type(v))
        if depth < 2 and hasattr(v, "__dict__"):  # a config object: its settings (less hashes, which
            # differ from process to process: ``GenerationConfig._original_object_hash``)
            fields = {k: self.value(x, depth + 1) for k, x in sorted(vars(v).items()) if "hash" not in k}
            return f"{self.value(type(v))}{fields}"
        return self.value(type(v))


def code_digest(roots: list) -> str:
    """A digest of the code reached from ``roots``: the files of the functions and classes
    outside installed packages (read, and their functions' global names followed), and
    the version of each installed package reached."""
    installed = tuple(str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("purelib", "platlib", "stdlib"))
    files: dict[str, str] = {}
    packages: dict[str, str] = {}
    seen: set[int] = set()
    where: dict[str, str | None] = {}  # module name -> its file, resolved
    todo = list(roots)
    while todo and len(seen) < WALK_LIMIT:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        module = inspect.getmodule(obj)
        if module is None:
            continue
        if module.__name__ not in where:
            file = getattr(module, "__file__", None)
            where[module.__name__] = str(Path(file).resolve()) if file else None
        path = where[module.__name__]
        if path is None:
            continue
        if path.startswith(installed):
            top = module.__name__.split(".")[0]
            packages[top] = _version(top)
            continue
        if path not in files:
            files[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        todo.extend(_reached(obj))
    return json.dumps({"files": sorted(files.items()), "packages": sorted(packages.items())})


def _reached(obj) -> list:
    """What ``obj``'s code names: a class's bases and members, a function's globals and closure."""
    if isinstance(obj, type):
        members = [getattr(m, "__func__", m) for m in vars(obj).values()]
        members += [f for m in members if isinstance(m, property) for f in (m.fget, m.fset, m.fdel) if f]
        return [*obj.__mro__[1:], *(m for m in members if inspect.isfunction(m) or inspect.isclass(m))]
    if not inspect.isfunction(obj):
        return []
    names, codes = set(), [obj.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    found = [obj.__globals__[n] for n in names if n in obj.__globals__]
    found += [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
    return [f for f in found if inspect.isfunction(f) or inspect.isclass(f) or inspect.ismodule(f)]


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _version(top: str) -> str:
    try:
        return importlib.metadata.version(top)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(sys.modules.get(top), "__version__", "?"))
