"""Where an Engine's parameter shards come from, without a full copy of the model.

Three ways to start (docs/runtime.md, "Starting without the full model"):

* **A model with its values** (built on every rank as usual): every rank takes rank 0's
  values, keeps its shards and lets go of the full tensors, one at a time.
* **A model on the meta device** (``with torch.device("meta"):``, FSDP2's convention):
  the modules are initialized one at a time, children before parents as
  ``model.apply`` visits them, with ``param_init_fn(module)`` if given, else the
  ``transformers`` model's own weight init (``_init_weights``, as its
  ``initialize_weights()`` applies it), else ``module.reset_parameters()``. A module's
  tensors are materialized just before its init and sharded once its parent's init has
  run too (a parent may set its children's values: ``MultiheadAttention``), so a rank
  holds its shards and one module's tensors with its children's. Every rank runs the
  init from rank 0's random state and checks that all ranks got the same values; or,
  with ``stream_init``, rank 0 alone runs it and scatters each parameter's shards, so
  the other ranks never hold a full tensor. Both give the values the same init gives on
  one device (``model.to_empty(device=...)``, then ``model.apply(init)`` or
  ``initialize_weights()``), for the same seed.
* **A pretrained checkpoint** (``pretrained=``, ``dcir_runtime.pretrained``): each rank
  reads only the rows of each tensor that hold its shard.

Materialized tensors are first filled with NaN (integers: their smallest value), so a
tensor no init wrote is found and named instead of training from uninitialized memory. Afterwards the model's
parameters are on the meta device, with their full shapes: the engine holds them.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils import swap_tensors

from dcir.diagnostics import DcirError, Diagnostic
from dcir.layout import ShardLayout
from dcir_lowering.calls import flat_shard
from dcir_runtime.pretrained import load_shards

#: how many names an error lists before "and N more"
_LISTED = 20


def listed(names: list[str]) -> str:
    """``names`` for an error message: the first ``_LISTED``, then how many more."""
    more = f", and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def device_of(model: torch.nn.Module) -> torch.device:
    """Where the engine runs ``model``: its parameters' and buffers' device; for a model
    wholly on the meta device, this rank's GPU if there is one, else the CPU."""
    real = next((t.device for t in [*model.parameters(), *model.buffers()] if not t.is_meta), None)
    if real is not None:
        return real
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _swap_in(t: torch.Tensor, data: torch.Tensor) -> None:
    """``t`` (a parameter or buffer) holds ``data`` from now on, in place: the modules,
    ties and references that hold ``t`` see it."""
    swap_tensors(t, torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter)
                 else data)


def to_meta(t: torch.Tensor) -> None:
    """``t`` on the meta device (its shape and dtype kept), in place."""
    _swap_in(t, torch.empty(t.shape, dtype=t.dtype, device="meta"))


