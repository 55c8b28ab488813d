"""Lightning's Trainer over the Engine: ``Trainer(strategy=DcirStrategy())`` trains an
unmodified ``LightningModule`` sharded across the ranks (docs/integrations.md).

The strategy is Lightning's DDP strategy (launch, process group, ``DistributedSampler``,
``self.log(..., sync_dist=True)``) with the model handed to ``dcir.initialize`` instead
of ``DistributedDataParallel``, as ``DeepSpeedStrategy`` hands it to DeepSpeed:

* ``self(batch)`` in ``training_step`` runs ``engine(batch)``; the loss the step returns
  goes through ``engine.backward``; Lightning's own accumulation (the loss divided by
  ``accumulate_grad_batches``) ends each micro-step with ``engine.step()``, which runs
  the optimizer at the boundary. The optimizer Lightning holds is an ``EngineOptimizer``:
  the engine's optimizer over this rank's shards, rebuilt from ``configure_optimizers``'s
  with its groups, which its LR schedulers drive.
* ``gradient_clip_val`` clips by the norm of the whole model (``engine.clip_grad_norm_``)
  or by value (elementwise, so each rank's shard is clipped as the whole would be).
* A checkpoint is a directory at the path Lightning gives: the engine's DCP checkpoint
  (tag ``dcir``), with Lightning's own state (loops, callbacks, schedulers) as its client
  state; ``ckpt_path=`` resumes it at any world size.
* After ``fit`` the module holds the trained parameters, whole, on every rank.

What it cannot honour is an error: manual optimization, precisions other than ``32-true``
and ``bf16-mixed``, epochs whose batches are not a multiple of ``accumulate_grad_batches``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from dcir.diagnostics import DcirError, Diagnostic
from dcir_runtime.engine import Engine, initialize
from dcir_runtime.shards import EngineOptimizerView

__all__ = ["DcirStrategy", "EngineOptimizer"]

#: the tag of the engine's checkpoint inside the directory Lightning names
TAG = "dcir"
#: Lightning's precision -> the engine's config for it
PRECISIONS = {"32-true": {}, "bf16-mixed": {"bf16": {"enabled": True}}}


def _accumulation_error(batches, accumulate: int) -> DcirError:
    return DcirError(Diagnostic(
        f"Lightning steps the optimizer at the end of every epoch, and an epoch here has {batches} batches, not a "
        f"multiple of accumulate_grad_batches={accumulate}: the engine steps every {accumulate} "
        "micro-batches; make the batches per epoch a multiple of it (batch size, drop_last, limit_train_batches)"))


class EngineOptimizer(EngineOptimizerView):
    """The optimizer Lightning steps: the engine's (``EngineOptimizerView``).
    ``step(closure)`` runs the closure (the last micro-step's forward, backward and
    clipping), then ``engine.step()``."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        accumulate = self.engine.config.gradient_accumulation_steps
        if not self.engine.is_gradient_accumulation_boundary():
            raise _accumulation_error(f"{self.engine.micro_steps % accumulate + 1} (left over)", accumulate)
        loss = closure() if closure is not None else None
        self.engine.step()
        self._opt_called = True  # what an LR scheduler's step-order check reads
        return loss

    # an LR scheduler warns unless the optimizer's step is the one it wrapped: this is the step
    step._wrapped_by_lr_sched = True

    def state_dict(self) -> dict:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.engine.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.engine.optimizer!r})"


class _EnginePrecision(Precision):
    """Lightning's precision plugin for the engine: the engine casts (``bf16``), so no
    autocast; backward is ``engine.backward``; clipping by norm is the whole model's."""

    def __init__(self, precision: str, strategy: "DcirStrategy"):
        self.precision = precision
        self.strategy = strategy

    def backward(self, tensor: torch.Tensor, model, optimizer, *args, **kwargs) -> None:
        self.strategy.engine.backward(tensor)

    def clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        self.strategy.engine.clip_grad_norm_(clip_val)


