"""One rank of one system's run in ``bench_train.py`` (see there).

``python train_worker.py SYSTEM OUT.json --layers ... --steps ...`` trains the
benchmark Llama with SYSTEM for warm-up plus measured steps (a DCIR system warms up
longer while its optimization cycle still profiles, plans or tries a plan: the steps
measured are those of the program the job keeps; ``warmup_steps``) and writes, from
rank 0, each measured step's time (the slowest rank's) and minor page faults (the most
any rank took), the peak resident memory of every rank and, for DCIR, the host time its
ranks spent blocked in ``comm.wait`` (the communication that compute did not hide).
With ``--device cuda`` every rank runs on the GPU of its ``LOCAL_RANK`` (NCCL), steps
are timed after a device synchronize, and the peak memory is the CUDA allocator's
(``torch.cuda.max_memory_allocated``).

With ``--init meta`` the sharded systems start without the full model: the Llama is
built under ``torch.device("meta")``; ``dcir.initialize`` initializes each rank's shards
(the model's own ``transformers`` init), FSDP2 follows its documented recipe
(``fully_shard``, ``model.to_empty(device=...)``, then ``model.initialize_weights()``,
which runs on the DTensor shards: same distributions, not the single-device values),
and DeepSpeed ZeRO-3 builds it under ``deepspeed.zero.Init``. ``floor`` and ``eager``
(one process, nothing to shard; ``floor-bf16`` and ``eager-bf16`` too), ``floor-busy``
(a whole copy in every process) and DeepSpeed ZeRO-1/2 build it with its values as with ``--init real``. Every rank also
reports its process's age at the end of the first step (``first_step_s``: start-up,
model, capture and the first step) and that step's own
time (``first_step_time_s``: capture or compiling, and the step). DCIR systems take
``--program-cache DIR`` (the Engine's ``program_cache``), ``--save-checkpoint DIR`` (after
the last step) and ``--load-checkpoint DIR`` (before the first, timed: ``load_s``), what
``bench_restart.py`` runs a restart with. ``--rss-trace``
prints each rank's resident and peak memory at each stage to stderr, and after the last
step its resident memory by what holds it (``resident_by_kind``). ``--trace DIR``
(DCIR systems): after the measured steps, one more optimizer step runs traced
(``Engine.trace``), each rank writing ``DIR/rank<N>.json``; it is not among the measured.

Every rank also reports its resident high-water mark over the measured steps alone
(``steps_rss_mib``: ``VmHWM``, reset through ``/proc/self/clear_refs`` before the first
measured step, so building, capture and compiling are left out) and, for DCIR, what the
Engine accounts (``accounted``: ``Dcir.accounting``) and each optimization cycle's record.
``dcir-recompute`` runs the cycle with ``recompute`` under ``--memory-budget`` bytes
(``dcir-recompute-fused`` with ``fuse`` too);
``fsdp2-ckpt`` checkpoints every decoder layer, ``fsdp2-compile-budget`` compiles each
under ``--compile-budget`` (``Fsdp2``). ``--allocated`` (CPU) also reports each rank's
allocator peak over the first measured step (``allocated``: ``Allocations``), the
figure a GPU's ``max_memory_allocated`` gives; the profiler it runs under slows that
run's steps.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch._C._profiler import _ExtraFields_Allocation

from dcir_runtime.config import TRANSPORTS


def device(ns) -> torch.device:
    if ns.device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def backend(ns) -> str:
    return "nccl" if ns.device == "cuda" else "gloo"


class Checked(torch.nn.Module):
    """A decoder layer behind a finiteness check of its input: a data-dependent branch,
    one graph break (``--systems ...-break``)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, *args, **kwargs):
        if not torch.isfinite(hidden_states).all():
            raise FloatingPointError("non-finite activations before a decoder layer")
        return self.layer(hidden_states, *args, **kwargs)


