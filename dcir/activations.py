"""Activations: what ``@forward`` hands to the backward, and what the backward computes again.

A saved activation is either kept (a ``{saved}`` result of ``@forward``, an argument of
``@backward``) or recomputed: the backward runs the forward's ops that made it again,
from values it still has. A recomputed op is an ordinary op of the backward marked
``act.recompute``, so the verifier, the memory model and the simulator see it as any
other op; only the mark says why it is there. A third choice, offload, hands the
backward an activation through host memory: a ``mem.offload`` in the forward and a
``mem.reload`` in the backward, both marked ``act.offload``. Users' own activation checkpointing
(``torch.utils.checkpoint``, ``model.gradient_checkpointing_enable()``, selective
checkpointing policies) lowers to this form: AOTAutograd's partitioner puts the ops of
a checkpointed region in the backward, and capture marks them.

A random op replayed in the backward draws what it drew in the forward: the forward
saves the generator's state just before it (``rng.get``), and the backward sets that
state around the replay and then puts the generator back as it was (``rng.set``):

    // @forward
    %rng_state = rng.get(%relu) : u8[5056]
    %native_dropout, %mask = aten.native_dropout.default(%relu) {p = 0.5, train = true} : ...
    // @backward
    %prev = rng.get(%relu) {act.recompute} : u8[5056]
    rng.set(%rng_state, %relu) {act.recompute}
    %native_dropout, %mask = aten.native_dropout.default(%relu) {p = 0.5, train = true, act.recompute} : ...
    rng.set(%prev, %relu) {act.recompute}
"""

from __future__ import annotations

from functools import lru_cache

from dcir import custom_ops
from dcir import ops as registry
from dcir.ir import Function, Op

#: the op attribute (a flag) that marks an op the backward runs again to rebuild an activation
RECOMPUTE = "act.recompute"
#: the op attribute (a flag) that marks the copy of a saved activation to host memory
#: (``mem.offload`` in the forward) and back (``mem.reload`` in the backward): the
#: ``offload_activations`` pass
OFFLOAD = "act.offload"


def draws_random(op: Op) -> bool:
    """Whether ``op`` draws random numbers from the generator (torch tags such an
    overload ``nondeterministic_seeded``: dropout, ``rand``, ``bernoulli``...). Such an
    op runs eagerly, never inside a compiled stretch: its numbers come from the
    generator ``rng.get`` and ``rng.set`` save and set, so a replay draws the same."""
    return registry.has_trait(op, registry.SCHEMA) and _random_overload(op.name)


@lru_cache(maxsize=None)
def _random_overload(name: str) -> bool:
    return custom_ops.lazy_torch().Tag.nondeterministic_seeded in custom_ops.resolve(name).tags


def recomputed(func: Function) -> list[Op]:
    """The ops of ``func`` marked as recompute, in order."""
    return [op for op in func.ops if RECOMPUTE in op.attrs]
