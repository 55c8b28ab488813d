"""Capture: a PyTorch model's training step -> a DCIR module.

``compile_to_ir(model, example_inputs)`` runs one step of a copy of the model under
Dynamo (whole graph, static shapes) and AOTAutograd, which hand over the forward and
backward graphs at aten level, and lowers them one op per FX node:

* parameters and buffers become module-level symbols named by their fully-qualified
  names (``param @fc1.weight : f32[16, 8] {trainable}``), read with ``param.get``; a
  tied weight is one symbol; a frozen parameter has no ``trainable``;
* ``@forward`` (``role forward``) takes the model's tensor inputs (``{input =
  "args[0]"}`` or a keyword such as ``{input = "labels"}``) and returns the model's
  outputs (``{output}``, its output flattened; ``Outputs`` keeps the structure) followed
  by the activations ``@backward`` needs (``{saved}``; parameters it needs are read
  again there, not passed, so a sharding pass can gather them where they are used);
* a buffer the forward mutates (BatchNorm's running statistics) is written with
  ``param.set``;
* a small constant tensor in the graph becomes a buffer with its elements in a
  ``value`` attribute;
* ``@backward`` takes those activations and the gradient of each differentiable output
  (``{grad = K}``) and hands each parameter's gradient to the optimizer with
  ``grad.set``; captured under ``torch.no_grad()`` (``training=False``) there is only
  ``@eval``, the forward that saves nothing.

Capture runs on a copy of the model whose parameters are fake tensors (``_fake_copy``):
it allocates no parameter, gradient or activation, so its cost does not grow with the
model's memory, a model on the meta device is captured as it is, and the caller's
model stays untouched (its gradients, its running statistics).
A graph break or an op DCIR cannot express is an error that names it and the model's
source line; nothing is captured partially. Logging, ``warnings.warn`` and ``print`` are
not breaks (``benign_breaks``).
"""

from __future__ import annotations

import contextlib
import copy
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._guards import TracingContext, detect_fake_mode
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode)
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from dcir import custom_ops, signature
from dcir import ops as registry
from dcir.activations import RECOMPUTE
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import DTYPE_BYTES, NONE, UNIT, Decl, DType, Function, Module, Op, TensorType, Type, Value
from dcir.roles import BACKWARD, EVAL, FORWARD
from dcir.shapes import dcir_dtype
from dcir_lowering.breaks import benign_breaks, notes
from dcir_lowering.outputs import Outputs

#: Largest constant tensor written into the text (elements); larger ones must be buffers.
MAX_CONSTANT = 4096


def compile_to_ir(model: torch.nn.Module, example_inputs, *, kwargs: dict | None = None, loss_fn=None,
                  name: str | None = None, param_dtype: torch.dtype | None = None,
                  output_dtype: torch.dtype | None = None, cast_inputs: bool = True) -> Module:
    """Capture ``model``'s training step on ``example_inputs`` as a DCIR module.

    ``@forward`` returns what the model returns, flattened into ``{output}`` results
    (``capture`` also gives the structure to rebuild it), or ``loss_fn(output)`` when
    given; ``@backward`` takes the gradient of each output that has one (``{grad = K}``).

    ``param_dtype`` and ``output_dtype`` mean what they mean in FSDP2's
    ``MixedPrecisionPolicy``: the step is captured with the floating parameters in
    ``param_dtype`` and (``cast_inputs``, FSDP2's ``cast_forward_inputs``) the floating
    inputs cast to it inside the step, the model's output cast to ``output_dtype``. The graph is then the one PyTorch
    runs in that precision, op for op, which retyping an fp32 graph would only
    approximate; the ``mixed_precision`` pass gives the parameters fp32 storage.
    """
    return capture(model, example_inputs, kwargs=kwargs, loss_fn=loss_fn, name=name, param_dtype=param_dtype,
                   output_dtype=output_dtype, cast_inputs=cast_inputs)[0]


