"""Function roles: what each function of a module is for, declared once.

A module's functions are named by their role (``@forward``, ``@backward``...). What a
role means to the models and passes lives here, as data, so that the memory model,
the cost model and the passes ask this table instead of spelling function names. A
new role (say, a forward-only inference program) is one row here plus the code
that runs it (the Engine); the memory and cost models follow from its fields.

=================  ====================================================================
field              meaning
=================  ====================================================================
``runs``           when it runs: ``"micro_step"`` (every micro-step), ``"step"`` (once
                   per optimizer step)
``last_only``      runs on the last micro-step only, in place of ``replaces``
``replaces``       the role it stands in for on the last micro-step
``takes_saved``    its leading arguments are the values ``@forward`` saved (the last
                   argument is the loss's tangent), so the memory model shares their
                   storage with ``@forward``'s returns
``saves``          returns ``(loss, *saved)`` for the roles with ``takes_saved``
``gradients``      hands gradients to the optimizer (``grad.set``)
``order``          position within one optimizer step, for memory accounting and for
                   reading a module in the order it runs
=================  ====================================================================

The text syntax does not name roles: a function's name is its role.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    name: str
    runs: str  # "micro_step" or "step"
    order: int
    last_only: bool = False
    replaces: str | None = None
    takes_saved: bool = False
    saves: bool = False
    gradients: bool = False


FORWARD, BACKWARD, BACKWARD_LAST, STEP, UNSHARD = "forward", "backward", "backward_last", "step", "unshard"

ROLES: dict[str, Role] = {r.name: r for r in [
    # gathers the parameters kept whole across micro-steps (unshard, zero2), before the first
    Role(UNSHARD, runs="step", order=0),
    Role(FORWARD, runs="micro_step", order=1, saves=True),
    Role(BACKWARD, runs="micro_step", order=2, takes_saved=True, gradients=True),
    # the last micro-step's backward (zero1 reduces there once; offload reloads there)
    Role(BACKWARD_LAST, runs="micro_step", order=2, last_only=True, replaces=BACKWARD, takes_saved=True,
         gradients=True),
    # the optimizer's update at the accumulation boundary (offload)
    Role(STEP, runs="step", order=3),
]}


def role(name: str) -> Role | None:
    """The role of the function ``name``, or None for a function with no declared role."""
    return ROLES.get(name)


def runs_per_step(name: str, functions, micro_steps: int) -> int:
    """How many times the function ``name`` runs per optimizer step, given the names of
    the module's ``functions`` (a role stood in for on the last micro-step runs once less).
    A function with no role runs once."""
    r = ROLES.get(name)
    if r is None or r.runs == "step":
        return 1
    if r.last_only:
        return 1
    replaced = any(ROLES[f].replaces == name for f in functions if f in ROLES and ROLES[f].last_only)
    return micro_steps - 1 if replaced else micro_steps


def runs_per_micro_step(name: str) -> bool:
    """Whether the function ``name`` runs within micro-steps (forward and backwards)."""
    r = ROLES.get(name)
    return r is not None and r.runs == "micro_step"


def takes_saved(name: str) -> bool:
    """Whether the function ``name`` takes ``@forward``'s saved values."""
    r = ROLES.get(name)
    return r is not None and r.takes_saved


def saver(functions) -> str | None:
    """The name of the function that saves values for the others (``forward``), if present."""
    return next((f for f in functions if f in ROLES and ROLES[f].saves), None)


def last_micro_step(functions, name: str) -> str:
    """The function that runs in place of ``name`` on the last micro-step, when the
    module has one (``backward`` -> ``backward_last``), else ``name`` itself."""
    return next((f for f in functions if f in ROLES and ROLES[f].replaces == name), name)


def in_order(functions) -> list[str]:
    """The names of ``functions`` in the order one optimizer step runs them (functions
    without a role last, in their given order)."""
    names = list(functions)
    return sorted(names, key=lambda f: (ROLES[f].order if f in ROLES else len(ROLES), names.index(f)))


def hands_gradients(name: str) -> bool:
    """Whether the function ``name`` hands gradients to the optimizer (a backward)."""
    r = ROLES.get(name)
    return r is not None and r.gradients

