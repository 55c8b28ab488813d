"""Mixed precision in the Engine: the config's policy, capture in it, fp16 loss scaling.

The config names the policy the way FSDP2 and DeepSpeed do (``docs/config.md``):

* ``"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}`` is
  FSDP2's ``MixedPrecisionPolicy`` (also ``output_dtype``, ``cast_forward_inputs``);
* ``"bf16": {"enabled": true}`` is DeepSpeed's bf16 section: bf16 compute and
  gathers, fp32 gradient reduction and master weights;
* ``"fp16": {"enabled": true, ...}`` is DeepSpeed's fp16 section: fp16 compute and
  gathers, fp32 reduction, and loss scaling (dynamic when ``loss_scale`` is 0).

The step is captured with the parameters in ``param_dtype`` and the ``mixed_precision``
pass places the casts in the IR (``dcir/passes/mixed_precision.py``): the shards, the
optimizer and its state stay fp32.

With loss scaling, ``backward`` seeds the backward with the scale instead of 1, so
small fp16 gradients do not flush to zero, and divides the gradient shards by it. The
scaler's state is ``engine.loss_scaler``, which checkpoints save and load.

At every optimizer step, in any precision, the ranks agree (one all_reduce of a flag)
whether a loss ``engine.backward`` saw or a gradient shard is inf or NaN. If one is, the
weights and the optimizer state are left as they are and the step's gradients dropped;
under fp16 the step is skipped and the scale goes down; otherwise the config's
``nonfinite`` says: ``"error"`` raises the same ``DcirError`` on every rank, naming
the step, the ranks and the first parameter it shows in (from one all_gather of what
each rank found), and ``"skip"`` skips the step with a warning that says the same.
A skipped step counts in ``engine.skipped_steps``, not in ``engine.steps``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dcir.diagnostics import DcirError, Diagnostic
from dcir.dtypes import parse_dtype
from dcir.passes.mixed_precision import MASTER, MixedPrecision
from dcir.shapes import torch_dtype

log = logging.getLogger("dcir")

#: FSDP2's MixedPrecisionPolicy fields (and their defaults)
_POLICY_KEYS = {"param_dtype": None, "reduce_dtype": None, "output_dtype": None, "cast_forward_inputs": True}
#: DeepSpeed's fp16 section (and its defaults)
_FP16_KEYS = {"enabled": False, "loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 1000,
              "hysteresis": 2, "min_loss_scale": 1.0, "consecutive_hysteresis": False}


# ---- the config's sections (called by dcir_runtime.config) ------------------------------

def check_policy(v):
    """``mixed_precision``: the policy with dtypes in the IR's spelling, or None."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"{v!r}; an object like {{\"param_dtype\": \"bfloat16\", \"reduce_dtype\": \"float32\"}}")
    _known_keys(v, _POLICY_KEYS, "mixed_precision")
    out = dict(_POLICY_KEYS)
    for key in ("param_dtype", "reduce_dtype", "output_dtype"):
        if v.get(key) is not None:
            out[key] = parse_dtype(v[key])
    if not isinstance(v.get("cast_forward_inputs", True), bool):
        raise ValueError(f"'cast_forward_inputs' is {v['cast_forward_inputs']!r}; true or false")
    out["cast_forward_inputs"] = v.get("cast_forward_inputs", True)
    return out


def check_fp16(v):
    """DeepSpeed's ``fp16`` section, defaults filled in, or None when absent or disabled."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"{v!r}; an object like {{\"enabled\": true, \"loss_scale\": 0}}")
    _known_keys(v, _FP16_KEYS, "fp16")
    out = {**_FP16_KEYS, **v}
    for key in ("enabled", "consecutive_hysteresis"):
        if not isinstance(out[key], bool):
            raise ValueError(f"'{key}' is {out[key]!r}; true or false")
    for key, least in (("initial_scale_power", 0), ("loss_scale_window", 1), ("hysteresis", 1)):
        if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] < least:
            raise ValueError(f"'{key}' is {out[key]!r}; a whole number >= {least}")
    for key in ("loss_scale", "min_loss_scale"):
        value = out[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
            raise ValueError(f"'{key}' is {value!r}; a finite number >= 0")
        out[key] = float(out[key])
    return out if out["enabled"] else None


def check_bf16(v):
    """DeepSpeed's ``bf16`` section: ``{"enabled": true}``, or None."""
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) - {"enabled"} or not isinstance(v.get("enabled", False), bool):
        raise ValueError(f"{v!r}; an object like {{\"enabled\": true}} (its only key is enabled)")
    return v if v.get("enabled") else None


def _known_keys(v: dict, known: dict, section: str) -> None:
    for key in v:
        if key not in known:
            raise ValueError(f"unknown key {key!r} in '{section}'; valid keys: {', '.join(known)}")


