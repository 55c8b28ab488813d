"""The optimizer-state store: what ``@step`` runs on (the ``offload`` pass).

``@step`` updates the parameters one by one (``optim.step @w``) with the user's
torch optimizer, and moves the state the pass put in host memory to the device and
back around each update. Its graph calls this store (``dcir_lowering.state_store``,
whose ``OptimizerStateStore`` is what a store must have):

* ``get_state`` / ``set_state``: a state tensor of the optimizer, by its buffer's
  name (``fc.weight.exp_avg``), read or replaced; before the first step the
  optimizer has none, and the store hands out ``ABSENT``, which the first update
  replaces with the state the optimizer creates;
* ``reload`` / ``offload`` start a copy to a new device buffer / a host buffer and
  return a pending copy; ``wait`` finishes it. The copy home of a reloaded tensor
  goes into the host buffer it was reloaded from when nothing else holds that any
  more (its contents went stale with the update), else into a new one. The copies run
  on the process's copy lanes for the device (``dcir_lowering.copies``: two CUDA
  streams on a GPU, a background thread on a CPU, where only the accounting tells
  "device" and "host" apart), which offloaded activations share;
* ``free`` releases a device copy's memory at once;
* ``step`` runs the optimizer for some parameters (one ``optim.step``, or a run of
  them with nothing but reads of state between them): the other parameters'
  gradients are hidden from it for the call, so it updates only those (torch
  optimizers skip parameters without a gradient).

The store counts the optimizer-state bytes on the device, now and at their peak,
which ``Engine.memory()`` reports (``optimizer_state``, ``optimizer_state_peak``,
``optimizer_state_host``); the copy lanes count the host time spent blocked in ``wait``
(``copy_wait_s``).
"""

from __future__ import annotations

import sys
import weakref

import torch

from dcir.buffers import OPTIM_KEY, OPTIM_STATE_OF
from dcir.ir import HostType
from dcir_lowering import copies
from dcir_lowering.copies import Pending

#: A state tensor the optimizer has not created yet (before its first step).
ABSENT = None


