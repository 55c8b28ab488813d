"""Sharding: compute ops see only full device values, never a shard or a host value;
every shard (declared or computed) is split across exactly ``world_size`` ranks, or,
split over a dimension of the module's mesh (``shard<T, local=2>``), across its size."""

from __future__ import annotations

from dcir import ops as registry
from dcir.ir import HostType, PendingType, ShardType
from dcir.verifier.checker import Checker


class Sharding(Checker):
    def module(self) -> None:
        self.ws = self.m.world_size  # read once: the walk never changes the module
        self.mesh = self.m.mesh
        for d in self.m.decls.values():
            held = d.type.inner if isinstance(d.type, HostType) and d.kind == "buffer" else d.type
            problem = self._split(held) if isinstance(held, ShardType) else None
            if problem:
                self.report.error(f"@{d.name} {problem}", self.report.loc(d), len(d.kind))

    def _split(self, t: ShardType) -> str | None:
        """Why shards of type ``t`` cannot be, in this module (None: they can)."""
        if t.over is not None and t.over not in self.mesh:
            dims = ", ".join(self.mesh) or "none: mesh.<dim> = <size> attributes declare them"
            return f"is split over \"{t.over}\", which is not a dimension of the module's mesh ({dims})"
        if t.over is not None and t.parts != self.mesh[t.over]:
            return f"is split into {t.parts} shards over \"{t.over}\", which has {self.mesh[t.over]} ranks"
        if t.over is None and self.ws is not None and t.parts != self.ws:
            return f"is split into {t.parts} shards, but the module runs on world_size = {self.ws} ranks"
        return None

    def operand(self, op, d, k: int, v) -> bool:
        if d is None or registry.COMPUTE not in d.traits:
            return True
        if isinstance(v.type, ShardType):
            self.report.operand_error(op, k, f"{op.name} computes on %{v.name}, a shard; compute needs the full value "
                                             "(comm.all_gather it, then comm.wait)", (self.report.def_note(v),))
            return False
        if isinstance(v.type, HostType):
            self.report.operand_error(op, k, f"{op.name} computes on %{v.name}, which is in host memory; "
                                             "mem.reload it first", (self.report.def_note(v),))
            return False
        return True

    def op(self, op, d, ok: bool) -> bool:
        """The parts of every shard a well-typed op defines (its type rule has run)."""
        if not ok:
            return ok
        for r in op.results:
            inner = r.type
            while isinstance(inner, (PendingType, HostType)):
                inner = inner.inner
            problem = self._split(inner) if isinstance(inner, ShardType) else None
            if problem:
                self.report.result_error(r, f"%{r.name} {problem}")
        return ok
