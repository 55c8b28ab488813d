"""The flat shard layout (``dcir.layout.ShardLayout``): its edge cases, its agreement with
``torch.chunk`` (what a DTensor ``Shard(0)`` means), and with the C++ runtime's
``chunk_of``, which sizes every reduce-scatter's result. (tests/dist_worker.py's ``ops``
checks at world 3 that the runtime's collectives put each rank's elements where
``range_of`` says.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dcir.ir import ShardType, TensorType
from dcir.layout import ShardLayout

#: (numel, world): an empty tensor, fewer elements than ranks, even and uneven splits, one rank
PAIRS = [(0, 1), (0, 3), (1, 1), (1, 4), (2, 3), (3, 8), (5, 5), (6, 3), (8, 4), (7, 2), (10, 3),
         (10, 4), (11, 8), (17, 1), (97, 7), (1000, 6)]


@pytest.mark.parametrize("numel,world", PAIRS)
def test_the_shards_tile_the_tensor_then_padding(numel, world):
    layout = ShardLayout(numel, world)
    assert layout.chunk * world == layout.padded
    assert numel <= layout.padded < numel + world  # less than one element of padding per rank
    ranges = [layout.range_of(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in rank order
    assert all(stop - start == layout.local_numel(r) <= layout.chunk for r, (start, stop) in enumerate(ranges))
    assert sum(layout.local_numel(r) for r in range(world)) == numel


@pytest.mark.parametrize("numel,world", [p for p in PAIRS if p[0]])
def test_without_the_padding_it_is_torch_chunk(numel, world):
    layout = ShardLayout(numel, world)
    pieces = torch.arange(numel).chunk(world)  # may be fewer than world: the last ranks hold only padding
    for rank in range(world):
        start, stop = layout.range_of(rank)
        want = pieces[rank].tolist() if rank < len(pieces) else []
        assert list(range(start, stop)) == want, rank


def test_the_edge_cases_by_value():
    assert (ShardLayout(10, 4).chunk, ShardLayout(10, 4).range_of(3)) == (3, (9, 10))
    fewer = ShardLayout(2, 4)  # fewer elements than ranks: ranks 2 and 3 hold one padding element each
    assert fewer.chunk == 1 and [fewer.range_of(r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    even = ShardLayout(12, 3)
    assert (even.chunk, even.padded, [even.local_numel(r) for r in range(3)]) == (4, 12, [4, 4, 4])
    empty = ShardLayout(0, 3)
    assert (empty.chunk, empty.padded, empty.range_of(2)) == (0, 0, (0, 0))


def test_the_ir_shard_type_is_the_layout():
    t = ShardType(TensorType("f32", (5,)), 2)
    assert t.layout == ShardLayout(5, 2) and t.numel == 3 and t.nbytes == 12  # docs/language.md's example


@pytest.mark.parametrize("numel,world,message", [(-1, 2, "numel >= 0"), (4, 0, "world >= 1")])
def test_a_bad_layout_is_refused(numel, world, message):
    with pytest.raises(ValueError, match=message):
        ShardLayout(numel, world)


@pytest.mark.parametrize("rank", [-1, 4])
def test_a_rank_outside_the_world_is_refused(rank):
    with pytest.raises(ValueError, match=f"rank {rank} is outside a world of 4"):
        ShardLayout(10, 4).range_of(rank)


#: In a fresh process (a test that ran an Engine in this one keeps its process group):
#: one fake process group of 8 ranks, groups of its first 1..8, and the shard sizes the
#: runtime's reduce-scatters (single and coalesced) give on the meta device.
_RUNTIME_CHUNKS = """
import json, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from dcir_runtime import native
native.load()
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
out = []
for numel, world in json.loads(sys.argv[1]):
    g = dist.new_group(ranks=list(range(world))).group_name
    one = torch.ops.dcir.reduce_scatter(torch.empty(numel, device="meta"), "sum", g, "t")
    (many,) = torch.ops.dcir.reduce_scatter_coalesced([torch.empty(numel, device="meta")], "sum", g, "t")
    out.append([one.numel(), many.numel()])
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_the_runtime_s_chunk_is_the_layout_s():
    pairs = [p for p in PAIRS if p[1] <= 8]
    done = subprocess.run([sys.executable, "-c", _RUNTIME_CHUNKS, json.dumps(pairs)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    chunks = json.loads(done.stdout.strip().splitlines()[-1])
    assert chunks == [[ShardLayout(n, w).chunk] * 2 for n, w in pairs], list(zip(pairs, chunks))
