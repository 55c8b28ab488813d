"""Builds (once per environment) and loads the C++ runtime in ``native/``.

``torch.utils.cpp_extension.load`` compiles ``native/dcir_runtime.cpp`` against the
installed torch into ``~/.cache/dcir/native/<torch version>/<variant>`` (or under
``$DCIR_CACHE``) and loads it, which registers ``torch.ops.dcir.*``. It rebuilds only
when the source, the flags or torch change; concurrent processes wait for one build
(``_exclusive``: a lock the kernel drops when its holder dies, so a build killed
midway never leaves the next process waiting on torch's own lock file).

Which variant is built, ``cpu`` (gloo) or ``cuda`` (adds NCCL through c10d, CUDA
streams and events, pinned host memory), is ``$DCIR_NATIVE_BUILD``:

* ``auto`` (the default): ``cuda`` when torch was built with CUDA, a GPU is visible
  and the CUDA toolkit is found, else ``cpu``;
* ``cuda``: the CUDA/NCCL variant even on a machine without a GPU, which compiles and
  links it (CI does, on every run: ``python -m dcir_runtime.native_build --check``); loading
  then works, running a CUDA collective needs a GPU;
* ``cpu``: the CPU variant whatever the machine has.

``build_info()`` says which variant was made and why; a build prints that line once.
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

SOURCE = Path(__file__).resolve().parents[1] / "native" / "dcir_runtime.cpp"
VARIANTS = ("auto", "cpu", "cuda")
#: The architectures a forced CUDA build targets when ``TORCH_CUDA_ARCH_LIST`` is unset
#: (no GPU to ask): A100 and H100. The source has no device code, so this only
#: satisfies the extension builder.
DEFAULT_ARCHS = "8.0;9.0"

_loaded: "BuildInfo | None" = None


class NativeBuildError(RuntimeError):
    """The requested variant cannot be built here; the message says what is missing."""


@dataclass(frozen=True)
class BuildInfo:
    variant: str       # "cpu" or "cuda"
    reason: str        # why this variant
    nccl: bool         # the NCCL path is compiled in (USE_C10D_NCCL)
    directory: Path    # where the build lives
    built_s: float | None = None  # seconds spent compiling; None: loaded from the cache

    def __str__(self) -> str:
        what = "CUDA/NCCL" if self.variant == "cuda" and self.nccl else self.variant.upper()
        return f"dcir native runtime: {what} build ({self.reason})"


def cache_dir() -> Path:
    root = Path(os.environ.get("DCIR_CACHE", Path.home() / ".cache" / "dcir"))
    tag = torch.__version__.replace("+", "_")
    return root / "native" / tag


def requested() -> str:
    value = os.environ.get("DCIR_NATIVE_BUILD", "auto").strip().lower() or "auto"
    if value not in VARIANTS:
        raise NativeBuildError(f"DCIR_NATIVE_BUILD={value!r}; valid: {', '.join(VARIANTS)}")
    return value


def _cuda_home() -> str | None:
    """A CUDA toolkit: a folder with ``bin/nvcc`` and ``include/cuda_runtime.h``, from
    ``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda`` or the ``nvcc`` on ``PATH``. The
    extension builder's own guess takes the parent of ``nvcc``'s folder, which is no
    toolkit when ``nvcc`` is a wrapper in ``/usr/local/bin``."""
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                  str(Path(nvcc).resolve().parents[1]) if nvcc else None]
    for home in filter(None, candidates):
        if (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "include" / "cuda_runtime.h").exists():
            return home
    return None


def choose(variant: str | None = None) -> tuple[str, str]:
    """(variant, reason): what ``load`` builds for ``variant`` (default: ``$DCIR_NATIVE_BUILD``)."""
    variant = variant or requested()
    cuda_torch = torch.version.cuda is not None
    if variant == "cpu":
        return "cpu", "DCIR_NATIVE_BUILD=cpu"
    if variant == "cuda":
        if not cuda_torch:
            raise NativeBuildError(f"DCIR_NATIVE_BUILD=cuda, but torch {torch.__version__} was built without CUDA; "
                                   "install a CUDA build of torch (pip install torch==2.14.1 takes one from this "
                                   "machine's disk)")
        if _cuda_home() is None:
            raise NativeBuildError("DCIR_NATIVE_BUILD=cuda, but no CUDA toolkit was found: set CUDA_HOME or put "
                                   "nvcc on PATH")
        gpu = "a GPU is visible" if torch.cuda.is_available() else "forced without a GPU: compiled and linked only"
        return "cuda", f"DCIR_NATIVE_BUILD=cuda; {gpu}"
    if not cuda_torch:
        return "cpu", f"torch {torch.__version__} has no CUDA; DCIR_NATIVE_BUILD=cuda needs a CUDA build of torch"
    if not torch.cuda.is_available():
        return "cpu", "no GPU is visible; DCIR_NATIVE_BUILD=cuda compiles the CUDA/NCCL path anyway"
    if _cuda_home() is None:
        return "cpu", "a GPU is visible but no CUDA toolkit was found; set CUDA_HOME to build the CUDA path"
    return "cuda", "a GPU is visible and torch has CUDA"


def _nvidia_includes() -> list[str]:
    """Include folders of the ``nvidia-*`` pip packages a CUDA build of torch installs:
    torch's CUDA headers include cuBLAS, cuSPARSE, cuSOLVER and NCCL headers from there."""
    found = []
    for entry in sys.path:
        found += glob.glob(os.path.join(entry, "nvidia", "*", "include"))
        found += glob.glob(os.path.join(entry, "nvidia", "*", "*", "include"))  # nvidia/cu13/<lib>/include
    return sorted(set(found))