def llama(ns, meta: bool = False, graph_break: bool = False):
    """The benchmark Llama (seed 0), or with ``--experts`` N its mixture-of-experts form, a
    Mixtral of the same shape: each MLP N SwiGLU experts of ``--intermediate``, each token
    through 2, the router's load-balancing loss added to the loss as transformers' MoE
    recipes train it. With ``meta``, built on the meta device (no values); with
    ``graph_break``, its middle decoder layer behind a finiteness check (``Checked``)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    shape = dict(vocab_size=ns.vocab, hidden_size=ns.hidden, intermediate_size=ns.intermediate or ns.hidden * 4,
                 num_hidden_layers=ns.layers, num_attention_heads=ns.hidden // 64, num_key_value_heads=ns.hidden // 64,
                 max_position_embeddings=ns.seq, attn_implementation="eager")
    if ns.experts:
        config, make = MixtralConfig(**shape, num_local_experts=ns.experts, num_experts_per_tok=2,
                                     output_router_logits=True), MixtralForCausalLM
    else:
        config, make = LlamaConfig(**shape), LlamaForCausalLM
    if meta:
        with torch.device("meta"):
            model = make(config)
    else:
        model = make(config).to(device(ns))
    if graph_break:
        middle = ns.layers // 2
        model.model.layers[middle] = Checked(model.model.layers[middle])
    return model


def batches(ns, rank: int, world: int):
    g = torch.Generator().manual_seed(1)
    while True:
        ids = torch.randint(0, ns.vocab, (ns.batch * world, ns.seq), generator=g)[rank * ns.batch:(rank + 1) * ns.batch]
        ids = ids.to(device(ns))
        yield {"input_ids": ids, "labels": ids}


def synchronize(ns) -> None:
    if ns.device == "cuda":
        torch.cuda.synchronize()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def minor_faults() -> int:
    """The page faults this process took without reading from disk: each a fresh page
    mapped in on first touch (every thread counted)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def reset_peak_rss() -> bool:
    """Start this process's resident high-water mark (``VmHWM``) afresh from its resident
    memory now (Linux: ``/proc/self/clear_refs``); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm_rss_mib() -> float | None:
    """This process's resident high-water mark since start or ``reset_peak_rss`` (Linux)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