def capture(model: torch.nn.Module, example_inputs, *, kwargs: dict | None = None, loss_fn=None,
            name: str | None = None, param_dtype: torch.dtype | None = None, output_dtype: torch.dtype | None = None,
            cast_inputs: bool = True, training: bool = True) -> tuple[Module, Outputs]:
    """``compile_to_ir``'s module and the structure of the model's output (``Outputs``).
    ``training=False``: the step without a backward (``@eval``: ``torch.no_grad()``),
    in the model's own mode."""
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    work = _fake_copy(model, _device(model, args, kwargs or {}))
    step = _stepper(work, model.training, loss_fn, param_dtype, output_dtype, cast_inputs)

    def listing():  # a graph break's list runs the Python between graphs: on real values, when there are some
        real = not any(t.is_meta for t in model.parameters())
        return _stepper(copy.deepcopy(model), model.training, loss_fn, param_dtype, output_dtype, cast_inputs) \
            if real else step

    _check_inputs(args, kwargs or {})
    captured = _Captured()
    with torch.set_grad_enabled(training):
        out = _trace(step, captured, args, kwargs or {}, work, listing)
    if captured.aliased():  # an output that is a view: AOTAutograd rebuilds it outside the graph
        captured = _Captured()
        with torch.set_grad_enabled(training):
            out = _trace(lambda *a, **kw: _clone_tensors(step(*a, **kw)), captured, args, kwargs or {}, work)
    outputs = Outputs.of(out, captured.produced)
    if training:
        _backward(captured)
    fold_clones(captured.forward, captured.mutated_outputs() + len(captured.meta.output_info))
    return _Lowering(work, captured, name or type(model).__name__).module(), outputs


def record_libraries(module: Module) -> None:
    """``module``'s attribute ``libraries``: the Python modules that register its custom
    ops (``dcir.custom_ops.defining_module``), so its text parses in a process that has
    not imported them (``dcir-opt file.dcir`` with no ``--load``)."""
    names = {custom_ops.defining_module(op.name) for _, op in module.ops()
             if op.family not in registry.FAMILIES and custom_ops.split(op.name) is not None}
    if names - {None}:
        module.attrs[custom_ops.LIBRARIES] = tuple(sorted(names - {None}))


def fold_clones(forward: fx.GraphModule, seen_outside: int) -> None:
    """AOTAutograd's forward graph ``forward`` without its copies that copy nothing:
    AOTAutograd traces ``dropout`` at ``p=0`` (and any dropout outside training) as
    ``clone(x)``, which eager PyTorch does not run (it returns ``x``); under attention
    that is a second [batch, heads, seq, seq] tensor per layer, saved for the backward
    beside the softmax it copies. ``seen_outside``: how many of the graph's first
    outputs leave it (mutated inputs, then the model's outputs; the rest are saved for
    the backward). A clone is folded into its source when neither can be seen or
    written outside the graph: the clone is no such output, its source is no graph
    input (the only values a functional graph writes are inputs) and no such output,
    and it keeps the source's layout."""
    graph = forward.graph
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    visible = set(outputs[:seen_outside])
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.clone.default or node in visible:
            continue
        source = node.args[0]
        layout = node.kwargs.get("memory_format", torch.preserve_format)
        if source.op == "placeholder" or source in visible or layout is not torch.preserve_format:
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        folded += 1
    if folded:
        forward.recompile()


def _stepper(work: torch.nn.Module, training: bool, loss_fn, param_dtype, output_dtype, cast_inputs: bool):
    """The step capture traces: ``work`` (a private copy, in ``training`` mode, its
    floating parameters in ``param_dtype`` if given) on the inputs (cast to it),
    its output cast to ``output_dtype``, then ``loss_fn`` if given."""
    work.train(training)
    if param_dtype is not None:
        for p in work.parameters():
            if p.is_floating_point():
                p.data = p.data.to(param_dtype)

    def step(*a, **kw):
        if param_dtype is not None and cast_inputs:
            a, kw = cast_floats((a, kw), param_dtype)
        out = work(*a, **kw)
        if output_dtype is not None:
            out = cast_floats(out, output_dtype)
        return loss_fn(out) if loss_fn is not None else out
    return step


