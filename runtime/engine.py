"""The training Engine: an unmodified model, trained sharded through DCIR.

``engine = dcir.initialize(model, optimizer=torch.optim.AdamW, config={...})``, then per
micro-step ``loss = engine(*args, **kwargs)``, ``engine.backward(loss)``,
``engine.step()``. Under ``torchrun`` every process is one rank; without it the engine
runs a world of one.

What happens:

1. ``initialize`` joins the process group (gloo on CPU, NCCL when the model is on a
   GPU), loads the C++ runtime, makes every rank start from rank 0's parameters and
   buffers, and keeps of each parameter only this rank's flat shard (the layout of
   ``shard<T, N>``), in the runtime's shard store. The optimizer is built over the
   shards, so its state is sharded too.
2. The first call captures the step (``dcir.compile_to_ir``) on rank 0 with that call's
   inputs, runs ``zero3`` and the configured passes, and sends the program's text to
   the other ranks, so every rank runs the same verified program. The model's full
   parameters are released then: from here on the engine owns the parameters.
3. Each call runs the lowered ``@forward``; ``backward`` runs ``@backward``, whose
   ``grad.set`` ops hand over reduce-scattered gradient shards, accumulated into the
   shards' ``.grad``; ``step`` runs the optimizer at the accumulation boundary.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

import dcir
from dcir.cost import estimate_module
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import TensorType
from dcir.memory import GRAD_ACC_OF, UNSHARD_OF, format_bytes, peaks as memory_peaks
from dcir.passes import PassManager, parse_pipeline
from dcir.passes.offload import Offload
from dcir.passes.zero1 import Zero1
from dcir.passes.zero2 import Zero2
from dcir.passes.zero3 import Zero3
from dcir_lowering.backend import Program, lower
from dcir_lowering.frontend import compile_to_ir
from dcir_runtime import native, precision
from dcir_runtime.config import Config
from dcir_runtime.offload import ABSENT, StateStore
from dcir_runtime.profiler import Profile, copy_profile


class RankFailure(RuntimeError):
    """A collective failed: another rank crashed, diverged or timed out."""


def initialize(model: torch.nn.Module, optimizer=None, config=None, *, loss_fn: Callable | None = None,
               lr_scheduler: Callable | None = None) -> "Engine":
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
    step; it is ``engine.lr_scheduler``."""
    config = Config.load(config)
    _check_scheduler_factory(lr_scheduler)  # before anything joins a group or holds a shard
    return Engine(model, optimizer, config, loss_fn, lr_scheduler)


#: How long the other ranks wait for rank 0 to capture and compile the step (tens of
#: seconds for a large model; a collective's ``timeout_s`` would be too short).
CAPTURE_TIMEOUT_S = 900


def _join_group(config: Config, device: torch.device) -> None:
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=config.timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # not launched by torchrun: a world of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _check_scheduler_factory(make: Callable | None) -> None:
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
    _check_scheduler_factory(make)
    scheduler = make(optimizer)
    if getattr(scheduler, "optimizer", optimizer) is not optimizer or not callable(getattr(scheduler, "step", None)):
        raise DcirError(Diagnostic("lr_scheduler(optimizer) must return a scheduler of that optimizer"))
    return scheduler