_IMPORTED = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc, to 10 ms), else since this
    module was imported (which leaves out the interpreter's start-up)."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def resident_by_kind(smaps: str = "/proc/self/smaps") -> dict[str, float]:
    """This process's resident memory now by what holds it, in MiB (Linux ``smaps``):
    ``anonymous`` (the heap and anonymous maps: tensors, Python's objects, and the freed
    memory glibc keeps), ``shared memory`` (``/dev/shm``: DCIR's outboxes, each rank's
    mapped by every rank, so each counts them all), ``libraries`` (``.so`` files) and
    ``files`` (other mapped files)."""
    kinds = dict.fromkeys(("anonymous", "shared memory", "libraries", "files"), 0.0)
    kind = "anonymous"
    with open(smaps) as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if fields[0] == "Rss:":
                kinds[kind] += int(fields[1]) / 1024
            elif not fields[0].endswith(":"):  # a mapping's header: address range, ..., path
                kind = _mapping_kind(fields[5].strip() if len(fields) == 6 else "")
    return kinds


def _mapping_kind(path: str) -> str:
    if not path or path.startswith("["):  # [heap], [stack], [anon:...]
        return "anonymous"
    if path.startswith("/dev/shm/"):
        return "shared memory"
    return "libraries" if ".so" in path.rsplit("/", 1)[-1] else "files"


def rss_trace(ns, stage: str, runner=None) -> None:
    """With ``--rss-trace``: this rank's resident and peak memory now (and, for DCIR, the
    bytes its runtime accounts for), on stderr."""
    if not ns.rss_trace:
        return
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                status[key] = int(value.split()[0]) / 1024
    rank = os.environ.get("RANK", "0")
    extra = ""
    if hasattr(runner, "engine") and hasattr(runner.engine, "memory"):
        m = runner.engine.memory()
        extra = "  runtime MiB: " + ", ".join(f"{k} {m[k] / 2**20:.1f}" for k in (
            "parameters", "gradients", "optimizer_state", "buffers", "replicas", "gathered_now", "gathered_peak"))
    print(f"rss-trace rank {rank} {stage:<22} RSS {status.get('VmRSS', 0):8.1f} MiB  peak "
          f"{status.get('VmHWM', 0):8.1f} MiB  age {process_age_s():7.2f} s{extra}", file=sys.stderr, flush=True)


class Allocations:
    """The CPU allocator's live bytes, as ``torch.cuda.max_memory_allocated`` gives a GPU's:
    torch's memory profiler, on from before the model is built, reports with every
    allocation and free the bytes allocated since it started that are still live. The
    peak of that over one step (``window``) is the step's allocator peak: every tensor
    the rank holds (shards, gradients, optimizer state, buffers) and what the step
    allocates, without the process's own memory (Python, torch, compiled programs).
    Allocations on threads other than the one stepping are not seen."""

    def __init__(self):
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()

    @contextlib.contextmanager
    def window(self):
        with torch.profiler.record_function("bench: measured step"):
            yield

    def peak_mib(self) -> dict:
        """``{"start", "peak"}``: MiB live when the window began, and the most within it."""
        self.profiler.__exit__(None, None, None)
        events, span = [], None
        todo = list(self.profiler.profiler.kineto_results.experimental_event_tree())
        while todo:
            e = todo.pop()
            todo.extend(e.children)
            if isinstance(e.extra_fields, _ExtraFields_Allocation) and e.extra_fields.device.type == "cpu":
                events.append((e.start_time_ns, e.extra_fields.total_allocated))
            elif e.name == "bench: measured step":
                span = (e.start_time_ns, e.end_time_ns)
        events.sort()
        before = [total for t, total in events if t < span[0]]
        inside = [total for t, total in events if span[0] <= t <= span[1]]
        start = before[-1] if before else 0
        return {"start": start / 2**20, "peak": max([start, *inside]) / 2**20}


def optimizer_state_bytes(model, world: int) -> int:
    """This rank's AdamW state: two fp32 tensors (exp_avg, exp_avg_sq) per element of
    every trainable parameter, each parameter sharded over ``world`` ranks."""
    return sum(2 * 4 * math.ceil(p.numel() / world) for p in model.parameters() if p.requires_grad)


#: the optimizer steps after which the Engine profiles the next step and plans again: three
#: profiles, combined per op by the median, so one noisy profile does not decide the plan
PROFILE_AT = [1, 2, 3]


class Dcir:
    """The Engine; after each of the first three steps the next is profiled (a plan that compiles
    stretches: the step after its first) and ``passes``
    are planned from the profiles so far (none: plain zero3, profiled for the cost model's prediction).
    ``extra`` is merged into the Engine's config (``zero_stage``, ``offload``); with
    ``offload_half``, ``offload.budget`` is half of this rank's optimizer state bytes."""

    def __init__(self, ns, inductor: bool, passes: tuple[str, ...] = (), extra: dict | None = None,
                 offload_half: bool = False, graph_break: bool = False):
        import dcir

        self.init = ns.init
        model = llama(ns, meta=ns.init == "meta", graph_break=graph_break)  # on meta: initialize() shards it
        rss_trace(ns, "model")
        config = {"gradient_accumulation_steps": ns.accumulate, "inductor": inductor, "timeout_s": 600,
                  "transport": ns.transport,
                  "optimize": {"passes": list(passes), "profile_at": PROFILE_AT}}
        if ns.accumulate_gradients == "full" and (extra or {}).get("zero_stage", 3) == 3:
            config["accumulate_gradients"] = "full"
        config.update(extra or {})
        if ns.program_cache:
            config["program_cache"] = ns.program_cache
        if offload_half:
            world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
            config["offload"] = {"budget": optimizer_state_bytes(model, world) // 2}
        self.engine = dcir.initialize(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), config=config,
                                      loss_fn=lambda out: out.loss)
        self.switched = False  # the last step installed another program (``settled``)

    def save_profile(self, path: str) -> None:
        """The last profiled module (prof.* attributes on every op), for dcir-opt, and the
        program that ran after it (``-planned.dcir``: the plan, its ops' profiles copied), whose
        step the Engine predicted."""
        profiled = self.engine.profiled_ir()
        if profiled is not None:
            with open(path, "w") as f:
                f.write(str(profiled))
            with open(path.removesuffix(".dcir") + "-planned.dcir", "w") as f:
                f.write(str(self.engine.module))

    def trace(self, path: str) -> None:
        """Trace the next optimizer step into ``path`` (Chrome JSON, ``Engine.trace``)."""
        self.engine.trace(path)

    def predicted_s(self) -> float | None:
        """The cost model's step time (None for a step with graph breaks: its regions are priced one by one)."""
        log = self.engine.optimize_log
        return log[-1]["predicted_s"] if log and self.engine.programs.regions is None else None

    def optimize_log(self) -> list[dict]:
        """Each cycle's record: the pipeline planned, why it was taken, its budget, predicted peak and step,
        the profiled step's measured peak per function beside the memory model's for it, and the collectives
        of the captured schedule and of the plan."""
        keys = ("step", "pipeline", "reason", "switched", "budget", "predicted_s", "planned_s", "predicted_peak",
                "measured_peak", "predicted_peak_profiled", "noise", "gain", "needed_gain", "trial", "collectives")
        return [{**{k: r.get(k) for k in keys}, "cached": r.get("cached", False)} for r in self.engine.optimize_log]

    def save(self, path: str) -> None:
        self.engine.save_checkpoint(path, tag="bench")

    def load(self, path: str) -> None:
        self.engine.load_checkpoint(path, tag="bench")

    def micro_step(self, batch):
        running = self.engine.module
        loss = self.engine(**batch)
        self.engine.backward(loss, scale_wrt_gas=True)  # DeepSpeed's default: divided by the accumulation
        self.engine.step()
        self.switched = self.engine.module is not running

    def settled(self) -> bool:
        """Whether the optimization cycle is done: its last profile planned from, no plan on
        trial (``runtime.trial``), none waiting to compile before a profile, and the program
        running has run a step since it was installed (a trial's winner is lowered again:
        its first step is warm-up too): from here on the program is the one the job keeps."""
        regions = self.engine.programs.regions
        planners = [r.planner for r in regions.regions] if regions is not None else [self.engine.planner]
        return self.engine.execution.steps_run > max(PROFILE_AT) and not self.switched and \
            all(p.trial is None and p.profile is None and p.warming is None for p in planners)

    def wait_s(self) -> float:
        """Host seconds blocked in comm.wait: collectives, and host copies (offload)."""
        m = self.engine.memory()
        return m.wait_s + m.copy_wait_s

    def sent_bytes(self) -> int:
        """Bytes this rank has handed to collectives, as the runtime counts them."""
        return self.engine.memory()["sent"]

    def accounting(self) -> dict:
        """What this rank holds as the runtime accounts it, in bytes, for the running program:
        ``fixed`` whatever the schedule (shards, optimizer state, buffers; gradient shards
        where they outlive a backward), ``step_peak`` the memory model's peak of the step
        (a lone backward's gradient shards in it), ``outbox`` the shared-memory
        outbox, ``held`` what ``memory_budget`` is checked against (fixed and the schedule's
        peak), ``least_step_peak`` the step's peak with every activation ``recompute`` can
        rebuild rebuilt (``recompute{budget=1}`` on the running program), and
        ``shm_fallbacks`` the transfers the outbox could not place, sent over the process
        group instead (0 when it is sized right)."""
        import dcir
        from dcir.passes.recompute import Recompute, footprint
        from dcir_runtime.accounting import fixed_bytes, scheduled_bytes
        from dcir_runtime.native import runtime_stats

        m = self.engine.memory()
        fixed = fixed_bytes(m)
        least = self.engine.ir().clone()
        dcir.run_passes(least, [Recompute(budget=1)])
        return {"fixed": fixed, "step_peak": m.step_peak, "outbox": m.transport, "held": fixed + scheduled_bytes(m),
                "least_step_peak": footprint(least)[0], "shm_fallbacks": runtime_stats().shm_fallbacks}


class _Plain:
    """A model and an optimizer, stepped every ``accumulate`` micro-steps."""

    init = "real"  # how the model was built: "meta" where the subclass built it on the meta device

    def __init__(self, model, ns):
        self.model, self.ns, self.n = model, ns, 0
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def micro_step(self, batch):
        (self.model(**batch).loss / self.ns.accumulate).backward()
        self.n += 1
        if self.n % self.ns.accumulate == 0:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


class Fsdp2(_Plain):
    """``fully_shard`` per decoder layer and on the root; with ``offload``, the
    parameters, gradients and optimizer step live on the CPU (``CPUOffloadPolicy``);
    with ``bf16``, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; with
    ``checkpoint``, every decoder layer checkpointed (``gradient_checkpointing_enable``,
    non-reentrant); with ``compile_budget``, every decoder layer ``torch.compile``'d
    with ``torch._functorch.config.activation_memory_budget`` set to it. With
    ``--init meta``, FSDP2's recipe: shard the meta model, ``to_empty``, then the
    model's own init (``initialize_weights()``) on the local shards."""

    def __init__(self, ns, offload: bool = False, bf16: bool = False, checkpoint: bool = False,
                 compile_budget: float | None = None, graph_break: bool = False):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        dist.init_process_group(backend(ns))
        meta = ns.init == "meta"
        self.init = ns.init
        model = llama(ns, meta=meta, graph_break=graph_break)
        rss_trace(ns, "model")
        if checkpoint:  # every decoder layer recomputed in the backward: transformers' own switch
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compile_budget is not None:  # torchtitan's recipe: each layer compiled before fully_shard, and
            # the min-cut partitioner told what fraction of the activations it may keep
            torch._functorch.config.activation_memory_budget = compile_budget
            for k, layer in enumerate(model.model.layers):
                model.model.layers[k] = torch.compile(layer)
        # pinning host memory needs an accelerator ("Cannot access accelerator device")
        pin = torch.accelerator.is_available()
        kwargs = {"offload_policy": CPUOffloadPolicy(pin_memory=pin)} if offload else {}
        if bf16:  # the policy dcir-bf16 runs: bf16 compute and gathers, fp32 reduction
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        if meta:
            model.to_empty(device="cpu" if offload else device(ns))  # offload: the shards live on the host
            model.initialize_weights()  # transformers v5; it writes the DTensor parameters and the rotary buffers
        super().__init__(model, ns)

    def micro_step(self, batch):
        if self.ns.accumulate_gradients == "full":  # FSDP2's own switch: reduce in the last micro-step only
            self.model.set_requires_gradient_sync((self.n + 1) % self.ns.accumulate == 0)
        super().micro_step(batch)


class DeepSpeed:
    """DeepSpeed eager ZeRO (``stage`` 1, 2 or 3), CPU accelerator, gloo. With
    ``offload``, ZeRO-Offload: ``offload_optimizer`` to the CPU, where DeepSpeed keeps
    all optimizer state and runs the step with its own CPU Adam. With ``--init meta`` at
    stage 3 the model is built under ``deepspeed.zero.Init`` (each rank allocates only its
    partition); stages 1 and 2 keep a full copy of the parameters, so it is built as usual."""

    def __init__(self, ns, stage: int = 3, offload: bool = False):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        zero = {"stage": stage}
        config = {"train_micro_batch_size_per_gpu": ns.batch, "gradient_accumulation_steps": ns.accumulate,
                  "zero_optimization": zero, "zero_allow_untested_optimizer": True}
        deepspeed.init_distributed(dist_backend="gloo")
        self.init = "meta" if ns.init == "meta" and stage == 3 else "real"
        if self.init == "meta":
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = llama(ns)
        else:
            model = llama(ns)
        if ns.experts and stage == 3:  # DeepSpeed's recipe for MoE: each sparse block gathered as one
            from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
            deepspeed.utils.set_z3_leaf_modules(model, [MixtralSparseMoeBlock])
        if offload:  # its CPU Adam comes from DeepSpeed's optimizer config, not a torch optimizer
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.accelerator.is_available()}
            config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            return
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def save(self, path: str) -> None:
        self.engine.save_checkpoint(path, tag="bench")

    def load(self, path: str) -> None:
        self.engine.load_checkpoint(path, tag="bench")

    def micro_step(self, batch):
        loss = self.engine(**batch).loss
        self.engine.backward(loss)
        self.engine.step()


