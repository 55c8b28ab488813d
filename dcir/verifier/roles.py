"""What the verifier assumes about function names, in one place.

A training module's backward is ``@backward``, with ``@backward_last`` as the
alternative that runs in the last micro-step of gradient accumulation. Until function
roles are declared in the language, these names are the declaration; a checker that
needs a function's role asks here. When ``dcir/roles.py`` (the role table issue 18
adds) is on main, these become ``roles.last_micro_step(module.functions, BACKWARD)``
and ``roles.role(name).gradients``.
"""

from __future__ import annotations

from dcir.ir import Module

#: functions that hand gradients to the optimizer; each runs alone in its micro-step
BACKWARDS = ("backward", "backward_last")


def final_backward(module: Module) -> str:
    """The backward of the last micro-step, which hands every gradient over (it need
    not exist: a module without it is not a training step)."""
    return "backward_last" if "backward_last" in module.functions else "backward"


def is_backward(name: str) -> bool:
    return name in BACKWARDS