def _device(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.device:
    """Where the step runs: the model's (its first parameter or buffer not on the meta
    device), else its inputs', else the CPU."""
    tensors = [*model.parameters(), *model.buffers(), *tree_leaves((args, kwargs))]
    return next((t.device for t in tensors if isinstance(t, torch.Tensor) and not t.is_meta), torch.device("cpu"))


def _fake_copy(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of ``model`` whose parameters, and buffers on the meta device, are fake
    tensors on ``device`` (``FakeTensorMode``): shapes, dtypes and strides without
    storage. Capture reads nothing else of them, so it allocates no parameter, gradient
    or activation, whatever the model's size, and takes a model whose parameters are on
    the meta device or held elsewhere as shards (the Engine's). The other buffers are
    copied (a step may read their values, and they are small)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    memo: dict = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(fake(p), requires_grad=p.requires_grad)
    for b in model.buffers():
        if b.is_meta:
            memo[id(b)] = fake(b)
    return copy.deepcopy(model, memo)


def _check_inputs(args: tuple, kwargs: dict) -> None:
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise DcirError(Diagnostic(
                f"an input of the model requires grad ({t.dtype}, shape {list(t.shape)}); DCIR trains the model's "
                "parameters and gives inputs no gradient: pass it detached, or make it a parameter of the model"))


def _backward(captured: "_Captured") -> None:
    """Run the captured step's backward once, so AOTAutograd hands over its graph: one
    gradient per output that needs one (their values do not shape the graph)."""
    needs = [t for t in captured.produced if t.requires_grad]
    if not needs:
        raise DcirError(Diagnostic("no output of the model requires grad: there is nothing to train (are the "
                                   "parameters frozen, or the step run under torch.no_grad()?)"))
    torch.autograd.backward(needs, [torch.ones_like(t) for t in needs])


def _clone_tensors(tree):
    return tree_map_only(torch.Tensor, torch.clone, tree)


def cast_floats(tree, dtype: torch.dtype):
    """Every floating tensor in ``tree`` cast to ``dtype`` (FSDP2's cast of forward inputs)."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _trace(step, captured: "_Captured", args: tuple, kwargs: dict, model: torch.nn.Module | None = None,
           listing=None):
    """One run of ``step`` under Dynamo as one graph, logging, warnings and prints
    ignored (``benign_breaks``). If Dynamo refuses something and ``model`` (the private
    copy ``step`` calls) is given, the step runs once eagerly first (``_warm_up``) and is
    traced again: what a model does only on its first call happens outside the trace.
    ``listing()`` gives the step whose graph breaks the error lists (by default ``step``)."""
    compiled = lambda: torch.compile(step, backend=captured.backend, fullgraph=True, dynamic=False)  # noqa: E731
    torch._dynamo.reset()
    try:
        with benign_breaks():
            try:
                return compiled()(*args, **kwargs)
            except torch._dynamo.exc.Unsupported:
                if model is None or not _warm_up(step, model, args, kwargs):  # a failed trace has run nothing
                    raise
                torch._dynamo.reset()
                return compiled()(*args, **kwargs)
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError, *DATA_DEPENDENT) as e:
        where = _where(str(e))  # the notes list every break, not just the first: the step runs again for them
        raise NotOneGraph(Diagnostic(f"cannot capture the model as one graph: {_why(e)}{where}",
                                     notes=notes(listing() if listing else step, args, kwargs))) from None
    finally:
        torch._dynamo.reset()


#: What running a captured graph on fake tensors raises at an op whose output's shape or
#: value depends on the data (Dynamo keeps ``torch.nonzero`` in its graph, and ``.item()``
#: called from a hook)
DATA_DEPENDENT = (DynamicOutputShapeException, DataDependentOutputException)


class NotOneGraph(DcirError):
    """The step does not trace as one graph: it has graph breaks (listed in the notes)."""


_UNSUPPORTED_OP = re.compile(r"unsupported operator: ([\w.]+)")


def _why(e: Exception) -> str:
    """Dynamo's reason; for an op Dynamo kept in the graph whose output's shape or value
    depends on the data (``torch.nonzero``, ``.item()`` in a hook), which fake tensors
    cannot run, what it is; for a custom op it cannot run on fake tensors, DCIR's
    (``dcir.custom_ops.problem``: which op, and to register a fake kernel)."""
    if isinstance(e, DATA_DEPENDENT):
        return f"{e.func} computes a shape or a value from the data, which a graph traced on fake tensors cannot"
    m = _UNSUPPORTED_OP.search(str(e))
    if m and not m.group(1).startswith("aten."):
        return custom_ops.problem(m.group(1)) or _first_line(e)
    return _first_line(e)


def _warm_up(step, model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """One eager call of ``step`` on ``model`` (capture's private copy), so that what a
    model does only on its first call runs outside Dynamo: ``transformers`` installs its
    output-capturing hooks under a ``threading.Lock`` (``maybe_install_capturing_hooks``),
    lazy modules size their parameters, caches fill. The call leaves no other trace: no
    autograd graph (``no_grad``), the random generators as they were (``fork_rng``: a
    dropout mask drawn here is not drawn in the trace), every parameter and buffer
    (BatchNorm's running statistics) restored to its value before. False if the eager
    call raised: then the trace's own error is the one to report.

    The call needs values (a mixture of experts routes tokens by them), so the copy's
    fake parameters are real tensors while it runs: ``torch.empty``, whose pages the
    system maps only as they are touched, and which go when the call returns."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    before = {name: t.detach().clone() for name, t in state.items() if not _is_fake(t)}
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), _real_for_a_while(model):
        try:
            step(*args, **kwargs)
        except Exception:  # the model's own failure; Dynamo's message names the construct
            return False
        finally:
            for name, t in before.items():
                state[name].copy_(t)
    return True


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def _real_for_a_while(model: torch.nn.Module):
    """Every fake parameter and buffer of ``model`` (tied ones alike) replaced by an
    uninitialized real tensor of its shape in the modules that hold it, and put back after."""
    real: dict[int, torch.Tensor] = {}
    swapped = []
    for m in model.modules():
        for slots in (m._parameters, m._buffers):
            for k, t in slots.items():
                if t is None or not _is_fake(t):
                    continue
                if id(t) not in real:
                    empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                    real[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if slots is m._parameters else empty
                swapped.append((slots, k, t))
                slots[k] = real[id(t)]
    try:
        yield
    finally:
        for slots, k, t in swapped:
            slots[k] = t


def _first_line(e: Exception) -> str:
    return str(e).strip().split("\n", 1)[0]


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _where(trace: str) -> str:
    """' at file:line' for the innermost frame of a stack trace outside torch, if any."""
    frames = [(f, n) for f, n in _FRAME.findall(trace or "") if "/torch/" not in f]
    return f" (at {frames[-1][0]}:{frames[-1][1]})" if frames else ""


@dataclass
class _Captured:
    inputs: list = field(default_factory=list)
    sources: list = field(default_factory=list)  # where Dynamo found each input: "L['kw']['labels']"
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    meta: object = None
    produced: list = field(default_factory=list)  # the model's outputs the capture run computed, in graph order

    def backend(self, gm: fx.GraphModule, example_inputs):
        # AOTAutograd's modules take ~0.9 s to import: loaded at the first capture, not with the package
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        self.inputs = list(example_inputs)
        # a placeholder a graph specialized to its sizes kept has Dynamo's record; no other has one
        self.sources = [n.meta["grapharg"].source.name if "grapharg" in n.meta else n.name
                        for n in gm.graph.nodes if n.op == "placeholder"]

        def fw(g, _):
            self.forward = g
            self.meta = TracingContext.get().fw_metadata
            run = make_boxed_func(g.forward)

            def record(args):
                outs = run(args)
                first = self.mutated_outputs()
                self.produced = list(outs[first:first + len(self.meta.output_info)])
                return outs
            record._boxed_call = True
            return record

        def bw(g, _):
            self.backward = g
            return make_boxed_func(g.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw, bw_compiler=bw)

    def mutated_outputs(self) -> int:
        """How many of the forward graph's outputs are mutated inputs (they come first)."""
        return sum(1 for info in self.meta.input_info if info.mutates_data)

    def aliased(self) -> bool:
        """Whether an output aliases an input or another value (AOTAutograd regenerates
        such outputs outside the graph, so the graph's output is not the model's)."""
        from torch._functorch._aot_autograd.schemas import OutputType  # AOTAutograd's, loaded by the capture

        return any(o.output_type != OutputType.non_alias for o in self.meta.output_info)


def _type(val) -> Type:
    if val is None:
        return NONE
    if not isinstance(val, torch.Tensor):
        raise DcirError(Diagnostic(f"DCIR values are tensors; the graph has a {type(val).__name__} value"))
    if val.layout != torch.strided:
        raise DcirError(Diagnostic(f"DCIR values are dense tensors; the graph has a {val.layout} tensor"))
    return TensorType(_element_type(val.dtype), tuple(int(d) for d in val.shape))


def _element_type(dtype: torch.dtype) -> str:
    try:
        return dcir_dtype(dtype)
    except ValueError:
        raise DcirError(Diagnostic(f"DCIR has no element type for {dtype}; its element types are: "
                                   f"{', '.join(DTYPE_BYTES)}")) from None


class _NoForm(TypeError):
    """An FX argument with no DCIR attribute form; the message says what it is and why."""


def _attr(value):
    """An FX argument that is not a tensor, as a DCIR attribute value. A complex number
    is a string in Python's complex syntax (``"(1+2j)"``; the schema says it is a number)."""
    if isinstance(value, torch.dtype):
        try:
            return DType(dcir_dtype(value))
        except ValueError:
            raise _NoForm(f"{value}, an element type DCIR does not have") from None
    if isinstance(value, (torch.device, torch.memory_format, torch.layout)):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return tuple(_attr(v) for v in value)
    if isinstance(value, complex):
        return repr(value)
    if isinstance(value, torch.Generator):
        raise _NoForm("torch.Generator: a generator is state that DCIR does not carry (programs draw from the "
                      "default generator); drop generator=")
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise _NoForm(type(value).__name__)


class GraphLowering:
    """FX nodes -> DCIR ops, into ``self.m`` (constants become its buffers)."""

    def __init__(self, module: Module):
        self.m = module

    def lower_ops(self, gm: fx.GraphModule, f: Function, env: dict, backward: bool = False) -> None:
        """The graph's ops, in order, appended to ``f``. In a ``backward`` graph, an op
        AOTAutograd's partitioner copied from the forward (activation checkpointing: its
        ``partitioner_tag`` says so) is marked ``act.recompute``."""
        used = {n.name for n in gm.graph.nodes}
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                env[node] = self._constant(gm, node, f)
                continue
            if node.op != "call_function":
                continue
            if node.target is operator.getitem:
                continue  # a result of the op before it, named after the getitem
            first = len(f.ops)
            if node.target in _RNG_HOPS:
                self._with_rng_state(node, f, env, used)
            else:
                self._check_target(node)
                f.ops.append(self._op(node, env, used))
            if backward and (node.target in _RNG_HOPS or node.meta.get("partitioner_tag") == "is_forward"):
                for op in f.ops[first:]:
                    op.attrs[RECOMPUTE] = UNIT

    def _with_rng_state(self, node: fx.Node, f: Function, env: dict, used: set) -> None:
        """AOTAutograd's wrappers of a random op in a checkpointed region, as DCIR ops:
        ``run_and_save_rng_state(op, *args)`` (the forward) reads the generator's state,
        then runs ``op``; ``run_with_rng_state(state, op, *args)`` (the backward's replay)
        sets the generator to ``state`` around ``op`` and puts it back after
        (``dcir.activations``)."""
        saving = node.target is _RNG_HOPS[0]
        state, (target, *args) = (None, node.args) if saving else (node.args[0], node.args[1:])
        anchor = next((a for a in args if isinstance(a, fx.Node)), None)
        if not isinstance(target, torch._ops.OpOverload) or anchor is None:
            raise self._unsupported(node, f"{node.target.name()} wraps {target}, not a torch operator on a tensor")
        picked = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        out_val = _call_val(target, args, node.kwargs)
        if saving:
            out_node = picked.get(1)
            state_val = picked[0].meta["val"] if 0 in picked else torch.get_rng_state()
            state_v = Value(picked[0].name if 0 in picked else _fresh(f"{node.name}_state", used), _type(state_val))
            if 0 in picked:
                env[picked[0]] = state_v
            f.ops.append(Op("rng.get", [env[anchor]], [state_v], parens=True))
        else:
            out_node = node
            prev = Value(_fresh(f"{node.name}_prev", used), env[state].type)
            f.ops.append(Op("rng.get", [env[anchor]], [prev], parens=True))
            f.ops.append(Op("rng.set", [env[state], env[anchor]], [], parens=True))
        call = _Call(target, tuple(args), dict(node.kwargs), {**node.meta, "val": out_val},
                     out_node.users if out_node is not None else {}, out_node.name if out_node is not None
                     else _fresh(f"{node.name}_out", used))
        f.ops.append(self._op(call, env, used))
        if call in env and out_node is not None:
            env[out_node] = env.pop(call)
        if not saving:
            f.ops.append(Op("rng.set", [prev, env[anchor]], [], parens=True))

    def _check_target(self, node: fx.Node) -> None:
        """An aten op, or a custom op DCIR can carry (``dcir.custom_ops``); else a located error."""
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator) and target.name().startswith("auto_functionalized"):
            inner = node.args[0] if node.args else None  # a mutating custom op, functionalized by AOTAutograd
            name = _op_name(inner) if isinstance(inner, torch._ops.OpOverload) else str(inner)
            raise self._unsupported(node, custom_ops.problem(name) or f"{name} mutates its arguments")
        if not isinstance(target, torch._ops.OpOverload):
            raise self._unsupported(node, f"{target} is not a torch operator (an aten op or a torch.library op)")
        if target.namespace != "aten":
            why = custom_ops.problem(_op_name(target))
            if why is not None:
                raise self._unsupported(node, why)

    def _constant(self, gm: fx.GraphModule, node: fx.Node, f: Function) -> Value:
        """A tensor the graph holds (``torch.tensor([...])`` in model code) as a buffer
        whose ``value`` attribute spells it out, so the text stays self-contained."""
        tensor = getattr(gm, node.target)
        if tensor.numel() > MAX_CONSTANT:
            raise self._unsupported(node, f"a constant tensor of {tensor.numel()} elements (more than {MAX_CONSTANT}); "
                                          "register it as a buffer of the model")
        name = f"{f.name}.{node.target}"
        elements = tuple(_attr(v) for v in tensor.flatten().tolist())  # complex elements: strings
        self.m.decls[name] = Decl("buffer", name, _type(tensor), {"value": elements})
        v = Value(node.name, _type(tensor))
        f.ops.append(Op("param.get", [], [v], symbol=name))
        return v

    def _op(self, node: fx.Node, env: dict, used: set) -> Op:
        schema = node.target._schema
        name = _op_name(node.target)
        given = dict(zip((a.name for a in schema.arguments), node.args))
        given.update(node.kwargs)
        tensor_args = [a for a in schema.arguments if _is_tensor(a.type)]
        for a in tensor_args:  # an optional tensor left out is absent: none, if a later tensor is given
            if str(a.type) == "Optional[Tensor]":
                given.setdefault(a.name, None)
        operands, attrs = [], {}
        last_tensor = max((k for k, a in enumerate(tensor_args) if isinstance(given.get(a.name), (fx.Node, list, tuple))),
                          default=-1)
        for a in schema.arguments:
            if a.name not in given:
                continue
            value = given[a.name]
            if _is_tensor(a.type):
                if isinstance(value, (list, tuple)):
                    absent = tuple(k for k, v in enumerate(value) if v is None)  # x[:, idx]: [None, idx]
                    if absent:
                        attrs[f"{a.name}.absent"] = absent
                    operands.extend(env[v] for v in value if v is not None)
                elif value is None:
                    if tensor_args.index(a) < last_tensor or not a.has_default_value():
                        attrs[a.name] = None
                elif isinstance(value, fx.Node):
                    operands.append(env[value])
                else:
                    attrs[a.name] = _attr(value)  # a number torch wraps into a tensor (complex: a string)
                continue
            try:
                attrs[a.name] = _attr(value)
            except _NoForm as e:
                raise self._unsupported(node, f"argument '{a.name}' of {name} is a {e}") from None
        if not schema.returns:  # aten._linalg_check_errors: called for its checks, returns nothing
            return Op(name, operands, [], attrs, parens=True)
        try:
            results = self._results(node, env, used)
        except DcirError as e:
            raise self._unsupported(node, f"{name} returns what DCIR cannot hold: {e.diagnostics[0].message}") from None
        return Op(name, operands, results, attrs, parens=True)

    def _results(self, node: fx.Node, env: dict, used: set) -> list[Value]:
        val = node.meta.get("val")
        if not isinstance(val, (tuple, list)):
            v = env[node] = Value(node.name, _type(val))
            return [v]
        by_index = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        results = []
        for k, item in enumerate(val):
            user = by_index.get(k)
            label = user.name if user is not None else _fresh(f"{node.name}_{k}", used)
            v = Value(label, _type(item))
            if user is not None:
                env[user] = v
            results.append(v)
        return results

    def _unsupported(self, node: fx.Node, what: str) -> DcirError:
        return DcirError(Diagnostic(f"cannot lower to DCIR: {what}{_where(node.meta.get('stack_trace', ''))}"))


def _call_val(target, args: tuple, kwargs: dict):
    """What ``target`` returns on the fake values of ``args`` (a wrapper node of AOTAutograd's
    carries no value of its own)."""
    vals = tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, args)
    kw = tree_map(lambda a: a.meta["val"] if isinstance(a, fx.Node) else a, kwargs)
    mode = detect_fake_mode(vals)
    with mode if mode is not None else contextlib.nullcontext():
        return target(*vals, **kw)


#: AOTAutograd's wrappers of a random op that activation checkpointing replays: saving
#: the generator's state in the forward, replaying with it in the backward
_RNG_HOPS = (torch.ops.higher_order.run_and_save_rng_state, torch.ops.higher_order.run_with_rng_state)


@dataclass(eq=False)
class _Call:
    """An FX call node's parts, for the op a higher-order wrapper calls (``_op`` reads these)."""

    target: object
    args: tuple
    kwargs: dict
    meta: dict
    users: dict
    name: str


class _Lowering(GraphLowering):
    """A captured step (forward and backward graphs of one model) -> one module."""

    def __init__(self, model: torch.nn.Module, captured: _Captured, name: str):
        super().__init__(Module(name))
        self.c = captured
        params = {id(p): (n, p) for n, p in model.named_parameters()}
        buffers = {id(b): n for n, b in model.named_buffers()}
        meta = captured.meta
        self.state: dict[int, str] = {}  # forward input index -> symbol
        self.user_inputs: list[int] = []
        bw = captured.backward
        grads = [n for n in bw.graph.nodes if n.op == "output"][0].args[0] if bw is not None else None
        for i, t in enumerate(captured.inputs):
            if id(t) in params:
                fqn, p = params[id(t)]
                has_grad = grads is None or (i < len(grads) and grads[i] is not None)
                attrs = {"trainable": UNIT} if p.requires_grad and has_grad else {}
                if p.requires_grad and not has_grad:
                    attrs["capture.unused"] = UNIT  # requires grad but gets none: the optimizer skips it
                self.m.decls[fqn] = Decl("param", fqn, _type(t), attrs)
                self.state[i] = fqn
            elif id(t) in buffers:
                fqn = buffers[id(t)]
                self.m.decls[fqn] = Decl("buffer", fqn, _type(t))
                self.state[i] = fqn
            else:
                self.user_inputs.append(i)
        self.mutated = [i for i, info in enumerate(meta.input_info) if info.mutates_data]
        self.n_user_outputs = len(meta.output_info)

    def module(self) -> Module:
        if self.c.backward is None:  # captured under torch.no_grad(): the forward alone
            self.m.functions[EVAL] = self._forward(EVAL)[0]
            record_libraries(self.m)
            return self.m
        fw, saved = self._forward(FORWARD)
        self.m.functions[FORWARD] = fw
        self.m.functions[BACKWARD] = self._backward(saved, fw)
        record_libraries(self.m)
        return self.m

    # ---- one FX graph -> one function ----
    def _forward(self, role: str) -> tuple[Function, list[str]]:
        """``@forward`` (or ``@eval``): the model's inputs in, its outputs and (for the
        backward) the saved values out."""
        gm = self.c.forward
        g = gm.graph
        f = Function(role, role=role)
        env: dict[fx.Node, Value] = {}
        placeholders = [n for n in g.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            v = Value(node.name, _type(node.meta["val"]))
            if i in self.state:
                f.ops.append(Op("param.get", [], [v], symbol=self.state[i]))
            else:
                f.args.append(v)
                f.arg_attrs.append(signature.mark(signature.INPUT, _input_name(self.c.sources[i])))
                v.owner, v.index = f, len(f.args) - 1
            env[node] = v
        self.lower_ops(gm, f, env)
        outputs = [n for n in g.nodes if n.op == "output"][0].args[0]
        for k, i in enumerate(self.mutated):  # mutated inputs come first
            f.ops.append(Op("param.set", [env[outputs[k]]], symbol=self.state[i], parens=True))
        rest = outputs[len(self.mutated):]
        model_outputs, saved = rest[:self.n_user_outputs], rest[self.n_user_outputs:]
        if role == EVAL:
            saved = []
        state_nodes = {placeholders[i] for i in self.state if i not in self.mutated}
        passed = [n for n in saved if n not in state_nodes]
        f.returns = [env[n] for n in model_outputs] + [env[n] for n in passed]
        f.result_types = [v.type for v in f.returns]
        f.result_attrs = ([signature.mark(signature.OUTPUT) for _ in model_outputs]
                          + [signature.mark(signature.SAVED) for _ in passed])
        self.saved_state = {n.name: self.state[placeholders.index(n)] for n in saved if n in state_nodes}
        return f, [n.name for n in passed]

    def _backward(self, saved: list[str], fw: Function) -> Function:
        """``@backward``: the saved values and the outputs' gradients in; each parameter's
        gradient handed to the optimizer."""
        gm = self.c.backward
        g = gm.graph
        f = Function(BACKWARD, role=BACKWARD)
        env: dict[fx.Node, Value] = {}
        # one gradient per output that requires one, in output order (AOTAutograd's tangents)
        differentiable = [k for k, info in enumerate(self.c.meta.output_info) if info.requires_grad]
        tangents = iter(differentiable)
        for node in (n for n in g.nodes if n.op == "placeholder"):
            v = Value(node.name, _type(node.meta["val"]))
            if node.name in self.saved_state:
                f.ops.append(Op("param.get", [], [v], symbol=self.saved_state[node.name]))
            else:
                f.args.append(v)
                is_tangent = node.name.startswith("tangents_")
                f.arg_attrs.append(signature.mark(signature.GRAD, next(tangents)) if is_tangent
                                   else signature.mark(signature.SAVED))
                v.owner, v.index = f, len(f.args) - 1
            env[node] = v
        if next(tangents, None) is not None:
            raise RuntimeError("internal: AOTAutograd's backward takes fewer tangents than there are differentiable outputs")
        self.lower_ops(gm, f, env, backward=True)
        grads = [n for n in g.nodes if n.op == "output"][0].args[0]
        returns = []
        for i, grad in enumerate(grads):
            fqn = self.state.get(i)
            if grad is not None and i in self.user_inputs:  # a region's input computed before it
                returns.append(env[grad])
                f.result_attrs.append(signature.mark(signature.INPUT_GRAD, self.user_inputs.index(i)))
            if grad is None or fqn is None or "trainable" not in self.m.decls[fqn].attrs:
                continue
            f.ops.append(Op("grad.set", [env[grad]], symbol=fqn, parens=True))
        f.returns = returns
        f.result_types = [v.type for v in returns]
        return f


_POSITIONAL = re.compile(r"L\['a'\]\[(\d+)\]")
_KEYWORD = re.compile(r"L\['kw'\]\['([^']+)'\]")


def _input_name(source: str) -> str:
    """Which argument of the step an input is: ``args[0]`` or a keyword (``labels``)."""
    m = _POSITIONAL.fullmatch(source)
    if m:
        return f"args[{m.group(1)}]"
    m = _KEYWORD.fullmatch(source)
    return m.group(1) if m else source


def _op_name(overload: torch._ops.OpOverload) -> str:
    """The DCIR name of a torch operator: ``aten.addmm.default``, ``transformers.grouped_mm_fallback.default``."""
    schema = overload._schema
    return f"{schema.name.replace('::', '.', 1)}.{schema.overload_name or 'default'}"


def _is_tensor(t) -> bool:
    return str(t) in ("Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]")


def _fresh(base: str, used: set) -> str:
    name, k = base, 1
    while name in used:
        name, k = f"{base}_{k}", k + 1
    used.add(name)
    return name
