"""Function roles: what each function of a module is for, declared once.

A function declares its role in the text (``func @forward(...) -> (...) role forward``)
and what passes through each argument and result (``dcir/signature.py``). What a role
means to the memory and cost models and the passes lives here, as data, so that they
ask this table instead of spelling function names. A new role is one row here plus the
code that runs it (the Engine); the memory and cost models follow from its fields.

=================  ====================================================================
field              meaning
=================  ====================================================================
``runs``           when it runs: ``"micro_step"`` (every micro-step), ``"step"`` (once
                   per optimizer step), ``"call"`` (when the user calls it: ``eval``)
``last_only``      runs on the last micro-step only, in place of ``replaces``
``replaces``       the role it stands in for on the last micro-step
``args``           the signature kinds its arguments may have, in the order they come
``results``        the signature kinds its results may have, in the order they come
``gradients``      hands gradients to the optimizer (``grad.set``)
``order``          position within one optimizer step, for memory accounting and for
                   reading a module in the order it runs
=================  ====================================================================

The kinds (``dcir/signature.py``): ``input`` (a model input), ``output`` (a model
output), ``saved`` (a value ``forward`` keeps for the backward), ``grad`` (the gradient
of one of ``forward``'s outputs), ``state`` (optimizer state carried between a backward,
``step`` and the next ``forward``: ``offload``), ``input_grad`` (the gradient of one of
``forward``'s inputs: a graph-break region's).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    name: str
    runs: str  # "micro_step", "step" or "call"
    order: int
    args: tuple[str, ...] = ()
    results: tuple[str, ...] = ()
    last_only: bool = False
    replaces: str | None = None
    gradients: bool = False

    @property
    def takes_saved(self) -> bool:
        """Its arguments include the values ``forward`` saved: the memory model shares
        their storage with ``forward``'s results."""
        return "saved" in self.args

    @property
    def saves(self) -> bool:
        return "saved" in self.results


FORWARD, BACKWARD, BACKWARD_LAST, STEP, UNSHARD, EVAL = (
    "forward", "backward", "backward_last", "step", "unshard", "eval")

ROLES: dict[str, Role] = {r.name: r for r in [
    # gathers the parameters kept whole across micro-steps (unshard, zero2), before the first
    Role(UNSHARD, runs="step", order=0),
    Role(FORWARD, runs="micro_step", order=1, args=("input", "state"), results=("output", "saved")),
    Role(BACKWARD, runs="micro_step", order=2, args=("saved", "grad"), results=("input_grad", "state"),
         gradients=True),
    # the last micro-step's backward (zero1 reduces there once; offload reloads there)
    Role(BACKWARD_LAST, runs="micro_step", order=2, args=("saved", "grad"), results=("input_grad", "state"),
         last_only=True, replaces=BACKWARD, gradients=True),
    # the optimizer's update at the accumulation boundary (offload)
    Role(STEP, runs="step", order=3, args=("state",), results=("state",)),
    # a forward without a backward (engine.eval() under torch.no_grad()): saves nothing
    Role(EVAL, runs="call", order=4, args=("input",), results=("output",)),
]}


def role(func) -> Role | None:
    """The role ``func`` (a Function) declares, or None for a plain function (or an
    undeclared role, which the verifier reports)."""
    return ROLES.get(func.role) if func.role is not None else None


def runs_per_step(func, functions, micro_steps: int) -> int:
    """How many times ``func`` runs per optimizer step, given the module's ``functions``
    (Function objects; a role stood in for on the last micro-step runs once less). A
    function with no role, and ``eval``, count once."""
    r = role(func)
    if r is None or r.runs != "micro_step" or r.last_only:
        return 1
    replaced = any((o := role(f)) is not None and o.replaces == r.name for f in functions)
    return micro_steps - 1 if replaced else micro_steps


def runs_per_micro_step(func) -> bool:
    """Whether ``func`` runs within micro-steps (forward and backwards)."""
    r = role(func)
    return r is not None and r.runs == "micro_step"


def takes_saved(func) -> bool:
    """Whether ``func`` takes ``forward``'s saved values."""
    r = role(func)
    return r is not None and r.takes_saved


def saver(functions):
    """The function that saves values for the others (``forward``), if present."""
    return next((f for f in functions if (r := role(f)) is not None and r.saves), None)


def hand_off(functions) -> tuple | None:
    """The function that saves values and those that take them (``forward`` and its
    backwards), or None when the module has no such pair: what a pass that changes how
    saved values travel rewrites."""
    functions = list(functions)
    fw, takers = saver(functions), [f for f in functions if takes_saved(f)]
    return (fw, takers) if fw is not None and takers else None


def last_micro_step(functions, name: str):
    """The function that runs in place of the role ``name`` on the last micro-step, when
    the module has one (``backward`` -> ``backward_last``), else the one of role
    ``name`` itself; None when neither is present."""
    functions = list(functions)
    return (next((f for f in functions if (r := role(f)) is not None and r.replaces == name), None)
            or next((f for f in functions if f.role == name), None))


def in_order(functions) -> list:
    """``functions`` in the order one optimizer step runs them (functions without a role
    last, in their given order)."""
    funcs = list(functions)
    return sorted(funcs, key=lambda f: (role(f).order if role(f) else len(ROLES), funcs.index(f)))


def hands_gradients(func) -> bool:
    """Whether ``func`` hands gradients to the optimizer (a backward)."""
    r = role(func)
    return r is not None and r.gradients
