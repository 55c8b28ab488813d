"""From PyTorch to DCIR (``frontend``: capture and lowering of a training step)."""

from dcir_lowering.frontend import compile_to_ir

__all__ = ["compile_to_ir"]
