"""The optimizer-state store, as a lowered program calls it.

``@step`` (made by the ``offload`` pass), the reloads it starts in the backward and the
copies home it finishes in the forward lower to calls on the store given as
``lower(..., optimizer_state=)``, which the program's state holds under
``OPTIMIZER_STATE``: each call is a node of the lowered graph whose target is one of the
functions below, which calls the method of that name on the store. What a store must
have is ``OptimizerStateStore`` (the Engine's is ``dcir_runtime.offload.StateStore``).
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Protocol

import torch
import torch.fx as fx

#: The key of the optimizer-state store in a program's state (``lower`` puts it there).
OPTIMIZER_STATE = "<optimizer state>"

#: A state tensor, or None for one the optimizer has not created yet (before its first step).
State = torch.Tensor | None


class OptimizerStateStore(Protocol):
    """What a lowered program calls on its optimizer-state store (``dcir_runtime.offload``
    says what each does), and what the profiler asks of it (``is_host``)."""

    def get_state(self, name: str) -> State:
        """The state tensor of buffer ``name`` (``fc.weight.exp_avg``)."""

    def set_state(self, name: str, value: State) -> None:
        """Replace the state tensor of buffer ``name``."""

    def reload(self, host: State) -> Any:
        """Start a copy to a new device buffer; returns the pending copy ``wait`` finishes."""

    def offload(self, t: State) -> Any:
        """Start a copy to a host buffer; returns the pending copy ``wait`` finishes."""

    def wait(self, pending: Any) -> State:
        """Finish a copy ``reload`` or ``offload`` started; returns its destination."""

    def free(self, t: State) -> None:
        """Release a device copy's memory at once."""

    def step(self, items: tuple, *state: State) -> tuple:
        """Run the optimizer for the parameters ``items`` names, ``((param, keys), ...)``,
        with their state tensors in that order; returns their state after the update."""

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a host copy this store made."""


#: A method of the store a lowered graph's node calls (``store_call``).
StoreMethod = Literal["get_state", "set_state", "reload", "offload", "wait", "free", "step"]


def _store(state: dict) -> OptimizerStateStore:
    return state[OPTIMIZER_STATE]


# ---- the targets of a lowered graph's calls on the store; ``state`` is the program's --------

def get_state(state: dict, name: str) -> State:
    return _store(state).get_state(name)


def set_state(state: dict, name: str, value: State) -> None:
    _store(state).set_state(name, value)


def reload(state: dict, host: State) -> Any:
    return _store(state).reload(host)


def offload(state: dict, t: State) -> Any:
    return _store(state).offload(t)


def wait(state: dict, pending: Any) -> State:
    return _store(state).wait(pending)


def free(state: dict, t: State) -> None:
    _store(state).free(t)


def step(state: dict, items: tuple, *tensors: State) -> tuple:
    return _store(state).step(items, *tensors)


#: Each target above, and the method of the store it calls.
CALLS: dict[Callable, StoreMethod] = {get_state: "get_state", set_state: "set_state", reload: "reload",
                                      offload: "offload", wait: "wait", free: "free", step: "step"}


def store_call(node: fx.Node) -> StoreMethod | None:
    """The method of the optimizer-state store a node of a lowered function calls, or None."""
    if node.op != "call_function":
        return None
    return CALLS.get(node.target)