class Floor(_Plain):
    """One process, no communication: the model compiled by torch.compile (or, as
    ``eager``, not: the compute a program that runs op by op does). Built with its values
    whatever ``--init``: one process holds the whole model anyway."""

    def __init__(self, ns, compiled: bool = True):
        super().__init__(torch.compile(llama(ns)) if compiled else llama(ns), ns)


class FloorBf16(_Plain):
    """``floor`` (or, uncompiled, ``eager``) in the policy ``fsdp2-bf16`` and ``dcir-bf16``
    run, in one process: the forward and backward on a copy of the model whose parameters
    are bf16 (its buffers as they are, as FSDP2's policy leaves them), AdamW stepping the
    fp32 parameters with the gradients cast to fp32, and the stepped parameters cast into
    the copy after each step (FSDP2 casts them at each gather)."""

    def __init__(self, ns, compiled: bool = True):
        model = llama(ns)
        compute = copy.deepcopy(model)
        for p in compute.parameters():
            p.data = p.data.to(torch.bfloat16)
        super().__init__(model, ns)  # the optimizer over the fp32 parameters
        self.forward = torch.compile(compute) if compiled else compute
        self.pairs = list(zip(model.parameters(), compute.parameters()))

    def micro_step(self, batch):
        (self.forward(**batch).loss / self.ns.accumulate).backward()
        self.n += 1
        if self.n % self.ns.accumulate:
            return
        for master, low in self.pairs:
            master.grad, low.grad = (None if low.grad is None else low.grad.float()), None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for master, low in self.pairs:
                low.copy_(master)


