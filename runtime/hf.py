"""The ``transformers`` Trainer on the DCIR Engine: ``DcirTrainer``.

A Trainer script changes its class, ``Trainer`` -> ``DcirTrainer``, and is launched with
``torchrun`` as for DDP; everything else (``TrainingArguments``, the dataset, the
collator, callbacks, ``resume_from_checkpoint``, ``save_model``) stays. The Trainer keeps
its loop: its data order and sharding across ranks, its loss (and its scaling for
gradient accumulation and token counts across ranks), its optimizer groups (weight decay
by name), its LR schedule, its logging and its checkpoint cadence. What DDP would do,
the Engine does instead (docs/integrations.md):

* the model: on the first ``_wrap_model`` the Trainer's model goes into
  ``dcir.initialize`` (its parameters to the meta device; each rank keeps its shards)
  with the optimizer the Trainer built on it, rebuilt over the shards with its groups;
  the Trainer then calls an ``EngineModule`` whose forward is the Engine's, and an
  ``EngineOptimizer`` whose ``step()`` is ``engine.step()``;
* backward: the Trainer's ``loss.backward()`` runs the Engine's sharded backward;
* accumulation: the Engine accumulates ``gradient_accumulation_steps`` micro-steps and
  the Trainer's optimizer step is its boundary (checked every micro-step);
* clipping: ``engine.clip_grad_norm_``, the norm over every rank's shards;
* checkpoints: ``checkpoint-N/`` holds the consolidated model (``save_pretrained``, so
  ``from_pretrained`` loads it), the Trainer's state, scheduler and RNG files, and
  ``dcir/`` the Engine's own crash-safe checkpoint (shards, optimizer state, RNG),
  from which ``resume_from_checkpoint`` continues bit for bit.

What the Engine cannot honour is refused when the Trainer is built (``DcirTrainer``'s
``__init__``), with the argument's name.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from dcir.diagnostics import DcirError, Diagnostic
from dcir_runtime import checkpoint
from dcir_runtime.engine import initialize
from dcir_runtime.shards import EngineOptimizerView

__all__ = ["DcirTrainer", "EngineModule", "EngineOptimizer"]

#: the Engine's checkpoint inside a Trainer's ``checkpoint-N/`` directory, and its tag
ENGINE_DIR, ENGINE_TAG = "dcir", "engine"
SCHEDULER = "scheduler.pt"  # the Trainer's name for its LR scheduler's state

#: TrainingArguments the Engine cannot honour: name -> why (any value but the default, which is falsy, is refused)
_REFUSED = {
    "fsdp": "FSDP shards the model its own way: DcirTrainer shards it through DCIR; drop fsdp",
    "deepspeed": "DeepSpeed shards the model its own way: DcirTrainer shards it through DCIR; drop deepspeed",
    "fp16": "accelerate's loss scaler would scale a loss the Engine backpropagates: use bf16=True, or the "
            "Engine's own fp16 through dcir_config={'fp16': {'enabled': True}}",
    "torch_compile": "the Engine compiles the step itself: drop torch_compile (the config's inductor compiles "
                     "the compute between collectives)",
    "neftune_noise_alpha": "NEFTune adds noise in a forward hook, which capture would freeze into the program",
    "auto_find_batch_size": "a smaller batch after an out-of-memory error needs a new Engine; choose the batch",
    "parallelism_config": "accelerate's parallelism (tensor, context, FSDP meshes) is not the Engine's; drop it",
    "load_best_model_at_end": "the best checkpoint would be loaded into the model's own parameters, which the "
                              "Engine holds as shards; load it with resume_from_checkpoint or from_pretrained",
}


class EngineModule(torch.nn.Module):
    """What the Trainer calls in place of its model: the Engine's forward (a training
    forward with gradients enabled, its forward-only program under ``torch.no_grad()``).
    The model stays a submodule (its parameters on the meta device), so the Trainer's
    parameter counts, ``config`` and ``unwrap_model`` still find it."""

    def __init__(self, engine, model: torch.nn.Module):
        super().__init__()
        self.engine, self.module = engine, model

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> "EngineModule":
        self.engine.train(mode)
        return super().train(mode)

    def _get_name(self) -> str:  # the Trainer picks label smoothing's shift by the model's class name
        return self.module._get_name()


class EngineOptimizer(EngineOptimizerView):
    """The Trainer's optimizer: the Engine's (``EngineOptimizerView``), whose ``step()``
    ends the Engine's accumulation and runs it; the state is saved with the Engine's
    checkpoint."""

    _is_accelerate_prepared = True  # accelerator.prepare hands it back as it is

    def __init__(self, engine):
        super().__init__(engine)
        self.step_was_skipped = False

    def step(self, closure=None):
        if closure is not None:
            raise DcirError(Diagnostic("the Engine's optimizer step takes no closure (LBFGS-style optimizers are "
                                       "not supported)"))
        self.step_was_skipped = not self.engine.step()

    def state_dict(self) -> dict:
        return {}  # in the Engine's checkpoint, sharded

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def _refusals(args: TrainingArguments) -> list[str]:
    problems = [f"TrainingArguments({name}={getattr(args, name)!r}): {why}" for name, why in _REFUSED.items()
                if getattr(args, name, None)]
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if args.world_size != launched:
        problems.append(f"TrainingArguments sees a world of {args.world_size} process(es) but {launched} were "
                        "launched (on a machine without a GPU, pass use_cpu=True so that accelerate joins them "
                        "over gloo)")
    return problems


class DcirTrainer(Trainer):
    """``transformers.Trainer`` with the model sharded by the DCIR Engine. Takes the
    Trainer's arguments, and ``dcir_config``: the Engine's config (docs/config.md) beyond
    what the TrainingArguments set (``gradient_accumulation_steps``, ``bf16``,
    ``max_grad_norm`` are taken from them). After training, ``trainer.engine`` is the
    Engine and ``trainer.model``'s parameters are on the meta device: save with
    ``trainer.save_model()`` (every rank calls it, as with DDP)."""

    def __init__(self, *args, dcir_config: dict | None = None, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            problems = _refusals(training_args)
            if problems:
                raise DcirError(Diagnostic("DcirTrainer cannot honour these arguments:\n  " + "\n  ".join(problems)))
        self.engine = None
        self._dcir_config = dict(dcir_config or {})
        super().__init__(*args, **kwargs)

    def _engine_config(self) -> dict:
        args, config = self.args, dict(self._dcir_config)
        accumulate = args.gradient_accumulation_steps
        for key, value in (("gradient_accumulation_steps", accumulate),
                           ("bf16", {"enabled": True} if args.bf16 else None)):
            if value is not None and config.setdefault(key, value) != value:
                raise DcirError(Diagnostic(f"dcir_config[{key!r}] = {config[key]!r} contradicts the "
                                           f"TrainingArguments ({value!r}); give it in one place"))
        return config

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        accumulate, batches = self.args.gradient_accumulation_steps, len(train_dataloader)
        if batches % accumulate and max_steps * accumulate > batches:  # the training reaches an epoch's end
            raise DcirError(Diagnostic(
                f"an epoch has {batches} batches per rank, not a multiple of gradient_accumulation_steps "
                f"{accumulate}: the Trainer would step early at each epoch's end, the Engine every {accumulate} "
                "micro-steps; use a dataset (or dataloader_drop_last, max_steps) that fills each optimizer step"))
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self.engine is None:
            if self.optimizer is None:  # evaluating before training: the optimizer the training will use
                self.create_optimizer()
            self.engine = initialize(self.model, optimizer=self.optimizer, config=self._engine_config())
            self.optimizer = EngineOptimizer(self.engine)
            self._engine_module = EngineModule(self.engine, self.model)
        return self._engine_module

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary != self.accelerator.sync_gradients:
            raise DcirError(Diagnostic(
                f"the Trainer {'runs' if self.accelerator.sync_gradients else 'skips'} the optimizer after this "
                f"micro-step and the Engine {'would' if boundary else 'would not'}: their gradient accumulation "
                "disagrees (gradient_accumulation_steps changed after the Trainer was built?)"))
        if not boundary:
            self.engine.step()  # the micro-step ends; the Trainer's optimizer.step() ends the last one
        return loss

    def _clip_grad_norm(self, model):
        return self.engine.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm if grad_norm is not None else self.engine.clip_grad_norm_(float("inf"))

    # ---- checkpoints ---------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:  # the newest complete one: a killed save leaves a partial checkpoint-N
            resume_from_checkpoint = self._last_complete_checkpoint()
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _last_complete_checkpoint(self) -> str:
        root = Path(self.args.output_dir)
        found = sorted((d for d in root.glob("checkpoint-*") if d.name.split("-")[-1].isdigit()),
                       key=lambda d: int(d.name.split("-")[-1]), reverse=True) if root.is_dir() else []
        for d in found:
            if (d / "trainer_state.json").is_file() and checkpoint.latest(d / ENGINE_DIR) == ENGINE_TAG:
                return str(d)
        raise DcirError(Diagnostic(f"resume_from_checkpoint=True: no complete checkpoint in {root} (a checkpoint-N "
                                   f"with trainer_state.json and the Engine's {ENGINE_DIR}/; found: "
                                   f"{', '.join(d.name for d in found) or 'none'})"))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The whole model, consolidated: ``save_pretrained`` on the main process of the
        parameters every rank gathers (a collective: call it on every rank)."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        full = self.engine.full_parameters()
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            self.model.save_pretrained(output_dir, state_dict=full)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR), tag=ENGINE_TAG)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The parameters come with the Engine's checkpoint (``_load_optimizer_and_scheduler``,
        once the Engine exists); here only that it is there."""
        if checkpoint.latest(Path(resume_from_checkpoint) / ENGINE_DIR) is None:
            raise DcirError(Diagnostic(f"{resume_from_checkpoint} holds no DCIR Engine checkpoint ({ENGINE_DIR}/): "
                                       "it was not saved by DcirTrainer, or its save did not finish; start from its "
                                       "model with from_pretrained instead"))

    def _load_optimizer_and_scheduler(self, resume_from: str | None) -> None:
        if resume_from is None:
            return
        self.engine.load_checkpoint(os.path.join(resume_from, ENGINE_DIR), tag=ENGINE_TAG)
        scheduler = os.path.join(resume_from, SCHEDULER)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
