"""Execution: the micro-step protocol of an Engine, over the lowered programs.

``out = engine(...)`` runs ``@forward`` (after ``@unshard`` on the first micro-step of
an optimizer step) inside an ``autograd.Function`` (``_Step``) and returns the model's
outputs; the backward of whatever loss the user computes from them runs ``@backward``
(or ``@backward_last`` on the last micro-step) with the outputs' gradients, and adds
the gradient shards it hands over to the shards' ``.grad``: through
``engine.backward(loss)`` or a plain ``loss.backward()``. ``engine.step()`` ends the
micro-step: at the accumulation boundary it clips, runs ``@step`` (``offload``) or the
optimizer, clears the gradients and advances the schedule. Under ``torch.no_grad()``
``engine(...)`` runs ``@eval``: a forward that saves nothing.

State handed between functions (``offload``) follows their signatures: the last
backward's ``{state}`` results are ``@step``'s arguments, and ``@step``'s results the
next forward's ``{state}`` arguments.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

import dcir
from dcir.diagnostics import DcirError, Diagnostic
from dcir.passes.zero3 import LOCAL
from dcir.roles import EVAL, FORWARD
from dcir_lowering.outputs import Outputs
from dcir_lowering.program import Program
from dcir_runtime.accounting import HandedOut
from dcir_runtime.config import Config
from dcir_runtime.group import ProcessGroup, RankFailure
from dcir_runtime.offload import ABSENT
from dcir_runtime.precision import Precision
from dcir_runtime.profiler import Profile


@dataclass
class Installed:
    """One program the engine runs: its module, lowered, and its output's structure."""

    module: dcir.Module
    program: Program
    outputs: Outputs


class _Step(torch.autograd.Function):
    """``@forward`` as one autograd node: its backward runs the backward program with
    the gradients of the outputs. ``anchor`` requires grad, so the node exists even when
    no input does (token ids); it gets no gradient."""

    @staticmethod
    def forward(ctx, execution: "Execution", installed: Installed, anchor, *inputs):
        outputs, saved = execution.run_forward(installed, inputs)
        ctx.execution, ctx.installed, ctx.saved, ctx.n_inputs = execution, installed, saved, len(inputs)
        ctx.set_materialize_grads(False)
        differentiable = installed.program.differentiable
        ctx.mark_non_differentiable(*[o for k, o in enumerate(outputs) if k not in differentiable])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.execution.run_backward(ctx, grads)
        return (None, None, None) + (None,) * ctx.n_inputs


