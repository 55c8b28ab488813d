"""``python -m dcir_runtime.native_build [--check] [--variant cuda]``: build and load
DCIR's C++ runtime and say which variant was made and why (``dcir_runtime.native``).

``--check`` is what CI runs in a venv holding a CUDA build of torch, on a machine
without a GPU: it compiles and links the CUDA/NCCL variant with every compiler
warning in the runtime's source an error, loads it, and resolves every
``torch.ops.dcir`` op; the exit status is nonzero when anything fails.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dcir_runtime.native import VARIANTS, NativeBuildError, load, registered_ops, requested


def check(variant: str, werror: bool = True) -> int:
    """Build ``variant``, load it and resolve every ``torch.ops.dcir`` op with its
    kernels; print what was built and the time. Nonzero when anything fails."""
    begin = time.perf_counter()
    try:
        info = load(verbose=True, variant=variant, werror=werror)
    except NativeBuildError as e:
        print(f"dcir native check: {e}", file=sys.stderr)
        return 1
    except (RuntimeError, OSError) as e:  # the extension builder reports compiler errors so
        print(f"dcir native check: the build failed: {e}", file=sys.stderr)
        return 1
    ops, missing = registered_ops(), []
    for name in ops:
        try:
            getattr(torch.ops.dcir, name).default
        except (AttributeError, RuntimeError):
            missing.append(name)
    if info.variant == "cuda" and not bool(torch.ops.dcir.has_cuda()):
        missing.append("has_cuda() is false in a CUDA build")
    print(f"{info}; {len(ops) - len(missing)} of {len(ops)} torch.ops.dcir ops resolved; "
          f"torch {torch.__version__}; {time.perf_counter() - begin:.1f} s")
    if missing:
        print(f"dcir native check: unresolved: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dcir_runtime.native_build",
                                 description="Build and load DCIR's C++ runtime; say which variant and why.")
    ap.add_argument("--check", action="store_true",
                    help="also resolve every torch.ops.dcir op, and fail on any compiler warning in the source")
    ap.add_argument("--variant", choices=VARIANTS, default=None,
                    help="override $DCIR_NATIVE_BUILD (auto, cpu, cuda)")
    ns = ap.parse_args(argv)
    if ns.check:
        return check(ns.variant or requested())
    try:
        print(load(variant=ns.variant))
    except NativeBuildError as e:
        print(f"dcir native: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
