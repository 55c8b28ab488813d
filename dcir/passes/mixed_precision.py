"""Mixed precision: fp32 master parameters, compute in ``param_dtype``, gradients
reduced in ``reduce_dtype``; every cast an explicit ``mem.cast``.

The policy is FSDP2's ``MixedPrecisionPolicy``. The input is a step captured with its
parameters in ``param_dtype`` (``compile_to_ir(..., param_dtype=torch.bfloat16)``, which
the Engine does): its compute is already what bf16 eager PyTorch runs, op for op, and
its parameters are declared in bf16. The pass gives every floating parameter fp32
storage (the master weights the optimizer updates; its state follows their dtype) and
places the casts where they pay:

* a parameter read is cast down right after it is read. When the read is a shard
  (after ``zero3``), the shard is cast before its ``comm.all_gather``, so the gather
  moves ``param_dtype`` bytes (half of fp32 for bf16); the cast shard is freed once
  the gather is done;
* a gradient is cast to ``reduce_dtype`` before its reduction (``comm.reduce_scatter``
  or ``comm.all_reduce``), so the ranks sum in that dtype, and the reduced gradient is
  cast to fp32 before ``grad.set`` when ``reduce_dtype`` is not fp32: the optimizer
  always sees fp32 gradients. The cast copy is freed after the reduction's wait; the
  gradient itself right after the cast, when the reduction was its last reader;
* ``zero1``'s gradient accumulators hold ``reduce_dtype`` when it is wider than
  ``param_dtype``, so the micro-steps' gradients are summed in it (``param.add`` of a
  bf16 gradient into an fp32 accumulator).

Run it after the ZeRO stage's pass: the casts then sit next to the collectives that
pass placed. (Run before, it would cast after the gather, which moves fp32 bytes.)

Before -> after (``zero3`` on 2 ranks, then ``mixed_precision{param_dtype=bf16}``)::

    param @fc.weight : shard<bf16[4, 8], 2> {trainable}
    %w_shard = param.get @fc.weight : shard<bf16[4, 8], 2>
    %w_pending = comm.all_gather(%w_shard) : pending<bf16[4, 8]>
    ...
    %g_pending = comm.reduce_scatter(%g) {op = "avg"} : pending<shard<bf16[4, 8], 2>>
    %g_shard = comm.wait(%g_pending) : shard<bf16[4, 8], 2>
    grad.set @fc.weight(%g_shard)
  ->
    param @fc.weight : shard<f32[4, 8], 2> {trainable}
    %w_shard_f32 = param.get @fc.weight : shard<f32[4, 8], 2>
    %w_shard = mem.cast(%w_shard_f32) {dtype = bf16} : shard<bf16[4, 8], 2>
    %w_pending = comm.all_gather(%w_shard) : pending<bf16[4, 8]>
    %w = comm.wait(%w_pending) : bf16[4, 8]
    mem.free(%w_shard)
    ...
    %g_f32 = mem.cast(%g) {dtype = f32} : f32[4, 8]
    mem.free(%g)
    %g_pending = comm.reduce_scatter(%g_f32) {op = "avg"} : pending<shard<f32[4, 8], 2>>
    %g_shard = comm.wait(%g_pending) : shard<f32[4, 8], 2>
    mem.free(%g_f32)
    grad.set @fc.weight(%g_shard)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import analysis
from dcir import ops as registry
from dcir.buffers import GRAD_ACC_OF
from dcir.context import PlanContext
from dcir.diagnostics import DcirError, Diagnostic
from dcir.dtypes import is_float, parse_dtype
from dcir.ir import DTYPE_BYTES, DType, Function, Module, Op, ShardType, Value, retyped
from dcir.passes import Pass
from dcir.passes.free import FreePlacer
from dcir.rewrite import EDITED, Constraint, Match, P, Rewriter, Rule, apply_rules

#: the dtype of the master parameters (and so of the optimizer state and the gradients it sees)
MASTER = "f32"


# ---- the edits: every change goes through the rewriter ---------------------------------


class _Edit:
    """The rewriter of one function, with what this pass's rewrites read: fresh names,
    the ops' original order, the placer of its frees (``dcir.passes.free``) and the
    values sharing each storage (a base and its views)."""

    def __init__(self, func: Function):
        self.func = func
        self.rewriter = Rewriter(func)
        self.fresh = func.name_maker()
        self.order = {op: i for i, op in enumerate(func.ops)}
        self.frees = FreePlacer(func)
        self.sharing: dict[Value, list[Value]] = {}
        for view, base in self.frees.bases.items():
            self.sharing.setdefault(base, [base]).append(view)

    def first_user(self, value: Value) -> Op | None:
        users = [u for u in value.users() if u in self.order]
        return min(users, key=self.order.__getitem__, default=None)

    def cast(self, value: Value, dtype: str, at: Op, name: str | None = None) -> Value:
        """A ``mem.cast`` of ``value`` to ``dtype``, inserted before ``at``; its result."""
        out = Value(name or self.fresh(f"{value.name}_{dtype}"), retyped(value.type, dtype))
        self.rewriter.insert_before(at, [Op("mem.cast", [value], [out], {"dtype": DType(dtype)})])
        return out

    def free_when_done(self, value: Value, reader: Op) -> None:
        """Free ``value`` once ``reader`` is done reading it (after its wait, when it is async)."""
        self.frees.release(self.rewriter, value, after=reader)

    def free_at_cast(self, value: Value, was_read_by: Op) -> None:
        """``was_read_by`` (an async op, reading until its wait) reads a cast of ``value``
        now, inserted right before it: when nothing else read ``value``'s storage after
        that, its free moves up to just after the cast, its last reader now."""
        base = self.frees.bases.get(value, value)
        readers = [u for v in self.sharing.get(base, [base]) for u in v.users() if u in self.order]
        free = next((u for u in readers if registry.has_trait(u, registry.FREES)), None)
        if free is not None and all(self.order[u] < self.order[was_read_by] for u in readers if u is not free):
            self.rewriter.move_before(free, was_read_by)

    def set_operand(self, op: Op, index: int, value: Value) -> None:
        self.rewriter.set_operands(op, [value if k == index else v for k, v in enumerate(op.operands)])

    def retype(self, value: Value, dtype: str) -> None:
        """``value`` holds ``dtype`` now (its readers are this pass's to keep consistent)."""
        value.type = retyped(value.type, dtype)


# ---- the rewrites ----------------------------------------------------------------------


def cast_parameter_read(m: Match) -> object:
    """%w = param.get @p : bf16  ->  %w_f32 = param.get @p : f32; %w = mem.cast(%w_f32)
    {dtype = bf16} before the first use of %w; mem.free(%w) once that use is done when
    it is a gather (the gathered copy is what compute reads)."""
    edit, op, policy, stats = m["edit"], m.root, m["policy"], m["stats"]
    low = op.results[0]
    master = Value(edit.fresh(f"{low.name}_{MASTER}"), retyped(low.type, MASTER))
    edit.rewriter.insert_before(op, [Op(op.name, [], [master], op.attrs, op.symbol, op.loc, op.parens)])
    first = edit.first_user(low)
    if first is None:  # an unused read: the master read replaces it
        edit.rewriter.erase(op)
        return EDITED
    name, users = low.name, low.users()
    low.name = edit.fresh(f"{name}_unused")
    cast = edit.cast(master, policy.param_dtype, first, name=name)
    edit.rewriter.replace_all_uses(low, cast)
    edit.rewriter.erase(op)
    if isinstance(cast.type, ShardType) and len(users) == 1 and registry.has_trait(first, registry.COLLECTIVE):
        edit.free_when_done(cast, first)
    stats["parameter reads cast to " + policy.param_dtype] += 1
    return EDITED


def cast_gradient(m: Match) -> object:
    """grad.set @p(%g_shard) of a reduced gradient: the reduction's operand %g is cast to
    reduce_dtype before it (the copy freed after its wait, %g after the cast when the
    reduction was its last reader), the reduction's results retyped;
    then %g_shard is cast to f32 before grad.set when it is not f32 already."""
    edit, op, policy, stats = m["edit"], m.root, m["policy"], m["stats"]
    grad = op.operands[0]
    reduction = _reduction_of(grad)
    if reduction is not None:
        start, k = reduction
        if start.operands[k].type.dtype != policy.reduce_dtype:
            low = start.operands[k]
            edit.set_operand(start, k, edit.cast(low, policy.reduce_dtype, start))
            edit.free_when_done(start.operands[k], start)
            edit.free_at_cast(low, start)
            stats["gradients reduced in " + policy.reduce_dtype] += 1
        reduced = start.operands[k].type.dtype  # (an accumulated sum may be in reduce_dtype already)
        edit.retype(start.results[k], reduced)
        edit.retype(grad, reduced)
    if grad.type.dtype != MASTER:
        edit.set_operand(op, 0, edit.cast(grad, MASTER, op))
        stats["gradients cast to " + MASTER] += 1
    return EDITED


def accumulate_in_reduce_dtype(func: Function, accumulators: set[str], dtype: str, stats: Counter) -> None:
    """zero1's gradient accumulators hold ``dtype`` (fp32: the micro-steps' gradients
    are summed in fp32, as FSDP2 accumulates them after an fp32 reduction): ``param.add``
    adds a bf16 gradient into one, and each read of one is retyped, so the reduction of
    the sum runs in ``dtype`` with no cast."""
    for op in func.ops:
        if registry.has_trait(op, registry.LOADS_STATE) and op.symbol in accumulators:
            op.results[0].type = retyped(op.results[0].type, dtype)
            stats["gradient accumulator ops in " + dtype] += 1


def _reduction_of(grad: Value) -> tuple[Op, int] | None:
    """(the reducing collective, the index of ``grad``'s pending value among its results) when
    ``grad`` is the result of a wait on a reduction that nothing else reads, else None."""
    started = analysis.started_by(grad)
    if started is None or not registry.has_trait(started[0], registry.REDUCES):
        return None
    if len(grad.uses) != 1:  # one reader, the grad.set (a return is a use too)
        return None
    return started


def _converted(m: Match) -> bool:
    decl = m.module.decls.get(m.root.symbol)
    return decl is not None and decl.kind == "param" and is_float(decl.type.dtype)


def _low_read(m: Match) -> bool:
    """A read in ``param_dtype`` (not the master read the rule makes, and not a parameter
    the policy leaves alone)."""
    low = m.root.results[0]
    return low.type.dtype == m["policy"].param_dtype != MASTER


CONVERTED = Constraint("a floating parameter", _converted)
RULES = [
    # param.get of a bf16 parameter -> f32 master read, cast down before its first use
    Rule(P(trait=registry.LOADS_STATE), cast_parameter_read, (CONVERTED, Constraint("read in param_dtype", _low_read)),
         name="cast parameter read", dead_too=True),
    # grad.set of a bf16 gradient -> reduce in reduce_dtype, hand f32 to the optimizer
    Rule(P(trait=registry.GRADIENT), cast_gradient, (CONVERTED,), name="cast gradient", dead_too=True),
]


@dataclass(frozen=True)
class MixedPrecision(Pass):
    name = "mixed_precision"
    param_dtype: str = "bf16"
    reduce_dtype: str = "f32"

    def __post_init__(self):
        object.__setattr__(self, "param_dtype", parse_dtype(self.param_dtype))
        object.__setattr__(self, "reduce_dtype", parse_dtype(self.reduce_dtype))

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        if self.param_dtype == MASTER and self.reduce_dtype == MASTER:
            return  # full precision: nothing to cast
        for decl in module.decls.values():
            if decl.kind != "param" or not is_float(decl.type.dtype) or decl.type.dtype == self.param_dtype:
                continue
            source = module.source if decl.loc is not None else None
            raise DcirError(Diagnostic(
                f"mixed_precision: @{decl.name} is {decl.type.dtype}, but param_dtype is {self.param_dtype}: the pass "
                f"expects a step captured with its parameters in {self.param_dtype} "
                "(compile_to_ir(..., param_dtype=...)), and makes their storage f32",
                source, decl.loc, len(decl.kind)))
        accumulators = self._accumulators(module)
        for func in module.functions.values():
            if accumulators:
                accumulate_in_reduce_dtype(func, accumulators, self.reduce_dtype, stats)
        # one sweep: each rule fires once at each op it matches (a cast read is f32 then)
        apply_rules(module, RULES, max_iterations=1,
                    context=lambda func: {"edit": _Edit(func), "policy": self, "stats": stats})
        for decl in module.decls.values():
            if decl.kind == "param" and decl.type.dtype == self.param_dtype:
                decl.type = retyped(decl.type, MASTER)
            elif decl.name in accumulators:
                decl.type = retyped(decl.type, self.reduce_dtype)

    def _accumulators(self, module: Module) -> set[str]:
        """The gradient accumulators (``zero1``) to keep in ``reduce_dtype``: when it is
        wider than ``param_dtype``, so adding a ``param_dtype`` gradient promotes to it."""
        if DTYPE_BYTES[self.reduce_dtype] <= DTYPE_BYTES[self.param_dtype]:
            return set()
        return {d.name for d in module.decls.values() if GRAD_ACC_OF in d.attrs and d.type.dtype == self.param_dtype}
