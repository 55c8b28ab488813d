"""Element types for mixed precision: their names.

Users name dtypes the way FSDP2 and DeepSpeed do (``"bfloat16"``, ``"float32"``, the
names of ``torch.dtype``); the IR spells them short (``bf16``, ``f32``). Both spellings
are accepted everywhere a dtype is configured, and an unknown one is an error that lists
the valid ones.
The verifier's dtype rules are its ``dtypes`` checker (``dcir/verifier/dtypes.py``).
"""

from __future__ import annotations

#: The floating dtypes a precision policy may name: torch's name -> the IR's spelling.
FLOAT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
#: torch's other names of the same dtypes (``torch.half`` is ``torch.float16``)
_ALIASES = {"float": "f32", "half": "f16", "double": "f64"}


def parse_dtype(name: object) -> str:
    """A floating dtype in the IR's spelling, from either spelling (``"bfloat16"``,
    ``"bf16"``, ``torch.bfloat16``). Raises ``ValueError`` listing the valid names."""
    text = str(name).removeprefix("torch.")
    short = {**FLOAT_DTYPES, **_ALIASES}.get(text, text)
    if short in FLOAT_DTYPES.values():
        return short
    valid = ", ".join(f"{long} ({s})" for long, s in FLOAT_DTYPES.items())
    raise ValueError(f"unknown dtype {name!r}; valid dtypes: {valid}")


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES.values()
