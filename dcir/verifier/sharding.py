"""Sharding: compute ops see only full device values, never a shard or a host value;
every shard (declared or computed) is split across exactly ``world_size`` ranks."""

from __future__ import annotations

from dcir import ops as registry
from dcir.ir import HostType, PendingType, ShardType
from dcir.verifier.checker import Checker


class Sharding(Checker):
    def module(self) -> None:
        self.ws = ws = self.m.world_size  # read once: the walk never changes the module
        for d in self.m.decls.values():
            held = d.type.inner if isinstance(d.type, HostType) and d.kind == "buffer" else d.type
            if isinstance(held, ShardType) and ws is not None and held.parts != ws:
                self.report.error(f"@{d.name} is split into {held.parts} shards, but the module runs on "
                                  f"world_size = {ws} ranks", self.report.loc(d), len(d.kind))

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
        ws = self.ws
        if not ok or ws is None:
            return ok
        for r in op.results:
            inner = r.type
            while isinstance(inner, (PendingType, HostType)):
                inner = inner.inner
            if isinstance(inner, ShardType) and inner.parts != ws:
                self.report.result_error(r, f"%{r.name} is split into {inner.parts} shards, but the module runs on "
                                            f"world_size = {ws} ranks")
        return ok