#: DCIR with profile-guided passes
SCHEDULES = {"dcir-prefetch": ("prefetch",), "dcir-unshard": ("unshard",),
             "dcir-optimized": ("prefetch", "unshard", "bucket"),
             "dcir-fused": ("prefetch", "unshard", "bucket", "fuse"),
             "dcir-recompute": ("recompute", "prefetch", "unshard", "bucket"),
             "dcir-recompute-fused": ("recompute", "prefetch", "unshard", "bucket", "fuse")}
#: DCIR's other ZeRO stages and offload, each with dcir-optimized's passes: config
#: merged into the Engine's (dcir-offload's budget is filled in by ``Dcir``)
ENGINE_FEATURES = {"dcir-zero1": {"zero_stage": 1}, "dcir-zero2": {"zero_stage": 2},
                   "dcir-offload": {"zero_stage": 3}}
#: the config section of DCIR's bf16 rows: FSDP2's bf16 policy (bf16 compute and gathers, fp32 reduction)
BF16 = {"bf16": {"enabled": True}}
#: DeepSpeed eager ZeRO, by stage
DEEPSPEED = {"deepspeed-zero1": 1, "deepspeed-zero2": 2, "deepspeed": 3}


def make(system: str, ns):
    if system == "dcir":
        return Dcir(ns, inductor=False)
    if system == "dcir-inductor":  # dcir-optimized's planned schedule: the two rows differ only in the lowering
        return Dcir(ns, inductor=True, passes=SCHEDULES["dcir-optimized"])
    if system in SCHEDULES:  # the cycle plans within --memory-budget (none: 0)
        extra = {"memory_budget": ns.memory_budget} if ns.memory_budget else {}
        return Dcir(ns, inductor=False, passes=SCHEDULES[system], extra=extra)
    if system in ENGINE_FEATURES:
        return Dcir(ns, inductor=False, passes=SCHEDULES["dcir-optimized"], extra=ENGINE_FEATURES[system],
                    offload_half=system == "dcir-offload")
    if system == "fsdp2":
        return Fsdp2(ns)
    if system == "dcir-break":  # plain zero3 on the model with one graph break: regions
        return Dcir(ns, inductor=False, graph_break=True)
    if system == "fsdp2-break":
        return Fsdp2(ns, graph_break=True)
    if system == "fsdp2-offload":
        return Fsdp2(ns, offload=True)
    if system == "fsdp2-bf16":
        return Fsdp2(ns, bf16=True)
    if system == "fsdp2-ckpt":
        return Fsdp2(ns, checkpoint=True)
    if system == "fsdp2-compile-budget":
        return Fsdp2(ns, compile_budget=ns.compile_budget)
    if system == "fsdp2-compile":  # torchtitan's recipe: the partitioner's default budget keeps what it likes
        return Fsdp2(ns, compile_budget=1.0)
    if system == "fsdp2-compile-bf16":
        return Fsdp2(ns, bf16=True, compile_budget=1.0)
    if system == "dcir-bf16":  # plain zero3, as dcir, in FSDP2's bf16 policy (DeepSpeed's bf16 section)
        return Dcir(ns, inductor=False, extra=BF16)
    if system == "dcir-fused-bf16":
        return Dcir(ns, inductor=False, passes=SCHEDULES["dcir-fused"], extra=BF16)
    if system in DEEPSPEED:
        return DeepSpeed(ns, stage=DEEPSPEED[system])
    if system == "deepspeed-offload":
        return DeepSpeed(ns, stage=3, offload=True)
    if system == "floor":
        return Floor(ns)
    if system == "eager":
        return Floor(ns, compiled=False)
    if system in ("floor-bf16", "eager-bf16"):
        return FloorBf16(ns, compiled=system == "floor-bf16")
    if system == "floor-busy":  # the floor on every core at once; the group only meets between steps
        dist.init_process_group(backend(ns))
        return Floor(ns)
    raise SystemExit(f"unknown system {system!r}")