class Engine:
    _count = 0

    def __init__(self, model: torch.nn.Module, optimizer, config: Config, loss_fn: Callable | None = None,
                 lr_scheduler: Callable | None = None):
        self.config, self.model, self.loss_fn = config, model, loss_fn
        precision.attach(self)  # self.precision, self.loss_scaler, self.skipped_steps
        self.device = next(model.parameters()).device
        _join_group(config, self.device)
        native.load()
        self.ops = torch.ops.dcir
        self.ops.set_timeout(int(config.timeout_s * 1000))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.group.WORLD.group_name
        self._sync_from_rank0(model)
        # one shard per distinct parameter (tied weights are one), named by its first FQN
        self.aliases: dict[str, list[str]] = {}
        first: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.aliases.setdefault(first.setdefault(id(p), name), []).append(name)
        self.shapes: dict[str, torch.Size] = {}
        self.shards: dict[str, torch.nn.Parameter] = {}
        self.ops.reset_peak()
        # several engines may live in one process: each keeps its shards under its own prefix
        Engine._count += 1
        self.store_prefix = f"engine{Engine._count}/"
        for name, p in model.named_parameters():
            self.shapes[name] = p.shape
            self.shards[name] = torch.nn.Parameter(self._shard_of(p.detach()), requires_grad=p.requires_grad)
            self.ops.set_shard(self.store_prefix + name, self.shards[name])
        self.full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        try:
            self._build_optimizer(optimizer, model, lr_scheduler)
        except BaseException:  # a half-built engine keeps no shards (nor leaves them to interpreter shutdown)
            self.ops.drop_shards(self.store_prefix)
            self.store_prefix = None
            raise
        self.last_grad_norm: torch.Tensor | None = None  # what the last clipping measured
        self.module: dcir.Module | None = None
        self.program: Program | None = None
        self._saved = None
        # state handed between functions (offload): the last backward's results are @step's
        # arguments, @step's results the next forward's last arguments
        self._step_args: tuple = ()
        self._forward_args: tuple = ()
        self.micro_steps = 0
        self.steps = 0
        self._gather_next = False  # after a checkpoint load: gather replicas at the next call
        self._place_loaded_state = False  # a checkpoint loaded before capture: offloaded state goes home
        self.capture_s = 0.0
        self.base_text = ""
        self.captured_peak: dict[str, int] = {}
        self._profile: Profile | None = None
        self._profiled: dcir.Module | None = None
        self._tracer = None  # dcir_runtime.trace.Tracer of the next step, when one is asked for
        self.optimize_log: list[dict] = []
        self._budget_cut = 0                 # taken off the passes' budget after a step went over
        self._replanned_for_memory = False
        self._cut_applied = False

    def __del__(self):
        ops = getattr(self, "ops", None)
        if ops is not None and getattr(self, "store_prefix", None):
            try:
                ops.drop_shards(self.store_prefix)
            except Exception:  # interpreter shutdown: the library may be gone already
                pass

    # ---- sharding ------------------------------------------------------------------------

    @torch.no_grad()
    def _sync_from_rank0(self, model: torch.nn.Module) -> None:
        if self.world == 1:
            return
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)

    def _collective_device(self) -> torch.device:
        """Where a small tensor for a torch.distributed collective lives: NCCL reduces
        only GPU tensors, gloo CPU ones."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _build_optimizer(self, optimizer, model: torch.nn.Module, lr_scheduler: Callable | None) -> None:
        """The optimizer over the trainable shards, its schedule, and the optimizer-state
        store ``@step`` runs on (the ``offload`` pass; None: ``optimizer.step()``)."""
        if optimizer is None:
            optimizer = torch.optim.AdamW
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = self._rebuild(optimizer, model)
        self._make_optimizer = optimizer
        trainable = {n: s for n, s in self.shards.items() if s.requires_grad}
        self.optimizer = optimizer(list(trainable.items()))
        self.lr_scheduler = _scheduler(lr_scheduler, self.optimizer)
        self.state_store = None
        if self.config.offload is not None:
            self.state_store = StateStore(self.optimizer, trainable, self.device)

    def _rebuild(self, built: torch.optim.Optimizer, model: torch.nn.Module) -> Callable:
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
            if set(shard) == {"probe"}:  # _state_keys: one parameter, the first group's settings
                return type(built)([{**groups[0], "params": list(named)}])
            return type(built)([{**g, "params": [(n, shard[n]) for n in g["params"] if n in shard]}
                                for g in groups if any(n in shard for n in g["params"])])
        return make

    def _shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's flat shard: ``full`` flattened, zero-padded to a multiple of the
        world size, elements ``[rank * chunk, (rank + 1) * chunk)``."""
        chunk = -(-full.numel() // self.world)
        flat = torch.nn.functional.pad(full.reshape(-1), (0, chunk * self.world - full.numel()))
        return flat[self.rank * chunk:(self.rank + 1) * chunk].clone()

    # ---- capture ------------------------------------------------------------------------

    def _from_rank0(self, key: str, make: Callable[[], str]) -> str:
        """Rank 0 runs ``make`` (returns module text, may raise DcirError); every rank
        gets its text, or rank 0's error, through the rendezvous store."""
        key = f"dcir/{self.store_prefix}{key}"
        store = dist.distributed_c10d._get_default_store()
        if self.rank == 0:
            try:
                status, text = "ok", make()
            except DcirError as e:
                status, text = "error", e.render()
            if self.world > 1:
                store.set(key, f"{status}\n{text}")
        else:
            store.wait([key], datetime.timedelta(seconds=CAPTURE_TIMEOUT_S))
            status, text = store.get(key).decode().split("\n", 1)
        if status == "error":
            raise DcirError(Diagnostic(f"rank 0 could not compile the step:\n{text}"))
        return text

    def _capture(self, args: tuple, kwargs: dict) -> None:
        begin = time.perf_counter()

        def compile_step() -> str:
            module = compile_to_ir(self.model, args, kwargs=kwargs, loss_fn=self.loss_fn,
                                   **precision.capture_options(self.precision))
            dcir.run_passes(module, [self._stage_pass(), *precision.passes(self.precision), *self._offload_pass(),
                                     *self._passes(self.config.passes)])
            return dcir.print(module)

        self.base_text = self._from_rank0("program", compile_step)
        module = dcir.parse(self.base_text, self._source_name())
        self.captured_peak = memory_peaks(module)  # what a plan starts from
        self._install(module)
        for p in self.model.parameters():  # the engine owns the parameters from here on
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.capture_s = time.perf_counter() - begin

    def _stage_pass(self):
        """The pass of the configured ZeRO stage."""
        if self.config.zero_stage == 1:
            return Zero1(world_size=self.world, micro_steps=self.config.gradient_accumulation_steps)
        return (Zero2 if self.config.zero_stage == 2 else Zero3)(world_size=self.world)

    def _offload_pass(self) -> list:
        """``offload`` within the configured budget, for the state this optimizer keeps."""
        if self.config.offload is None:
            return []
        return [Offload(budget=self.config.offload["budget"], state="+".join(self._state_keys()),
                        micro_steps=self.config.gradient_accumulation_steps)]

    def _state_keys(self) -> list[str]:
        """The optimizer's per-element state tensors (Adam: exp_avg, exp_avg_sq), found by
        stepping a fresh optimizer of the same kind once on a two-element parameter."""
        probe = torch.nn.Parameter(torch.zeros(2, device=self.device))
        probe.grad = torch.zeros_like(probe)
        opt = self._make_optimizer([("probe", probe)])
        opt.step()
        return [k for k, v in opt.state[probe].items() if isinstance(v, torch.Tensor) and v.shape == probe.shape]

    def _source_name(self) -> str:
        return f"<{type(self.model).__name__} on {self.world} ranks>"

    def _install(self, module: dcir.Module) -> None:
        state = dict(self.model.named_buffers())
        if self.state_store is not None and self._place_loaded_state:
            from dcir_runtime.checkpoint import place_loaded_state
            place_loaded_state(self, module)  # binds the store too
            self._place_loaded_state = False
        elif self.state_store is not None:
            self.state_store.bind(module)
        self.program = lower(module, state, inductor=self.config.inductor, group=self.group,
                             store_prefix=self.store_prefix, optimizer_state=self.state_store)
        self.module = module
        step = module.functions.get("step")
        carried = len(step.returns) if step is not None else 0
        if len(self._forward_args) != carried:  # before the first step: no state exists yet
            self._forward_args = (ABSENT,) * carried

    # ---- the optimization cycle -------------------------------------------------------------

    def _passes(self, specs: list[str], budget: int | None = None) -> list:
        """The passes of ``specs``, with what the engine knows filled in where the spec
        leaves it open: the memory ``budget``, and the micro-steps per optimizer step."""
        out = []
        for p in parse_pipeline(",".join(specs)):
            if getattr(p, "budget", "n/a") is None and budget is not None:
                p = dataclasses.replace(p, budget=budget)
            if getattr(p, "micro_steps", None) == 1:
                p = dataclasses.replace(p, micro_steps=self.config.gradient_accumulation_steps)
            out.append(p)
        return out

    def _fixed_bytes(self, m: dict) -> int:
        """What a rank holds whatever the schedule: parameter shards, gradient shards (held
        through the backward and the optimizer step), optimizer state, buffers."""
        trainable = sum(s.numel() * s.element_size() for s in self.shards.values() if s.requires_grad)
        return m["parameters"] + trainable + m["optimizer_state_peak"] + m["buffers"]

    def _pass_budget(self) -> int | None:
        """The memory budget left to a schedule: the configured budget less what this
        rank holds whatever the schedule (shards, gradient shards, optimizer state, buffers)."""
        if self.config.memory_budget is None:
            return None
        fixed = self._fixed_bytes(self.memory())
        if fixed + self._budget_cut >= self.config.memory_budget:
            raise DcirError(Diagnostic(
                f"rank {self.rank}: parameter shards, gradient shards, optimizer state and buffers take "
                f"{format_bytes(fixed)}, which leaves nothing of the memory budget of "
                f"{format_bytes(self.config.memory_budget)} for the step's own memory"))
        return self.config.memory_budget - fixed - self._budget_cut

    def _replan(self) -> None:
        """Write the finished profile into the IR, plan the configured passes from it on
        the captured schedule, and switch to the new program."""
        # the ranks agree on every figure, so each one's estimates below, and with them
        # whether to switch, come out the same: every rank must run the same program
        peaks = self._profile.annotate(dist.group.WORLD, self._collective_device())
        self._profile, self._profiled = None, self.module
        profiled = self.module.clone()  # a snapshot, without a print and two parses
        budget = self._pass_budget()
        record: dict = {"step": self.steps, "measured_peak": peaks, "captured_peak": self.captured_peak,
                        "predicted_peak_profiled": memory_peaks(self.module)}

        # the captured schedule keeps every profile: an op this run did not measure (a
        # collective the plan had merged) keeps its figure from an earlier run
        base = dcir.parse(self.base_text, self._source_name())
        copy_profile(profiled, base)
        self.base_text = dcir.print(base)

        def plan() -> str:
            PassManager(self._passes(self.config.optimize["passes"], budget)).run(base)
            return dcir.print(base)

        module = dcir.parse(self._from_rank0(f"plan{self.steps}", plan), self._source_name())
        micro = self.config.gradient_accumulation_steps
        before = estimate_module(profiled, micro_steps=micro)
        after = estimate_module(module, micro_steps=micro)
        # settle: a plan the cost model finds no faster than the running schedule is not taken
        # (unless memory forced this cycle: then the plan within the smaller budget is)
        forced = self._replanned_for_memory and self._budget_cut > 0 and not self._cut_applied
        self._cut_applied = self._cut_applied or forced
        take = after.seconds < before.seconds or forced
        record.update(predicted_before_s=before.seconds, predicted_s=after.seconds if take else before.seconds,
                      planned_s=after.seconds, cost_source=after.source, budget=budget, switched=take,
                      reason="memory" if forced else "faster" if take else "kept",
                      predicted_peak=memory_peaks(module if take else self.module))
        if take:
            self._install(module)
            self.ops.reset_peak()  # the new schedule's gathered peak is measured afresh
        self.optimize_log.append(record)

    def trace(self, path) -> None:
        """Trace the next optimizer step that starts after this call into ``path``: a
        Chrome trace (Perfetto) of this rank with measured and predicted rows
        (``dcir_runtime.trace``). A step the optimization cycle profiles is not traced:
        the next one is."""
        from dcir_runtime.trace import Tracer

        self._tracer = Tracer(lambda: self.module, path, self.rank)

    def profiled_ir(self) -> dcir.Module | None:
        """The last profiled module (ops carry ``prof.*`` attributes), if any."""
        return self._profiled

    # ---- the training step ---------------------------------------------------------------

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """Runs ``@forward`` on this rank's micro-batch; returns the loss."""
        if self.program is None:
            self._capture(args, kwargs)
        inputs = self.program._inputs(args, kwargs)
        self._check_inputs(inputs)
        first = self.micro_steps % self.config.gradient_accumulation_steps == 0  # of an optimizer step
        if first or self._gather_next:
            with torch.no_grad():  # the first micro-step of a step: gathered copies, if any
                self._run("unshard", self.program.unshard)
            self._gather_next = False
        fn = self.program.forward_fn
        if self._profile is not None:
            fn = functools.partial(self._profile.run, "forward", self.program.forward_gm)
        elif self._tracer is not None and (self._tracer.recorded or first):
            fn = functools.partial(self._tracer.run, "forward", self.program.forward_gm)
        with torch.no_grad():
            loss, self._saved = self._run("forward", fn, self.program.state, {}, *inputs, *self._forward_args)
        self._forward_args = (ABSENT,) * len(self._forward_args)  # the copies home are done
        return loss

    def _check_inputs(self, inputs: list) -> None:
        fw = self.module.functions["forward"]
        names = fw.attrs.get("capture.inputs") or [f"%{a.name}" for a in fw.args]
        for arg, name, x in zip(fw.args, names, inputs):
            if isinstance(arg.type, TensorType) and tuple(x.shape) != tuple(arg.type.shape):
                raise DcirError(Diagnostic(
                    f"input {name} has shape {list(x.shape)}; the program was captured for {arg.type} "
                    "(shapes are static: give every micro-batch the captured shape)"))

    def _run(self, which: str, fn, *args):
        try:
            out = fn(*args)
        except RuntimeError as e:
            if "dcir runtime" not in str(e) and "Connection closed" not in str(e) and "Gloo" not in str(e):
                raise
            raise RankFailure(f"rank {self.rank} of {self.world}: step {self.steps + 1} failed in @{which}: {e}") from None
        return (out[0], tuple(out[1:])) if which == "forward" else out

    def backward(self, loss: torch.Tensor) -> None:
        """Runs ``@backward`` for the last forward; accumulates this rank's gradient
        shards (scaled by 1/gradient_accumulation_steps) into the shards' ``.grad``."""
        if self._saved is None:
            raise RuntimeError("engine.backward(loss) needs a forward first (loss = engine(...))")
        scale = 1.0 / self.config.gradient_accumulation_steps
        tangent = torch.full_like(loss, scale * precision.loss_scale(self))
        grads: dict = {}
        last = (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0
        name, gm, fn = self.program.backward_for(last)
        if self._profile is not None:
            fn = functools.partial(self._profile.run, name, gm)
        elif self._tracer is not None and self._tracer.recorded:
            fn = functools.partial(self._tracer.run, name, gm)
        with torch.no_grad():
            out = self._run(name, fn, self.program.state, grads, *self._saved, tangent)
            self._saved = None
            if last:  # what the last backward hands to @step: optimizer state reloaded early
                self._step_args = tuple(out or ())
            precision.unscale(self, grads)
            for name, g in grads.items():
                shard = self.shards[name]
                shard.grad = g.detach() if shard.grad is None else shard.grad.add_(g)

    def step(self) -> bool:
        """Ends a micro-step; at the accumulation boundary runs the optimizer on the
        shards and clears their gradients. Returns whether the optimizer ran."""
        self.micro_steps += 1
        if self.micro_steps % self.config.gradient_accumulation_steps:
            return False
        if not precision.step_or_skip(self):  # fp16: inf/NaN gradients skip the step
            return False
        if self.config.gradient_clipping is not None:
            self._clip(self.config.gradient_clipping, 2.0)
        if self.program.step_gm is not None:  # the program's own step: state moves as it says
            with torch.no_grad():
                fn = self.program.step_gm
                if self._profile is not None:  # its ops' costs, for the cost model's step
                    fn = functools.partial(self._profile.run, "step", self.program.step_gm)
                elif self._tracer is not None and self._tracer.recorded:
                    fn = functools.partial(self._tracer.run, "step", self.program.step_gm)
                out = self._run("step", fn, self.program.state, {}, *self._step_args)
            self._step_args = ()
            self._forward_args = tuple(out or ())  # state still on the device, copied home next forward
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.steps += 1
        if self._tracer is not None and self._tracer.recorded:
            self._tracer.write()
            self._tracer = None
        if self._profile is not None:
            self._replan()
        elif self.config.optimize is not None and self.steps in self.config.optimize["profile_at"]:
            self._profile = Profile(self.module)  # the next step runs under the profiler
        self._check_budget()
        return True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale this optimizer step's gradients so that their norm, taken over every
        parameter of the model (all ranks' shards), is at most ``max_norm``; returns that
        total norm, the same on every rank, as ``torch.nn.utils.clip_grad_norm_`` does on
        one device. A collective: every rank calls it, after the backward of the last
        micro-step of an optimizer step and before ``engine.step()``."""
        if self.program is None or (self.micro_steps + 1) % self.config.gradient_accumulation_steps:
            raise DcirError(Diagnostic(
                "clip_grad_norm_ clips a whole step's gradients: call it after its last micro-step's backward "
                f"(every {self.config.gradient_accumulation_steps}), before engine.step()"))
        return self._clip(float(max_norm), float(norm_type))

    @torch.no_grad()
    def _clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The global norm of the shards' gradients (padding is zero and adds nothing),
        summed across ranks in float64; the gradients scaled by ``max_norm / (norm +
        1e-6)`` when that is below 1, as torch's ``clip_grad_norm_`` does."""
        grads = [s.grad for s in self.shards.values() if s.grad is not None]
        device = self._collective_device()
        if norm_type == float("inf"):
            local = max((g.abs().max().double() for g in grads), default=torch.zeros((), dtype=torch.float64))
            total = local.reshape(1).to(device)
            if self.world > 1:
                dist.all_reduce(total, op=dist.ReduceOp.MAX)
        else:
            local = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=torch.float64))
            total = local.reshape(1).to(device)
            if self.world > 1:
                dist.all_reduce(total)
            total = total.pow(1.0 / norm_type)
        norm = total[0].to(self.device, torch.float32)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        self.last_grad_norm = norm
        return norm

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale ``backward`` multiplies the loss by (DeepSpeed's name); 1 without."""
        return precision.loss_scale(self)

    def get_lr(self) -> list[float]:
        """The learning rate of each of the optimizer's parameter groups (DeepSpeed's name)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def _check_budget(self) -> None:
        """After a step: over the memory budget is an error, unless the optimization
        cycle can plan again within less (once: the overshoot, agreed across ranks,
        comes off the budget the passes get, and the next step is profiled)."""
        budget = self.config.memory_budget
        if budget is None:
            return
        m = self.memory()
        # the program's replicas and accumulators are the schedule's memory: the passes'
        # budget leaves them out of the fixed part, because the memory model counts them
        held = self._fixed_bytes(m) + m["replicas"] + m["gradient_accumulators"] + m["gathered_peak"]
        over = held - budget
        if self.config.optimize is not None and self.world > 1:
            agreed = torch.tensor([float(over)], dtype=torch.float64, device=self._collective_device())
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            over = int(agreed.item())
        if over <= 0:
            return
        if self.config.optimize is not None and not self._replanned_for_memory and self.optimize_log:
            self._replanned_for_memory = True
            self._budget_cut += over
            self._profile = self._profile or Profile(self.module)
            return
        raise DcirError(Diagnostic(
            f"rank {self.rank} holds {format_bytes(held)} (parameters, gradients, optimizer state, buffers, "
            f"replicas, accumulators and the peak of gathered parameters), over the memory budget of {format_bytes(budget)}"))

    # ---- state ---------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag: str | None = None, client_state=None):
        """Writes everything needed to continue (shards, optimizer state, steps, RNG,
        the position in gradient accumulation, ``client_state``) to ``save_dir/<tag>/``
        (default ``step<N>``) on torch.distributed.checkpoint, visible only once complete;
        a collective. Returns its directory (``dcir_runtime.checkpoint``, docs/checkpoint.md)."""
        from dcir_runtime import checkpoint
        return checkpoint.save(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir, tag: str | None = None):
        """Loads ``load_dir/<tag>`` (default: the latest complete checkpoint), saved at any
        world size, ZeRO stage or offload setting; a collective. Returns (its directory,
        the ``client_state`` it was saved with). On any error the engine is unchanged."""
        from dcir_runtime import checkpoint
        return checkpoint.load(self, load_dir, tag)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, by FQN (tied names share a tensor), on every rank:
        a collective, so every rank must call it."""
        out = {}
        for name, shard in self.shards.items():
            full = self.ops.wait(self.ops.all_gather(shard.detach(), list(self.shapes[name]), self.group, name))
            full = full.clone()
            for alias in self.aliases[name]:
                out[alias] = full
        return out

    def ir(self) -> dcir.Module:
        """The DCIR module this engine runs (after the first call has captured it)."""
        if self.module is None:
            raise RuntimeError("engine.ir() exists after the first call: capture needs the step's inputs")
        return self.module

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, as the runtime accounts them: this engine's parameter
        shards, gradient shards, optimizer state on the device (now and at its peak,
        which ``offload`` bounds) and in host memory, replicated buffers, the program's
        gathered copies of parameters (``replicas``: ``zero1``/``zero2``, ``unshard``
        across micro-steps) and gradient accumulators (``zero1``), gathered
        parameters now and at their peak (the runtime's, for the process); plus the
        full model's parameter bytes for comparison, and the runtime's counters:
        collectives started, bytes sent, seconds blocked in ``comm.wait`` of a
        collective (``wait_s``) and of a host copy (``copy_wait_s``, ``offload``)."""
        stats = self.ops.memory_stats()
        grads = sum(s.grad.numel() * s.grad.element_size() for s in self.shards.values() if s.grad is not None)
        tensors = [t for st in self.optimizer.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0]
        store = self.state_store
        host = sum(t.numel() * t.element_size() for t in tensors if store is not None and store.is_host(t))
        state = sum(t.numel() * t.element_size() for t in tensors) - host
        buffers = sum(b.numel() * b.element_size() for b in self.model.buffers())
        held = {UNSHARD_OF: 0, GRAD_ACC_OF: 0}  # the program's own buffers
        for name, d in (self.module.decls.items() if self.module is not None else ()):
            for kind in held:
                if kind in d.attrs:
                    held[kind] += d.full_type.nbytes
        params = sum(s.numel() * s.element_size() for s in self.shards.values())
        return {"parameters": params, "gradients": grads, "optimizer_state": state,
                "optimizer_state_peak": max(state, store.peak if store is not None else 0),
                "optimizer_state_host": host, "buffers": buffers,
                "replicas": held[UNSHARD_OF], "gradient_accumulators": held[GRAD_ACC_OF],
                "gathered_now": stats[1], "gathered_peak": stats[2], "full_parameters": self.full_bytes,
                "collectives": stats[4], "sent": stats[5], "wait_s": stats[6] / 1e9,
                "copy_wait_s": store.wait_s if store is not None else 0.0}