class DcirStrategy(DDPStrategy):
    """``Trainer(strategy=DcirStrategy(config={...}))``: trains through ``dcir.initialize``
    with ``config`` (docs/config.md) less ``gradient_accumulation_steps``, which is the
    Trainer's ``accumulate_grad_batches``. Launch with ``torchrun``."""

    strategy_name = "dcir"

    def __init__(self, config: dict | None = None, **kwargs):
        config = dict(config or {})
        key = "gradient_accumulation_steps"
        if key in config:
            raise DcirError(Diagnostic(
                f"DcirStrategy(config=...) takes no {key}: "
                "set accumulate_grad_batches on the Trainer, which the strategy hands to the engine"))
        self.engine_config = config
        self.engine: Engine | None = None
        super().__init__(**kwargs)

    # ---- what Lightning asks of the strategy -------------------------------------------------

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin or _EnginePrecision("32-true", self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning's plugin for the Trainer's ``precision`` becomes the engine's (None:
        not chosen yet, so the Trainer's flag decides)."""
        if plugin is None:
            self._precision_plugin = None
            return
        name = getattr(plugin, "precision", type(plugin).__name__)
        if name not in PRECISIONS:
            raise DcirError(Diagnostic(
                f"DcirStrategy trains in precision {' or '.join(map(repr, PRECISIONS))} "
                f"(the engine's bf16: bf16 compute, fp32 master weights and reduction), not {name!r}"))
        self._precision_plugin = _EnginePrecision(name, self)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine exists, and loads its shards, after setup

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine's checkpoint holds the optimizer state

    def connect(self, model: LightningModule) -> None:
        if not model.automatic_optimization:
            raise DcirError(Diagnostic(
                "DcirStrategy trains with automatic optimization only (the engine runs the backward and the step): "
                f"{type(model).__name__}.automatic_optimization is False"))
        super().connect(model)

    def setup(self, trainer: Trainer) -> None:
        self.accelerator.setup(trainer)
        self.model_to_device()
        if trainer.state.fn != TrainerFn.FITTING:  # nothing to train: the module as it is, on every rank
            _sync_module_states(self.model)
            self.setup_precision_plugin()
            return
        self.setup_optimizers(trainer)  # the user's configure_optimizers, on the module's own parameters
        lm = self.lightning_module
        config = {**self.engine_config, **PRECISIONS[self.precision_plugin.precision],
                  "gradient_accumulation_steps": trainer.accumulate_grad_batches}
        self.engine = initialize(lm, optimizer=self.optimizers[0], config=config)
        optimizer = EngineOptimizer(self.engine)
        for scheduler_config in self.lr_scheduler_configs:
            scheduler_config.scheduler.optimizer = optimizer
        self.optimizers = [optimizer]
        lm.forward = _routed_forward(lm, self.engine)
        self.setup_precision_plugin()

    def on_train_start(self) -> None:
        trainer, accumulate = self.lightning_module.trainer, self.lightning_module.trainer.accumulate_grad_batches
        batches = trainer.num_training_batches
        if batches != float("inf") and batches % accumulate:
            raise _accumulation_error(batches, accumulate)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """A micro-step inside accumulation ends here (Lightning steps no optimizer for it);
        the last one ends in ``EngineOptimizer.step``."""
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()

    def optimizer_state(self, optimizer) -> dict:
        return {}  # in the engine's checkpoint

    def lightning_module_state_dict(self) -> dict:
        return {}  # in the engine's checkpoint

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        pass  # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass  # loaded by load_checkpoint

    # ---- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any | None = None) -> None:
        """The engine's checkpoint in the directory ``filepath`` (tag ``dcir``), Lightning's
        state its client state; every rank writes its shards (a collective)."""
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        self.engine.save_checkpoint(filepath, tag=TAG, client_state=client_state)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Loads the engine's checkpoint at ``checkpoint_path`` (a collective); returns
        Lightning's state saved with it."""
        if self.engine is None:
            raise DcirError(Diagnostic(
                "DcirStrategy loads checkpoints into the engine it trains with, in trainer.fit(..., ckpt_path=...); "
                f"{self.lightning_module.trainer.state.fn.value} cannot: export {checkpoint_path} (dcir-checkpoint "
                "export) to load it elsewhere"))
        _, client_state = self.engine.load_checkpoint(checkpoint_path, tag=TAG)
        return client_state

    # ---- the end --------------------------------------------------------------------------------

    def teardown(self) -> None:
        """After a finished fit the module gets the trained parameters, whole, on every
        rank (a collective); after a failed one they stay on the meta device (a peer may
        be gone), and the module is left where it is."""
        lm, engine = self.lightning_module, self.engine
        if engine is None or lm is None:
            return super().teardown()
        lm.__dict__.pop("forward", None)
        failed = lm._trainer is not None and lm.trainer.state.status == TrainerStatus.INTERRUPTED
        if not failed:
            _write_back(lm, engine.full_parameters())
        self.engine = None
        if not failed:
            return super().teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


def _routed_forward(lm: LightningModule, engine: Engine) -> Callable:
    """``lm``'s forward while the engine trains it: ``engine(...)``, in ``lm``'s mode.
    The engine's capture copies the module, and the copy must run the class's own
    forward, so the routing is off while the engine runs."""
    def forward(*args, **kwargs):
        engine.train(lm.training)
        del lm.forward
        try:
            return engine(*args, **kwargs)
        finally:
            lm.forward = forward
    return forward


@torch.no_grad()
def _write_back(lm: LightningModule, full: dict[str, torch.Tensor]) -> None:
    """Every parameter of ``lm`` (on the meta device while the engine held it) replaced
    by its whole value from ``full``; tied names stay one parameter."""
    made: dict[int, torch.nn.Parameter] = {}
    for fqn, p in list(lm.named_parameters(remove_duplicate=False)):
        if id(p) not in made:
            made[id(p)] = torch.nn.Parameter(full[fqn].to(p.dtype), requires_grad=p.requires_grad)
        owner, _, leaf = fqn.rpartition(".")
        setattr(lm.get_submodule(owner), leaf, made[id(p)])