def parser() -> argparse.ArgumentParser:
    """The worker's options (``bench_checkpoint.py`` builds its ranks' options from it too)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("system")
    ap.add_argument("out")
    for name, default in [("layers", 6), ("hidden", 256), ("seq", 128), ("batch", 4), ("vocab", 32000),
                          ("accumulate", 1), ("steps", 6), ("warmup", 5), ("intermediate", 0), ("experts", 0)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--init", choices=("real", "meta"), default="real")
    ap.add_argument("--rss-trace", action="store_true")
    ap.add_argument("--transport", choices=TRANSPORTS, default="auto",
                    help="DCIR's transport for gathers and reduce-scatters (the Engine's config key)")
    ap.add_argument("--accumulate-gradients", choices=("shard", "full"), default="shard",
                    help="under --accumulate, DCIR's ZeRO-3 and FSDP2: each micro-step's gradients reduce-scattered "
                         "(shard), or summed in full and reduced once per optimizer step (full)")
    ap.add_argument("--trace", default=None, help="trace one more step after the measured ones into DIR/rank<N>.json")
    ap.add_argument("--memory-budget", type=int, default=0,
                    help="the Engine's memory_budget in bytes per rank, for the systems the cycle plans "
                         "(dcir-recompute and dcir-recompute-fused are given one by bench_train.py; 0: none)")
    ap.add_argument("--allocated", action="store_true",
                    help="measure the first measured step's allocator peak (CPU: under torch's memory profiler, "
                         "on from before the model is built; that run's step times are not representative)")
    ap.add_argument("--compile-budget", type=float, default=0.5,
                    help="fsdp2-compile-budget: torch._functorch.config.activation_memory_budget (default 0.5)")
    ap.add_argument("--program-cache", default=None, help="DCIR systems: the Engine's program_cache directory")
    ap.add_argument("--save-checkpoint", default=None, help="DCIR systems: save a checkpoint after the last step")
    ap.add_argument("--load-checkpoint", default=None,
                    help="DCIR systems: load the checkpoint --save-checkpoint saved before the first step (timed)")
    return ap


def main() -> None:
    ap = parser()
    ns = ap.parse_args()
    if ns.allocated and ns.device != "cpu":
        ap.error("--allocated measures the CPU allocator; on a GPU, peak_cuda_mib is that figure")
    if (ns.program_cache or ns.save_checkpoint or ns.load_checkpoint) and not ns.system.startswith("dcir"):
        ap.error("--program-cache, --save-checkpoint and --load-checkpoint are for DCIR systems")
    torch.set_num_threads(1)
    rss_trace(ns, "start")
    allocations = Allocations() if ns.allocated else None
    runner = make(ns.system, ns)
    rss_trace(ns, "built", runner)
    start_rss = peak_rss_mib()  # the peak of starting: the model, sharding, initialization (DCIR: and capture)
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    data = batches(ns, rank, world)
    load_s = None
    if ns.load_checkpoint:
        begin = time.perf_counter()
        runner.load(ns.load_checkpoint)
        load_s = time.perf_counter() - begin
    times, waits, sent, faults, first_step, first_step_time = [], [], [], [], None, None
    step, warmup = 0, ns.warmup
    while step < warmup + ns.steps:
        if step == warmup and hasattr(runner, "settled") and not runner.settled() and warmup < ns.warmup + 100:
            warmup += 1  # the optimization cycle still profiles, plans or tries plans: warming up
        wait0 = runner.wait_s() if hasattr(runner, "wait_s") else 0.0
        sent0 = runner.sent_bytes() if hasattr(runner, "sent_bytes") else None
        if step == warmup:  # the measured steps' own peak, without building, capture and compiling
            reset = reset_peak_rss()
        if distributed:
            dist.barrier()
        synchronize(ns)
        faults0 = minor_faults()
        begin = time.perf_counter()
        with allocations.window() if allocations is not None and step == warmup else contextlib.nullcontext():
            for _ in range(ns.accumulate):
                runner.micro_step(next(data))
        synchronize(ns)
        elapsed = time.perf_counter() - begin
        faulted = minor_faults() - faults0
        first_step = first_step if first_step is not None else process_age_s()
        first_step_time = first_step_time if first_step_time is not None else elapsed
        rss_trace(ns, f"step {step}", runner)
        waited = (runner.wait_s() - wait0) if hasattr(runner, "wait_s") else None
        if step >= warmup:
            times.append(elapsed)
            waits.append(waited)
            faults.append(faulted)
            sent.append(runner.sent_bytes() - sent0 if sent0 is not None else None)
        step += 1
    if ns.rss_trace:
        by_kind = ", ".join(f"{k} {v:.1f}" for k, v in resident_by_kind().items())
        print(f"rss-trace rank {rank} resident MiB by kind: {by_kind}", file=sys.stderr, flush=True)
    if ns.trace and hasattr(runner, "trace"):  # one more step, traced, not measured
        os.makedirs(ns.trace, exist_ok=True)
        runner.trace(os.path.join(ns.trace, f"rank{rank}.json"))
        for _ in range(ns.accumulate):
            runner.micro_step(next(data))
    if ns.save_checkpoint:
        runner.save(ns.save_checkpoint)
    predicted = runner.predicted_s() if hasattr(runner, "predicted_s") else None
    allocated = allocations.peak_mib() if allocations is not None else None
    rss = peak_rss_mib()  # before the accounting below, whose planning is not part of the step
    steps_rss = hwm_rss_mib() if ns.steps and reset else None
    accounted = runner.accounting() if hasattr(runner, "accounting") else None
    per_rank = {"times": times, "waits": waits, "sent": sent, "faults": faults, "peak_rss_mib": rss,
                "predicted_s": predicted, "accounted": accounted, "steps_rss_mib": steps_rss,
                "first_step_s": first_step, "first_step_time_s": first_step_time, "load_s": load_s,
                "start_rss_mib": start_rss, "allocated": allocated,
                "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if ns.device == "cuda" else None}
    everyone = [per_rank]
    if distributed:
        everyone = [None] * world
        dist.all_gather_object(everyone, per_rank)
    if rank == 0:
        if hasattr(runner, "save_profile"):
            runner.save_profile(os.path.splitext(ns.out)[0] + ".dcir")
        steps = [max(r["times"][i] for r in everyone) for i in range(ns.steps)]
        waits = None
        if everyone[0]["waits"][0] is not None:
            waits = [max(r["waits"][i] for r in everyone) for i in range(ns.steps)]
        with open(ns.out, "w") as f:
            json.dump({"system": ns.system, "world": world, "step_s": steps, "wait_s": waits,
                       "sent_bytes": [max(r["sent"][i] for r in everyone) if everyone[0]["sent"][i] is not None
                                      else None for i in range(ns.steps)],
                       "minor_faults": [max(r["faults"][i] for r in everyone) for i in range(ns.steps)],
                       "peak_rss_mib": [r["peak_rss_mib"] for r in everyone],
                       "start_rss_mib": [r["start_rss_mib"] for r in everyone],
                       "peak_cuda_mib": [r["peak_cuda_mib"] for r in everyone],
                       "allocated": [r["allocated"] for r in everyone],
                       "first_step_s": max(r["first_step_s"] for r in everyone),
                       "first_step_time_s": max(r["first_step_time_s"] for r in everyone),
                       "load_s": max(r["load_s"] for r in everyone) if load_s is not None else None,
                       "init": getattr(runner, "init", "real"), "warmup_steps": warmup,
                       "predicted_s": everyone[0]["predicted_s"],
                       "accounted": [r["accounted"] for r in everyone],
                       "steps_rss_mib": [r["steps_rss_mib"] for r in everyone],
                       "optimize_log": runner.optimize_log() if hasattr(runner, "optimize_log") else None}, f)
    if distributed:
        dist.barrier()
        os._exit(0)  # skip process-group teardown: it is not what is measured


if __name__ == "__main__":
    sys.exit(main())
