"""Quantize: parameters gathered and gradients reduced in int8 (ZeRO++'s qwZ and qgZ).

With ``weights`` (the default), every gather of a floating-point shard moves it in int8:
before the gather each rank quantizes its shard in blocks of ``block`` elements
(``mem.quantize``: each block scaled by its absolute maximum over 127, the scales in
f32), gathers the int8 shards and the scales in one coalesced collective (one
collective's latency, as the unquantized gather had), and after the wait rebuilds the full
tensor (``mem.dequantize``) in the shard's type. A gather then moves a quarter of an f32
parameter's bytes (half of a bf16 one's), plus 4 bytes of scale per block (1.6% at 256).
Each element of the gathered parameter is off by at most half its block's scale,
``absmax / 254``; the parameter shards and the optimizer's update stay exact, so the
error does not accumulate across steps beyond what the forward and backward computed
with it.

With ``gradients``, every reduce-scatter of a floating-point gradient (sum or average)
moves int8 too, as an all-to-all (ZeRO++'s qgZ, in one level): each rank quantizes its
gradient in one row per rank's chunk (``mem.quantize {parts}``), sends row ``p`` to rank
``p`` (``comm.all_to_all``, and the scales the same way), and sums the rows it received,
dequantized, in f32 in rank order (``mem.dequantize_reduce``). The gradient is freed
once quantized (when nothing else reads it later), not after the wait. A rank sends a
quarter of an f32 reduce-scatter's bytes. Each element of the sum is off by at most the
sum over the ranks of half their block's scale (``sum_r absmax_r / 254``; an average,
that over the ranks' count). Collectives already coalesced are left as they are (run it
before ``bucket``).

Before -> after (``block=256``, world size 2)::

    %w_pending = comm.all_gather(%w_shard) : pending<f32[4, 8]>
    %w = comm.wait(%w_pending) : f32[4, 8]
  ->
    %w_shard_q, %w_shard_scales = mem.quantize(%w_shard) {block = 256} : shard<i8[4, 8], 2>, shard<f32[2], 2>
    %w_pending, %w_scales_pending = comm.all_gather_coalesced(%w_shard_q, %w_shard_scales) : pending<i8[4, 8]>, pending<f32[2]>
    %w_q, %w_scales = comm.wait(%w_pending, %w_scales_pending) : i8[4, 8], f32[2]
    mem.free(%w_shard_q, %w_shard_scales)
    %w = mem.dequantize(%w_q, %w_scales) {block = 256, parts = 2, dtype = f32} : f32[4, 8]
    mem.free(%w_q, %w_scales)

    %g_pending = comm.reduce_scatter(%g) {op = "avg"} : pending<shard<f32[4, 8], 2>>
    %g_shard = comm.wait(%g_pending) : shard<f32[4, 8], 2>
  -> (``gradients=true``)
    %g_q, %g_scales = mem.quantize(%g) {block = 256, parts = 2} : i8[2, 16], f32[2, 1]
    mem.free(%g)
    %g_pending = comm.all_to_all(%g_q) : pending<i8[2, 16]>
    %g_scales_pending = comm.all_to_all(%g_scales) : pending<f32[2, 1]>
    %g_rows, %g_row_scales = comm.wait(%g_pending, %g_scales_pending) : i8[2, 16], f32[2, 1]
    mem.free(%g_q, %g_scales)
    %g_shard = mem.dequantize_reduce(%g_rows, %g_row_scales) {block = 256, op = "avg", dtype = f32} : shard<f32[4, 8], 2>
    mem.free(%g_rows, %g_row_scales)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import analysis
from dcir import ops as registry
from dcir.context import PlanContext
from dcir.ir import DType, Function, Module, Op, PendingType, ShardType, TensorType, Value
from dcir.passes import Pass
from dcir.rewrite import Rewriter


def _quantize_gather(func: Function, start: Op, wait: Op, block: int) -> int:
    """``start`` (a single all_gather) and its ``wait`` moved in int8 (module docstring);
    returns the bytes a rank sends now."""
    rewriter, fresh = Rewriter(func), func.name_maker()
    shard, full = start.operands[0], wait.results[0]
    group = {k: v for k, v in start.attrs.items() if k == "group"}
    q_type, s_type = registry.quantized_types(shard.type, block)
    q, scales = Value(fresh(shard.name + "_q"), q_type), Value(fresh(shard.name + "_scales"), s_type)
    q_pending = Value(start.results[0].name, PendingType(q_type.full))
    s_pending = Value(fresh(full.name + "_scales_pending"), PendingType(s_type.full))
    q_full, s_full = Value(fresh(full.name + "_q"), q_type.full), Value(fresh(full.name + "_scales"), s_type.full)
    rewriter.insert_before(start, [Op("mem.quantize", [shard], [q, scales], {"block": block}),
                                   Op(registry.coalesced_form(start), [q, scales], [q_pending, s_pending], dict(group))])
    rebuilt = Value(full.name, full.type)
    rewriter.insert_before(wait, [
        Op(wait.name, [q_pending, s_pending], [q_full, s_full]), Op("mem.free", [q, scales]),
        Op("mem.dequantize", [q_full, s_full], [rebuilt],
           {"block": block, "parts": shard.type.parts, "dtype": DType(full.type.dtype)}),
        Op("mem.free", [q_full, s_full])])
    rewriter.replace_all_uses(full, rebuilt)
    rewriter.erase(wait)
    rewriter.erase(start)
    return q_type.nbytes + s_type.nbytes


def _quantize_reduction(func: Function, start: Op, wait: Op, block: int) -> int:
    """``start`` (a single reduce_scatter) and its ``wait`` moved in int8 as an all-to-all
    of per-rank rows, summed after the wait (module docstring); returns the bytes a rank
    sends now."""
    rewriter, fresh = Rewriter(func), func.name_maker()
    full, shard = start.operands[0], wait.results[0]
    group = {k: v for k, v in start.attrs.items() if k == "group"}
    q_type, s_type = registry.quantized_rows(full.type, shard.type.parts, block)
    q, scales = Value(fresh(full.name + "_q"), q_type), Value(fresh(full.name + "_scales"), s_type)
    q_pending = Value(start.results[0].name, PendingType(q_type))
    s_pending = Value(fresh(full.name + "_scales_pending"), PendingType(s_type))
    rows, row_scales = Value(fresh(full.name + "_rows"), q_type), Value(fresh(full.name + "_row_scales"), s_type)
    quantize = Op("mem.quantize", [full], [q, scales], {"block": block, "parts": shard.type.parts})
    rewriter.insert_before(start, [
        quantize,
        Op("comm.all_to_all", [q], [q_pending], dict(group)),
        Op("comm.all_to_all", [scales], [s_pending], dict(group))])
    summed = Value(shard.name, shard.type)
    rewriter.insert_before(wait, [
        Op(wait.name, [q_pending, s_pending], [rows, row_scales]), Op("mem.free", [q, scales]),
        Op("mem.dequantize_reduce", [rows, row_scales], [summed],
           {"block": block, "op": start.attrs["op"], "dtype": DType(shard.type.dtype), **group}),
        Op("mem.free", [rows, row_scales])])
    rewriter.replace_all_uses(shard, summed)
    rewriter.erase(wait)
    rewriter.erase(start)
    _free_after(rewriter, func, full, quantize)
    return q_type.nbytes + s_type.nbytes


def _free_after(rewriter: Rewriter, func: Function, full: Value, quantize: Op) -> None:
    """The gradient's storage, freed after the reduction's wait while the collective read
    it, is freed right after ``quantize`` when nothing else reads it (or a view of it)
    later: the rows are what the all-to-all sends."""
    bases = analysis.view_bases(func)
    base = bases.get(full, full)
    at = rewriter.position(quantize)
    for op in func.ops[at + 1:]:
        mine = [v for v in op.operands if bases.get(v, v) is base]
        if mine and op.name != "mem.free":
            return  # read again: its free stays where it is
        if mine:
            rest = [v for v in op.operands if v not in mine]
            if rest:
                rewriter.set_operands(op, rest)
            else:
                rewriter.erase(op)
            rewriter.insert_after(quantize, [Op("mem.free", mine)])
            return


def _quantizable(op: Op, wait: Op | None, trait: str) -> bool:
    """A single collective of ``trait`` on one floating-point tensor, waited on alone (a
    reduction: a sum or an average)."""
    if not registry.has_trait(op, trait) or registry.is_coalesced(op) or wait is None or len(wait.operands) != 1:
        return False
    if trait == registry.SCATTERS and op.attrs.get("op") not in ("sum", "avg"):
        return False
    t = op.operands[0].type
    return isinstance(t, ShardType if trait == registry.GATHERS else TensorType) and t.dtype in ("f32", "bf16", "f16")


@dataclass(frozen=True)
class Quantize(Pass):
    name = "quantize"
    #: elements per scale
    block: int = 256
    #: parameter gathers in int8 (qwZ)
    weights: bool = True
    #: gradient reductions in int8 (qgZ)
    gradients: bool = False

    def __post_init__(self):
        if self.block < 1:
            raise ValueError("block must be at least 1")
        if not (self.weights or self.gradients):
            raise ValueError("weights=false and gradients=false quantize nothing: give either or both")

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        for func in module.functions.values():
            waits = analysis.waits(func)
            for op in list(func.ops):
                wait, t = waits.get(op.results[0]) if op.results else None, op.operands[0].type if op.operands else None
                if self.weights and _quantizable(op, wait, registry.GATHERS):
                    sent = _quantize_gather(func, op, wait, self.block)
                    stats["quantize: gathers moved in int8"] += 1
                elif self.gradients and _quantizable(op, wait, registry.SCATTERS):
                    sent = _quantize_reduction(func, op, wait, self.block)
                    stats["quantize: reductions moved in int8"] += 1
                else:
                    continue
                stats["quantize: bytes a rank sends, before"] += t.nbytes
                stats["quantize: bytes a rank sends, after"] += sent
