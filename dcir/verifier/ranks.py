"""Ranks and collective order: an op with a ``ranks`` attribute runs only on those
ranks. A ``collective`` op never does, unless it runs over a dimension of the module's
mesh and is restricted to whole groups of it; and no op may read a value that only
some of the ranks it runs on have. So the ranks of every group issue the same
collectives on it in the same order (no deadlock)."""

from __future__ import annotations

from dcir import mesh
from dcir import ops as registry
from dcir.verifier.checker import Checker


def _ranks(op) -> tuple | None:
    """The ranks an op is restricted to, if its ``ranks`` attribute is well formed."""
    ranks = op.attrs.get("ranks")
    return ranks if isinstance(ranks, tuple) and ranks and all(isinstance(r, int) for r in ranks) else None


class Ranks(Checker):
    def function(self, f) -> None:
        self.restricted = {}  # value -> the ranks that have it

    def operand(self, op, d, k: int, v) -> bool:
        have = self.restricted.get(v)
        if have is None:
            return True
        if d is not None and registry.COLLECTIVE in d.traits and "ranks" not in op.attrs:
            self.report.operand_error(op, k, f"collective {op.name} reads %{v.name}, which only ranks {list(have)} "
                                             "compute; every rank must contribute the same collective",
                                      (self.report.def_note(v),))
            return False
        op_ranks = _ranks(op)
        if op_ranks is None or not set(op_ranks) <= set(have):
            who = "every rank" if op_ranks is None else f"ranks {list(op_ranks)}"
            self.report.operand_error(op, k, f"%{v.name} exists only on ranks {list(have)}, but {op.name} runs on "
                                             f"{who}", (self.report.def_note(v),))
            return False
        return True

    def op(self, op, d, ok: bool) -> bool:
        if "ranks" not in op.attrs:  # most ops: checked here, as this runs for every op
            return ok
        op_ranks = _ranks(op)
        if op_ranks is None or d is None or registry.COLLECTIVE not in d.traits:
            return ok
        group = op.attrs.get("group")
        if group not in self.m.mesh:
            self.report.op_error(op, f"collective {op.name} is restricted to ranks {list(op_ranks)}; every rank "
                                     "must issue the same collectives in the same order")
            return False
        for ranks in mesh.groups(self.m.mesh, group):  # every rank of a group, or none of it
            left = sorted(set(ranks) - set(op_ranks))
            if len(left) < len(ranks):
                if left:
                    self.report.op_error(op, f"collective {op.name} over \"{group}\" runs on ranks "
                                             f"{sorted(set(ranks) & set(op_ranks))} but not on {left} of the same group "
                                             f"{list(ranks)}: collectives on that group could run in different orders "
                                             "on its ranks (restrict a collective to whole groups)")
                    return False
        return ok

    def effects(self, op, d, ok: bool) -> None:
        ranks = _ranks(op) if ok and "ranks" in op.attrs else None
        if ranks is not None:
            for r in op.results:
                self.restricted[r] = ranks
