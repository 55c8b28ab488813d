"""An op's schema as DCIR records it (``Schema``, its ``Arg``s), whether torch's table of aten
ops (``dcir.aten``) or a custom op registered in this process (``dcir.custom_ops``) gave it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Arg:
    name: str
    type: str  # torch's spelling: "Tensor", "Optional[Tensor]", "List[Tensor]", "List[int]", "number", ...
    has_default: bool
    kwarg_only: bool
    alias_set: str | None  # "a" for Tensor(a) / Tensor(a!)
    mutable: bool

    @property
    def is_tensor(self) -> bool:
        return self.type in ("Tensor", "Optional[Tensor]")

    @property
    def is_tensor_list(self) -> bool:
        return self.type in ("List[Tensor]", "List[Optional[Tensor]]")


@dataclass(frozen=True, slots=True)
class Schema:
    name: str  # "aten.addmm.default"
    args: tuple[Arg, ...]
    returns: tuple[Arg, ...]

    @property
    def mutates(self) -> bool:
        return any(a.mutable for a in self.args)

    @property
    def variadic_results(self) -> bool:
        return len(self.returns) == 1 and self.returns[0].is_tensor_list

    def aliased_operand(self, result_index: int) -> str | None:
        """The argument a result aliases (a view of its storage), or None."""
        if self.variadic_results:
            result_index = 0
        if result_index >= len(self.returns):
            return None
        alias = self.returns[result_index].alias_set
        if alias is None:
            return None
        return next((a.name for a in self.args if a.alias_set == alias), None)


def arg_record(a) -> list:
    """The record of a ``torch.Argument`` ``a``: ``Arg``'s fields, in order (what the schema cache holds)."""
    info = a.alias_info
    alias = sorted(info.before_set)[0] if info is not None and info.before_set else None
    return [a.name, str(a.type), bool(a.has_default_value()), bool(a.kwarg_only), alias,
            bool(info is not None and info.is_write)]
