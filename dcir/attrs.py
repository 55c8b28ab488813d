"""The IR's attribute values beside numbers, strings and lists: ``UNIT`` (``{trainable}``), a
``SymbolRef`` (``@fc1.weight``) and a ``DType`` (``bf16``); below both ``dcir.ir`` and the printer."""

from __future__ import annotations

import math
from dataclasses import dataclass


class Unit:
    """The value of a present-but-valueless attribute: ``{trainable}``."""

    _instance: "Unit | None" = None

    def __new__(cls) -> "Unit":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNIT"


UNIT = Unit()


@dataclass(frozen=True, slots=True)
class SymbolRef:
    """A reference to a module-level symbol used as an attribute value: ``@fc1.weight``."""

    name: str


@dataclass(frozen=True, slots=True)
class DType:
    """An element type used as an attribute value: ``{dtype = bf16}``."""

    name: str


#: An attribute value: int, float, str, bool, None, UNIT, SymbolRef, DType or a tuple of them.
Attr = object


def attr_key(value: Attr) -> object:
    """A comparison key that tells ``1``, ``1.0`` and ``true`` apart (Python does not)."""
    if isinstance(value, tuple):
        return ("list", tuple(attr_key(v) for v in value))
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)