@dataclass(frozen=True)
class Policy:
    """What the Engine does in mixed precision, whichever section asked for it (IR dtypes)."""

    param_dtype: str = MASTER
    reduce_dtype: str = MASTER
    output_dtype: str | None = None
    cast_forward_inputs: bool = True

    @property
    def active(self) -> bool:
        return self.param_dtype != MASTER or self.reduce_dtype != MASTER or self.output_dtype is not None


def policy_of(config) -> Policy:
    """The policy of ``config``: ``mixed_precision`` (FSDP2's defaults: ``reduce_dtype``
    follows ``param_dtype``), else ``bf16`` or ``fp16`` (low precision compute, fp32
    reduction). ``Config`` allows one of them."""
    mp = config.mixed_precision
    if mp is not None:
        param = mp["param_dtype"] or MASTER
        return Policy(param, mp["reduce_dtype"] or param, mp["output_dtype"], mp["cast_forward_inputs"])
    if config.bf16 is not None:
        return Policy("bf16", MASTER)
    if config.fp16 is not None:
        return Policy("f16", MASTER)
    return Policy()


# ---- capture -----------------------------------------------------------------------------

def capture_options(policy: Policy) -> dict:
    """Keyword arguments of ``compile_to_ir`` that capture the step in the policy's precision."""
    if not policy.active:
        return {}
    return {"param_dtype": torch_dtype(policy.param_dtype) if policy.param_dtype != MASTER else None,
            "output_dtype": torch_dtype(policy.output_dtype) if policy.output_dtype else None,
            "cast_inputs": policy.cast_forward_inputs}


def passes(policy: Policy) -> list:
    """The pass that places the policy's casts (after the ZeRO stage's pass)."""
    return [MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)] if policy.active else []


# ---- fp16 loss scaling -----------------------------------------------------------------------

