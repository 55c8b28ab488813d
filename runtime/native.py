"""Builds (once per environment) and loads the C++ runtime in ``native/``.

``torch.utils.cpp_extension.load`` compiles ``native/dcir_runtime.cpp`` against the
installed torch into ``~/.cache/dcir/native/<torch version>`` (or ``$DCIR_CACHE``) and
loads it, which registers ``torch.ops.dcir.*``. It rebuilds only when the source, the
flags or torch change; concurrent processes wait for one build (the extension
builder's lock). The CUDA path is compiled when torch was built with CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parents[1] / "native" / "dcir_runtime.cpp"
_loaded = False


def cache_dir() -> Path:
    root = Path(os.environ.get("DCIR_CACHE", Path.home() / ".cache" / "dcir"))
    tag = torch.__version__.replace("+", "_")
    return root / "native" / tag


def load(verbose: bool = False) -> None:
    """Registers ``torch.ops.dcir`` (building the extension first when needed)."""
    global _loaded
    if _loaded:
        return
    from torch.utils import cpp_extension

    flags = ["-O2"]
    cuda = torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None
    if cuda:
        flags.append("-DDCIR_WITH_CUDA")
    build = cache_dir() / ("cuda" if cuda else "cpu")
    build.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name="dcir_native",
        sources=[str(SOURCE)],
        extra_cflags=flags,
        with_cuda=cuda,
        build_directory=str(build),
        is_python_module=False,
        verbose=verbose,
    )
    _loaded = True