def hollow(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    """``t`` in place as a tensor of its shape on ``device``, in ``dtype``, with no storage:
    what Dynamo guards on (shape, stride, device, dtype) without a byte of the values,
    which the engine holds as shards (graph-break regions, ``dcir_runtime.regions``)."""
    empty = torch.empty(t.shape, dtype=dtype, device=device)
    empty.untyped_storage().resize_(0)
    _swap_in(t, empty)


def _unset(dtype: torch.dtype):
    """What a materialized tensor holds until an init writes it: NaN, or for integers
    their smallest value (no init writes that); None for booleans."""
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    return None if dtype == torch.bool else torch.iinfo(dtype).min


def _materialize(t: torch.Tensor, device: torch.device) -> None:
    """``t`` (on meta) in place as real memory on ``device``, filled with ``_unset``."""
    real = torch.empty(t.shape, dtype=t.dtype, device=device)
    if _unset(t.dtype) is not None:
        real.fill_(_unset(t.dtype))
    _swap_in(t, real)


def _unwritten(t: torch.Tensor) -> bool:
    """Whether an element of ``t`` still holds ``_unset``: no init wrote it."""
    unset = _unset(t.dtype)
    if unset is None:
        return False
    return bool(torch.isnan(t).any()) if isinstance(unset, float) else bool((t == unset).any())


def initializer(model: torch.nn.Module, param_init_fn: Callable | None) -> Callable[[torch.nn.Module], None]:
    """The init of one module: ``param_init_fn``, a ``transformers`` model's own (the
    nearest enclosing ``PreTrainedModel``'s, as ``initialize_weights`` dispatches it), or
    ``reset_parameters()`` where the module has one (what stays unset is named later)."""
    if param_init_fn is not None:
        return param_init_fn
    owner = _transformers_owners(model)
    if owner:
        from transformers import initialization  # optional: here the model is a transformers one

        def hf(m):
            root = owner[m]
            with initialization.guard_torch_init_functions():
                root._initialize_weights(m, root.is_custom_code())
        return hf

    def reset(m):
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
    return reset


def _transformers_owners(model: torch.nn.Module) -> dict:
    """Each module -> the ``transformers`` model whose ``_init_weights`` initializes it
    (the nearest enclosing one), or {} when ``model`` is not one."""
    try:
        from transformers import PreTrainedModel  # optional (the integrations and train extras)
    except ImportError:
        return {}
    if not isinstance(model, PreTrainedModel):
        return {}
    owner: dict = {}

    def walk(m, root):
        root = m if isinstance(m, PreTrainedModel) else root
        owner[m] = root
        for child in m.children():
            walk(child, root)
    walk(model, model)
    return owner


def post_order(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(module, parent) for every module, children before parents, as ``model.apply``
    visits them; the root is its own parent."""
    out, seen = [], set()

    def walk(m, parent):
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            walk(child, m)
        out.append((m, parent))
    walk(model, model)
    return out


class MetaInit:
    """Initializes ``model``'s tensors on the meta device module by module, handing
    each parameter to ``release(name, full)`` once its owners' parents have run, then
    putting it back on meta. ``compute``: whether this rank runs the init (every rank,
    or rank 0 alone when streamed; the others only take part in ``release``)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, init: Callable[[torch.nn.Module], None],
                 compute: bool, params: bool = True, skip: set[str] = frozenset()):
        self.model, self.device, self.init, self.compute, self.params = model, device, init, compute, params
        self.names: dict[int, str] = {}  # each tensor's first FQN
        for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            self.names.setdefault(id(t), n)
        self.skip = skip  # parameters that have their shards already
        self.uninitialized: list[str] = []  # names no init wrote (rank computing them)

    def _own(self, m: torch.nn.Module) -> list[torch.Tensor]:
        ts = [p for p in m._parameters.values()
              if p is not None and p.is_meta and self.names[id(p)] not in self.skip] if self.params else []
        return ts + [b for b in m._buffers.values() if b is not None and b.is_meta]

    def run(self, release: Callable[[str, torch.Tensor | None], None]) -> None:
        order = post_order(self.model)
        waiting: dict[int, int] = {}   # tensor -> owners' parents yet to run
        at: dict[int, list] = {}       # module -> tensors whose wait it ends
        for m, parent in order:
            for t in self._own(m):
                waiting[id(t)] = waiting.get(id(t), 0) + 1
                at.setdefault(id(parent), []).append(t)
        done: set[int] = set()
        live: set[int] = set()  # materialized, not yet released
        first: dict[int, torch.nn.Module] = {}  # tensor -> the module that initialized it
        for m, _ in order:
            fresh = [t for t in self._own(m) if id(t) not in done]
            own_live = any(id(t) in live for t in [*m._parameters.values(), *m._buffers.values()])
            if self.compute and (fresh or own_live or at.get(id(m))):  # its tensors, or its children's
                for t in fresh:
                    _materialize(t, self.device)
                    first.setdefault(id(t), m)
                with torch.no_grad(), _untied(m, first):
                    self.init(m)
            done.update(id(t) for t in fresh)
            live.update(id(t) for t in fresh)
            for t in at.get(id(m), []):
                waiting[id(t)] -= 1
                if waiting[id(t)] == 0:
                    live.discard(id(t))
                    self._release(t, release)

    def _release(self, t: torch.Tensor, release: Callable) -> None:
        name = self.names[id(t)]
        if not isinstance(t, torch.nn.Parameter):
            if self.compute and _unwritten(t):
                self.uninitialized.append(name)
            return  # buffers stay, replicated
        bad = self.compute and _unwritten(t)
        if bad:
            self.uninitialized.append(name)
        release(name, None if bad or not self.compute else t.detach())
        if not t.is_meta:
            to_meta(t)


@contextlib.contextmanager
def _untied(m: torch.nn.Module, first: dict):
    """While ``m``'s init runs, a parameter it shares with a module initialized before
    (a tied weight) is a scratch tensor of its own: the init draws its random numbers
    and the value is dropped, as ``model.to_empty()`` (which unties), the init, then
    ``tie_weights()`` (the first owner's value) give on one device."""
    tied = {k: p for k, p in m._parameters.items() if p is not None and first.get(id(p), m) is not m}
    for k, p in tied.items():
        m._parameters[k] = torch.nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
    try:
        yield
    finally:
        m._parameters.update(tied)


def sync_rng(group, device: torch.device) -> Callable[[], None]:
    """Every rank's random state set to rank 0's (so an init every rank runs draws the
    same numbers); returns what puts each other rank's own state back afterwards (rank 0
    goes on from where the init left it, as on one device)."""
    if group.world == 1:
        return lambda: None
    own = torch.random.get_rng_state()
    state = own.clone().to(group.device)
    dist.broadcast(state, src=0)
    torch.random.set_rng_state(state.cpu())
    cuda = device.type == "cuda"
    own_cuda = torch.cuda.get_rng_state(device) if cuda else None
    if cuda:
        s = own_cuda.clone().to(device)
        dist.broadcast(s, src=0)
        torch.cuda.set_rng_state(s.cpu(), device)

    def restore():
        if group.rank != 0:
            torch.random.set_rng_state(own)
            if cuda:
                torch.cuda.set_rng_state(own_cuda, device)
    return restore


def _checksum(t: torch.Tensor) -> float:
    """The sum of ``t`` in float64, a million elements at a time (no full float64 copy)."""
    return float(sum(part.double().sum() for part in t.detach().reshape(-1).split(1 << 20)))


def check_agree(group, sums: dict[str, float]) -> None:
    """The init every rank ran gave every rank the same values (by each tensor's sum)."""
    if group.world == 1 or not sums:
        return
    v = torch.tensor(list(sums.values()), dtype=torch.float64, device=group.device)
    lo, hi = v.clone(), v.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    differ = [n for n, a, b in zip(sums, lo.tolist(), hi.tolist()) if not (a == b or (a != a and b != b))]
    if differ:
        raise DcirError(Diagnostic(
            f"the parameter init gave the ranks different values ({listed(differ)}): it does not follow the random "
            "seed alone; pass stream_init=True to initialize on rank 0 and send each rank its shards"))


_calls = 0  # engines started in this process: each one's rendezvous keys are its own


def take_shards(model: torch.nn.Module, group, device: torch.device, *, param_init_fn: Callable | None = None,
                stream_init: bool = False, pretrained=None) -> dict[str, torch.Tensor]:
    """This rank's flat shard of each parameter of ``model`` (by first FQN), from its
    values, its init on the meta device or ``pretrained``; afterwards every parameter is
    on the meta device and every buffer holds rank 0's values."""
    global _calls
    _calls += 1
    named = dict(model.named_parameters())
    on_meta = [n for n, p in named.items() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if not on_meta and pretrained is None and (param_init_fn is not None or stream_init):
        given = "param_init_fn" if param_init_fn is not None else "stream_init"
        raise DcirError(Diagnostic(
            f"{given} initializes a model built on the meta device, and this model's parameters all have values: "
            f"build it under torch.device('meta'), or drop {given}"))
    out: dict[str, torch.Tensor] = {}
    if pretrained is not None:
        out.update(load_shards(model, pretrained, group.shard_rank, group.shard_world, device))
    for name, p in named.items():  # parameters with values: rank 0's, each let go once sharded
        if name not in out and not p.is_meta:
            if group.world > 1:
                dist.broadcast(p.data, src=0)
            out[name] = flat_shard(p.detach(), group.shard_rank, group.shard_world)
        if not p.is_meta:
            to_meta(p)
    if any(p.is_meta for n, p in named.items() if n not in out) or any(b.is_meta for b in model.buffers()):
        _init_on_meta(model, group, device, out, initializer(model, param_init_fn), stream_init,
                      params=pretrained is None)
    _share_buffers(model, group, device)
    return out


def _init_on_meta(model, group, device, out: dict, init: Callable, stream: bool, params: bool) -> None:
    """``MetaInit`` on every rank (from rank 0's random state, checked to agree) or, with
    ``stream``, on rank 0, scattering each parameter's shards; an error names every
    tensor no init wrote."""
    compute = not stream or group.rank == 0
    meta_init = MetaInit(model, device, init, compute, params, skip=set(out))
    sums: dict[str, float] = {}

    def local(name, full):
        if full is not None:
            out[name] = flat_shard(full, group.shard_rank, group.shard_world)
            sums[name] = _checksum(full)

    restore = sync_rng(group, device) if not stream else (lambda: None)
    try:
        meta_init.run(_scatter(group, model, out) if stream and group.world > 1 else local)
    finally:
        restore()

    def check() -> str:
        if meta_init.uninitialized:
            raise DcirError(Diagnostic(
                f"no init gave these tensors of the meta-device model a value: {listed(meta_init.uninitialized)}; "
                "pass param_init_fn=(a function of one module), or give their modules a reset_parameters()"))
        return "ok"
    if stream:
        group.from_rank0(f"init{_calls}", check, "initialize the model")
    else:
        check()
        check_agree(group, sums)


def _scatter(group, model: torch.nn.Module, out: dict) -> Callable:
    """The ``release`` of a streamed init: rank 0 says whether the parameter has values,
    then scatters its flat shards; each rank keeps its own."""
    dtypes = {n: (p.dtype, p.numel()) for n, p in model.named_parameters()}

    def release(name, full):
        flag = torch.tensor([0 if full is None else 1], device=group.device)
        dist.broadcast(flag, src=0)
        if not flag.item():
            return
        dtype, numel = dtypes[name]
        mine = torch.empty(ShardLayout(numel, group.shard_world).chunk, dtype=dtype, device=group.device)
        parts = None
        if group.rank == 0:
            parts = [flat_shard(full, group.shard_of(r), group.shard_world).to(group.device)
                     for r in range(group.world)]
        dist.scatter(mine, parts, src=0)
        out[name] = mine
    return release


def _share_buffers(model: torch.nn.Module, group, device: torch.device) -> None:
    """Every rank takes rank 0's buffers (a streamed init computed them there alone; the
    other ranks' are still on meta)."""
    for b in model.buffers():
        if b.is_meta:
            _materialize(b, device)
    if group.world > 1:
        for b in model.buffers():
            dist.broadcast(b.data, src=0)
