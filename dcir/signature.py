"""What passes between a module's functions, as their signatures declare it.

Each argument and result of a function with a role carries one *kind* in its attribute
dict (``dcir/roles.py`` says which kinds each role takes, in which order):

===============  ======================================================================
kind             meaning
===============  ======================================================================
``{input = N}``  an argument of the model's call: ``"args[0]"`` or a keyword (``labels``);
                 a bare ``{input}`` is the next positional argument
``{output}``     a value the model returns (``forward``, ``eval``), in the order of the
                 flattened output (``torch.utils._pytree``)
``{saved}``      a value ``forward`` keeps for the backward: its k-th saved result is
                 each backward's k-th saved argument
``{grad = K}``   the gradient of ``forward``'s output K (its tangent); an output that
                 needs none (an integer, a value without grad) has no ``grad``
``{state}``      optimizer state carried between functions (``offload``): the last
                 backward's state results are ``step``'s arguments, ``step``'s results
                 the next ``forward``'s state arguments
``{input_grad    a backward's result: the gradient of ``forward``'s K-th ``{input}``
= K}``           argument (a graph-break region's input computed by the region before
                 it, which needs one)
===============  ======================================================================

The verifier checks these declarations (``dcir/verifier/signatures.py``); passes, the
memory and cost models and the Engine read them through this module.
"""

from __future__ import annotations

from dcir.ir import UNIT, Function, Value

INPUT, OUTPUT, SAVED, GRAD, STATE, INPUT_GRAD = "input", "output", "saved", "grad", "state", "input_grad"
KINDS = (INPUT, OUTPUT, SAVED, GRAD, STATE, INPUT_GRAD)


def kind(attrs: dict) -> str | None:
    """The kind an argument's or result's attributes declare (the first, if several)."""
    return next((k for k in KINDS if k in attrs), None)


def args(func: Function, k: str) -> list[Value]:
    """``func``'s arguments of kind ``k``, in order."""
    return [a for a, d in zip(func.args, func.arg_attrs) if k in d]


def results(func: Function, k: str) -> list[Value]:
    """The values ``func`` returns as kind ``k``, in order."""
    return [v for v, d in zip(func.returns, func.result_attrs) if k in d]


def result_indices(func: Function, k: str) -> list[int]:
    return [i for i, d in enumerate(func.result_attrs) if k in d]


def input_names(func: Function) -> list[str]:
    """What each ``input`` argument is in the model's call: ``args[0]``, ``labels``; a
    bare ``{input}`` is the next positional argument."""
    out, k = [], 0
    for d in func.arg_attrs:
        if INPUT in d:
            named = isinstance(d[INPUT], str)
            out.append(d[INPUT] if named else f"args[{k}]")
            k += not named
    return out


def grads(func: Function) -> list[tuple[Value, int]]:
    """``func``'s ``grad`` arguments with the output each is the gradient of."""
    return [(a, d[GRAD]) for a, d in zip(func.args, func.arg_attrs) if GRAD in d]


def input_grads(func: Function) -> list[tuple[Value, int]]:
    """``func``'s ``input_grad`` results with the ``forward`` input each is the gradient of."""
    return [(v, d[INPUT_GRAD]) for v, d in zip(func.returns, func.result_attrs) if INPUT_GRAD in d]


def saved_pairs(forward: Function, backward: Function) -> list[tuple[Value, Value]]:
    """(what ``forward`` returns as saved, the ``backward`` argument it arrives as)."""
    return list(zip(results(forward, SAVED), args(backward, SAVED)))


def first_grad(func: Function) -> int:
    """Where ``func``'s ``grad`` arguments start (its saved arguments end there)."""
    return next((i for i, d in enumerate(func.arg_attrs) if GRAD in d), len(func.args))


def mark(k: str, value=UNIT) -> dict:
    """The attribute dict of one argument or result of kind ``k``."""
    return {k: value}
