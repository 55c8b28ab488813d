"""What an Engine holds of the model: this rank's flat shard of every parameter, in the
runtime's shard store, and the optimizer built over those shards.

A shard follows the IR's ``shard<T, N>`` layout (``dcir.layout.ShardLayout``): the
parameter flattened, zero-padded to a multiple of the world size, rank ``r`` holding
elements ``[r * chunk, (r + 1) * chunk)``. Tied parameters are one shard, named by the
parameter's first FQN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dcir.diagnostics import DcirError, Diagnostic
from dcir_runtime.pretrained import aliases_of
from dcir_runtime.offload import StateStore


class ShardedParameters:
    """This rank's shards of ``model``'s parameters, registered in the shard store
    under a prefix of their own (several engines may live in one process)."""

    _count = 0

    def __init__(self, model: torch.nn.Module, rank: int, world: int, values: dict[str, torch.Tensor]):
        """``values``: this rank's flat shard of each parameter, by first FQN
        (``materialize.take_shards``); ``model``'s parameters give names and shapes."""
        self.rank, self.world = rank, world
        #: the first FQN of each distinct parameter -> every FQN it goes by
        self.aliases = aliases_of(model)
        self.shapes: dict[str, torch.Size] = {}
        self.shards: dict[str, torch.nn.Parameter] = {}
        ops = torch.ops.dcir
        ops.reset_peak()
        ShardedParameters._count += 1
        self.store_prefix: str | None = f"engine{ShardedParameters._count}/"
        for name, p in model.named_parameters():
            self.shapes[name] = p.shape
            self.shards[name] = torch.nn.Parameter(values[name], requires_grad=p.requires_grad)
            ops.set_shard(self.store_prefix + name, self.shards[name])
        #: the whole model's parameter bytes, for comparison with what a rank holds
        self.full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: s for n, s in self.shards.items() if s.requires_grad}

    def drop(self) -> None:
        """Take the shards out of the shard store (an engine that goes away, or one
        whose ``initialize`` failed, leaves none behind for interpreter shutdown)."""
        if self.store_prefix is None:
            return
        prefix, self.store_prefix = self.store_prefix, None
        torch.ops.dcir.drop_shards(prefix)


@dataclass
class ShardOptimizer:
    """The optimizer over the trainable shards, its schedule, and the optimizer-state
    store ``@step`` runs on (the ``offload`` pass; None: ``optimizer.step()``)."""

    optimizer: torch.optim.Optimizer
    lr_scheduler: object
    state_store: StateStore | None
    #: builds an optimizer of the same kind and settings over ``(fqn, shard)`` pairs
    make: Callable

    @classmethod
    def build(cls, optimizer, model: torch.nn.Module, trainable: dict[str, torch.nn.Parameter],
              lr_scheduler: Callable | None, offload: bool, device: torch.device) -> "ShardOptimizer":
        """``optimizer``: a ``torch.optim`` class, a factory over ``(fqn, shard)`` pairs,
        an optimizer built on ``model``'s parameters (``_rebuild``), or None: AdamW."""
        if optimizer is None:
            optimizer = torch.optim.AdamW
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = _rebuild(optimizer, model)
        built = optimizer(list(trainable.items()))
        scheduler = _scheduler(lr_scheduler, built)
        return cls(built, scheduler, StateStore(built, trainable, device) if offload else None, optimizer)

    def state_keys(self, device: torch.device) -> list[str]:
        """The optimizer's per-element state tensors (Adam: exp_avg, exp_avg_sq), found by
        stepping a fresh optimizer of the same kind once on a two-element parameter."""
        probe = torch.nn.Parameter(torch.zeros(2, device=device))
        probe.grad = torch.zeros_like(probe)
        opt = self.make([("probe", probe)])
        opt.step()
        return [k for k, v in opt.state[probe].items() if isinstance(v, torch.Tensor) and v.shape == probe.shape]


def check_scheduler_factory(make: Callable | None) -> None:
    """A function of the engine's optimizer: a scheduler built beforehand, on the model's
    parameters, would never see the shards the engine updates."""
    if make is not None and (isinstance(make, torch.optim.lr_scheduler.LRScheduler) or not callable(make)):
        raise DcirError(Diagnostic(
            f"lr_scheduler takes a function of the engine's optimizer, not a {type(make).__name__}: "
            "the engine updates the shards, so give lambda opt: LambdaLR(opt, ...)"))


def _scheduler(make: Callable | None, optimizer: torch.optim.Optimizer):
    """``make(optimizer)``, checked: a scheduler of the engine's own optimizer."""
    if make is None:
        return None
    check_scheduler_factory(make)
    scheduler = make(optimizer)
    if getattr(scheduler, "optimizer", optimizer) is not optimizer or not callable(getattr(scheduler, "step", None)):
        raise DcirError(Diagnostic("lr_scheduler(optimizer) must return a scheduler of that optimizer"))
    return scheduler


def _rebuild(built: torch.optim.Optimizer, model: torch.nn.Module) -> Callable:
    """An optimizer built on the model's own parameters (DeepSpeed's ``initialize(model,
    optimizer=opt)``) as a factory of the same class, groups and hyperparameters over
    the shards, each named by its parameter's FQN; frozen parameters are left out."""
    if built.state:
        raise DcirError(Diagnostic(
            f"optimizer {type(built).__name__} has state already (it has stepped): "
            "give the engine a fresh one, or a function of the shards"))
    name_of = {id(p): n for n, p in model.named_parameters()}
    strangers = [p for g in built.param_groups for p in g["params"] if id(p) not in name_of]
    if strangers:
        raise DcirError(Diagnostic(
            f"optimizer {type(built).__name__} holds {len(strangers)} tensor(s) that are not the model's: "
            "build it on model.parameters(), or pass a function of the shards"))
    groups = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
               "params": [name_of[id(p)] for p in g["params"]]} for g in built.param_groups]

    def make(named):
        shard = dict(named)
        if set(shard) == {"probe"}:  # ShardOptimizer.state_keys: one parameter, the first group's settings
            return type(built)([{**groups[0], "params": list(named)}])
        return type(built)([{**g, "params": [(n, shard[n]) for n in g["params"] if n in shard]}
                            for g in groups if any(n in shard for n in g["params"])])
    return make


class EngineOptimizerView(torch.optim.Optimizer):
    """What a training loop (the transformers Trainer, Lightning) holds as its optimizer
    when the Engine trains: the Engine's optimizer over the shards, its parameter
    groups, hyperparameters and state (which an LR scheduler sets). Gradients are the
    Engine's to clear, so ``zero_grad`` does nothing; each loop's subclass says what
    ``step`` is."""

    def __init__(self, engine):  # no Optimizer.__init__: the groups are the Engine's optimizer's
        self.engine = engine

    param_groups = property(lambda self: self.engine.optimizer.param_groups)
    state = property(lambda self: self.engine.optimizer.state)
    defaults = property(lambda self: self.engine.optimizer.defaults)

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass
