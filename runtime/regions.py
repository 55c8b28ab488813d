"""Graph-break regions through the Engine: a step Dynamo splits into several graphs,
each run as a sharded DCIR program of its own, the Python between them eagerly.

When the step does not trace as one graph (``capture`` says so on every rank), the
Engine runs the model under ``torch.compile`` with a backend of its own
(``RegionStep``). Dynamo hands the backend each graph when the step first reaches it,
on this rank, with real inputs: the Python before it has run on real values (a
``.item()`` read a real tensor). The backend captures the graph as a module
(``dcir_lowering.regions.capture_region``), runs the configured pipeline on it (the
ZeRO stage's pass, the mixed-precision casts, the configured passes) and lowers it over
the engine's shards; each call runs it inside an ``autograd.Function`` (``_RegionCall``)
whose backward runs the region's backward: it reduce-scatters the region's parameter
gradients into the shards and hands autograd the gradients of the region's inputs.

Dynamo guards on the parameters' shapes, devices and dtypes. The model's parameters are
*hollow* for it (``materialize.hollow``): their shapes on the engine's device, with no
storage, always. Their guards hold from call to call, so they never make a region
compile again, and no rank holds a full parameter outside a region's gathers (or an
eager module's call: ``EagerParameters``).

The ranks agree on every region before it runs: each sends a fingerprint of the
region's collectives (``programs.collectives``), and one more at the end of the forward.
A data-dependent branch that sends ranks into regions with other collectives, or into
more or fewer regions, is an error on every rank that names the regions, never a hang.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

import dcir
from dcir import signature
from dcir.diagnostics import DcirError, Diagnostic
from dcir.memory import peaks
from dcir.passes.zero3 import FULL, LOCAL, NODES
from dcir.roles import BACKWARD, EVAL, FORWARD, UNSHARD
from dcir_lowering.breaks import benign_breaks
from dcir_lowering.dynamo import specialize, symbolic_inputs
from dcir_lowering.frontend import DATA_DEPENDENT, _where, cast_floats
from dcir_lowering.regions import capture_region
from dcir_runtime import capture, materialize, precision, programs, transport
from dcir_runtime.execution import Installed
from dcir_runtime.plan import Planner

log = logging.getLogger("dcir")

#: What a rank sends when its forward has run every region it runs (a region's fingerprint is never it)
_END = 0


@dataclass
class Region:
    """One captured graph: its lowered program, which of Dynamo's inputs it takes, and
    what the ranks compare."""

    name: str
    where: str  # the model's lines it covers: "model.py:12-14"
    installed: Installed
    inputs: list[int]  # positions of its {input} arguments among Dynamo's inputs
    fingerprint: int
    planner: Planner  # its optimization cycle
    key: str  # its captured text's digest: the same region on every rank that has it
    outbox: int = 0  # the shared-memory outbox its collectives need (transport.outbox_bytes)
    unsharded: object = None  # the shards' generation its @unshard last ran for
    unshard_now: bool = False  # whether this call runs its @unshard (the ranks agreed)
    grad_inputs: dict[int, int] = field(default_factory=dict)  # {input_grad = K} result -> input K

    def describe(self) -> str:
        return f"{self.name} ({self.where})" if self.where else self.name


class RegionStep:
    """The Engine's step as graph-break regions (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.regions: list[Region] = []
        self.eager_regions: list[str] = []  # the graphs DCIR could not capture, run eagerly
        self.eager_reasons: set[str] = set()  # where they are, each logged once
        config = engine.config
        if config.offload is not None:
            raise DcirError(Diagnostic("the step has graph breaks, and 'offload' runs on a whole-step program: "
                                       "remove the breaks (dcir.graph_breaks lists them) or drop 'offload'"))
        if engine.execution.precision.loss_scaler is not None:
            raise DcirError(Diagnostic("the step has graph breaks, and fp16's loss scaling needs a whole-step "
                                       "program: remove the breaks (dcir.graph_breaks lists them), or train in bf16"))
        # the step in the policy's precision, as the whole-step capture traces it (``frontend._stepper``)
        self._precision = precision.capture_options(precision.policy_of(config))
        low = self._precision.get("param_dtype")
        for p in engine.model.parameters():
            materialize.hollow(p, engine.device, low if low is not None and p.is_floating_point() else p.dtype)
        self.eager = EagerParameters(engine)
        # Dynamo's automatic dynamism: a float read with .item() that changes between calls becomes an input
        # (a region after `if x.item() > t:` is guarded on the comparison, not compiled again per value), and
        # sizes that change become symbolic; each concrete size is a static program (_backend)
        self._compiled = torch.compile(self._step, backend=self._backend, dynamic=None)

    def _step(self, *args, **kwargs):
        low, out_dtype = self._precision.get("param_dtype"), self._precision.get("output_dtype")
        if low is not None and self._precision["cast_inputs"]:
            args, kwargs = cast_floats((args, kwargs), low)
        out = self.engine.model(*args, **kwargs)
        if out_dtype is not None:
            out = cast_floats(out, out_dtype)
        return self.engine.loss_fn(out) if self.engine.loss_fn is not None else out

    # ---- capture ---------------------------------------------------------------------------------

    def _backend(self, gm: fx.GraphModule, example_inputs):
        """What runs one graph Dynamo hands over: its region; for a graph Dynamo made
        symbolic (sizes that changed between calls, a float read with ``.item()`` that it
        keeps as an input), one region per concrete set of sizes, captured at its first call
        (``specialize``: the sizes become constants), the float an input of its own."""
        if not symbolic_inputs(gm):
            return self._region(gm, list(example_inputs))
        regions: dict = {}

        def run(*values):
            key = tuple((tuple(v.shape), v.stride()) if isinstance(v, torch.Tensor) else v for v in values)
            tensors = [v for v in values if not isinstance(v, (int, torch.SymInt))]
            if key not in regions:
                regions[key] = self._region(specialize(gm, values, [False] * len(values)), tensors)
            return regions[key](*tensors)
        return run

    def _region(self, gm: fx.GraphModule, example_inputs: list):
        engine = self.engine
        training = torch.is_grad_enabled()
        name, where = f"region{len(self.regions) + len(self.eager_regions)}", _lines(gm)
        try:
            module, inputs = capture_region(gm, example_inputs, engine.model,
                                            f"{name} ({where})" if where else name, training)
        except (DcirError, *DATA_DEPENDENT) as e:
            return self._eager_region(gm, example_inputs, f"{name} ({where})" if where else name, e)
        module.name = f"{type(engine.model).__name__}_{name}"
        config = engine.config
        if config.zero_stage == 1 or config.accumulate_gradients == FULL:  # reduced at every micro-step: a region
            # that a branch skips in the last would never reduce its sum
            config = dataclasses.replace(config, gradient_accumulation_steps=1, accumulate_gradients=None)
        capture.run_pipeline(module, config, engine.world, engine.process_group.mesh.get(LOCAL, engine.world),
                             training and module.role(FORWARD) is not None, engine.optimizer_state_keys,
                             engine.planner.passes)
        text = dcir.print(module)
        key = hashlib.sha256(text.encode()).hexdigest()[:16]
        planner = Planner(engine.config, engine.process_group, f"{engine.store_prefix}region-{key}/",
                          capture.source_name(engine.model, engine.world))
        planner.start(text, module)
        planner.log = engine.optimize_log  # the engine's one record of every cycle, each region's among them
        region = Region(name, where, Installed(module, engine.lower(module), None), inputs, _fingerprint(module),
                        planner, key)
        region.outbox = transport.outbox_bytes(module)
        region.grad_inputs = {i: k for i, (_, k) in enumerate(signature.input_grads(module.role(BACKWARD)))} \
            if module.role(BACKWARD) is not None else {}
        self.regions.append(region)
        return lambda *values: self._run(region, values)

    def _eager_region(self, gm: fx.GraphModule, example_inputs, label: str, why: Exception):
        """A graph DCIR cannot capture (an op it cannot express, a shape from the data): it
        runs as Dynamo traced it, eagerly, with the parameters it reads gathered for it
        (``EagerParameters``), agreed across ranks as a region is."""
        fqn = self.eager.fqn
        params = [t for t in example_inputs if isinstance(t, torch.nn.Parameter) and id(t) in fqn]
        reason = why.render().splitlines()[0] if isinstance(why, DcirError) else str(why).splitlines()[0]
        where = label.split(" ", 1)[-1]  # "region3 (model.py:12)" -> "(model.py:12)"
        if where not in self.eager_reasons:  # once: Dynamo may compile the same code again (another size)
            self.eager_reasons.add(where)
            log.warning("dcir: graph-break %s runs eagerly, its parameters gathered for it: %s", label, reason)
        digest = hashlib.sha256(repr(("eager", [fqn[id(p)] for p in params])).encode()).digest()
        fingerprint = int.from_bytes(digest[:7], "little") + 1
        self.eager_regions.append(label)

        def run(*values):
            self._agree(fingerprint, f"{label}, run eagerly")
            self.eager.gather_params(params)
            return gm(*values)
        return run

    # ---- between steps: the optimization cycle, region by region ----------------------------------

    def after_step(self, steps: int, fixed_bytes) -> None:
        """After optimizer step ``steps``: the outbox sized for every region any rank runs;
        then each region's optimization cycle (``Planner``): profiled in the step after a
        ``profile_at`` step, planned from its profile and switched to as one program is.
        Only the regions every rank profiled are planned (the others keep their schedule):
        planning agrees across ranks, and a region one rank never ran has nothing to agree."""
        engine = self.engine
        if engine.transport_bytes:
            need = max((r.outbox for r in self.regions), default=0)
            need = int(engine.process_group.most(need, "the outbox the regions need"))
            engine.transport_bytes = transport.resize(engine.process_group, engine.config.transport,
                                                      engine.transport_bytes, need)
        if engine.config.optimize is None:
            return
        waiting = [r for r in self.regions if r.planner.after_step(steps, r.installed.module)]
        ready = {r.key: r for r in waiting if r.planner.profile.runs}
        seen = engine.process_group.gather_texts(" ".join(sorted(ready)), "the graph-break regions to plan")
        common = set.intersection(*(set(t.split()) for t in seen))
        for r in waiting:
            if r.key not in common or ready[r.key] is not r:
                r.planner.profile = None
        outbox = transport.outbox_bytes if engine.transport_bytes else None
        for key in sorted(common):
            region = ready[key]
            module = region.planner.replan(region.installed.module, steps, fixed_bytes, outbox)
            engine.optimize_log[-1]["region"] = region.describe()
            if module is not None:
                region.installed = Installed(module, engine.lower(module), None)
                region.fingerprint, region.unsharded = _fingerprint(module), None  # its own copies: gathered anew
                region.outbox = transport.outbox_bytes(module)

    def largest(self) -> dcir.Module | None:
        """The region whose modelled peak is the highest (what a memory budget is checked against)."""
        return max((r.installed.module for r in self.regions), key=lambda m: max(peaks(m).values(), default=0),
                   default=None)

    # ---- running -----------------------------------------------------------------------------------

    def __call__(self, args: tuple, kwargs: dict):
        """The model's outputs for this call; every rank agrees on the regions it ran."""
        self.eager.release()  # what the last call's eager modules gathered and no gradient released
        self.engine.model.train(self.engine.training)
        # every region of every shape and mode the engine keeps compiles (models share their code
        # objects, and so Dynamo's limit, across engines); past that an error, never the model eagerly
        limit = 4 * self.engine.config.max_programs
        try:
            with benign_breaks(), torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
                out = self._compiled(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # a region DCIR cannot capture: its own error
            if isinstance(e.inner_exception, DcirError):
                raise e.inner_exception from None
            raise
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            raise DcirError(Diagnostic(
                f"the step's graph-break regions were compiled {limit} times for one piece of the model's code "
                "(a new input shape or mode each time, or a branch's every value); pad or bucket the inputs to "
                "fewer shapes")) from None
        self._agree(_END, "the end of its forward")
        return out

    def _run(self, region: Region, values: tuple):
        program = region.installed.program
        execution = self.engine.execution
        stale = UNSHARD in program.graphs and region.unsharded != execution.replicas
        # a rank that ran this region's twin (a branch's other side, the same collectives) earlier in the
        # step has its replicas already: every rank gathers them again when one must, or their gathers differ
        region.unshard_now = self._agree(region.fingerprint, region.describe(), stale)
        inputs = [values[i] for i in region.inputs]
        if program.function(FORWARD) is None:  # no output needs a gradient (or under no_grad)
            with torch.no_grad():
                out = execution.run(EVAL, program.runs[EVAL], program.state, {}, *inputs)
            return tuple(program.split(EVAL, out)[0])
        return _RegionCall.apply(self, region, execution.anchor, *inputs)

    def _agree(self, fingerprint: int, what: str, flag: bool = False) -> bool:
        """Every rank is about to run the same region (or all have finished the forward);
        returns whether any rank raised ``flag``."""
        group = self.engine.process_group
        seen = group.gather_ints(fingerprint * 2 + int(flag), f"the graph-break region to run next ({what})")
        if len({v >> 1 for v in seen}) == 1:
            return any(v & 1 for v in seen)
        doing = group.gather_texts(f"runs {what}" if fingerprint != _END else "has finished its forward",
                                   "what each rank runs")
        said = "; ".join(f"rank {k} {d}" for k, d in enumerate(doing))
        raise DcirError(Diagnostic(
            f"the ranks' steps diverged at a graph break: {said}. A branch on a tensor's value went different "
            "ways on different ranks, and the regions after it run different collectives; keep what the step "
            "branches on the same on every rank (compute it from values every rank shares, or all_reduce it "
            "first)"))

    def _timed(self, region: Region, which: str):
        """What runs the region's function of role ``which``: under its profiler while its cycle profiles."""
        program, profile = region.installed.program, region.planner.profile
        gm, fn = program.graphs[which], program.runs[which]
        if profile is None:
            return fn
        return functools.partial(profile.run, which, gm, compiled=fn if fn is not gm else None)

    def forward(self, region: Region, inputs: tuple) -> tuple[list, tuple]:
        execution = self.engine.execution
        program = region.installed.program
        if region.unshard_now:
            with torch.no_grad():
                execution.run("unshard", program.unshard)
            region.unsharded = execution.replicas
        with torch.no_grad():
            out = execution.run(FORWARD, self._timed(region, FORWARD), program.state, {}, *inputs)
        return program.split(FORWARD, out)

    def backward(self, region: Region, saved: tuple, grads: tuple, n_inputs: int) -> list:
        execution = self.engine.execution
        program = region.installed.program
        execution.backward_started()
        last = execution.boundary_next()
        name = program.backward_for(last)[0]
        fn = self._timed(region, name)
        given = {k: g for k, g in enumerate(grads) if g is not None}
        out_grads: dict = {}
        with torch.no_grad():
            out = execution.run(name, fn, program.state, out_grads, [*saved, *program.tangents(given, last)])
            execution.add_grads(out_grads)
        input_grads: list = [None] * n_inputs
        for i, g in enumerate(out or ()):
            input_grads[region.grad_inputs[i]] = g
        return input_grads


class EagerParameters:
    """Parameters the Python between regions uses. A module whose call runs eagerly (one
    whose forward is marked ``torch._dynamo.disable``, or one called from code Dynamo
    skipped) has its own parameters gathered by a forward pre-hook; Dynamo traces the
    hooks of the modules it compiles as no-ops (``torch.compiler.is_compiling``), and
    those of a marked forward run outside it. A gathered parameter stays whole until its
    gradient has been averaged across the ranks into its shard (``comm.reduce_scatter``'s
    ``avg``, as a region's are; autograd may have saved it for the backward), or, frozen
    or under ``torch.no_grad()``, until the next call; then it is hollow again."""

    def __init__(self, engine):
        self.engine = engine
        self.fqn = {id(p): name for name, p in engine.model.named_parameters()}
        self.hollow: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (parameter, its hollow tensor)
        self.handles = []
        for m in engine.model.modules():
            if not any(p is not None for p in m._parameters.values()):
                continue
            marked = getattr(m.forward, "_torchdynamo_disable", False)
            self.handles.append(m.register_forward_pre_hook(self._gather_outside if marked else self._gather))
        for p in engine.model.parameters():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._reduce))

    def _gather(self, module, _args) -> None:
        if not torch.compiler.is_compiling():
            self.gather(module)

    @torch._dynamo.disable
    def _gather_outside(self, module, _args) -> None:
        self.gather(module)

    def gather(self, module) -> None:
        """``module``'s own parameters whole, from every rank's shard."""
        self.gather_params([p for p in module._parameters.values() if p is not None])

    def gather_params(self, params: list) -> None:
        """``params`` whole, from every rank's shard (those gathered already stay as they are)."""
        ops, engine = torch.ops.dcir, self.engine
        for p in params:
            if id(p) in self.hollow:
                continue
            name = self.fqn[id(p)]
            shard = engine.shards[name].detach()
            over = engine.process_group.shard_name
            full = ops.wait(ops.all_gather(shard, list(p.shape), over, f"{name} (eager)")).to(p.dtype)
            self.hollow[id(p)] = (p, p.data)
            p.data = full

    def release(self, p: torch.Tensor | None = None) -> None:
        """``p`` (None: every gathered parameter) hollow again."""
        for key in [id(p)] if p is not None else list(self.hollow):
            if key in self.hollow:
                param, empty = self.hollow.pop(key)
                param.data = empty

    def _reduce(self, p: torch.Tensor) -> None:
        ops, engine = torch.ops.dcir, self.engine
        name = self.fqn[id(p)]
        grad = p.grad.to(engine.shards[name].dtype)
        p.grad = None
        self.release(p)
        names = engine.process_group.names
        if not engine.process_group.shards_in_node:
            engine.execution.add_grads({name: ops.wait(ops.reduce_scatter(grad, "avg", names[None], f"{name} (eager)"))})
            return
        # HSDP: reduce-scattered in the node, the shard averaged across nodes
        local = ops.wait(ops.reduce_scatter(grad, "avg", names[LOCAL], f"{name} (eager)"))
        engine.execution.add_grads({name: ops.wait(ops.all_reduce(local, "avg", names[NODES], f"{name} (eager)"))})


