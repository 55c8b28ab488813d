"""Gradients: only a trainable parameter has a gradient; it is reduced across ranks
exactly once (when the module runs on more than one rank; with a mesh, over each of its
dimensions exactly once, for example reduce-scattered over "local" and all-reduced over
"nodes") before the ``gradient`` op
hands it to the optimizer; and each optimizer step gets it exactly once, from the
final backward (see ``roles``)."""

from __future__ import annotations

from dcir import ops as registry
from dcir import roles
from dcir.verifier.checker import Checker


class Gradients(Checker):
    def __init__(self, report, module):
        super().__init__(report, module)
        self.handed = {}  # function -> parameter -> the gradient ops handing it over

    def function(self, f) -> None:
        self.func = f.name
        self.reductions = {}  # value -> the mesh dimensions it was reduced over ("" : the world), in order
        self.stored = {}  # symbol -> those of what this function wrote into it (param.add of a reduced shard)

    def effects(self, op, d, ok: bool) -> None:
        if d is not None and registry.GRADIENT in d.traits and op.symbol in self.m.decls:
            self.handed.setdefault(self.func, {}).setdefault(op.symbol, []).append(op)
        if not ok:
            return
        # a reduce collective adds its dimensions; everything else keeps the most of its inputs
        if self.reductions or registry.REDUCES in d.traits:
            self._count(op, d)
        if registry.GRADIENT in d.traits:
            self._reduced_once(op, self.reductions.get(op.operands[0], ()))

    def _count(self, op, d) -> None:
        if registry.WAITS in d.traits:
            for v, r in zip(op.operands, op.results):
                self.reductions[r] = self.reductions.get(v, ())
            return
        dims = max((self.reductions.get(v, ()) for v in op.operands), key=len, default=())
        if registry.LOADS_STATE in d.traits:  # what this function wrote there, read back
            dims = self.stored.get(op.symbol, ())
        if registry.REDUCES in d.traits:
            group = op.attrs.get("group")
            dims = dims + ((group,) if group is not None else tuple(self.m.mesh) or ("",))
        if dims and registry.WRITES_STATE in d.traits and op.symbol is not None:
            self.stored[op.symbol] = max(self.stored.get(op.symbol, ()), dims, key=len)
        if dims:
            for r in op.results:
                self.reductions[r] = dims

    def _reduced_once(self, op, dims: tuple) -> None:
        decl = self.m.decls[op.symbol]
        if not decl.trainable:
            what = "a buffer" if decl.kind == "buffer" else "a frozen parameter (no 'trainable')"
            self.report.op_error(op, f"grad.set of @{decl.name}, which is {what}; only trainable parameters have "
                                     "gradients")
            return
        ws, mesh = self.m.world_size or 1, self.m.mesh
        twice = next((dim for k, dim in enumerate(dims) if dim in dims[:k]), None)
        if twice is not None and not mesh:
            self.report.op_error(op, f"the gradient of @{decl.name} is reduced across ranks {len(dims)} times; it "
                                     "must be reduced exactly once")
        elif twice is not None:
            self.report.op_error(op, f"the gradient of @{decl.name} is reduced over \"{twice}\" twice; it must be "
                                     "reduced over each mesh dimension exactly once")
        elif not dims and ws > 1:
            self.report.op_error(op, f"the gradient of @{decl.name} is not reduced across ranks (world_size = {ws}); "
                                     "reduce_scatter or all_reduce it before grad.set")
        elif mesh and any(dim not in dims and n > 1 for dim, n in mesh.items()):  # a dimension of 1: nothing to reduce
            left = [dim for dim, n in mesh.items() if dim not in dims and n > 1]
            self.report.op_error(op, f"the gradient of @{decl.name} is not reduced over \"{left[0]}\"; reduce it "
                                     "over each mesh dimension before grad.set")

    def end_module(self) -> None:
        """Each trainable parameter gets one gradient per optimizer step: the final
        backward hands it over exactly once. The backwards are alternatives (each runs
        alone in its micro-step), so the count is per function."""
        last = roles.last_micro_step(self.m.functions.values(), roles.BACKWARD)
        final = last.name if last is not None else None
        training = last is not None
        for decl in self.m.decls.values():
            if not decl.trainable:
                continue
            if training and not self.handed.get(final, {}).get(decl.name):
                self.report.error(f"trainable parameter @{decl.name} never gets a gradient: @{final} must grad.set "
                                  "it exactly once (or drop 'trainable' to freeze it)",
                                  self.report.loc(decl), len(decl.kind))
            self._handed_once(decl.name)

    def _handed_once(self, name: str) -> None:
        for func, per in self.handed.items():  # within one backward: once
            sets = per.get(name, [])
            for extra in sets[1:] if roles.hands_gradients(self.m.functions[func]) else ():
                self._twice(extra, name, sets[0])
        # in any other function: a second hand-over (or, without a backward, a second one)
        first = next((per[name][0] for func, per in self.handed.items()
                      if roles.hands_gradients(self.m.functions[func]) and per.get(name)), None)
        others = [op for func, per in self.handed.items() if not roles.hands_gradients(self.m.functions[func])
                  for op in per.get(name, [])]
        for extra in others if first is not None else others[1:]:
            self._twice(extra, name, first or others[0])

    def _twice(self, extra, name: str, first) -> None:
        self.report.op_error(extra, f"the gradient of @{name} is handed to the optimizer twice",
                             (self.report.op_note(first, "first grad.set here"),))
