"""The runtime program: a lowered module over live state (``Program``), how a call's
arguments reach its functions (``call_inputs``), and the state it runs on: the model's
tensors by FQN (``state_of``) and the tensors the program makes itself (``constants``,
``gathered_copies``, on ``device_of`` the state). ``dcir_lowering.backend.lower`` makes a
``Program``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from dcir import signature
from dcir.buffers import GRAD_ACC_OF, UNSHARD_OF
from dcir.ir import Function, Module, ShardType
from dcir.roles import BACKWARD, BACKWARD_LAST, EVAL, FORWARD, STEP, UNSHARD
from dcir.shapes import torch_dtype


@dataclass
class Program:
    """A lowered program over live state (the model's tensors, by FQN): each function
    with a role (``dcir/roles.py``) lowered to a GraphModule taking ``(state, grads,
    *args)`` (``graphs``), and what runs it (``runs``: the same, or compiled).

    ``forward(*args, **kwargs)`` returns ``(outputs, saved)``, split as ``@forward``'s
    signature declares (``dcir/signature.py``); ``backward(saved, grads)`` returns the
    gradients by FQN; ``train_step(*args, **kwargs)`` does both, with the gradient of
    every output all ones (for a loss: ``loss.backward()``), and accumulates into the
    parameters' ``.grad``. Arguments are matched to the ``{input = ...}`` arguments by
    their names (``args[0]`` or a keyword such as ``labels``). ``device``: where the
    program's own tensors (``constants``, ``gathered_copies``, tangents) live.
    """

    module: Module
    state: dict
    graphs: dict[str, fx.GraphModule]
    runs: dict[str, object]
    device: torch.device

    def function(self, role: str):
        return self.module.role(role)

    @property
    def forward_gm(self):
        return self.graphs.get(FORWARD)

    @property
    def step_gm(self):
        return self.graphs.get(STEP)

    def backward_for(self, last: bool) -> tuple[str, fx.GraphModule, object]:
        """(role, graph, callable) of the backward to run: ``@backward_last`` in the last
        micro-step of an optimizer step when the module has one, else ``@backward``."""
        role = BACKWARD_LAST if last and BACKWARD_LAST in self.graphs else BACKWARD
        return role, self.graphs[role], self.runs[role]

    def unshard(self) -> None:
        """Gather the copies ``@unshard`` fills: once per optimizer step, before its
        first micro-step (the parameters change only at the step)."""
        if UNSHARD in self.graphs:
            self.graphs[UNSHARD](self.state, {})

    @functools.cached_property
    def differentiable(self) -> frozenset[int]:
        """The outputs the backward takes a gradient of (``{grad = K}``)."""
        return frozenset(k for _, k in signature.grads(self.function(self.backward_for(False)[0])))

    def split(self, role: str, out) -> tuple[list, tuple]:
        """A run's results of the function of ``role``: (its outputs, the rest)."""
        kinds = [signature.kind(d) for d in self.function(role).result_attrs]
        out = list(out or ())
        return ([v for v, k in zip(out, kinds) if k == signature.OUTPUT],
                tuple(v for v, k in zip(out, kinds) if k != signature.OUTPUT))

    def forward(self, *args, **kwargs):
        role = FORWARD if FORWARD in self.runs else EVAL
        return self.split(role, self.runs[role](self.state, {}, *self.inputs(role, args, kwargs)))

    def inputs(self, role: str, args: tuple, kwargs: dict) -> list:
        """The call's ``args`` and ``kwargs`` in the order of the ``{input}`` arguments of
        the function of ``role`` (``call_inputs``)."""
        return call_inputs(self.function(role), args, kwargs)

    def tangents(self, given: dict | None = None, last: bool = True) -> list:
        """The backward's ``{grad = K}`` arguments: ``given[K]`` (the gradient of output K),
        zeros where it has none (the loss did not use that output); without ``given``,
        ones (the gradient of the outputs' sum)."""
        bw = self.function(self.backward_for(last)[0])
        device = self.device
        out = []
        for arg, k in signature.grads(bw):
            dtype = torch_dtype(arg.type.dtype)
            g = given.get(k) if given is not None else torch.ones(arg.type.shape, dtype=dtype, device=device)
            out.append(torch.zeros(arg.type.shape, dtype=dtype, device=device) if g is None else g.to(dtype))
        return out

    def backward(self, saved, grads: list, last: bool = True) -> dict:
        """Gradients by FQN; ``last``: this is the last micro-step of an optimizer step."""
        out: dict = {}
        self.backward_for(last)[2](self.state, out, [*saved, *grads])
        return out

    @torch.no_grad()
    def train_step(self, *args, **kwargs):
        self.unshard()
        outputs, saved = self.forward(*args, **kwargs)
        for fqn, g in self.backward(saved, self.tangents()).items():
            p = self.state[fqn]
            g = g.detach().reshape(p.shape)  # a one-rank shard is the flattened gradient
            p.grad = g.clone() if p.grad is None else p.grad + g
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def call_inputs(func: Function, args: tuple, kwargs: dict) -> list:
    """A call's ``args`` and ``kwargs`` in the order of ``func``'s ``{input}`` arguments,
    by their names (``args[0]``, ``labels``); a function that declares none takes them
    by position."""
    if not signature.args(func, signature.INPUT):  # a hand-written function: by position
        return list(args) + list(kwargs.values())
    out = []
    for name in signature.input_names(func):
        m = re.fullmatch(r"args\[(\d+)\]", name)
        if m and int(m.group(1)) < len(args):
            out.append(args[int(m.group(1))])
        elif name in kwargs:
            out.append(kwargs[name])
        else:
            raise TypeError(f"the captured step takes an input {name!r} that this call does not give")
    return out



def device_of(tensors) -> torch.device:
    """Where a program over ``tensors`` runs: the first tensor's device; with none,
    torch's default device (``torch.set_default_device``)."""
    first = next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)
    return first if first is not None else torch.get_default_device()


def constants(module: Module, device: torch.device | str) -> dict:
    """The buffers whose text spells out their value (``{value = [...]}``), as tensors on ``device``."""
    out = {}
    for name, decl in module.decls.items():
        if "value" in decl.attrs:
            t = decl.type
            values = [complex(v) if isinstance(v, str) else v for v in decl.attrs["value"]]  # complex: "(1+2j)"
            out[name] = torch.tensor(values, dtype=torch_dtype(t.dtype), device=device).reshape(t.shape)
    return out


def gathered_copies(module: Module, device: torch.device | str) -> dict:
    """Storage for the buffers the schedule keeps: gathered copies of parameters (filled
    by ``@unshard``) and gradient accumulators (``zero1``'s full ones, HSDP's shards; zero
    at the start)."""
    out = {}
    for name, d in module.decls.items():
        if UNSHARD_OF in d.attrs or GRAD_ACC_OF in d.attrs:
            shape = d.type.numel if isinstance(d.type, ShardType) else d.type.shape  # a shard is flat
            out[name] = torch.zeros(shape, dtype=torch_dtype(d.type.dtype), device=device)
    return out


def state_of(model: torch.nn.Module) -> dict:
    """A model's parameters and buffers by FQN: the state a Program runs on."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}