class Execution:
    """The running programs, the position in the step (micro-steps, optimizer steps)
    and what passes between their functions."""

    def __init__(self, config: Config, group: ProcessGroup, shards: dict[str, torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer, lr_scheduler):
        self.config, self.group, self.shards = config, group, shards
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.program: Program | None = None  # the training program the planner plans (the first captured)
        self.module: dcir.Module | None = None
        self.micro_steps = 0
        self.steps = 0
        self.steps_run = 0  # optimizer steps this engine ran: unlike ``steps``, a checkpoint load leaves it
        self.half_loaded: str | None = None  # why a failed checkpoint load left the state partly overwritten
        self.last_grad_norm: torch.Tensor | None = None  # what the last clipping measured
        self._pending = None  # the autograd node of the last training forward, until its backward runs
        self.handed = HandedOut()  # the last training forward's outputs, and what of them its caller keeps
        self._backward_done = False  # this micro-step has had its backward
        self._step_args: tuple = ()
        self._forward_args: tuple = ()
        self._gather_next = False  # after a checkpoint load: gather replicas at the next call
        self.replicas = 0  # the shards' generation: one more after each optimizer step and checkpoint load
        # requires grad, so a training forward's autograd node exists even when no input needs one
        self.anchor = torch.zeros((), requires_grad=True)
        self.precision = Precision(config)  # the policy, and fp16's loss scaling
        self.tracer = None  # dcir_runtime.trace.Tracer of the next step, when one is asked for
        self.profile: Profile | None = None  # set by the engine while the optimization cycle profiles

    def install(self, module: dcir.Module, program: Program) -> None:
        """Plan from and trace ``program`` (lowered from ``module``), the training program."""
        self.program, self.module = program, module
        step = module.role("step")
        carried = len(step.returns) if step is not None else 0
        if len(self._forward_args) != carried:  # before the first step: no state exists yet
            self._forward_args = (ABSENT,) * carried

    def resume(self, steps: int, micro_steps: int) -> None:
        """A checkpoint was loaded: its counts; a forward without its backward (an
        evaluation) is over; replicas (zero1/2, unshard) come from the loaded shards."""
        self.steps, self.micro_steps = steps, micro_steps
        self._pending, self._backward_done = None, False
        self.precision.losses.clear()  # the losses of a step that did not happen
        self._gather_next, self.half_loaded = True, None  # a load succeeded: nothing to refuse
        self.replicas += 1

    def check_loaded(self) -> None:
        """Refuses a state a failed checkpoint load left partly overwritten."""
        if self.half_loaded is not None:
            raise DcirError(Diagnostic(f"the engine's state is partly overwritten ({self.half_loaded}): load a checkpoint before training on, evaluating or saving"))  # noqa: E501

    def boundary_next(self) -> bool:
        """Whether the next ``step()`` ends an optimizer step (the accumulation boundary)."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def _timed(self, which: str, installed: Installed, first: bool = False):
        """What runs the function of role ``which``: its lowered graph, run by the profiler
        (the optimization cycle) or by the tracer (from the first forward of the step it
        traces on) when the training program is running."""
        gm, fn = installed.program.graphs[which], installed.program.runs[which]
        if installed.program is not self.program:
            return fn
        if self.profile is not None:
            return functools.partial(self.profile.run, which, gm, compiled=fn if fn is not gm else None)
        if self.tracer is not None and (self.tracer.recorded or first):
            return functools.partial(self.tracer.run, which, gm)
        return fn

    # ---- forward ---------------------------------------------------------------------------------

    def forward(self, installed, args: tuple, kwargs: dict):
        """The model's outputs, as the model returns them; their backward is the program's
        (or, for a step with graph breaks, its regions': ``dcir_runtime.regions``)."""
        self.check_loaded()
        if self._pending is not None:
            raise DcirError(Diagnostic(
                "engine(...) was called again before engine.backward(loss) of the previous forward: run each "
                "micro-step's backward before the next forward (or evaluate under torch.no_grad())"))
        if self._backward_done:
            raise DcirError(Diagnostic(
                "engine(...) was called after engine.backward(loss) without engine.step(): end each micro-step "
                "with engine.step()"))
        if not isinstance(installed, Installed):  # graph-break regions
            out = installed(args, kwargs)
            self._pending = next((t.grad_fn for t in tree_leaves(out)
                                  if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
            return self.handed.hand(out)
        inputs = installed.program.inputs(FORWARD, args, kwargs)
        outputs = _Step.apply(self, installed, self.anchor, *inputs)
        self._pending = next((o.grad_fn for o in outputs if o.grad_fn is not None), None)
        return installed.outputs.rebuild(list(self.handed.hand(outputs)))  # each tensor, inside a cache too

    def run_forward(self, installed: Installed, inputs) -> tuple[list, tuple]:
        first = self.micro_steps % self.config.gradient_accumulation_steps == 0  # of an optimizer step
        if first or self._gather_next:
            with torch.no_grad():  # the first micro-step of a step: gathered copies, if any
                self.run("unshard", installed.program.unshard)
            self._gather_next = False
        fn = self._timed(FORWARD, installed, first)
        with torch.no_grad():
            out = self.run(FORWARD, fn, installed.program.state, {}, *inputs, *self._forward_args)
        self._forward_args = (ABSENT,) * len(self._forward_args)  # the copies home are done
        return installed.program.split(FORWARD, out)

    @torch.no_grad()
    def evaluate(self, installed, args: tuple, kwargs: dict):
        """``@eval``: the outputs of a forward that saves nothing (``torch.no_grad()``)."""
        self.check_loaded()
        if not isinstance(installed, Installed):  # graph-break regions
            return installed(args, kwargs)
        inputs = installed.program.inputs(EVAL, args, kwargs)
        out = self.run(EVAL, installed.program.runs[EVAL], installed.program.state, {}, *inputs)
        return installed.outputs.rebuild(installed.program.split(EVAL, out)[0])

    def run(self, which: str, fn, *args):
        """``fn(*args)``, the function of role ``which``; a collective that failed is a ``RankFailure``."""
        try:
            return fn(*args)
        except RuntimeError as e:
            if "dcir runtime" not in str(e) and "Connection closed" not in str(e) and "Gloo" not in str(e):
                raise
            raise RankFailure(f"rank {self.group.rank} of {self.group.world}: step {self.steps + 1} failed in "
                              f"@{which}: {e}") from None

    # ---- backward --------------------------------------------------------------------------------

    def backward(self, loss, scale_wrt_gas: bool) -> None:
        """``loss.backward()`` after checking that it reaches the last forward's outputs."""
        if self._pending is None:
            raise DcirError(Diagnostic(
                "engine.backward(loss) ran twice for one forward: its backward has run already"
                if self._backward_done else "engine.backward(loss) needs a forward first: out = engine(...)"))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {list(loss.shape)}"
            raise DcirError(Diagnostic(f"engine.backward(loss) takes a scalar loss tensor, not {what} (the engine "
                                       "returns the model's outputs: compute the loss from them, e.g. out.loss)"))
        if not _reaches(loss.grad_fn, self._pending):
            raise DcirError(Diagnostic(
                "engine.backward(loss): this loss was not computed from the outputs of the engine's last forward; "
                "nothing was changed"))
        self.precision.saw_loss(self.micro_steps % self.config.gradient_accumulation_steps + 1, loss)
        if scale_wrt_gas:
            loss = loss / self.config.gradient_accumulation_steps
        loss.backward()

    def run_backward(self, ctx, grads) -> None:
        """The backward of ``ctx``'s forward, with ``grads`` (None: that output got none)."""
        if ctx.saved is None:
            raise DcirError(Diagnostic("the engine's backward ran twice for one forward: its saved values are gone "
                                       "(call backward once per engine(...) call)"))
        program, saved = ctx.installed.program, ctx.saved
        ctx.saved = None
        self.backward_started(saved, grads)
        scale = self.precision.loss_scale()
        given = {k: (g * scale if scale != 1 else g) for k, g in enumerate(grads) if g is not None}
        last = self.boundary_next()
        name, _, _ = program.backward_for(last)
        fn = self._timed(name, ctx.installed)
        out_grads: dict = {}
        with torch.no_grad():
            tangents = program.tangents(given, last)  # held here to the end, as autograd holds the given ones
            box = [*saved, *tangents]
            del saved  # the backward empties the box: each saved activation goes after its last use
            out = self.run(name, fn, program.state, out_grads, box)
            if last:  # what the last backward hands to @step: optimizer state reloaded early
                self._step_args = tuple(out or ())
            self.add_grads(out_grads)

    def backward_started(self, saved: tuple = (), grads: tuple = ()) -> None:
        """The last forward's backward runs (its ``saved`` activations, the ``grads`` of its
        outputs): the next call starts no new forward before ``step()``; what of its
        outputs the caller keeps is beside the whole backward, and what its loss holds
        beside the backward's entry (``HandedOut``)."""
        self._pending, self._backward_done = None, True
        self.handed.backward_starts(saved, grads)

    def add_grads(self, grads: dict) -> None:
        """A backward's gradient shards (by FQN), unscaled, added to the shards' ``.grad``."""
        self.precision.unscale(grads)
        for fqn, g in grads.items():
            shard = self.shards[fqn]
            shard.grad = g.detach() if shard.grad is None else shard.grad.add_(g)

    # ---- step ------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Ends a micro-step; at the accumulation boundary clips, runs the optimizer (or
        ``@step``), clears the gradients and advances the schedule. Returns whether the
        optimizer ran. An inf or NaN loss or gradient (``Precision.step_or_skip``) skips
        the step, or raises a ``DcirError`` (config ``nonfinite``): either way the
        parameters, the optimizer state, ``steps`` and the schedule are as they were and
        the gradients are dropped, so the next micro-step starts the next optimizer step."""
        if self._pending is not None:
            raise DcirError(Diagnostic("engine.step() before engine.backward(loss) of the last forward: nothing was "
                                       "changed"))
        if not self._backward_done:
            raise DcirError(Diagnostic("engine.step() without a forward and backward since the last step: nothing "
                                       "was changed"))
        self._backward_done = False
        self.micro_steps += 1
        if self.micro_steps % self.config.gradient_accumulation_steps:
            return False
        begin = time.perf_counter()
        if not self.precision.step_or_skip(self.shards, self.group, self.optimizer, self.steps,
                                           self.config.nonfinite):
            return False  # an inf or NaN skipped the step (fp16, nonfinite 'skip'); 'error' raised
        if self.config.gradient_clipping is not None:
            self.clip(self.config.gradient_clipping, 2.0)
        checked = time.perf_counter()
        if self.program is not None and self.program.step_gm is not None:  # the program's own step: state moves
            with torch.no_grad():
                fn = self._timed("step", Installed(self.module, self.program, None))
                out = self.run("step", fn, self.program.state, {}, *self._step_args)
            self._step_args = ()
            self._forward_args = tuple(out or ())  # state still on the device, copied home next forward
        else:
            self.optimizer.step()
            if self.profile is not None:  # the optimizer runs outside the program: the profile times it
                self.profile.optimizer_s.append(time.perf_counter() - checked)
        cleared = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.profile is not None:  # the checks and the clearing run outside any program
            self.profile.checks_s.append(checked - begin + time.perf_counter() - cleared)
        self.replicas += 1
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.steps += 1
        self.steps_run += 1
        if self.tracer is not None and self.tracer.recorded:
            self.tracer.write()
            self.tracer = None
        return True

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """The shards' gradients clipped to ``max_norm`` in ``norm_type`` (``clip_shards``)."""
        self.last_grad_norm = clip_shards(self.shards, self.group, max_norm, norm_type)
        return self.last_grad_norm


@torch.no_grad()
def clip_shards(shards: dict[str, torch.nn.Parameter], group: ProcessGroup, max_norm: float,
                norm_type: float) -> torch.Tensor:
    """The global norm of the ``shards``' gradients (padding is zero and adds nothing),
    summed across the ranks that hold different shards (under HSDP, a node's) in
    float64; the gradients scaled by ``max_norm / (norm + 1e-6)`` when that is below 1,
    as torch's ``clip_grad_norm_`` does."""
    grads = [s.grad for s in shards.values() if s.grad is not None]
    device = group.collective_device()
    over = group.subgroups[LOCAL] if group.shards_in_node else None  # None: every rank
    if norm_type == float("inf"):
        local = max((g.abs().max().double() for g in grads), default=torch.zeros((), dtype=torch.float64))
        total = local.reshape(1).to(device)
        if group.shard_world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=over)
    else:
        local = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=torch.float64))
        total = local.reshape(1).to(device)
        if group.shard_world > 1:
            dist.all_reduce(total, group=over)
        total = total.pow(1.0 / norm_type)
    norm = total[0].to(group.device, torch.float32)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


def _reaches(node, target) -> bool:
    """Whether the autograd graph from ``node`` reaches ``target``."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        if n is target:
            return True
        seen.add(id(n))
        todo.extend(f for f, _ in n.next_functions)
    return False
