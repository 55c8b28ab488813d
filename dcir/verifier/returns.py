"""Returns: a function returns as many values as its signature declares, each of the
declared type. (What may not be returned, an undefined, pending or freed value, is
the business of the SSA, async and memory checkers.)"""

from __future__ import annotations

from dcir.verifier.checker import Checker
from dcir.verifier.report import plural


class Returns(Checker):
    def end_function(self, f) -> None:
        if len(f.returns) != len(f.result_types):
            self.report.return_error(f, f"@{f.name} returns {plural(len(f.returns), 'value')}, but its signature "
                                        f"declares {len(f.result_types)}")
            return
        for k, (v, t) in enumerate(zip(f.returns, f.result_types)):
            if v.owner is not None and v.type != t:
                self.report.return_error(f, f"return value #{k} %{v.name} has type {v.type}, but @{f.name} declares "
                                            f"{t}", (self.report.def_note(v),))
