"""What the nodes of a lowered graph call besides torch's ops: the program's state
(``param.get`` / ``param.set``, ``grad.set``), the random generator (``rng.get`` /
``rng.set``), the unboxing of a boxed function's arguments and the picking of one result
of several; and what a node is to the profiler (``OP_INDEX``, ``reads_state``).

The lowering (``dcir_lowering.backend``) makes these calls, the compiled stretches
(``dcir_lowering.stretches``) keep them out of Inductor, and the profiler
(``dcir_runtime.profiler``) reads them; they live here so that none of those imports another
for them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from dcir.layout import ShardLayout
from dcir_lowering import state_store


#: ``node.meta`` key: position in its function of the op an FX node comes from
OP_INDEX = "dcir_op"


def _state_get(state: dict, name: str) -> torch.Tensor:
    return state[name]


def _state_set(state: dict, name: str, value: torch.Tensor) -> None:
    with torch.no_grad():
        state[name].copy_(value)


def _state_add(state: dict, name: str, value: torch.Tensor) -> None:
    with torch.no_grad():
        state[name].add_(value)


def _state_zero(state: dict, name: str) -> None:
    with torch.no_grad():
        state[name].zero_()


def _grad_set(grads: dict, name: str, value: torch.Tensor) -> None:
    grads[name] = value


def _unbox(box: list) -> tuple:
    """A boxed function's arguments, taken out of the caller's list, which is emptied:
    the function then holds the only reference to each, and its graph lets it go after
    its last use (a backward's saved activations, as AOTAutograd's boxed calls do)."""
    args = tuple(box)
    box.clear()
    return args


def _rng_get(where: torch.Tensor) -> torch.Tensor:
    """``rng.get``: the state of the default generator of ``where``'s device."""
    if where.device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(where.device).get_rng_state(where.device)


def _rng_set(state: torch.Tensor, where: torch.Tensor) -> None:
    """``rng.set``: the default generator of ``where``'s device starts again from ``state``."""
    if where.device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(where.device).set_rng_state(state, where.device)


def _item(values, i):
    """The ``i``-th of several results (a coalesced collective's, a multi-result op's)."""
    return values[i]


# ---- what a lowered graph's nodes do, for the profiler (``dcir_runtime.profiler``) ----------

def reads_state(node: fx.Node) -> bool:
    """Whether a node of a lowered function reads the program's state (parameter
    shards, buffers, optimizer state), or picks a result of such a read. An update
    (``optim.step``) returns the state it was given, updated in place."""
    if node.op != "call_function":
        return False
    if node.target is _item and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    if node.target in (state_store.get_state, state_store.step):
        return True
    qualified = getattr(node.target, "_qualified_op_name", "")
    return qualified == "dcir::get_shard" or node.target is _state_get


#: what a lowered graph calls that is state access or the runtime's (``dcir_lowering.stretches``)
RUNTIME_CALLS = (_state_get, _state_set, _state_add, _state_zero, _grad_set, *state_store.CALLS, _rng_get, _rng_set,
                 _unbox)


def _blockwise(rows: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``rows`` ([R, n]) in int8, in blocks of ``block`` elements each scaled by
    its absolute maximum over 127 (a block of zeros: scale 1), and the scales ([R, blocks])."""
    n = rows.shape[1]
    blocks = -(-n // block)
    padded = torch.nn.functional.pad(rows.float(), (0, blocks * block - n)).view(rows.shape[0], blocks, block)
    scales = padded.abs().amax(dim=2) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(padded / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(rows.shape[0], -1)[:, :n], scales


def _quantize(shard: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mem.quantize`` of a shard: the flat shard in int8 (``_blockwise``), and its scales."""
    q, scales = _blockwise(shard.reshape(1, -1), block)
    return q.reshape(-1), scales.reshape(-1)


def _quantize_rows(full: torch.Tensor, block: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mem.quantize {parts}``: ``full`` in one int8 row per rank's chunk (the
    ``ShardLayout``: flattened, zero-padded), each in blocks (``_blockwise``)."""
    chunk = ShardLayout(full.numel(), parts).chunk
    rows = torch.nn.functional.pad(full.reshape(-1), (0, parts * chunk - full.numel())).view(parts, chunk)
    q, scales = _blockwise(rows, block)
    return q.contiguous(), scales


def _dequantize_reduce(rows: torch.Tensor, scales: torch.Tensor, block: int, op: str,
                       dtype: torch.dtype) -> torch.Tensor:
    """``mem.dequantize_reduce``: this rank's flat shard of the sum of the rows every rank
    sent it, each dequantized and added in f32 in rank order (an average: over the rows)."""
    chunk = rows.shape[1]
    values = rows.float() * scales.repeat_interleave(block, dim=1)[:, :chunk]
    total = values[0].clone()
    for r in range(1, rows.shape[0]):
        total += values[r]
    if op == "avg":
        total /= rows.shape[0]
    return total.to(dtype)


def _dequantize(q: torch.Tensor, scales: torch.Tensor, block: int, parts: int, dtype: torch.dtype) -> torch.Tensor:
    """``mem.dequantize``: element ``i`` of the gathered tensor came from rank ``i //
    chunk``'s shard, block ``(i % chunk) // block`` of it."""
    numel = q.numel()
    chunk = ShardLayout(numel, parts).chunk
    blocks = -(-chunk // block)
    i = torch.arange(numel, device=q.device)
    scale = scales[(i // chunk) * blocks + (i % chunk) // block]
    return (q.reshape(-1).float() * scale).to(dtype).view(q.shape)


def flat_shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's flat shard of ``full`` in the ``ShardLayout``: ``full`` flattened,
    zero-padded to a multiple of the world size, elements ``[rank * chunk, (rank + 1) * chunk)``."""
    layout = ShardLayout(full.numel(), world)
    lo, hi = layout.range_of(rank)
    shard = torch.zeros(layout.chunk, dtype=full.dtype, device=full.device)  # only the shard is new memory
    shard[:hi - lo] = full.reshape(-1)[lo:hi]
    return shard


def _take_shard(full: torch.Tensor, group: str | None) -> torch.Tensor:
    """``mem.shard``: this rank's ``flat_shard`` of ``full`` over the process group named
    ``group`` (None: a world of one rank, the whole tensor)."""
    if group is None:
        return flat_shard(full, 0, 1)
    pg = dist.distributed_c10d._resolve_process_group(group)
    return flat_shard(full, pg.rank(), pg.size())