def _flags(variant: str, werror: bool) -> tuple[list[str], bool]:
    """(compiler flags, NCCL compiled in). The ``nvidia`` packages' headers are searched
    after the toolkit's (``-idirafter``): they hold a partial copy of the toolkit's."""
    flags = ["-O2", "-Wall"]
    if werror:
        flags.append("-Werror")
    if variant != "cuda":
        return flags, False
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    flags.append("-DDCIR_WITH_CUDA")
    if nccl:
        flags.append("-DUSE_C10D_NCCL")
    for folder in _nvidia_includes():
        flags += ["-idirafter", folder]
    return flags, nccl


def load(verbose: bool = False, *, variant: str | None = None, werror: bool = False) -> BuildInfo:
    """Registers ``torch.ops.dcir`` (building the extension first when needed); returns
    what was built and why. ``variant`` overrides ``$DCIR_NATIVE_BUILD``; ``werror``
    makes any compiler warning in the runtime's source an error (CI's check)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    chosen, reason = choose(variant)
    flags, nccl = _flags(chosen, werror)
    if chosen == "cuda":
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
        os.environ["CUDA_HOME"] = _cuda_home()
    from torch.utils import cpp_extension  # lazily, after CUDA_HOME is set (below)
    if chosen == "cuda":  # the builder reads its toolkit from this global, set when it was first imported
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]
    build = cache_dir() / (chosen + ("-werror" if werror else ""))
    build.mkdir(parents=True, exist_ok=True)
    lib = build / "dcir_native.so"
    before = lib.stat().st_mtime if lib.exists() else None
    begin = time.perf_counter()
    with _exclusive(build):
        cpp_extension.load(
            name="dcir_native",
            sources=[str(SOURCE)],
            extra_cflags=flags,
            with_cuda=chosen == "cuda",
            build_directory=str(build),
            is_python_module=False,
            verbose=verbose,
        )
    rebuilt = not lib.exists() or before is None or lib.stat().st_mtime != before
    _loaded = BuildInfo(chosen, reason, nccl, build, time.perf_counter() - begin if rebuilt else None)
    if rebuilt:
        print(f"{_loaded} in {_loaded.built_s:.1f} s", file=sys.stderr)
    return _loaded


#: seconds a process waits for another's build before it says so
WAIT_NOTE_S = 30.0


@contextmanager
def _exclusive(build: Path, note_after_s: float = WAIT_NOTE_S):
    """One process at a time in ``build``'s ``cpp_extension.load``. torch's builder
    guards a build with a ``lock`` file that a killed build leaves behind, and every
    later load then waits on it forever, silently. This lock (``flock``) goes with its
    holder's death, so while it is held, a ``lock`` file is stale: it is removed, and
    said. A wait longer than ``note_after_s`` is said once too."""
    with open(build / "build.flock", "w") as f:
        start, noted = time.monotonic(), False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not noted and time.monotonic() - start > note_after_s:
                    print(f"dcir native runtime: waiting for another process's build in {build}", file=sys.stderr)
                    noted = True
                time.sleep(0.2)
        stale = build / "lock"
        if stale.exists():
            stale.unlink()
            print(f"dcir native runtime: removed {stale}, left by a build that was killed", file=sys.stderr)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_info() -> BuildInfo | None:
    """What ``load`` built or loaded in this process (None before it ran)."""
    return _loaded


def registered_ops() -> list[str]:
    """Every op the runtime registers (``m.def`` in the source's ``TORCH_LIBRARY(dcir, m)``)."""
    return sorted(set(re.findall(r'm\.def\("(\w+)\(', SOURCE.read_text())))


class RuntimeStats(NamedTuple):
    """The C++ runtime's counters for this process (``dcir::memory_stats``), by name."""

    shard_bytes: int      # the shard store: every engine's parameter shards
    gathered_now: int     # gathered buffers alive now (from their all_gather to their mem.free)
    gathered_peak: int    # their peak since the last ``dcir::reset_peak``
    freed: int            # bytes released by mem.free
    collectives: int      # collectives started
    sent: int             # bytes handed to them
    wait_ns: int          # host time blocked in comm.wait of a collective
    pending: int          # collectives started and not yet waited
    shm_fallbacks: int    # gathers and reduce-scatters the shared-memory outbox could not place (dcir_runtime.transport)


def runtime_stats() -> RuntimeStats:
    """The runtime's counters, named (the op returns them as a list, in this order)."""
    return RuntimeStats(*torch.ops.dcir.memory_stats())
