"""The mesh the ranks form: named dimensions, row-major (the last varies fastest).

A module declares one with ``mesh.<dim> = <size>`` attributes, in order: ``attributes
{world_size = 4, mesh.nodes = 2, mesh.local = 2}`` puts ranks 0, 1 on node 0 and 2, 3 on
node 1. A collective over a dimension (``{group = "local"}``) runs within each group of
ranks that differ only in that coordinate: over ``local``, {0, 1} and {2, 3}; over
``nodes``, {0, 2} and {1, 3}. A shard type names the dimension it is split over
(``shard<f32[8], local=2>``) and is replicated over the others.
"""

from __future__ import annotations

import math


def groups(mesh: dict[str, int], dim: str) -> list[tuple[int, ...]]:
    """Every group of ranks a collective over ``dim`` runs in, each in rank order."""
    sizes = list(mesh.values())
    k = list(mesh).index(dim)
    stride = math.prod(sizes[k + 1:])
    world = math.prod(sizes)
    starts = [r for r in range(world) if (r // stride) % sizes[k] == 0]
    return [tuple(s + i * stride for i in range(sizes[k])) for s in starts]


def group_of(mesh: dict[str, int], dim: str, rank: int) -> tuple[int, ...]:
    """The ranks ``rank`` runs a collective over ``dim`` with (itself included)."""
    return next(g for g in groups(mesh, dim) if rank in g)


def coordinate(mesh: dict[str, int], dim: str, rank: int) -> int:
    """``rank``'s place along ``dim``: which shard it holds of a tensor split over it."""
    return group_of(mesh, dim, rank).index(rank)


def describe(mesh: dict[str, int]) -> str:
    """``nodes=2 × local=2``."""
    return " × ".join(f"{d}={n}" for d, n in mesh.items())
