"""Lightning's Trainer over the Engine (``dcir_runtime.lightning.DcirStrategy``, issue 37):
the script of docs/integrations.md trains at world 2 to the numbers Lightning's own
single-process run reaches, resumes from its Lightning checkpoint bit for bit, and what
the strategy cannot honour is an error that says so."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from dcir.diagnostics import DcirError
from dcir_runtime import checkpoint, native
from dcir_runtime.lightning import DcirStrategy
from jobs import run_job

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "docs" / "examples" / "lightning_dcir.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run_job(argv: list[str], cwd: Path, timeout_s: float = 180) -> None:
    """Runs ``argv`` (torchrun's workers included) under a hard timeout; fails the test
    unless it succeeds."""
    done = run_job(argv, timeout_s, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The script three times: Lightning alone on one process (``--stock``), DcirStrategy
    at world 2 for 3 epochs, and at world 2 again from the first epoch's checkpoint."""
    native.load()  # built once here, before the ranks load it
    where = tmp_path_factory.mktemp("lightning")
    _run_job([sys.executable, str(SCRIPT), "--out", "stock", "--stock"], where)
    _run_job([*TORCHRUN, str(SCRIPT), "--out", "dcir"], where)
    _run_job([*TORCHRUN, str(SCRIPT), "--out", "resumed", "--resume", "dcir/checkpoints/epoch=0-step=2.ckpt"], where)
    return where


def _losses(run: Path) -> list[tuple[str, str, float]]:
    """(epoch, step, value) of every logged train_loss and val_loss, in order."""
    with open(run / "logs" / "metrics.csv") as f:
        return [(row["epoch"], row["step"], float(row["train_loss"] or row["val_loss"])) for row in csv.DictReader(f)]


def test_world2_trains_as_lightning_does_on_one_process(runs):
    stock, dcir = torch.load(runs / "stock" / "model.pt"), torch.load(runs / "dcir" / "model.pt")
    assert stock.keys() == dcir.keys()
    for name in stock:  # the same arithmetic, reduced in another order: 1e-7 of the weights' scale measured
        error = ((stock[name] - dcir[name]).norm() / stock[name].norm()).item()
        assert error <= 1e-5, (name, error)
    a, b = _losses(runs / "stock"), _losses(runs / "dcir")
    assert len(a) == len(b) == 9 and [r[:2] for r in a] == [r[:2] for r in b]  # 6 steps' and 3 validations' rows
    assert b[-2][2] < b[0][2]  # it learns
    for (epoch, step, x), (_, _, y) in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (epoch, step, x, y)


def test_resumed_from_a_lightning_checkpoint_bit_for_bit(runs):
    straight, resumed = torch.load(runs / "dcir" / "model.pt"), torch.load(runs / "resumed" / "model.pt")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert _losses(runs / "resumed") == _losses(runs / "dcir")[3:]  # epochs 1 and 2, the same values


def test_a_lightning_checkpoint_is_the_engines(runs):
    """ModelCheckpoint's file names are directories: the engine's checkpoint, tag ``dcir``."""
    ckpt = runs / "dcir" / "checkpoints" / "epoch=0-step=2.ckpt"
    assert ckpt.is_dir() and checkpoint.latest(ckpt) == "dcir"
    assert sorted(p.name for p in (runs / "dcir" / "checkpoints").iterdir()) == [
        "epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"]


# ---- what the strategy refuses --------------------------------------------------------------


class _Tiny(L.LightningModule):
    def __init__(self, automatic: bool = True):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.automatic_optimization = automatic

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def in_process():
    """A Trainer in this process: what Lightning's launcher sets in the environment and
    the process group it starts are undone afterwards."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    if dist.is_initialized():
        dist.destroy_process_group()


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, strategy=DcirStrategy(), logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _batches(n: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 4)), batch_size=1)


def test_refuses_a_precision_it_cannot_train_in():
    with pytest.raises(DcirError) as e:
        _trainer(precision="64-true")
    assert ("DcirStrategy trains in precision '32-true' or 'bf16-mixed' "
            "(the engine's bf16: bf16 compute, fp32 master weights and reduction), not '64-true'") in str(e.value)


def test_bf16_mixed_is_the_engines_bf16(in_process):
    """No autocast: the engine computes in bf16 and keeps fp32 master weights; the module
    gets them back after fit."""
    seen = {}

    class Look(L.Callback):
        def on_train_end(self, trainer, module):
            seen["policy"] = trainer.strategy.engine.precision

    model = _Tiny()
    _trainer(precision="bf16-mixed", max_epochs=1, callbacks=[Look()]).fit(model, _batches(2))
    assert (seen["policy"].param_dtype, seen["policy"].reduce_dtype) == ("bf16", "f32")
    assert model.net.weight.dtype == torch.float32 and not model.net.weight.is_meta


def test_refuses_gradient_accumulation_in_the_engine_config():
    with pytest.raises(DcirError) as e:
        DcirStrategy(config={"gradient_accumulation_steps": 2})
    assert ("DcirStrategy(config=...) takes no gradient_accumulation_steps: "
            "set accumulate_grad_batches on the Trainer, which the strategy hands to the engine") in str(e.value)


def test_refuses_manual_optimization(in_process):
    with pytest.raises(DcirError) as e:
        _trainer(max_epochs=1).fit(_Tiny(automatic=False), _batches(2))
    assert ("DcirStrategy trains with automatic optimization only (the engine runs the backward and the step): "
            "_Tiny.automatic_optimization is False") in str(e.value)


def test_refuses_an_epoch_that_ends_inside_accumulation(in_process):
    with pytest.raises(DcirError) as e:
        _trainer(max_epochs=1, accumulate_grad_batches=2).fit(_Tiny(), _batches(3))
    assert ("Lightning steps the optimizer at the end of every epoch, and an epoch here has 3 batches, not a "
            "multiple of accumulate_grad_batches=2: the engine steps every 2 "
            "micro-batches; make the batches per epoch a multiple of it (batch size, drop_last, limit_train_batches)"
            ) in str(e.value)


def test_loads_checkpoints_only_to_train(in_process, tmp_path):
    with pytest.raises(DcirError) as e:
        _trainer().validate(_Tiny(), _batches(2), ckpt_path=str(tmp_path))
    assert ("DcirStrategy loads checkpoints into the engine it trains with, in trainer.fit(..., ckpt_path=...); "
            f"validate cannot: export {tmp_path} (dcir-checkpoint export) to load it elsewhere") in str(e.value)