class LossScaler:
    """DeepSpeed's loss scaler: static when ``loss_scale`` > 0, else dynamic: starts at
    2**initial_scale_power; an overflow halves it (not below ``min_loss_scale``) once
    ``hysteresis`` - 1 overflows have been tolerated, and so does every overflow until
    the hysteresis is refilled: when ``loss_scale_window`` steps without one double the
    scale, or, with ``consecutive_hysteresis``, after every step without one."""

    def __init__(self, fp16: dict):
        self.dynamic = fp16["loss_scale"] == 0
        self.cur_scale = 2.0 ** fp16["initial_scale_power"] if self.dynamic else fp16["loss_scale"]
        self.min_scale, self.window = fp16["min_loss_scale"], fp16["loss_scale_window"]
        self.delayed_shift = self.cur_hysteresis = fp16["hysteresis"]
        self.consecutive_hysteresis = fp16["consecutive_hysteresis"]
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update_scale(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter, "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, state: dict) -> None:
        self.cur_scale, self.cur_iter = state["cur_scale"], state["cur_iter"]
        self.last_overflow_iter, self.cur_hysteresis = state["last_overflow_iter"], state["cur_hysteresis"]


# ---- inf and NaN at the optimizer step -----------------------------------------------------

def _nonfinite_here(losses: list, shards: dict) -> bool:
    """Whether one of ``losses`` or of the shards' gradients holds an inf or a NaN (one
    host sync). The tensors' norms first, in one fused pass that reads each once: a
    finite norm has no inf or NaN under it, so a healthy step is settled there (18 ms
    of element-wise checks became 1.5 ms on the benchmark's 11 M-element shards); only
    a norm that overflows or is not finite is checked element by element."""
    tensors = [loss.detach().float() for _, loss in losses] + [s.grad for s in shards.values() if s.grad is not None]
    if not tensors:
        return False
    norms = torch._foreach_norm([t.reshape(-1) for t in tensors])
    if bool(torch.stack([n.float().to(norms[0].device) for n in norms]).isfinite().all()):
        return False
    flags = [torch.isfinite(t).all() for t in tensors]
    return not bool(torch.stack([f.to(flags[0].device) for f in flags]).all())


def _findings(rank: int, losses: list, shards: dict) -> dict:
    """What this rank saw: how many losses, the non-finite ones as (micro-step, value),
    and the position (in the model's parameter order, the shards') of the first shard
    whose value, and of the first whose gradient, is not finite."""
    def first(values) -> int | None:
        return next((i for i, t in enumerate(values) if t is not None and not torch.isfinite(t).all()), None)
    values = [loss.item() for _, loss in losses]
    return {"rank": rank, "seen": len(losses),
            "losses": [(micro, v) for (micro, _), v in zip(losses, values) if not math.isfinite(v)],
            "value": first([s.detach() for s in shards.values()]), "grad": first([s.grad for s in shards.values()])}


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _describe(step: int, found: list[dict], names: list[str]) -> str:
    """What the ranks ``found`` (``_findings``, one per rank) at optimizer step ``step``
    (1-based: ``engine.steps`` + 1), the same words on every rank."""
    parts = []
    bad = [(f["rank"], micro, v) for f in found for micro, v in f["losses"]]
    if bad:
        rank, micro, value = bad[0]
        n, others = len(bad) - 1, _ranks(sorted({r for r, _, _ in bad[1:]}))
        more = f", and {n} more non-finite loss{'es' * (n > 1)} on {others}" if n else ""
        parts.append(f"the loss is {value} (rank {rank}, micro-step {micro}{more})")
    elif any(f["seen"] for f in found):
        parts.append("the loss is finite")
    for key, what in (("value", "parameter is {}"), ("grad", "gradient is {}'s")):
        firsts = [f[key] for f in found if f[key] is not None]
        if firsts:
            at = min(firsts)
            parts.append(f"the first non-finite {what.format(names[at])} "
                         f"({_ranks([f['rank'] for f in found if f[key] == at])})")
            break
    return f"step {step}: " + "; ".join(parts)


def _gathered(group, mine: dict) -> list[dict]:
    """Every rank's ``mine``, in rank order: a collective, run only once the ranks agreed
    that one of them found something."""
    if group.world == 1:
        return [mine]
    out: list = [None] * group.world
    dist.all_gather_object(out, mine)
    return out


# ---- what the Engine's execution asks ------------------------------------------------------

class Precision:
    """One engine's policy, its loss scaler (None without fp16), the losses of this
    optimizer step that ``engine.backward`` saw, and the count of the optimizer steps
    skipped for an inf or NaN; ``Execution`` asks it at each backward and step."""

    def __init__(self, config):
        self.policy = policy_of(config)
        self.loss_scaler = LossScaler(config.fp16) if config.fp16 is not None else None
        self.skipped_steps = 0
        self.losses: list[tuple[int, torch.Tensor]] = []  # (micro-step of the step, 1-based; the loss)

    def loss_scale(self) -> float:
        """The factor ``backward`` seeds the backward with (1 without loss scaling)."""
        return self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0

    def saw_loss(self, micro_step: int, loss: torch.Tensor) -> None:
        """``engine.backward`` backpropagates ``loss``, the ``micro_step``-th of the optimizer step (1-based)."""
        self.losses.append((micro_step, loss.detach()))

    def unscale(self, grads: dict) -> None:
        """Divide this micro-step's gradient shards by the loss scale, in place."""
        if self.loss_scaler is None:
            return
        for g in grads.values():
            g.div_(self.loss_scaler.cur_scale)

    @torch.no_grad()
    def step_or_skip(self, shards: dict, group, optimizer, steps: int, nonfinite: str | None) -> bool:
        """At the optimizer step (``steps`` taken so far): whether to take it. The ranks
        agree whether a loss of the step or a gradient shard holds an inf or a NaN; if
        one does, the gradients are dropped (the parameters and the optimizer state are
        untouched) and, under fp16, the step is skipped and the scale adjusted; else
        ``nonfinite`` ``"skip"`` skips it and ``"error"`` (None) raises the same
        ``DcirError`` on every rank."""
        losses, self.losses = self.losses, []
        bad = group.most(float(_nonfinite_here(losses, shards)), "whether the step's numbers are finite")
        bad = bad > 0
        if self.loss_scaler is not None:
            return self._scaled(bad, group, optimizer, steps)
        if not bad:
            return True
        said = _describe(steps + 1, _gathered(group, _findings(group.rank, losses, shards)), list(shards))
        optimizer.zero_grad(set_to_none=True)
        if nonfinite != "skip":
            raise DcirError(Diagnostic(f"{said}; the step's gradients were dropped, nothing else changed "
                                       "(config nonfinite 'skip' skips such steps)"))
        self.skipped_steps += 1
        if group.rank == 0:
            log.warning("dcir: %s; step skipped (%d so far)", said, self.skipped_steps)
        return False

    def _scaled(self, overflow: bool, group, optimizer, steps: int) -> bool:
        """fp16: the scaler learns whether the step overflowed; an overflow skips it."""
        scaler = self.loss_scaler
        attempted = scaler.cur_scale
        scaler.update_scale(overflow)
        if not overflow:
            return True
        optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        if group.rank == 0:
            log.warning("dcir: step %d: inf/NaN gradients, step skipped (%d so far); loss scale %g -> %g",
                        steps + 1, self.skipped_steps, attempted, scaler.cur_scale)
        return False
