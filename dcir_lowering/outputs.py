"""The structure of a model's output, so the Engine returns what the model returns.

``@forward`` returns the model's output as flat ``{output}`` results; ``Outputs`` keeps
everything else of it: the containers (tuples, dicts, a ``transformers`` ``ModelOutput``,
a ``DynamicCache``), the constants, and where each result goes. It is the output of the
capture run with each result tensor replaced by a marker (``_Slot``); ``rebuild`` copies
it with the markers replaced by a run's tensors (``copy.deepcopy`` with a prepared memo,
so any picklable Python object works, registered with ``torch.utils._pytree`` or not).

Rank 0 captures; the structure reaches the other ranks pickled (``pack``/``unpack``).
"""

from __future__ import annotations

import base64
import copy
import pickle
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef  # storage identity, fake tensors' too

from dcir.diagnostics import DcirError, Diagnostic


@dataclass(frozen=True)
class _Slot:
    """Where output ``index`` (of ``@forward``'s ``{output}`` results) goes."""

    index: int


@dataclass(frozen=True)
class _ViewSlot:
    """A view of output ``index`` (a sliding-window KV cache keeps a slice of what the
    graph returned): its sizes, strides and offset relative to that output's."""

    index: int
    size: tuple
    stride: tuple
    offset: int


class Outputs:
    def __init__(self, template):
        self.template = template
        self._slots = list(_slots(template))

    @classmethod
    def of(cls, out, produced: list[torch.Tensor]) -> "Outputs":
        """The structure of ``out``, whose tensors are the forward graph's outputs
        ``produced`` (by identity), or views of them (by storage: a sliding-window cache's
        slice). A tensor in ``out`` that the graph did not produce (an input or a parameter
        returned as it is) is refused: the engine would return a copy."""
        memo = {id(t): _Slot(k) for k, t in enumerate(produced)}
        storages = {StorageWeakRef(t.untyped_storage()): k for k, t in enumerate(produced) if t.numel()}
        for t in _tensors(out):
            k = storages.get(StorageWeakRef(t.untyped_storage())) if id(t) not in memo and t.numel() else None
            if k is None:
                continue
            base = produced[k]
            same = (t.shape, t.stride(), t.storage_offset()) == (base.shape, base.stride(), base.storage_offset())
            memo[id(t)] = _Slot(k) if same else _ViewSlot(k, tuple(t.shape), tuple(t.stride()),
                                                          t.storage_offset() - base.storage_offset())
        stray = next((t for t in _tensors(out) if id(t) not in memo), None)
        if stray is not None:
            raise DcirError(Diagnostic(
                f"the model returns a tensor ({stray.dtype}, shape {list(stray.shape)}) that its forward does not "
                "compute (an input or a parameter returned as it is); return a computed value instead"))
        memo[id(memo)] = list(produced)  # keep them alive while copying, as deepcopy does
        return cls(copy.deepcopy(out, memo))

    def rebuild(self, tensors: list[torch.Tensor]):
        """The model's output, with ``tensors`` (one per ``{output}`` result) in place."""
        if isinstance(self.template, _Slot):  # the common case: one tensor (a loss)
            return tensors[self.template.index]
        memo = {}
        for s in self._slots:
            t = tensors[s.index]
            memo[id(s)] = t if isinstance(s, _Slot) else t.as_strided(s.size, s.stride, t.storage_offset() + s.offset)
        return copy.deepcopy(self.template, memo)

    def pack(self) -> str:
        try:
            return base64.b64encode(pickle.dumps(self.template)).decode()
        except Exception as e:  # noqa: BLE001 — any pickling failure is the same user-facing problem
            raise DcirError(Diagnostic(f"the model's output cannot be sent to the other ranks: it does not pickle "
                                       f"({type(e).__name__}: {e})")) from None

    @classmethod
    def unpack(cls, text: str) -> "Outputs":
        return cls(pickle.loads(base64.b64decode(text)))


def _walk(obj, seen: set):
    """Every object reachable from ``obj`` through containers and instance attributes."""
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), type)):
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, torch.Tensor):
        return
    if isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
    for child in children:
        yield from _walk(child, seen)


def _tensors(template):
    return (o for o in _walk(template, set()) if isinstance(o, torch.Tensor))


def _slots(template):
    return (o for o in _walk(template, set()) if isinstance(o, (_Slot, _ViewSlot)))
