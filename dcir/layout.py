"""The flat shard layout: which elements of a tensor each rank holds.

A tensor split across ``world`` ranks (the IR's ``shard<T, N>``, an Engine's parameter
shards, a checkpoint's pieces, a pretrained tensor read shard by shard) is flattened and
zero-padded to a multiple of ``world``; rank ``r`` holds elements ``[r * chunk, (r + 1) *
chunk)`` with ``chunk = ceil(numel / world)``, so every rank's shard has the same size and
collectives move the same bytes on every rank even when the split is uneven. Without the
padding it is ``torch.chunk``'s split, what a DTensor ``Shard(0)`` over ``numel`` means.

    >>> layout = ShardLayout(numel=10, world=4)
    >>> layout.chunk, layout.padded, layout.range_of(3), layout.local_numel(3)
    (3, 12, (9, 10), 1)

This is the only place the rule is written; the C++ runtime's ``chunk_of``
(native/dcir_runtime.cpp) follows it, and tests/test_layout.py checks that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """How a tensor of ``numel`` elements is split into ``world`` equal flat shards."""

    numel: int
    world: int

    def __post_init__(self) -> None:
        if self.numel < 0 or self.world < 1:
            raise ValueError(f"a shard layout needs numel >= 0 and world >= 1, got numel={self.numel}, "
                             f"world={self.world}")

    @property
    def chunk(self) -> int:
        """Elements every rank holds, padding included: ``ceil(numel / world)``."""
        return -(-self.numel // self.world)

    @property
    def padded(self) -> int:
        """Elements of the padded flat tensor, all ranks' shards together."""
        return self.chunk * self.world

    def range_of(self, rank: int) -> tuple[int, int]:
        """``(start, stop)``: the real (unpadded) elements of the flat tensor ``rank``
        holds; empty (``start == stop == numel``) for a rank that holds only padding."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a world of {self.world}")
        return min(rank * self.chunk, self.numel), min((rank + 1) * self.chunk, self.numel)

    def local_numel(self, rank: int) -> int:
        """How many of ``rank``'s ``chunk`` elements are real, not padding."""
        start, stop = self.range_of(rank)
        return stop - start
