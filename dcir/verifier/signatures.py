"""Signatures: each function's declared role is one ``dcir/roles.py`` knows, at most one
function declares it, and its arguments and results each declare one kind the role
takes, in the role's order (``dcir/signature.py``). Between functions, the hand-offs
agree: each backward's ``{saved}`` arguments are ``forward``'s ``{saved}`` results in
number and type; each ``{grad = K}`` is the gradient of ``forward``'s output K, of its
type, once; each ``{input_grad = K}`` the gradient of ``forward``'s input K, of its
type, once; ``{state}`` travels from the last backward to ``step`` and from ``step`` to
``forward`` in number and type."""

from __future__ import annotations

from dcir import roles, signature
from dcir.ir import UNIT
from dcir.verifier.checker import Checker


class Signatures(Checker):
    def function(self, f) -> None:
        if f.role is None:
            return
        role = roles.ROLES.get(f.role)
        if role is None:
            self.report.error(f"@{f.name} declares the unknown role '{f.role}'; roles are "
                              f"{', '.join(roles.ROLES)}", self.report.loc(f), 4)
            return
        other = next((g for g in self.m.functions.values() if g is not f and g.role == f.role), None)
        if other is not None and list(self.m.functions).index(other.name) < list(self.m.functions).index(f.name):
            self.report.error(f"@{f.name} declares role {f.role}, which @{other.name} declares already",
                              self.report.loc(f), 4)
        self._kinds(f, "argument", f.arg_attrs, role.args)
        self._kinds(f, "result", f.result_attrs, role.results)

    def _kinds(self, f, what: str, attrs: list[dict], allowed: tuple[str, ...]) -> None:
        last = -1
        for k, d in enumerate(attrs):
            kinds = [x for x in signature.KINDS if x in d]
            if len(kinds) != 1 or kinds[0] not in allowed:
                said = " and ".join(kinds) or "no kind"
                self.report.error(f"{what} #{k} of @{f.name} declares {said}; a {f.role} {what} is one of "
                                  f"{', '.join('{' + a + '}' for a in allowed) or 'none'}", self.report.loc(f), 4)
                return
            at = allowed.index(kinds[0])
            if at < last:
                self.report.error(f"{what} #{k} of @{f.name} is {{{kinds[0]}}} after {{{allowed[last]}}}; the "
                                  f"order is {', '.join(allowed)}", self.report.loc(f), 4)
                return
            last = at

    def end_module(self) -> None:
        fw = self.m.role(roles.FORWARD)
        for f in self.m.functions.values():
            r = roles.role(f)
            if r is None or not r.takes_saved or fw is None:  # a backward alone is checked alone
                continue
            self._same(f, "saved", signature.results(fw, signature.SAVED), signature.args(f, signature.SAVED), fw)
            self._grads(f, fw)
            self._input_grads(f, fw)
        step = self.m.role(roles.STEP)
        last = roles.last_micro_step(self.m.functions.values(), roles.BACKWARD)
        if step is not None and last is not None:
            self._same(step, "state", signature.results(last, signature.STATE), signature.args(step, signature.STATE),
                       last)
        if step is not None and fw is not None:
            self._same(fw, "state", signature.results(step, signature.STATE), signature.args(fw, signature.STATE),
                       step)

    def _same(self, f, kind: str, given: list, taken: list, source) -> None:
        if len(given) != len(taken):
            self.report.error(f"@{f.name} takes {len(taken)} {{{kind}}} arguments; @{source.name} hands over "
                              f"{len(given)}", self.report.loc(f), 4)
            return
        for k, (v, a) in enumerate(zip(given, taken)):
            if v.type != a.type:
                self.report.error(f"{{{kind}}} argument %{a.name} of @{f.name} has type {a.type}; @{source.name} hands "
                                  f"over {v.type} there (#{k})", self.report.loc(f), 4)

    def _grads(self, f, fw) -> None:
        self._gradients(f, fw, signature.grads(f), signature.results(fw, signature.OUTPUT), "of", "output",
                        signature.GRAD)

    def _input_grads(self, f, fw) -> None:
        self._gradients(f, fw, signature.input_grads(f), signature.args(fw, signature.INPUT), "returned by",
                        "input", signature.INPUT_GRAD)

    def _gradients(self, f, fw, pairs, targets: list, how: str, what: str, kind: str) -> None:
        """Each ``(value, K)`` of ``pairs`` is the gradient of ``targets[K]`` (``forward``'s
        K-th ``what``): one of them, of its type, once."""
        seen = set()
        for v, k in pairs:
            who = f"%{v.name} {how} @{f.name}"
            if k is UNIT or not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < len(targets):
                self.report.error(f"{who} is the gradient of {what} {k}; @{fw.name} has {len(targets)} {what}s "
                                  f"(write {{{kind} = K}}, K from 0)", self.report.loc(f), 4)
            elif k in seen:
                self.report.error(f"{who} is a second gradient of {what} {k}", self.report.loc(f), 4)
            elif v.type != targets[k].type:
                self.report.error(f"{who} is the gradient of {what} {k}, of type {targets[k].type}, but has type "
                                  f"{v.type}", self.report.loc(f), 4)
            seen.add(k)
