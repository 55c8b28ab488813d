"""The Engine's configuration: a dict or a JSON file, checked key by key.

An unknown key or a bad value is a ``DcirError`` that names it and lists what is
valid; nothing is silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from itertools import product
from pathlib import Path

from dcir.diagnostics import DcirError, Diagnostic
from dcir.machine import HardwareError, Machine, load as load_machine
from dcir.memory import parse_bytes
from dcir.passes import parse_pipeline
from dcir.passes.zero3 import FULL, SHARD
from dcir.topology import Layout, layout
from dcir_runtime import precision

#: a ZeRO++ setting's value that lets the planner choose it (``Config.machine``)
AUTO = "auto"


@dataclass(frozen=True)
class Config:
    #: ZeRO stage, the pass that shards the step: 3 shards parameters, gradients and
    #: optimizer state (``zero3``); 2 keeps parameters replicated (``zero2``); 1 also
    #: reduces gradients once per optimizer step under accumulation (``zero1``)
    zero_stage: int = 3
    #: passes run after the stage's own, as pipeline specs (``"dce"``, ``"canonicalize"``)
    passes: list = field(default_factory=list)
    #: micro-steps per optimizer step (``engine.backward(loss)`` backpropagates ``loss``
    #: as given: divide it by N, or pass ``scale_wrt_gas=True`` as DeepSpeed does by default)
    gradient_accumulation_steps: int = 1
    #: ZeRO-3 under accumulation: ``"shard"`` reduce-scatters every micro-step's gradients
    #: into the shards (FSDP2's default); ``"full"`` sums them in full gradients and
    #: reduce-scatters once per optimizer step (``zero3{accumulate=full}``, FSDP2's
    #: ``set_requires_gradient_sync(False)`` on the early micro-steps); None: ``"shard"``
    accumulate_gradients: str | None = None
    #: the most bytes the runtime may hold per rank (``"2GiB"``); None: no limit
    memory_budget: int | None = None
    #: seconds a collective may wait for the other ranks before the step fails
    timeout_s: float = 300.0
    #: compile the compute between collectives with Inductor instead of running it eagerly
    inductor: bool = False
    #: the optimization cycle (``docs/passes.md``): after each optimizer step listed in
    #: ``profile_at`` (1 = after the first), the next step is profiled, the profile is
    #: written into the IR and ``passes`` are planned from it; no re-capture.
    #: ``{"passes": ["prefetch", "unshard"], "profile_at": [1, 3]}``; None: off. A plan is
    #: taken when predicted faster by more than the profiles' noise and by enough to pay
    #: for any peak it raises (``memory_price``, default 0.1: a plan raising the peak by
    #: 30% must save 3% of the step), then measured against the running program over
    #: ``trial_steps`` steps each (default 3; 0: no trial; twice as many when only the
    #: plan's median step was faster at the first look)
    optimize: dict | None = None
    #: clip the gradients of every optimizer step to this global L2 norm, taken over every
    #: rank's shards (DeepSpeed's ``gradient_clipping``; ``engine.clip_grad_norm_`` is
    #: FSDP's way to the same); None: no clipping
    gradient_clipping: float | None = None
    #: optimizer-state offload (the ``offload`` pass): ``{"budget": "1GiB"}`` keeps at
    #: most that many bytes of optimizer state on the device (per rank), the rest in
    #: host memory, moved around the update of its parameter; None: off
    offload: dict | None = None
    #: FSDP2's ``MixedPrecisionPolicy``: ``{"param_dtype": "bfloat16", "reduce_dtype":
    #: "float32"}``, also ``output_dtype`` and ``cast_forward_inputs`` (docs/config.md);
    #: parameter storage and optimizer state stay fp32; None: fp32 throughout
    mixed_precision: dict | None = None
    #: DeepSpeed's ``bf16`` section: ``{"enabled": true}`` is ``mixed_precision`` with
    #: bfloat16 parameters and fp32 reduction
    bf16: dict | None = None
    #: DeepSpeed's ``fp16`` section: fp16 parameters, fp32 reduction, loss scaling
    #: (``loss_scale`` 0: dynamic; ``initial_scale_power``, ``loss_scale_window``,
    #: ``hysteresis``, ``min_loss_scale``, ``consecutive_hysteresis``)
    fp16: dict | None = None
    #: programs kept at once, one per input shape (and mode: training, evaluation), like
    #: Dynamo's recompile limit; a new shape beyond it is an error that says so
    max_programs: int = 8
    #: how gathers, reduce-scatters and all-to-alls move their bytes (``dcir_runtime.transport``):
    #: ``"auto"`` (shared memory where it can be set up, else the process group),
    #: ``"shared_memory"`` (every rank on one host, a CPU model) or ``"process_group"``
    transport: str = "auto"
    #: an inf or NaN loss (as ``engine.backward`` saw it) or gradient at an optimizer step:
    #: ``"error"`` raises, on every rank, a message that names the step, the ranks and the
    #: first parameter it shows in; ``"skip"`` skips the step as fp16's loss scaling does.
    #: None: ``"error"``, and under ``fp16`` the loss scaler's skipping (``"skip"`` is the same)
    nonfinite: str | None = None
    #: a directory where rank 0 keeps every program it compiles, and the plan the
    #: optimization cycle took, so a restarted job with the same model, code, config and
    #: world skips capture and planning (``dcir_runtime.program_cache``); None: off
    program_cache: str | None = None
    #: hybrid sharding (FSDP2's HSDP): ``{"replicate": R, "shard": S}``, R × S = the world
    #: size; parameters sharded over the S ranks of a node (consecutive ranks, as torchrun
    #: numbers them), replicated across the R nodes, gradients reduce-scattered in the node and
    #: averaged across nodes once per optimizer step; ``initialize(mesh=DeviceMesh)`` sets
    #: it from a 2-D mesh. None: every parameter sharded over every rank
    mesh: dict | None = None
    #: DeepSpeed ZeRO++'s hierarchical partitioning (hpZ): S ranks a node (consecutive, as
    #: torchrun numbers them); parameters stay sharded over every rank, and each rank keeps
    #: its shard of each parameter split over its node from the forward to the backward,
    #: whose gathers then stay within the node (the ``hierarchical`` pass). None: off
    #: ``"auto"``: the ranks of a node (torchrun's ``LOCAL_WORLD_SIZE``) if the planner
    #: prices hpZ faster within the budget on ``machine`` (``dcir.topology``), else off
    zero_hpz_partition_size: int | str | None = None
    #: DeepSpeed ZeRO++'s quantized weights (qwZ): every parameter gather moves int8 in
    #: blocks of 256 with f32 scales (the ``quantize`` pass); shards, optimizer and gradient
    #: reductions stay exact. ``"auto"``: if the planner prices them faster on ``machine``
    zero_quantized_weights: bool | str = False
    #: DeepSpeed ZeRO++'s quantized gradients (qgZ): every gradient reduce-scatter moves int8
    #: rows in blocks of 256 with f32 scales, exchanged all-to-all and summed in f32 on the
    #: receiving rank (the ``quantize`` pass); shards, optimizer and gathers stay exact.
    #: ``"auto"``: if the planner prices them faster on ``machine``
    zero_quantized_gradients: bool | str = False
    #: the hardware description (a ``dcir/machines`` name or a ``.toml``, ``dcir.hardware``)
    #: the ZeRO++ settings given as ``"auto"`` are chosen on: the planner prices each way to
    #: lay the step across nodes on it and takes the fastest that fits (``dcir.topology``)
    machine: str | None = None

    def __post_init__(self):
        given = [k for k in ("mixed_precision", "bf16", "fp16") if getattr(self, k) is not None]
        if len(given) > 1:
            raise _error(f"the config enables {' and '.join(given)}: give one of mixed_precision, bf16, fp16")
        if self.inductor and any(_names_fuse(spec) for spec in [*self.passes, *(self.optimize or {}).get("passes", [])]):
            raise _error("the config sets inductor, which compiles every stretch of compute, and runs the fuse "
                         "pass, which chooses the stretches to compile: give one of them")
        if self.mesh is not None and self.zero_hpz_partition_size is not None:
            raise _error("the config gives mesh (HSDP: parameters sharded within a node) and zero_hpz_partition_size "
                         "(hpZ: sharded over every rank, gathered within the node in the backward): give one of them")
        if self.zero_hpz_partition_size is not None and self.zero_stage != 3:
            raise _error(f"zero_hpz_partition_size keeps node-local partitions of ZeRO-3's sharded parameters: give "
                         f"zero_stage 3, not {self.zero_stage}")
        if self.zero_quantized_weights and self.zero_stage != 3:
            raise _error(f"zero_quantized_weights quantizes ZeRO-3's parameter gathers: give zero_stage 3, not "
                         f"{self.zero_stage}")
        if self.zero_quantized_gradients and self.zero_stage != 3:
            raise _error(f"zero_quantized_gradients quantizes ZeRO-3's gradient reductions (ZeRO++'s qgZ): give "
                         f"zero_stage 3, not {self.zero_stage}")
        auto = self.auto_knobs
        if auto and self.machine is None:
            raise _error(f"{' and '.join(auto)} given as \"auto\": the planner chooses by pricing each way to lay the "
                         f"step across nodes on a machine description: give machine (a dcir/machines name or a .toml)")
        if self.machine is not None and not auto:
            raise _error("machine is the description the ZeRO++ settings given as \"auto\" are chosen on, and none "
                         "is: give zero_hpz_partition_size, zero_quantized_weights or zero_quantized_gradients "
                         "\"auto\", or leave machine out")
        if self.mesh is not None and self.zero_stage != 3:
            raise _error(f"the config's mesh shards parameters within a node (HSDP), which is ZeRO-3's: give zero_stage "
                         f"3, not {self.zero_stage}")
        self._check_accumulation()
        if self.fp16 is not None and self.nonfinite == "error":
            raise _error("fp16's loss scaler skips the steps that overflow: give nonfinite 'skip' or leave it out, "
                         "not 'error'")

    def _check_accumulation(self) -> None:
        if self.accumulate_gradients is None:
            return
        if self.zero_stage != 3:
            raise _error(f"accumulate_gradients chooses where ZeRO-3 accumulates (stage 1 always sums full gradients, "
                         f"stage 2 reduces every micro-step's into its shards): give zero_stage 3, not "
                         f"{self.zero_stage}")
        if self.accumulate_gradients == FULL and self.gradient_accumulation_steps == 1:
            raise _error("accumulate_gradients 'full' sums the micro-steps' gradients before reducing them, and "
                         "there is one micro-step a step: give gradient_accumulation_steps above 1, or leave it out")
        if self.accumulate_gradients == FULL and self.mesh is not None:
            raise _error("accumulate_gradients 'full' reduces over one flat group, and the config's mesh (HSDP) "
                         "already averages across nodes once per optimizer step: give one of them")

    @property
    def auto_knobs(self) -> list[str]:
        """The ZeRO++ settings the planner chooses (given as ``"auto"``)."""
        return [k for k in ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")
                if getattr(self, k) == AUTO]

    def topology(self, per_node: int) -> dict | None:
        """The mesh the ranks form and what parameters are sharded over: ``{"replicate": R
        (None: the world over S), "shard": S, "hsdp": True}`` (sharded over the node) or
        ``"hsdp": False`` (over every rank, hpZ; ``"auto"``: nodes of ``per_node``, the
        ranks a node runs); None: one flat group."""
        if self.mesh is not None:
            return {**self.mesh, "hsdp": True}
        hpz = self.zero_hpz_partition_size
        if hpz is not None:
            return {"replicate": None, "shard": per_node if hpz == AUTO else hpz, "hsdp": False}
        return None

    def described_machine(self) -> Machine | None:
        """The machine ``machine`` describes (checked when the config was read)."""
        return None if self.machine is None else load_machine(self.machine)

    def layouts(self, world: int) -> tuple[Layout, ...]:
        """The ways across nodes this config allows on ``world`` ranks: one, or, with
        settings given as ``"auto"``, each combination they leave open, the simpler first
        (``dcir.topology``)."""
        def either(value) -> tuple[bool, ...]:
            return (False, True) if value == AUTO else (bool(value),)

        hpz = self.zero_hpz_partition_size
        hpzs = (False, True) if hpz == AUTO else (hpz is not None and world > hpz,)  # one node: nothing to keep
        return tuple(layout(self.mesh is not None, h, w, g)
                     for h, w, g in product(hpzs, either(self.zero_quantized_weights),
                                            either(self.zero_quantized_gradients)))

    @classmethod
    def load(cls, config) -> "Config":
        if config is None:
            return cls()
        if isinstance(config, Config):
            return config
        where = ""
        if isinstance(config, (str, Path)):
            where = f"{config}: "
            try:
                config = json.loads(Path(config).read_text())
            except OSError as e:
                raise _error(f"{where}cannot read the config: {e.strerror}") from None
            except json.JSONDecodeError as e:
                raise _error(f"{config}:{e.lineno}:{e.colno}: not JSON: {e.msg}") from None
        if not isinstance(config, dict):
            raise _error(f"{where}the config must be a JSON object (a dict), not {type(config).__name__}")
        valid = [f.name for f in fields(cls)]
        values = {}
        for key, value in config.items():
            if key not in valid:
                hint = f": {ELSEWHERE[key]}" if key in ELSEWHERE else ""
                raise _error(f"{where}unknown config key {key!r}{hint}; valid keys: {', '.join(valid)}")
            try:
                values[key] = _CHECKS[key](value)
            except (TypeError, ValueError) as e:
                raise _error(f"{where}bad value for {key!r}: {e}") from None
        return cls(**values)


def _stage(v):
    if v not in (1, 2, 3) or isinstance(v, bool):
        raise ValueError(f"{v!r}; valid: 1, 2, 3")
    return v


def _passes(v):
    if isinstance(v, str):
        v = [v] if v else []
    if not isinstance(v, list) or not all(isinstance(p, str) for p in v):
        raise ValueError(f"{v!r}; a list of pass specs like [\"dce\", \"canonicalize\"]")
    for spec in v:
        try:
            parse_pipeline(spec)
        except DcirError as e:
            raise ValueError(e.diagnostics[0].message) from None
    return list(v)


def _names_fuse(spec: str) -> bool:
    return any(p.name == "fuse" for p in parse_pipeline(spec))


def _optimize(v):
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"{v!r}; an object like {{\"passes\": [\"prefetch\", \"unshard\"], \"profile_at\": [1, 3]}}")
    keys = {"passes", "profile_at", "trial_steps", "memory_price"}
    for key in v:
        if key not in keys:
            raise ValueError(f"unknown key {key!r} in 'optimize'; valid keys: passes, profile_at, trial_steps, "
                             "memory_price")
    passes = _passes(v.get("passes", ["prefetch", "unshard", "bucket"]))
    at = v.get("profile_at", [1])
    if not isinstance(at, list) or not at or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in at):
        raise ValueError(f"'profile_at' is {at!r}; a non-empty list of optimizer steps >= 1, like [1, 3]")
    trial = v.get("trial_steps", 3)
    if isinstance(trial, bool) or not isinstance(trial, int) or not (trial == 0 or trial >= 2):
        raise ValueError(f"'trial_steps' is {trial!r}; the measured steps of each side of a plan's trial: "
                         "an int >= 2, or 0 to take plans on the cost model's word")
    price = v.get("memory_price", 0.1)
    if isinstance(price, bool) or not isinstance(price, (int, float)) or not 0 <= price < float("inf"):
        raise ValueError(f"'memory_price' is {price!r}; a number >= 0, the share of a step's time a plan must save "
                         "to raise the peak by the whole of it")
    return {"passes": passes, "profile_at": sorted(set(at)), "trial_steps": trial, "memory_price": float(price)}


def _offload(v):
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) != {"budget"}:
        raise ValueError(f"{v!r}; an object like {{\"budget\": \"1GiB\"}} (its only key is budget)")
    return {"budget": parse_bytes(v["budget"])}


def _positive_int(v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{v!r}; a whole number >= 1")
    return v


def _budget(v):
    return None if v is None else parse_bytes(v)


def _seconds(v):
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{v!r}; a number of seconds > 0")
    return float(v)


def _max_norm(v):
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or v == float("inf"):
        raise ValueError(f"{v!r}; a finite norm > 0, like 1.0 (or null for no clipping)")
    return float(v)


def _precision(check: str):
    """A check of ``dcir_runtime.precision``."""
    def run(v):
        return getattr(precision, check)(v)
    return run


#: the values of ``transport`` (``dcir_runtime.transport``)
TRANSPORTS = ("auto", "shared_memory", "process_group")


def _transport(v):
    if v not in TRANSPORTS:
        raise ValueError(f"{v!r}; one of {', '.join(TRANSPORTS)}")
    return v


def _accumulate_gradients(v):
    if v is not None and v not in (SHARD, FULL):
        raise ValueError(f"{v!r}; one of {SHARD}, {FULL} (or null: {SHARD})")
    return v


#: the values of ``nonfinite`` (``dcir_runtime.precision``)
NONFINITE = ("error", "skip")


def _nonfinite(v):
    if v is not None and v not in NONFINITE:
        raise ValueError(f"{v!r}; one of {', '.join(NONFINITE)} (or null: error, and fp16's skipping under fp16)")
    return v


def _directory(v):
    if v is not None and (not isinstance(v, (str, Path)) or not str(v)):
        raise ValueError(f"{v!r}; a directory path, or null")
    return None if v is None else str(v)


def _optional_positive_int(v):
    if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise ValueError(f"{v!r}; a positive integer, or null")
    return v


def _mesh(v):
    if v is None:
        return None
    if not (isinstance(v, dict) and set(v) == {"replicate", "shard"}
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in v.values())):
        raise ValueError(f"{v!r}; {{\"replicate\": R, \"shard\": S}} with positive integers R × S = the world size "
                         "(or null: shard over every rank)")
    return {"replicate": v["replicate"], "shard": v["shard"]}


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError(f"{v!r}; true or false")
    return v


def _or_auto(check):
    """``check``, or the string ``"auto"`` (the planner chooses: ``Config.machine``)."""
    def checked(v):
        if v == AUTO:
            return v
        try:
            return check(v)
        except ValueError as e:
            raise ValueError(f"{e}, or \"auto\"") from None
    return checked


def _machine(v):
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise ValueError(f"{v!r}; a dcir/machines name or a .toml path")
    try:
        load_machine(v)
    except HardwareError as e:
        raise ValueError(str(e)) from None
    return v


#: DeepSpeed config keys DCIR takes elsewhere: where (the error for the key says it)
ELSEWHERE = {
    "optimizer": "the optimizer is initialize's optimizer argument, optimizer=lambda ps: torch.optim.AdamW(ps, lr=...)",
    "scheduler": "the schedule is initialize's lr_scheduler argument, lr_scheduler=lambda opt: LambdaLR(opt, ...)",
    "zero_optimization": "its settings are top-level keys here: stage is zero_stage, offload_optimizer is "
                         "offload, zero_hpz_partition_size, zero_quantized_weights and zero_quantized_gradients "
                         "keep their names",
    "train_batch_size": "the batch is the tensors each call gets; gradient_accumulation_steps makes micro-steps",
    "train_micro_batch_size_per_gpu": "the batch is the tensors each call gets; gradient_accumulation_steps makes "
                                      "micro-steps",
}


_CHECKS = {"zero_stage": _stage, "passes": _passes, "gradient_accumulation_steps": _positive_int,
           "accumulate_gradients": _accumulate_gradients,
           "memory_budget": _budget, "timeout_s": _seconds, "inductor": _bool,
           "optimize": _optimize, "offload": _offload, "gradient_clipping": _max_norm,
           "mixed_precision": _precision("check_policy"), "bf16": _precision("check_bf16"),
           "fp16": _precision("check_fp16"), "max_programs": _positive_int,
           "transport": _transport, "nonfinite": _nonfinite, "program_cache": _directory,
           "mesh": _mesh, "zero_hpz_partition_size": _or_auto(_optional_positive_int),
           "zero_quantized_weights": _or_auto(_bool), "zero_quantized_gradients": _or_auto(_bool),
           "machine": _machine}


def _error(message: str) -> DcirError:
    return DcirError(Diagnostic(message))