class StateStore:
    def __init__(self, optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter],
                 device: torch.device):
        self.optimizer, self.params, self.device = optimizer, params, device
        self._host: dict[int, weakref.ref] = {}  # the host copies: state that lives in host memory
        # a device copy -> the host copy it was reloaded from, which its copy home may reuse
        self._origin: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.on_device: dict[int, int] = {}  # storage -> bytes of state on the device
        self.peak = 0
        self._names: dict[str, tuple[str, str]] = {}
        self._loaded = False  # a checkpoint load replaced the state: the next bind places it
        self.lanes = copies.lanes(device)  # the process's, which activations' copies share

    def bind(self, module) -> None:
        """Learn which buffer of ``module`` is which parameter's state tensor; after a
        checkpoint load (``place_loaded_state``), put the loaded state where ``module`` keeps it first."""
        if self._loaded:
            self._offload_loaded(module)
        self._names = {name: (d.attrs[OPTIM_STATE_OF].name, d.attrs[OPTIM_KEY])
                       for name, d in module.decls.items() if OPTIM_STATE_OF in d.attrs}
        for st in self.optimizer.state.values():  # what is on the device already (kept across plans)
            for t in st.values():
                if isinstance(t, torch.Tensor) and t.dim() > 0 and not self.is_host(t):
                    self._count(t)

    def place_loaded_state(self, module=None) -> None:
        """A checkpoint load filled the optimizer's state: place it as ``module`` (the running
        program) keeps it, now; with no program yet (None), at the next ``bind``, when one is captured."""
        self._loaded = True
        if module is not None:
            self.bind(module)

    def _offload_loaded(self, module) -> None:
        """Optimizer state a load created (the optimizer had none) is an ordinary tensor
        beside its shard; the state ``module`` keeps in host memory (``offload``: a
        ``host<...>`` buffer) goes into a host buffer of this store, as its own copies home
        would, so it is not held on the device and the store accounts it as host memory."""
        self._loaded = False
        for d in module.decls.values():
            if OPTIM_STATE_OF not in d.attrs or not isinstance(d.type, HostType):
                continue
            state = self.optimizer.state[self.params[d.attrs[OPTIM_STATE_OF].name]]
            key = d.attrs[OPTIM_KEY]
            if isinstance(state.get(key), torch.Tensor) and not self.is_host(state[key]):
                state[key] = self.wait(self.offload(state[key]))

    # ---- accounting ----------------------------------------------------------------------

    def _count(self, t: torch.Tensor) -> None:
        self.on_device[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.peak = max(self.peak, self.device_bytes())

    def device_bytes(self) -> int:
        return sum(self.on_device.values())

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a host copy this store made (on a CPU, RAM either way)."""
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def host_bytes(self) -> int:
        alive = (r() for r in self._host.values())
        return sum(t.untyped_storage().nbytes() for t in alive if t is not None)

    # ---- what @step calls ----------------------------------------------------------------

    def get_state(self, name: str):
        param, key = self._names[name]
        return self.optimizer.state[self.params[param]].get(key, ABSENT)

    def set_state(self, name: str, value) -> None:
        if value is not ABSENT:
            param, key = self._names[name]
            self.optimizer.state[self.params[param]][key] = value

    def reload(self, host):
        if host is ABSENT:
            return Pending(ABSENT)
        dst = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self._count(dst)  # the device buffer exists from here on
        key = id(dst)
        self._origin[key] = (weakref.ref(dst, lambda _: self._origin.pop(key, None)), host)
        return self.lanes.copy(dst, host, "reload")

    def offload(self, t):
        if t is ABSENT:
            return Pending(ABSENT)
        dst = self._stale_home(t)
        if dst is None:
            dst = self.lanes.host_buffer(t)
            key = id(dst)
            self._host[key] = weakref.ref(dst, lambda _: self._host.pop(key, None))
        return self.lanes.copy(dst, t, "offload")

    def _stale_home(self, t: torch.Tensor) -> torch.Tensor | None:
        """The host copy ``t`` was reloaded from, when nothing but this store holds it any
        more: its contents are stale (``t`` is the state now), so the copy home can
        overwrite it rather than fill a new buffer (on a CPU a new buffer's pages are
        faulted in as it is written: five times the copy's own time for 32 MB here)."""
        ref, host = self._origin.pop(id(t), (None, None))
        if ref is None or ref() is not t or host.shape != t.shape or host.dtype != t.dtype:
            return None
        # two references are this local and getrefcount's own argument; a third is a
        # holder that could still read the old contents
        return host if sys.getrefcount(host) <= 2 else None

    def wait(self, pending: Pending):
        return pending.result if pending.lanes is None else pending.lanes.wait(pending)  # None: no state yet

    def free(self, t) -> None:
        if t is ABSENT:
            return
        self.on_device.pop(t.untyped_storage().data_ptr(), None)
        t.untyped_storage().resize_(0)

    def step(self, items: tuple, *state):
        """Update the parameters ``items`` names, ``((param, keys), ...)``, with the state
        tensors given for them in that order, in one optimizer call; returns their state
        after the update, in the same order."""
        params = [self.params[name] for name, _ in items]
        chosen = set(map(id, params))
        fresh = []
        at = 0
        for p, (_, keys) in zip(params, items):
            st = self.optimizer.state[p]
            fresh.append(not st)
            for key, t in zip(keys, state[at:at + len(keys)]):
                if t is not ABSENT:
                    st[key] = t
            at += len(keys)
        hidden = [(q, q.grad) for group in self.optimizer.param_groups for q in group["params"]
                  if id(q) not in chosen and q.grad is not None]
        for q, _ in hidden:
            q.grad = None
        try:
            self.optimizer.step()
        finally:
            for q, g in hidden:
                q.grad = g
        out = []
        for p, (_, keys), new in zip(params, items, fresh):
            st = self.optimizer.state[p]
            for key in keys:
                t = st.get(key, ABSENT)
                if new and t is not ABSENT:  # the optimizer created it now, on the device
                    self._count(t)
                out.append(t)
        return tuple(out)
