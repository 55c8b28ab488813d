"""Execution: the micro-step protocol of an Engine, over the lowered program.

Per micro-step ``engine(...)`` runs ``@forward`` (after ``@unshard`` on the first
micro-step of an optimizer step), ``engine.backward(loss)`` runs ``@backward`` (or
``@backward_last`` on the last micro-step) and accumulates the gradient shards it hands
over into the shards' ``.grad``, and ``engine.step()`` ends the micro-step: at the
accumulation boundary it clips, runs ``@step`` (``offload``) or the optimizer, clears
the gradients and advances the schedule.

State handed between functions (``offload``): the last backward's results are
``@step``'s arguments, and ``@step``'s results the next forward's last arguments.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import dcir
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import TensorType
from dcir_lowering.backend import Program
from dcir_runtime.config import Config
from dcir_runtime.group import ProcessGroup
from dcir_runtime.offload import ABSENT
from dcir_runtime.precision import Precision
from dcir_runtime.profiler import Profile


#: why a loss computed outside the engine is refused, and what to do instead
_OUTSIDE_LOSS = ("a loss computed outside the engine is not supported yet; compute it in the model (labels=) or with "
                 "initialize(..., loss_fn=), and scale it with gradient_accumulation_steps")


class RankFailure(RuntimeError):
    """A collective failed: another rank crashed, diverged or timed out."""


class Execution:
    """The running program, the position in the step (micro-steps, optimizer steps)
    and what passes between its functions."""

    def __init__(self, config: Config, group: ProcessGroup, shards: dict[str, torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer, lr_scheduler):
        self.config, self.group, self.shards = config, group, shards
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.program: Program | None = None
        self.module: dcir.Module | None = None
        self.micro_steps = 0
        self.steps = 0
        self.last_grad_norm: torch.Tensor | None = None  # what the last clipping measured
        self._saved = None  # the last forward's saved values, for its backward
        self._loss = None  # the loss the last forward returned: what backward differentiates
        self._step_args: tuple = ()
        self._forward_args: tuple = ()
        self._gather_next = False  # after a checkpoint load: gather replicas at the next call
        self.precision = Precision(config)  # the policy, and fp16's loss scaling
        self.tracer = None  # dcir_runtime.trace.Tracer of the next step, when one is asked for

    def install(self, module: dcir.Module, program: Program) -> None:
        """Run ``program`` (lowered from ``module``) from the next call on."""
        self.program, self.module = program, module
        step = module.functions.get("step")
        carried = len(step.returns) if step is not None else 0
        if len(self._forward_args) != carried:  # before the first step: no state exists yet
            self._forward_args = (ABSENT,) * carried

    def resume(self, steps: int, micro_steps: int) -> None:
        """A checkpoint was loaded: its counts; a forward without its backward (an
        evaluation) is over; replicas (zero1/2, unshard) come from the loaded shards."""
        self.steps, self.micro_steps = steps, micro_steps
        self._saved = None
        self._gather_next = True

    def boundary_next(self) -> bool:
        """Whether the next ``step()`` ends an optimizer step (the accumulation boundary)."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def _timed(self, which: str, gm, fn, profile: Profile | None, first: bool = False):
        """``fn``, or ``gm`` run by the profiler (the optimization cycle) or by the tracer
        (from the first forward of the step it traces on)."""
        if profile is not None:
            return functools.partial(profile.run, which, gm)
        if self.tracer is not None and (self.tracer.recorded or first):
            return functools.partial(self.tracer.run, which, gm)
        return fn

    def forward(self, args: tuple, kwargs: dict, profile: Profile | None) -> torch.Tensor:
        inputs = self.program._inputs(args, kwargs)
        self._check_inputs(inputs)
        first = self.micro_steps % self.config.gradient_accumulation_steps == 0  # of an optimizer step
        if first or self._gather_next:
            with torch.no_grad():  # the first micro-step of a step: gathered copies, if any
                self._run("unshard", self.program.unshard)
            self._gather_next = False
        fn = self._timed("forward", self.program.forward_gm, self.program.forward_fn, profile, first)
        with torch.no_grad():
            loss, self._saved = self._run("forward", fn, self.program.state, {}, *inputs, *self._forward_args)
        self._forward_args = (ABSENT,) * len(self._forward_args)  # the copies home are done
        self._loss = loss
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
            raise RankFailure(f"rank {self.group.rank} of {self.group.world}: step {self.steps + 1} failed in "
                              f"@{which}: {e}") from None
        return (out[0], tuple(out[1:])) if which == "forward" else out

    def backward(self, loss: torch.Tensor, profile: Profile | None) -> None:
        if self._saved is None:
            raise RuntimeError("engine.backward(loss) needs a forward first (loss = engine(...))")
        if loss is not self._loss:  # the captured backward seeds the captured loss: another would be ignored
            raise DcirError(Diagnostic(
                f"engine.backward(loss) takes the loss the last engine(...) call returned; this tensor is not it: "
                f"{_OUTSIDE_LOSS}"))
        scale = 1.0 / self.config.gradient_accumulation_steps
        tangent = torch.full_like(loss, scale * self.precision.loss_scale())
        grads: dict = {}
        last = self.boundary_next()
        name, gm, fn = self.program.backward_for(last)
        fn = self._timed(name, gm, fn, profile)
        with torch.no_grad():
            out = self._run(name, fn, self.program.state, grads, *self._saved, tangent)
            self._saved = None
            if last:  # what the last backward hands to @step: optimizer state reloaded early
                self._step_args = tuple(out or ())
            self.precision.unscale(grads)
            for name, g in grads.items():
                shard = self.shards[name]
                shard.grad = g.detach() if shard.grad is None else shard.grad.add_(g)

    def step(self, profile: Profile | None) -> bool:
        """Ends a micro-step; at the accumulation boundary clips, runs the optimizer (or
        ``@step``), clears the gradients and advances the schedule. Returns whether the
        optimizer ran."""
        self.micro_steps += 1
        if self.micro_steps % self.config.gradient_accumulation_steps:
            return False
        if not self.precision.step_or_skip(self.shards, self.group, self.optimizer, self.steps):
            return False  # fp16: inf/NaN gradients skip the step
        if self.config.gradient_clipping is not None:
            self.clip(self.config.gradient_clipping, 2.0)
        if self.program.step_gm is not None:  # the program's own step: state moves as it says
            with torch.no_grad():
                fn = self._timed("step", self.program.step_gm, self.program.step_gm, profile)
                out = self._run("step", fn, self.program.state, {}, *self._step_args)
            self._step_args = ()
            self._forward_args = tuple(out or ())  # state still on the device, copied home next forward
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.steps += 1
        if self.tracer is not None and self.tracer.recorded:
            self.tracer.write()
            self.tracer = None
        return True

    @torch.no_grad()
    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The global norm of the shards' gradients (padding is zero and adds nothing),
        summed across ranks in float64; the gradients scaled by ``max_norm / (norm +
        1e-6)`` when that is below 1, as torch's ``clip_grad_norm_`` does."""
        grads = [s.grad for s in self.shards.values() if s.grad is not None]
        device = self.group.collective_device()
        world = self.group.world
        if norm_type == float("inf"):
            local = max((g.abs().max().double() for g in grads), default=torch.zeros((), dtype=torch.float64))
            total = local.reshape(1).to(device)
            if world > 1:
                dist.all_reduce(total, op=dist.ReduceOp.MAX)
        else:
            local = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=torch.float64))
            total = local.reshape(1).to(device)
            if world > 1:
                dist.all_reduce(total)
            total = total.pow(1.0 / norm_type)
        norm = total[0].to(self.group.device, torch.float32)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        self.last_grad_norm = norm
        return norm
