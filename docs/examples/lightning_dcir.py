"""A Lightning script, sharded through DCIR by one argument (docs/integrations.md).

    torchrun --nproc-per-node 2 docs/examples/lightning_dcir.py --out run       # DcirStrategy, 2 ranks
    python docs/examples/lightning_dcir.py --out single --stock                 # Lightning alone, 1 process
    torchrun --nproc-per-node 2 docs/examples/lightning_dcir.py --out resumed \\
        --resume run/checkpoints/epoch=0-step=2.ckpt                            # continue a run

A two-layer MLP learns a fixed random regression: 8 samples per optimizer step (split
across the ranks), 2 micro-steps per step, AdamW with weight decay, a linear warmup,
gradients clipped to norm 0.5, a validation pass and a checkpoint after every epoch.
Rank 0 logs to ``--out/logs/metrics.csv`` and saves the trained module's ``state_dict``
to ``--out/model.pt``.
"""

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dcir_runtime.lightning import DcirStrategy

GLOBAL_BATCH = 8  # samples per micro-step, all ranks together


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-2, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, torch.sin(x[:, :4] * 2) + 0.1 * torch.randn(n, 4, generator=g))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the run's directory: logs, checkpoints, model.pt")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--resume", default=None, help="a checkpoint of this script to continue from")
    ap.add_argument("--stock", action="store_true", help="Lightning's own single-process training (the reference)")
    args = ap.parse_args()
    world = 1 if args.stock else int(os.environ.get("WORLD_SIZE", "1"))

    L.seed_everything(0)  # the same initial weights on every rank
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy="auto" if args.stock else DcirStrategy(),
        max_epochs=args.epochs, accumulate_grad_batches=2, gradient_clip_val=0.5,
        logger=CSVLogger(args.out, name="logs", version=""), log_every_n_steps=1,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False)
    # one shuffle of the samples per epoch (seed 0), of which rank r reads every world-th from r: each
    # micro-step of the ranks together reads the samples one process reads at world 1
    data = dataset(32, seed=1)
    sampler = DistributedSampler(data, num_replicas=world, rank=0 if args.stock else int(os.environ.get("RANK", "0")),
                                 shuffle=True, seed=0)
    train = DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler)
    val = DataLoader(dataset(16, seed=2), batch_size=GLOBAL_BATCH // world)
    trainer.fit(model, train, val, ckpt_path=args.resume)
    if trainer.is_global_zero:  # after fit the module holds the trained weights, whole, on every rank
        torch.save(model.state_dict(), os.path.join(args.out, "model.pt"))


if __name__ == "__main__":
    main()