class _RegionCall(torch.autograd.Function):
    """A region's ``@forward`` as one autograd node; its backward runs the region's
    backward and returns the gradients of its inputs. ``anchor`` requires grad, so the
    node exists when no input does (the first region)."""

    @staticmethod
    def forward(ctx, step: RegionStep, region: Region, anchor, *inputs):
        outputs, saved = step.forward(region, inputs)
        ctx.step, ctx.region, ctx.saved, ctx.n_inputs = step, region, saved, len(inputs)
        ctx.set_materialize_grads(False)
        differentiable = region.installed.program.differentiable
        ctx.mark_non_differentiable(*[o for k, o in enumerate(outputs) if k not in differentiable])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.saved is None:
            raise DcirError(Diagnostic("a graph-break region's backward ran twice for one forward: its saved values "
                                       "are gone (call backward once per engine(...) call)"))
        saved, ctx.saved = ctx.saved, None
        return (None, None, None, *ctx.step.backward(ctx.region, saved, grads, ctx.n_inputs))


#: Dynamo's name for the code after a graph break at line N of a function
_RESUMED = re.compile(r"torch_dynamo_resume_in_\w+?_at_(\d+)")


def _fingerprint(module: dcir.Module) -> int:
    """A positive int64 of the collectives ``module`` runs, in order (``programs.collectives``)."""
    digest = hashlib.sha256(repr(programs.collectives(module)).encode()).digest()
    return int.from_bytes(digest[:7], "little") + 1


def _lines(gm: fx.GraphModule) -> str:
    """The model's lines a region's ops come from, ``file:first-last`` (the innermost frame
    outside torch), and the graph break it follows, if any: ``model.py:14-20, after the
    break at line 12``."""
    traces = [n.meta.get("stack_trace", "") for n in gm.graph.nodes if n.op == "call_function"]
    spots = [s[5:-1] for s in map(_where, traces) if s]  # " (at file:line)" -> "file:line"
    if not spots:
        return ""
    file = spots[0].rsplit(":", 1)[0]
    lines = sorted({int(s.rsplit(":", 1)[1]) for s in spots if s.rsplit(":", 1)[0] == file})
    where = f"{file.rsplit('/', 1)[-1]}:{lines[0]}" + (f"-{lines[-1]}" if lines[-1] != lines[0] else "")
    after = sorted({int(m) for t in traces for m in _RESUMED.findall(t)})
    return where + (f", after the break at line {after[-1]}" if after else "")

