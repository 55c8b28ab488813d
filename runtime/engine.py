"""The training Engine: an unmodified model, trained sharded through DCIR.

``engine = dcir.initialize(model, optimizer=torch.optim.AdamW, config={...})``, then per
micro-step ``loss = engine(*args, **kwargs)``, ``engine.backward(loss)``,
``engine.step()``. Under ``torchrun`` every process is one rank; without it the engine
runs a world of one.

The Engine is the public face of five parts, each in its own module (docs/runtime.md,
"How the Engine is built"):

* ``group``: the process group, joined by ``initialize`` (and left again when
  ``initialize`` fails after creating it);
* ``materialize`` and ``shards``: this rank's flat shard of every parameter, from the
  model's values, its init on the meta device or a pretrained checkpoint, in the
  runtime's shard store, and the optimizer over the shards, so its state is sharded
  too. The model's parameters go to the meta device: from here on the engine holds them;
* ``capture``: on the first call, rank 0 captures the step with that call's inputs on
  fake tensors, runs the stage's pass and the configured passes, and every rank runs
  its text;
* ``plan``: the passes and the optimization cycle (profile a step, replan, switch);
* ``execution``: the micro-step protocol, ``@forward`` / ``@backward`` / ``@step``,
  with ``accounting`` saying what the rank holds.

This module wires them: what one part learns (a new plan, a finished step) the
Engine hands to the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

import torch

import dcir
from dcir.diagnostics import DcirError, Diagnostic
from dcir_lowering import backend
from dcir_lowering.stretches import stretch_times
from dcir_runtime import checkpoint, native
from dcir_runtime.accounting import (MemoryStats, StepPeak, fixed_bytes, kept_gradients, measure, note_caller,
                                     scheduled_bytes)
from dcir_runtime.capture import source_name
from dcir_runtime.config import Config
from dcir_runtime import materialize, programs, transport
from dcir_runtime.execution import Execution, Installed, RankFailure
from dcir_runtime.group import ProcessGroup, local_world
from dcir_runtime.plan import Planner
from dcir_runtime.shards import ShardedParameters, ShardOptimizer, check_scheduler_factory
from dcir_runtime.trace import Tracer

__all__ = ["Engine", "RankFailure", "initialize"]


def initialize(model: torch.nn.Module, optimizer=None, config=None, *, loss_fn: Callable | None = None,
               lr_scheduler: Callable | None = None, param_init_fn: Callable | None = None,
               stream_init: bool = False, pretrained=None, mesh=None) -> "Engine":
    """An Engine that trains ``model`` sharded across the ranks of this job.

    ``optimizer`` is a ``torch.optim`` class (built with its defaults), a callable taking
    the trainable parameter shards as ``(fqn, shard)`` pairs, as ``named_parameters()``
    gives them, and returning an optimizer (``lambda ps: AdamW(ps, lr=1e-3)``, or
    parameter groups chosen by name), or an optimizer built on the model's own
    parameters (DeepSpeed's way), rebuilt with its groups over the shards; None: AdamW.
    Groups keep their names (``engine.optimizer.param_groups[i]["param_names"]``).
    ``config`` is a dict or a JSON file (``Config``).
    ``loss_fn(output)`` computes the loss when the model's output is not one (see
    ``dcir.compile_to_ir``). ``lr_scheduler`` is a callable taking the engine's
    optimizer and returning a ``torch.optim.lr_scheduler`` scheduler (``lambda opt:
    LambdaLR(opt, warmup)``), which ``engine.step()`` advances after every optimizer
    step; it is ``engine.lr_scheduler``.

    No rank holds a full copy of the model (docs/runtime.md, "Starting without the full
    model"). ``model`` may be built on the meta device (``with torch.device("meta"):``);
    each rank then materializes and keeps only its shards, initialized module by module
    with ``param_init_fn(module)`` if given, else a ``transformers`` model's own weight
    init, else each module's ``reset_parameters()``; ``stream_init=True`` runs that init
    on rank 0 alone and scatters each parameter's shards. ``pretrained`` (a
    ``.safetensors`` file, a ``.safetensors.index.json`` or a directory ``save_pretrained``
    wrote) gives the parameters' values instead: each rank reads only its slices. After
    this call the model's parameters are on the meta device: the engine holds them.

    ``mesh``: a 2-D ``DeviceMesh`` of dimensions (replicate, shard), as FSDP2's
    ``fully_shard(mesh=...)`` takes for HSDP: parameters sharded over ``shard`` (the ranks of
    a node), replicated over ``replicate`` (the config's ``mesh`` says the same without one)."""
    config = _mesh_config(Config.load(config), mesh)
    check_scheduler_factory(lr_scheduler)  # before anything joins a group or holds a shard
    return Engine(model, optimizer, config, loss_fn, lr_scheduler,
                  start=dict(param_init_fn=param_init_fn, stream_init=stream_init, pretrained=pretrained),
                  device_mesh=mesh)


def _mesh_config(config: Config, mesh) -> Config:
    """``config`` with the split of ``initialize(mesh=...)``'s DeviceMesh, checked."""
    if mesh is None:
        return config
    grid = getattr(mesh, "mesh", None)  # a DeviceMesh's ranks, as a tensor
    if not isinstance(grid, torch.Tensor) or grid.dim() != 2:
        got = f"one of shape {list(grid.shape)}" if isinstance(grid, torch.Tensor) else f"a {type(mesh).__name__}"
        raise DcirError(Diagnostic(f"initialize(mesh=...) takes a 2-D DeviceMesh of dimensions (replicate, shard), as "
                                   f"FSDP2's HSDP does; got {got}"))
    shape = tuple(grid.shape)
    if grid.flatten().tolist() != list(range(shape[0] * shape[1])):
        raise DcirError(Diagnostic(f"initialize(mesh=...): the mesh {mesh.mesh.tolist()} does not number the ranks in "
                                   "order, a node's ranks consecutive, as init_device_mesh does"))
    split = {"replicate": shape[0], "shard": shape[1]}
    if config.mesh not in (None, split):
        raise DcirError(Diagnostic(f"the config's mesh {config.mesh} differs from initialize(mesh=...)'s {split}"))
    return dataclasses.replace(config, mesh=split)


def _part(path: str, doc: str) -> property:
    """A read-only attribute of the Engine that is one of its parts' (``"sharded.shards"``)."""
    def get(engine):
        for name in path.split("."):
            engine = getattr(engine, name)
        return engine
    return property(get, doc=doc)


class Engine:
    def __init__(self, model: torch.nn.Module, optimizer, config: Config, loss_fn: Callable | None = None,
                 lr_scheduler: Callable | None = None, start: dict | None = None, device_mesh=None):
        self.model, self.loss_fn = model, loss_fn
        self.device = materialize.device_of(model)
        self.process_group = ProcessGroup.join(config.timeout_s, self.device, config.topology(local_world()), device_mesh)
        try:
            self._set_up(model, optimizer, config, lr_scheduler, start or {})
        except BaseException as e:  # a half-built engine keeps no shards, and leaves a group it made
            if getattr(self, "sharded", None) is not None:
                self.sharded.drop()
            if isinstance(e, Exception):  # an interrupt is not waited on by a barrier
                self.process_group.leave_after_failure()
            raise

    def _set_up(self, model: torch.nn.Module, optimizer, config: Config, lr_scheduler: Callable | None,
                start: dict) -> None:
        group = self.process_group
        native.load()
        self.ops = torch.ops.dcir
        self.ops.set_timeout(int(config.timeout_s * 1000))
        self.sharded = ShardedParameters(model, group.shard_rank, group.shard_world,
                                         materialize.take_shards(model, group, self.device, **start))
        self.transport_bytes = transport.set_up(group, config.transport, self.device)
        self._optim = ShardOptimizer.build(optimizer, model, self.sharded.trainable(), lr_scheduler,
                                           config.offload is not None, self.device)
        self.planner = Planner(config, group, self.sharded.store_prefix, source_name(model, group.world))
        self.execution = Execution(config, group, self.shards, self.optimizer, self.lr_scheduler)
        self._config = config
        self.capture_s = 0.0
        self._step_peak = StepPeak()
        self.training = model.training
        self.programs = programs.Programs()

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone already
            if getattr(self, "sharded", None) is not None:
                self.sharded.drop()

    # ---- what the parts hold, under the Engine's names ----------------------------------------

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        self._config = self.planner.config = self.execution.config = config

    rank = _part("process_group.rank", "this process's rank")
    world = _part("process_group.world", "the number of ranks")
    group = _part("process_group.name", "the c10d name of the process group the runtime's collectives run over")
    shards = _part("sharded.shards", "FQN -> this rank's flat shard (an nn.Parameter; tied parameters are one)")
    shapes = _part("sharded.shapes", "FQN -> the parameter's full shape")
    aliases = _part("sharded.aliases", "FQN of a shard -> every FQN of that parameter")
    store_prefix = _part("sharded.store_prefix", "this engine's prefix in the runtime's shard store")
    full_bytes = _part("sharded.full_bytes", "the whole model's parameter bytes")
    optimizer = _part("_optim.optimizer", "the torch optimizer over the shards, with its state")
    lr_scheduler = _part("_optim.lr_scheduler", "the scheduler ``lr_scheduler(optimizer)`` made, or None")
    state_store = _part("_optim.state_store", "the optimizer-state store ``@step`` runs on (offload), or None")
    module = _part("execution.module", "the running DCIR module (None before capture)")
    program = _part("execution.program", "the running lowered program (None before capture)")
    steps = _part("execution.steps", "optimizer steps done")
    micro_steps = _part("execution.micro_steps", "micro-steps done")
    last_grad_norm = _part("execution.last_grad_norm", "the global gradient norm the last clipping measured")
    optimize_log = _part("planner.log", "one record per optimization cycle (docs/passes.md)")
    precision = _part("execution.precision.policy", "the mixed-precision policy (docs/config.md)")
    loss_scaler = _part("execution.precision.loss_scaler", "fp16's dynamic loss scaler, or None")
    skipped_steps = _part("execution.precision.skipped_steps", "optimizer steps skipped (fp16 overflow, nonfinite 'skip')")

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale ``backward`` multiplies the loss by (DeepSpeed's name); 1 without."""
        return self.execution.precision.loss_scale()

    def trace(self, path) -> None:
        """Trace the next optimizer step that starts after this call into ``path``: a
        Chrome trace (Perfetto) of this rank with measured and predicted rows
        (``dcir_runtime.trace``). A step the optimization cycle profiles is not traced:
        the next one is."""
        self.execution.tracer = Tracer(lambda: self.module, path, self.rank, self._pass_budget)

    def profiled_ir(self) -> dcir.Module | None:
        """The last profiled module (ops carry ``prof.*`` attributes), if any."""
        return self.planner.profiled

    # ---- capture and planning ------------------------------------------------------------------

    def _program_for(self, args: tuple, kwargs: dict) -> Installed:
        """The program for this call: one per mode and input shapes, captured at first use
        (``programs.capture_program``)."""
        grad = torch.is_grad_enabled()
        key = programs.key(self.training, grad, args, kwargs)
        installed = self.programs.get(key)
        if installed is None:
            begin = time.perf_counter()
            installed = programs.capture_program(self, args, kwargs, key, grad)
            self.capture_s += time.perf_counter() - begin
        return installed

    def _install(self, module: dcir.Module) -> None:
        """Run ``module`` as the training program from the next call on (a replan): the
        programs of other shapes are captured again, against it."""
        program = self.lower(module)
        self.execution.install(module, program)
        self.programs.replace_base(module, program)
        self.transport_bytes = transport.fit(self.process_group, self.config.transport, self.transport_bytes, module)

    def lower(self, module: dcir.Module) -> backend.Program:
        """``module`` lowered over this engine's state, all it makes (replicas...) on the engine's device;
        a module with ``@step`` binds the optimizer-state store first (``StateStore.bind``)."""
        if self.state_store is not None and module.role("step") is not None:
            self.state_store.bind(module)  # places the state a checkpoint load left, if one did
        state = dict(self.model.named_buffers())
        return backend.lower(module, state, inductor=self.config.inductor, group=self.process_group.names,
                             store_prefix=self.store_prefix, optimizer_state=self.state_store, device=self.device)

    def optimizer_state_keys(self) -> list[str]:
        """The optimizer's per-element state tensors (Adam: ``exp_avg``, ``exp_avg_sq``), which
        the ``offload`` pass may keep in host memory (``ShardOptimizer.state_keys``)."""
        return self._optim.state_keys(self.device)

    def _pass_budget(self) -> int | None:
        """The memory budget left to a schedule (``Planner.pass_budget``)."""
        return self.planner.pass_budget(lambda: fixed_bytes(self.memory()))

    def _after_step(self) -> None:
        """The optimization cycle's turn after an optimizer step (each region's, for a step with graph
        breaks: ``RegionStep.after_step``; it counts this engine's steps, not a checkpoint's), then the budget."""
        fixed, regions = lambda: fixed_bytes(self.memory()), self.programs.regions
        if regions is not None:
            regions.after_step(self.execution.steps_run, fixed)
        else:
            note_caller(self.module, self.execution.handed.loss_bytes)  # the cycle plans with it
            module = self.planner.cycle(self.execution.steps_run, self.module, fixed,
                                        transport.outbox_bytes if self.transport_bytes else None,
                                        lambda: {name: stretch_times(fn) for name, fn in self.program.runs.items()})
            if module is not None:
                self._install(module)
                self.ops.reset_peak()  # the new schedule's gathered peak is measured afresh
        if self.config.memory_budget is not None:
            m = self.memory()
            self.planner.check_budget(fixed_bytes(m), scheduled_bytes(m),
                                      regions.largest() if regions is not None else self.module)

    # ---- the training step -----------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        """Runs this rank's micro-batch through the model; returns what the model returns
        (a tensor, a tuple, a ``ModelOutput``...). With gradients enabled it is a training
        forward (``@forward``, after ``@unshard`` on the first micro-step): compute any
        loss from the outputs and call ``engine.backward(loss)`` (or ``loss.backward()``).
        Under ``torch.no_grad()`` it runs ``@eval``, a forward that saves nothing."""
        installed = self._program_for(args, kwargs)
        self.execution.profile = self.planner.profile
        if not torch.is_grad_enabled():
            return self.execution.evaluate(installed, args, kwargs)
        return self.execution.forward(installed, args, kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        """Backpropagates ``loss`` (computed from the last forward's outputs) through the
        sharded backward and adds this rank's gradient shards to the shards' ``.grad``.
        ``loss`` is taken as given: under gradient accumulation divide it by the micro-steps,
        or pass ``scale_wrt_gas=True`` (DeepSpeed's default) to have it divided here."""
        self.execution.profile = self.planner.profile
        self.execution.backward(loss, scale_wrt_gas)

    def step(self) -> bool:
        """Ends a micro-step; at the accumulation boundary runs the optimizer on the
        shards and clears their gradients. Returns whether the optimizer ran."""
        self.execution.profile = self.planner.profile
        if not self.execution.step():
            return False
        self._after_step()
        return True

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``engine.step()`` runs the optimizer (DeepSpeed's name)."""
        return self.execution.boundary_next()

    def train(self, mode: bool = True) -> "Engine":
        """Training mode (dropout on, BatchNorm updating its statistics): ``nn.Module.train``'s."""
        self.training = bool(mode)
        return self

    def eval(self) -> "Engine":
        """Evaluation mode: ``engine.eval()`` and ``torch.no_grad()`` run a forward-only program."""
        return self.train(False)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale this optimizer step's gradients so that their norm, taken over every
        parameter of the model (all ranks' shards), is at most ``max_norm``; returns that
        total norm, the same on every rank, as ``torch.nn.utils.clip_grad_norm_`` does on
        one device. A collective: every rank calls it, after the backward of the last
        micro-step of an optimizer step and before ``engine.step()``."""
        if self.program is None or not self.execution.boundary_next():
            raise DcirError(Diagnostic(
                "clip_grad_norm_ clips a whole step's gradients: call it after its last micro-step's backward "
                f"(every {self.config.gradient_accumulation_steps}), before engine.step()"))
        return self.execution.clip(float(max_norm), float(norm_type))

    def get_lr(self) -> list[float]:
        """The learning rate of each of the optimizer's parameter groups (DeepSpeed's name)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    # ---- state -------------------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag: str | None = None, client_state=None, keep_last: int | None = None):
        """Writes everything needed to continue (shards, optimizer state, steps, RNG, the position in
        accumulation, ``client_state``) to ``save_dir/<tag>/`` (default ``step<N>``) on DCP, visible once
        complete, keeping the newest ``keep_last`` complete checkpoints (None: all); a collective.
        Returns its directory (``dcir_runtime.checkpoint``, docs/checkpoint.md)."""
        return checkpoint.save(self, save_dir, tag, client_state, keep_last)

    def load_checkpoint(self, load_dir, tag: str | None = None):
        """Loads ``load_dir/<tag>`` (default: the latest undamaged checkpoint), saved at any
        world size, ZeRO stage or offload setting; a collective. Returns (its directory, its
        ``client_state``). Errors are found before the engine changes (docs/checkpoint.md)."""
        return checkpoint.load(self, load_dir, tag)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, by FQN (tied names share a tensor), on every rank:
        a collective, so every rank must call it."""
        out = {}
        for name, shard in self.shards.items():
            over = self.process_group.shard_name  # the ranks holding distinct shards
            full = self.ops.wait(self.ops.all_gather(shard.detach(), list(self.shapes[name]), over, name)).clone()
            for alias in self.aliases[name]:
                out[alias] = full
        return out

    def ir(self) -> dcir.Module:
        """The DCIR module this engine runs (after the first call has captured it); for a
        step with graph breaks, its first region's (``engine.programs.modules()``: all)."""
        modules = [self.module] if self.module is not None else self.programs.modules()
        if not modules:
            raise RuntimeError("engine.ir() exists after the first call: capture needs the step's inputs")
        return modules[0]

    def memory(self) -> MemoryStats:
        """Bytes this rank holds, as the runtime accounts them, and its counters, by name
        (``m.parameters``, or ``m["parameters"]``): parameter and gradient shards, optimizer
        state (on the device now and at its peak, in host memory), replicated buffers, the
        program's replicas, accumulators and step peak, gathered parameters (now, peak), the
        outbox; collectives, bytes sent, seconds blocked in waits (``accounting.MemoryStats``)."""
        kept = kept_gradients(self.module, self.config.gradient_accumulation_steps,
                              self.programs.regions is not None, self.shards)
        return measure(self.shards, self.optimizer, self.state_store, self.model, self.module, self.full_bytes,
                       self.transport_bytes, self._step_peak(self.module), kept, self.execution.handed.peak)
