"""Quantize: parameters gathered in int8 (ZeRO++'s quantized weights, qwZ).

Every gather of a floating-point shard moves it in int8 instead: before the gather each
rank quantizes its shard in blocks of ``block`` elements (``mem.quantize``: each block
scaled by its absolute maximum over 127, the scales in f32), gathers the int8 shards and
the scales, and after the wait rebuilds the full tensor (``mem.dequantize``) in the
shard's type. A gather then moves a quarter of an f32 parameter's bytes (half of a bf16
one's), plus 4 bytes of scale per block (1.6% at 256). Each element of the gathered
parameter is off by at most half its block's scale, ``absmax / 254``; the parameter
shards, the optimizer's update and the gradients stay exact (the reductions are not
quantized), so the error does not accumulate across steps beyond what the forward and
backward computed with it. Gathers already coalesced are left as they are (run it before
``bucket``).

Before -> after (``block=256``, world size 2)::

    %w_pending = comm.all_gather(%w_shard) : pending<f32[4, 8]>
    %w = comm.wait(%w_pending) : f32[4, 8]
  ->
    %w_shard_q, %w_shard_scales = mem.quantize(%w_shard) {block = 256} : shard<i8[4, 8], 2>, shard<f32[2], 2>
    %w_pending = comm.all_gather(%w_shard_q) : pending<i8[4, 8]>
    %w_scales_pending = comm.all_gather(%w_shard_scales) : pending<f32[2]>
    %w_q, %w_scales = comm.wait(%w_pending, %w_scales_pending) : i8[4, 8], f32[2]
    mem.free(%w_shard_q, %w_shard_scales)
    %w = mem.dequantize(%w_q, %w_scales) {block = 256, parts = 2, dtype = f32} : f32[4, 8]
    mem.free(%w_q, %w_scales)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import analysis
from dcir import ops as registry
from dcir.context import PlanContext
from dcir.ir import DType, Function, Module, Op, PendingType, ShardType, Value
from dcir.passes import Pass
from dcir.rewrite import Rewriter


def _quantize_gather(func: Function, start: Op, wait: Op, block: int) -> None:
    """``start`` (a single all_gather) and its ``wait`` moved in int8 (module docstring)."""
    rewriter, fresh = Rewriter(func), func.name_maker()
    shard, full = start.operands[0], wait.results[0]
    group = {k: v for k, v in start.attrs.items() if k == "group"}
    q_type, s_type = registry.quantized_types(shard.type, block)
    q, scales = Value(fresh(shard.name + "_q"), q_type), Value(fresh(shard.name + "_scales"), s_type)
    q_pending = Value(start.results[0].name, PendingType(q_type.full))
    s_pending = Value(fresh(full.name + "_scales_pending"), PendingType(s_type.full))
    q_full, s_full = Value(fresh(full.name + "_q"), q_type.full), Value(fresh(full.name + "_scales"), s_type.full)
    rewriter.insert_before(start, [Op("mem.quantize", [shard], [q, scales], {"block": block}),
                                   Op(start.name, [q], [q_pending], dict(group)),
                                   Op(start.name, [scales], [s_pending], dict(group))])
    rebuilt = Value(full.name, full.type)
    rewriter.insert_before(wait, [
        Op(wait.name, [q_pending, s_pending], [q_full, s_full]), Op("mem.free", [q, scales]),
        Op("mem.dequantize", [q_full, s_full], [rebuilt],
           {"block": block, "parts": shard.type.parts, "dtype": DType(full.type.dtype)}),
        Op("mem.free", [q_full, s_full])])
    rewriter.replace_all_uses(full, rebuilt)
    rewriter.erase(wait)
    rewriter.erase(start)


@dataclass(frozen=True)
class Quantize(Pass):
    name = "quantize"
    #: elements per scale
    block: int = 256

    def __post_init__(self):
        if self.block < 1:
            raise ValueError("block must be at least 1")

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        for func in module.functions.values():
            waits = analysis.waits(func)
            for op in list(func.ops):
                if not registry.has_trait(op, registry.GATHERS) or registry.is_coalesced(op):
                    continue
                wait, t = waits.get(op.results[0]), op.operands[0].type
                if wait is None or len(wait.operands) != 1 or not isinstance(t, ShardType) \
                        or t.dtype not in ("f32", "bf16", "f16"):
                    continue
                _quantize_gather(func, op, wait, self.block)
                stats["quantize: gathers moved in int8"] += 1
                stats["quantize: bytes a rank sends, before"] += t.nbytes
                stats["quantize: bytes a rank sends, after"] += t.numel + 4 * -(-t.numel // self.block)
